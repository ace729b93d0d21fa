"""Architectures of keras-io examples, reproduced (not copied) for the conformance corpus.

Each builder names the keras-io example it reproduces. The custom layers keep the
shape keras-io gives them, quirks included, because users copy them as they are:
`__init__` takes no **kwargs (so `from_config` cannot pass `name` or `trainable`
back), and only the examples that define `get_config` have one here. Sizes are shrunk
so 8 steps take seconds. `rate` is the dropout the example uses, or 0 for the
equivalence runs.

Importing this module imports Keras (the layers subclass keras.layers.Layer):
the harness imports it only inside a process that trains.
"""

import keras
from keras import layers, ops

VOCABULARY, SEQUENCE, CLASSES = 256, 16, 10


# ------------------------------------------------ "Text classification with Transformer"

class TransformerBlock(layers.Layer):
    """keras-io "Text classification with Transformer": attention + a 2-layer feed-forward,
    each with dropout, a residual and a LayerNormalization."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                     layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attended = self.dropout1(self.att(inputs, inputs))
        out1 = self.layernorm1(inputs + attended)
        return self.layernorm2(out1 + self.dropout2(self.ffn(out1)))


class TokenAndPositionEmbedding(layers.Layer):
    """keras-io "Text classification with Transformer": a token table plus a position
    table looked up with ops.arange (every example hits every position row)."""

    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = self.pos_emb(ops.arange(start=0, stop=ops.shape(x)[-1], step=1))
        return self.token_emb(x) + positions


def text_transformer(rate):
    """keras-io "Text classification with Transformer" (embed 32, 2 heads, ff 32)."""
    inputs = layers.Input(shape=(SEQUENCE,))
    x = TokenAndPositionEmbedding(SEQUENCE, VOCABULARY, 32)(inputs)
    x = TransformerBlock(32, 2, 32, rate)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(rate)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(rate)(x)
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(x))


# ------------------------------------------------ "Timeseries classification from scratch"

def timeseries_fcn(rate):
    """keras-io "Timeseries classification from scratch": 3 x (Conv1D 64, kernel 3 ->
    BatchNormalization -> ReLU), GlobalAveragePooling1D, softmax (filters shrunk to 16)."""
    del rate   # the example has no dropout
    inputs = layers.Input((64, 1))
    x = inputs
    for _ in range(3):
        x = layers.Conv1D(filters=16, kernel_size=3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.ReLU()(x)
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(x))


# ------------------------------------------------ "Simple MNIST convnet"

def mnist_convnet(rate):
    """keras-io "Simple MNIST convnet": Conv2D 32 / pool / Conv2D 64 / pool / flatten /
    Dropout(0.5) / softmax, on 28x28x1."""
    return keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(rate),
        layers.Dense(CLASSES, activation="softmax"),
    ])


# ------------------------------------------------ "Transfer learning & fine-tuning"

def frozen_base_classifier(rate):
    """keras-io guide "Transfer learning & fine-tuning": a base model with
    `trainable = False`, called with training=False (its BatchNormalization stays in
    inference mode), then pooling, Dropout(0.2) and a new Dense head. The base here is a
    small conv net with random weights instead of Xception with ImageNet's."""
    base_model = keras.Sequential([
        keras.Input((32, 32, 3)),
        layers.Conv2D(16, 3, strides=2, padding="same"),
        layers.BatchNormalization(),
        layers.Activation("relu"),
        layers.Conv2D(32, 3, strides=2, padding="same"),
    ], name="base_model")
    base_model.trainable = False
    inputs = keras.Input(shape=(32, 32, 3))
    x = layers.Rescaling(scale=1 / 127.5, offset=-1)(inputs)
    x = base_model(x, training=False)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(rate)(x)
    return keras.Model(inputs, layers.Dense(CLASSES)(x))


# ------------------------------------------------ "The Functional API" (multi-input)

