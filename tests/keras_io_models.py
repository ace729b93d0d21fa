"""Models of the shapes keras-io's examples write, reproduced here (not copied), with
tiny sizes and offline random data, for the tests that hold tfdist's guarantee on
models it did not design:

- "Text classification with Transformer" (keras-io/examples/nlp/text_classification_
  with_transformer.py): a TokenAndPositionEmbedding whose position table is an
  Embedding looked up with ops.arange, a TransformerBlock; both custom layers take
  no **kwargs in __init__, as keras-io writes them.
- "Timeseries classification from scratch" (keras-io/examples/timeseries/
  timeseries_classification_from_scratch.py): Conv1D + BatchNormalization + ReLU,
  GlobalAveragePooling1D.
- "Transfer learning & fine-tuning" (keras-io/guides/transfer_learning.py): a frozen
  base (trainable = False) under a trainable head, and a frozen sub-layer inside a
  custom layer.

Every case is (build_and_compile, x, y, fit_kwargs) with 8 global batches of 16.
"""

import keras
import numpy as np
from keras import layers

# keras-io's two custom layers, as the conformance corpus reproduces them (no **kwargs).
from benchmarks.conformance_keras_io import TokenAndPositionEmbedding, TransformerBlock
from tfdist.testing import equivalence

VOCAB, MAXLEN, EMBED = 50, 8, 16
GLOBAL_BATCH, STEPS = 16, 8


def text_transformer(dropout: float = 0.0):
    inputs = layers.Input(shape=(MAXLEN,))
    x = TokenAndPositionEmbedding(MAXLEN, VOCAB, EMBED)(inputs)
    x = TransformerBlock(EMBED, 2, 32, dropout)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dense(16, activation="relu")(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


def timeseries_convnet():
    inputs = layers.Input(shape=(MAXLEN * 2, 1))
    x = inputs
    for _ in range(2):
        x = layers.Conv1D(filters=8, kernel_size=3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.ReLU()(x)
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs, outputs)


def masked_sequences():
    """Padded token sequences (Embedding(mask_zero=True), as keras-io's text examples pad
    them) normalised by a BatchNormalization that receives the mask: its statistics are
    over the unpadded positions of the whole batch."""
    inputs = layers.Input(shape=(MAXLEN,))
    x = layers.Embedding(VOCAB, EMBED, mask_zero=True)(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs, outputs)


class FrozenInside(layers.Layer):
    """A custom layer with a frozen projection inside and a trainable one after it."""

    def __init__(self, units):
        super().__init__()
        self.fixed = layers.Dense(units, activation="tanh", name="fixed")
        self.fixed.trainable = False
        self.tuned = layers.Dense(units)

    def call(self, x):
        return self.tuned(self.fixed(x))


def frozen_base():
    inputs = layers.Input(shape=(12,))
    base = layers.Dense(16, activation="relu", name="frozen_base")
    base.trainable = False
    x = base(inputs)
    x = FrozenInside(16)(x)
    outputs = layers.Dense(3, activation="softmax", name="head")(x)
    return keras.Model(inputs, outputs)


FROZEN_PATHS = ("frozen_base/kernel", "frozen_base/bias", "fixed/kernel", "fixed/bias")


def frozen_variables(model):
    """The variables the user froze (by path suffix), each must end as it started."""
    return [v for v in model.weights if any(v.path.endswith(p) for p in FROZEN_PATHS)]


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam_clip": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    "sgd": lambda: keras.optimizers.SGD(0.1),
}


def _arrays(name: str):
    rng = np.random.default_rng(7)
    n = GLOBAL_BATCH * STEPS
    if name in ("text", "text64"):
        # Repeated tokens within and across examples: the token table's rows repeat too.
        return rng.integers(0, VOCAB, (n, MAXLEN)).astype("int32"), rng.integers(0, 2, n)
    if name == "masked":
        # Each example padded with 0 after its own length (1 to MAXLEN tokens).
        ids = rng.integers(1, VOCAB, (n, MAXLEN))
        ids[np.arange(MAXLEN) >= rng.integers(1, MAXLEN + 1, (n, 1))] = 0
        return ids.astype("int32"), rng.integers(0, 2, n)
    if name == "timeseries":
        return rng.normal(size=(n, MAXLEN * 2, 1)).astype("float32"), rng.integers(0, 2, n)
    return rng.normal(size=(n, 12)).astype("float32"), rng.integers(0, 3, n)


def in_float64(build):
    """`build` with every layer's variables and computation in float64."""
    def build_in_float64():
        with equivalence.dtype_policy("float64"):
            return build()
    return build_in_float64


BUILDERS = {"text": text_transformer, "timeseries": timeseries_convnet, "frozen": frozen_base,
            "masked": masked_sequences, "text64": in_float64(text_transformer)}


def case(name: str, optimizer: str):
    """(build_and_compile, x, y, fit kwargs) of model `name` with `optimizer`."""
    build = BUILDERS[name]

    def build_and_compile():
        model = build()
        model.compile(optimizer=OPTIMIZERS[optimizer](),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    x, y = _arrays(name)
    return build_and_compile, x, y, dict(batch_size=GLOBAL_BATCH, epochs=1, shuffle=False)
