"""Optimizer registry (Keras 3). Hyper-parameters other than the rate are fixed, named defaults."""

import keras

from tfdist.registry import Registry

MOMENTUM = 0.9
ADAMW_WEIGHT_DECAY = 0.004  # Keras' default

OPTIMIZERS = Registry("optimizer", {
    "sgd": lambda lr: keras.optimizers.SGD(learning_rate=lr),
    "momentum": lambda lr: keras.optimizers.SGD(learning_rate=lr, momentum=MOMENTUM),
    "adam": lambda lr: keras.optimizers.Adam(learning_rate=lr),
    "adamw": lambda lr: keras.optimizers.AdamW(learning_rate=lr, weight_decay=ADAMW_WEIGHT_DECAY),
})


def build_optimizer(name: str, learning_rate: float, mixed_precision=None):
    """tfdist's four (fixed hyper-parameters), else any Keras optimizer by identifier."""
    if name in OPTIMIZERS:
        optimizer = OPTIMIZERS.get(name)(learning_rate)
    else:
        optimizer = keras.optimizers.get({"class_name": name, "config": {
            "learning_rate": learning_rate}})
    if mixed_precision == "mixed_float16":
        # float16 gradients underflow without a (dynamic) loss scale.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer
