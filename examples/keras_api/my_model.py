"""A user's own model and data, nothing tfdist-specific: the examples next to this
file train it in each tfdist mode. (A functional model with two named inputs, a
regression target, per-example sample weights.)"""

import keras
import numpy as np


def make_data(n=2048, seed=0):
    """({"numbers": (n, 6), "flags": (n, 2)}, targets (n, 1), weights (n,))."""
    rng = np.random.default_rng(seed)
    numbers = rng.normal(size=(n, 6)).astype("float32")
    flags = rng.integers(0, 2, size=(n, 2)).astype("float32")
    target = numbers[:, :3].sum(1, keepdims=True) * (1 + flags[:, :1]) - flags[:, 1:]
    weights = rng.uniform(0.5, 1.5, size=(n,)).astype("float32")
    return {"numbers": numbers, "flags": flags}, target.astype("float32"), weights


def make_model():
    numbers = keras.Input((6,), name="numbers")
    flags = keras.Input((2,), name="flags")
    h = keras.layers.Concatenate(name="features")([numbers, flags])
    h = keras.layers.Dense(64, activation="relu", name="hidden")(h)
    h = keras.layers.Dense(32, activation="relu", name="hidden2")(h)
    return keras.Model({"numbers": numbers, "flags": flags},
                       keras.layers.Dense(1, name="prediction")(h), name="my_regressor")


def compile_model(model):
    model.compile(optimizer=keras.optimizers.AdamW(
                      keras.optimizers.schedules.CosineDecay(3e-3, decay_steps=200)),
                  loss="mse", metrics=["mae"])
    return model


# For the absl entrypoint: --model=my_model:uncompiled --dataset=my_model:datasets
def uncompiled():
    return make_model()


def datasets():
    """(train, test) as tuples of NumPy arrays; tfdist shuffles, batches and shards them."""
    x, y, w = make_data()
    test_x, test_y, _ = make_data(512, seed=1)
    return (x, y, w), (test_x, test_y)
