"""Small ResNet (basic blocks) for 32x32 images; also works on 8x8.

Layers (a functional model, so every layer name is also its variable path prefix):
  stem_conv (3x3, width filters[0]), stem_norm, stem_relu
  per stage s (width filters[s]) and block b in 0..BLOCKS_PER_STAGE-1, prefix
  `stage{s}_block{b}_`: conv1 (3x3, stride 2 in block 0 of stages after the
  first while the map stays >= 2x2), norm1, relu1, conv2 (3x3), norm2, and when
  the shape changes a projection shortcut `shortcut_conv` (1x1) + `shortcut_norm`;
  then `add` and `relu2`
  pool (global average), logits (Dense(num_classes)), float32_logits (cast).

Every BatchNormalization uses synchronized=True: under a tf.distribute strategy
the batch mean and variance are all-reduced over the global batch, so a
data-parallel step normalizes exactly like one device seeing the whole batch.
Convolutions before a norm have no bias (the norm's beta replaces it).
"""

import keras

from tfdist.models import common

NAME = "resnet"
BLOCKS_PER_STAGE = 2
MIN_DOWNSAMPLED_SIZE = 2


def build(info, config) -> keras.Model:
    """Returns a built ResNet mapping an image batch (N, H, W, C) to float32 logits."""
    common.validate_image_classifier(NAME, info)
    inputs = keras.Input(info.input_shape, dtype=info.input_dtype, name="images")
    x = _conv_norm(inputs, config.filters[0], 3, 1, "stem_conv", "stem_norm")
    x = keras.layers.ReLU(name="stem_relu")(x)
    spatial = tuple(info.input_shape[:2])
    for stage, width in enumerate(config.filters):
        for block in range(BLOCKS_PER_STAGE):
            downsample = stage > 0 and block == 0 and min(spatial) // 2 >= MIN_DOWNSAMPLED_SIZE
            if downsample:
                spatial = tuple((size + 1) // 2 for size in spatial)
            x = _basic_block(x, width, 2 if downsample else 1, f"stage{stage}_block{block}_")
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    x = keras.layers.Dense(info.num_classes, name="logits")(x)
    outputs = common.float32_logits(x)
    return keras.Model(inputs, outputs, name=NAME)


def _basic_block(x, width: int, stride: int, prefix: str):
    """relu(norm(conv(relu(norm(conv(x))))) + shortcut(x)), He et al. 2016."""
    # Layers are created in this order, which fixes the order of initialiser draws.
    y = _conv_norm(x, width, 3, stride, prefix + "conv1", prefix + "norm1")
    y = keras.layers.ReLU(name=prefix + "relu1")(y)
    y = _conv_norm(y, width, 3, 1, prefix + "conv2", prefix + "norm2")
    shortcut = x
    if stride != 1 or x.shape[-1] != width:
        shortcut = _conv_norm(x, width, 1, stride, prefix + "shortcut_conv",
                              prefix + "shortcut_norm")
    y = keras.layers.Add(name=prefix + "add")([y, shortcut])
    return keras.layers.ReLU(name=prefix + "relu2")(y)


def _conv_norm(x, width: int, kernel_size: int, stride: int, conv_name: str, norm_name: str):
    x = keras.layers.Conv2D(width, kernel_size, strides=stride, padding="same",
                            use_bias=False, name=conv_name)(x)
    return keras.layers.BatchNormalization(synchronized=True, name=norm_name)(x)
