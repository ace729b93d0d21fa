"""Pieces every registry model shares: the float32 output cast and input checks."""

import keras

from tfdist.data.base import CLASSIFICATION
from tfdist.errors import require


def float32_logits(x):
    """A variable-free linear float32 layer: the loss never sees bf16/fp16 logits."""
    return keras.layers.Activation("linear", dtype="float32", name="float32_logits")(x)


def validate_image_classifier(name: str, info) -> None:
    """cnn and resnet need float images (height, width, channels) with class labels."""
    require(info.task == CLASSIFICATION,
            f"Model '{name}' needs a classification dataset of images (e.g. digits, "
            f"synthetic or an image tfds:NAME dataset), but dataset '{info.name}' is "
            f"a {info.task} dataset. For language modelling use model 'transformer'.")
    require(len(info.input_shape) == 3,
            f"Model '{name}' needs images shaped (height, width, channels), but "
            f"dataset '{info.name}' has examples shaped {tuple(info.input_shape)}. "
            f"Use model 'mlp' for flat features, or e.g. --synthetic_shape 32,32,3.")
    require(keras.backend.is_float_dtype(info.input_dtype),
            f"Model '{name}' needs floating-point images, but dataset '{info.name}' "
            f"provides {info.input_dtype}.")