def ticket_ranker(rate):
    """keras-io guide "The Functional API", "Models with multiple inputs and outputs":
    title and body through a shared-size Embedding and LSTMs, tags concatenated, two
    heads (priority, department). Sizes shrunk (embedding 16, LSTMs 16 and 8)."""
    del rate   # the guide's model has no dropout
    title_input = keras.Input(shape=(None,), name="title")
    body_input = keras.Input(shape=(None,), name="body")
    tags_input = keras.Input(shape=(12,), name="tags")
    title_features = layers.LSTM(16)(layers.Embedding(VOCABULARY, 16)(title_input))
    body_features = layers.LSTM(8)(layers.Embedding(VOCABULARY, 16)(body_input))
    x = layers.concatenate([title_features, body_features, tags_input])
    priority = layers.Dense(1, name="priority")(x)
    department = layers.Dense(4, name="department")(x)
    return keras.Model(inputs={"title": title_input, "body": body_input, "tags": tags_input},
                       outputs={"priority": priority, "department": department})


# ------------------------------------------------ "Making new layers and models via subclassing"

class Linear(layers.Layer):
    """The guide's Linear layer: weights made in build() with add_weight."""

    def __init__(self, units=32):
        super().__init__()
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units),
                                 initializer="random_normal", trainable=True)
        self.b = self.add_weight(shape=(self.units,), initializer="zeros", trainable=True)

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b


class ActivityRegularizationLayer(layers.Layer):
    """The guide's layer that calls self.add_loss in call() (a loss beside the compiled one)."""

    def __init__(self, rate=1e-2):
        super().__init__()
        self.rate = rate

    def call(self, inputs):
        self.add_loss(self.rate * ops.mean(inputs))
        return inputs


class MLPBlock(keras.Model):
    """The guide's subclassed model: Linear layers nested in a keras.Model subclass,
    plus an activity-regularisation add_loss."""

    def __init__(self):
        super().__init__()
        self.linear_1 = Linear(32)
        self.regularization = ActivityRegularizationLayer(1e-2)
        self.linear_2 = Linear(32)
        self.linear_3 = Linear(CLASSES)

    def call(self, inputs):
        x = ops.relu(self.linear_1(inputs))
        x = ops.relu(self.linear_2(self.regularization(x)))
        return self.linear_3(x)


def subclassed_mlp(rate):
    """keras-io guide "Making new layers and models via subclassing" (MLPBlock)."""
    del rate
    return MLPBlock()


# ------------------------------------------------ "Bidirectional LSTM on IMDB"

def bidirectional_lstm(rate):
    """keras-io "Bidirectional LSTM on IMDB": Embedding, two Bidirectional LSTMs, a
    sigmoid unit (embedding 16, LSTMs 8 instead of 128 and 64)."""
    del rate
    inputs = keras.Input(shape=(None,), dtype="int32")
    x = layers.Embedding(VOCABULARY, 16)(inputs)
    x = layers.Bidirectional(layers.LSTM(8, return_sequences=True))(x)
    x = layers.Bidirectional(layers.LSTM(8))(x)
    return keras.Model(inputs, layers.Dense(1, activation="sigmoid")(x))


# ------------------------------------------------ "Timeseries classification with a Transformer"

def encoder_block(inputs, head_size, num_heads, ff_dim, rate):
    """The example's transformer_encoder: attention (with dropout), a post-norm residual,
    a Conv1D(kernel_size=1) feed-forward."""
    x = layers.MultiHeadAttention(key_dim=head_size, num_heads=num_heads, dropout=rate)(
        inputs, inputs)
    x = layers.LayerNormalization(epsilon=1e-6)(layers.Dropout(rate)(x))
    res = x + inputs
    x = layers.Conv1D(filters=ff_dim, kernel_size=1, activation="relu")(res)
    x = layers.Conv1D(filters=inputs.shape[-1], kernel_size=1)(layers.Dropout(rate)(x))
    return layers.LayerNormalization(epsilon=1e-6)(x) + res


def timeseries_transformer(rate):
    """keras-io "Timeseries classification with a Transformer model" (2 blocks, head size
    16, 2 heads, ff 4, an MLP head of 32; dropout 0.25 / 0.4 in the example)."""
    inputs = keras.Input(shape=(64, 1))
    x = inputs
    for _ in range(2):
        x = encoder_block(x, head_size=16, num_heads=2, ff_dim=4, rate=0.25 if rate else 0.0)
    x = layers.GlobalAveragePooling1D(data_format="channels_last")(x)
    x = layers.Dense(32, activation="relu")(x)
    x = layers.Dropout(0.4 if rate else 0.0)(x)
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(x))


