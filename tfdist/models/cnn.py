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

from tfdist.models import common

NAME = "cnn"
MIN_POOLED_SIZE = 2


def build(info, config) -> keras.Model:
    """Returns a built CNN mapping an image batch (N, H, W, C) to float32 logits."""
    common.validate_image_classifier(NAME, info)
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
    outputs = common.float32_logits(x)
    return keras.Model(inputs, outputs, name=NAME)
