"""Small convolutional classifier for 8x8 to 32x32 images (any channel count).

Layers: for each width in config.filters, `conv_{i}` (3x3 'same', relu) and,
while the feature map stays at least 2x2, `pool_{i}` (2x2 max pool); then
`flatten`, `logits` (Dense(num_classes), no activation) and `float32_logits`,
a variable-free cast to float32 for mixed precision. No BatchNorm, no dropout,
so a step is a pure function of weights and batch on any number of replicas.
Variable paths are `conv_{i}/kernel`, `conv_{i}/bias`, `logits/kernel`,
`logits/bias`.
"""

import keras

from tfdist.data.base import CLASSIFICATION
from tfdist.errors import require

NAME = "cnn"
MIN_POOLED_SIZE = 2


def build(info, config) -> keras.Model:
    """Returns a built CNN mapping an image batch (N, H, W, C) to float32 logits."""
    _validate(info)
    inputs = keras.Input(info.input_shape, dtype=info.input_dtype, name="images")
    x = inputs
    spatial = tuple(info.input_shape[:2])
    for index, width in enumerate(config.filters):
        x = keras.layers.Conv2D(width, 3, padding="same", activation="relu",
                                name=f"conv_{index}")(x)
        if min(spatial) // 2 >= MIN_POOLED_SIZE:
            x = keras.layers.MaxPooling2D(2, name=f"pool_{index}")(x)
            spatial = tuple(size // 2 for size in spatial)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dense(info.num_classes, name="logits")(x)
    # A linear float32 layer casts the logits up, so the loss never sees bf16/fp16.
    outputs = keras.layers.Activation("linear", dtype="float32", name="float32_logits")(x)
    return keras.Model(inputs, outputs, name=NAME)


def _validate(info) -> None:
    require(info.task == CLASSIFICATION,
            f"Model '{NAME}' needs a classification dataset of images (e.g. digits, "
            f"synthetic or an image tfds:NAME dataset), but dataset '{info.name}' is "
            f"a {info.task} dataset. For language modelling use model 'transformer'.")
    require(len(info.input_shape) == 3,
            f"Model '{NAME}' needs images shaped (height, width, channels), but "
            f"dataset '{info.name}' has examples shaped {tuple(info.input_shape)}. "
            f"Use model 'mlp' for flat features, or e.g. --synthetic_shape 32,32,3.")
    require(keras.backend.is_float_dtype(info.input_dtype),
            f"Model '{NAME}' needs floating-point images, but dataset '{info.name}' "
            f"provides {info.input_dtype}.")