# ------------------------------------------------ "Image classification with Vision Transformer"

class Patches(layers.Layer):
    """The example's patch extraction layer (it has a get_config, without **kwargs in
    __init__)."""

    def __init__(self, patch_size):
        super().__init__()
        self.patch_size = patch_size

    def call(self, images):
        shape = ops.shape(images)
        patches = ops.image.extract_patches(images, size=self.patch_size)
        count = (shape[1] // self.patch_size) * (shape[2] // self.patch_size)
        return ops.reshape(patches, (shape[0], count, self.patch_size ** 2 * shape[3]))

    def get_config(self):
        config = super().get_config()
        config.update({"patch_size": self.patch_size})
        return config


class PatchEncoder(layers.Layer):
    """The example's projection plus a position Embedding looked up with ops.arange."""

    def __init__(self, num_patches, projection_dim):
        super().__init__()
        self.num_patches = num_patches
        self.projection = layers.Dense(units=projection_dim)
        self.position_embedding = layers.Embedding(input_dim=num_patches,
                                                   output_dim=projection_dim)

    def call(self, patch):
        positions = ops.expand_dims(ops.arange(start=0, stop=self.num_patches, step=1), 0)
        return self.projection(patch) + self.position_embedding(positions)

    def get_config(self):
        config = super().get_config()
        config.update({"num_patches": self.num_patches})
        return config


def vit_small(rate):
    """keras-io "Image classification with Vision Transformer": random flip / rotation /
    zoom augmentation (only with random layers on), Patches, PatchEncoder, 2 pre-norm
    blocks (4 heads there, 2 here), a flattened representation, a gelu MLP head, logits."""
    inputs = keras.Input(shape=(32, 32, 3))
    x = inputs
    if rate:
        x = keras.Sequential([layers.RandomFlip("horizontal"), layers.RandomRotation(0.02),
                              layers.RandomZoom(0.2, 0.2)], name="data_augmentation")(x)
    encoded = PatchEncoder(16, 32)(Patches(8)(x))
    for _ in range(2):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
        attention = layers.MultiHeadAttention(num_heads=2, key_dim=16, dropout=rate)(x1, x1)
        x2 = layers.Add()([attention, encoded])
        x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
        for units in (64, 32):
            x3 = layers.Dropout(rate)(layers.Dense(units, activation=keras.activations.gelu)(x3))
        encoded = layers.Add()([x3, x2])
    x = layers.Flatten()(layers.LayerNormalization(epsilon=1e-6)(encoded))
    x = layers.Dropout(0.5 if rate else 0.0)(x)
    x = layers.Dense(32, activation=keras.activations.gelu)(x)
    return keras.Model(inputs, layers.Dense(CLASSES)(x))


# ------------------------------------------------ "Image classification from scratch"

def small_xception(rate):
    """keras-io "Image classification from scratch": Rescaling, an entry conv block, 
    residual SeparableConv2D blocks with BatchNormalization and a strided 1x1 projection,
    Dropout(0.5), a softmax head (block widths 16/32 instead of 128..728; the example's
    RandomFlip + RandomRotation in front when random layers are on)."""
    inputs = keras.Input(shape=(32, 32, 3))
    x = inputs
    if rate:
        x = keras.Sequential([layers.RandomFlip("horizontal"), layers.RandomRotation(0.1)],
                             name="data_augmentation")(x)
    x = layers.Rescaling(1.0 / 255)(x)
    x = layers.Activation("relu")(layers.BatchNormalization()(
        layers.Conv2D(16, 3, strides=2, padding="same")(x)))
    previous = x
    for size in (16, 32):
        x = layers.Activation("relu")(x)
        x = layers.BatchNormalization()(layers.SeparableConv2D(size, 3, padding="same")(x))
        x = layers.Activation("relu")(x)
        x = layers.BatchNormalization()(layers.SeparableConv2D(size, 3, padding="same")(x))
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        x = layers.add([x, layers.Conv2D(size, 1, strides=2, padding="same")(previous)])
        previous = x
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.5 if rate else 0.0)(x)
    return keras.Model(inputs, layers.Dense(CLASSES, activation="softmax")(x))
