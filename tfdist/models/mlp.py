"""Multi-layer perceptron for classification.

Layers: `flatten`, `dense_0`, `dense_1`, ... (one relu Dense per entry of
config.hidden_sizes), `logits` (Dense(num_classes), no activation), then
`float32_logits`, a variable-free cast so the output is float32 under mixed
precision. Variable paths are `dense_{i}/kernel`, `dense_{i}/bias`,
`logits/kernel`, `logits/bias`.
"""

import keras

from tfdist.data.base import CLASSIFICATION
from tfdist.errors import require
from tfdist.models import common

NAME = "mlp"


def build(info, config) -> keras.Model:
    """Returns a built MLP mapping one example batch to float32 class logits."""
    _validate(info)
    inputs = keras.Input(info.input_shape, dtype=info.input_dtype, name="features")
    x = keras.layers.Flatten(name="flatten")(inputs)
    for index, width in enumerate(config.hidden_sizes):
        x = keras.layers.Dense(width, activation="relu", name=f"dense_{index}")(x)
    x = keras.layers.Dense(info.num_classes, name="logits")(x)
    outputs = common.float32_logits(x)
    return keras.Model(inputs, outputs, name=NAME)


def _validate(info) -> None:
    require(info.task == CLASSIFICATION,
            f"Model '{NAME}' needs a classification dataset (e.g. digits, synthetic "
            f"or an image tfds:NAME dataset), but dataset '{info.name}' is a "
            f"{info.task} dataset. For language modelling use model 'transformer'.")
    require(keras.backend.is_float_dtype(info.input_dtype),
            f"Model '{NAME}' needs floating-point features, but dataset '{info.name}' "
            f"provides {info.input_dtype}.")
