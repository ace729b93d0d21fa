"""Models and data a user might bring, none of them tfdist's: built here for the
Keras-API equivalence tests (tests/test_keras_api.py, test_keras_api_dtensor.py, and
the multi-worker ones through MODULE:FUNCTION)."""

import keras
import numpy as np

EXAMPLES = 256
GLOBAL_BATCH = 32


def regression_arrays(n: int = EXAMPLES, seed: int = 0):
    """({"a": (n, 5), "b": (n, 3)}, y (n, 1), sample weights (n,))."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, 5)).astype("float32")
    b = rng.normal(size=(n, 3)).astype("float32")
    y = (a.sum(1, keepdims=True) - 2 * b[:, :1] + 0.1 * rng.normal(size=(n, 1))).astype(
        "float32")
    return {"a": a, "b": b}, y, rng.uniform(0.5, 1.5, size=(n,)).astype("float32")


def classification_arrays(n: int = EXAMPLES, classes: int = 4, seed: int = 1):
    """x (n, 12), integer labels (n,), sample weights (n,)."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(classes, 12)) * 2
    labels = rng.integers(0, classes, size=n)
    x = (centers[labels] + rng.normal(size=(n, 12))).astype("float32")
    return x, labels.astype("int32"), rng.uniform(0.5, 1.5, size=(n,)).astype("float32")


def two_input_regressor():
    """A functional model with two named inputs fed from a dict."""
    a = keras.Input((5,), name="a")
    b = keras.Input((3,), name="b")
    h = keras.layers.Concatenate(name="join")([a, b])
    h = keras.layers.Dense(16, activation="relu", name="hidden")(h)
    h = keras.layers.Dense(8, activation="tanh", name="hidden2")(h)
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(1, name="out")(h),
                       name="two_input_regressor")


def softmax_classifier(classes: int = 4):
    """Probabilities out (the loss then takes from_logits=False)."""
    return keras.Sequential([
        keras.Input((12,)),
        keras.layers.Dense(24, activation="relu", name="hidden"),
        keras.layers.Dense(16, activation="relu", name="hidden2"),
        keras.layers.Dense(classes, activation="softmax", name="probabilities"),
    ], name="softmax_classifier")


@keras.saving.register_keras_serializable(package="tfdist_tests")
class SubclassedClassifier(keras.Model):
    """A subclassed model: Python call(), no graph of layers (data-parallel modes)."""

    def __init__(self, classes: int = 4, width: int = 24, **kwargs):
        super().__init__(**kwargs)
        self.classes, self.width = classes, width
        self.hidden = keras.layers.Dense(width, activation="relu", name="hidden")
        self.head = keras.layers.Dense(classes, name="logits")

    def call(self, x, training=False):
        return self.head(self.hidden(x) + 0.5 * self.hidden(x * 0.5))

    def get_config(self):
        return {"classes": self.classes, "width": self.width, **super().get_config()}


OPTIMIZERS = {
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adamw_cosine": lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.CosineDecay(3e-3, decay_steps=20, warmup_target=5e-3,
                                               warmup_steps=3), weight_decay=0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-3, rho=0.9, momentum=0.5),
}


def compiled(build, optimizer: str, loss, metrics):
    def build_and_compile():
        model = build()
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss=loss, metrics=metrics)
        return model
    return build_and_compile


CASES = {
    # name: (build_and_compile for an optimizer, x, y, fit kwargs)
    "dict_regression": (
        lambda opt: compiled(two_input_regressor, opt, "mse", ["mae"]),
        lambda: regression_arrays()),
    "softmax_weighted": (
        lambda opt: compiled(softmax_classifier, opt,
                             keras.losses.SparseCategoricalCrossentropy(from_logits=False),
                             ["accuracy"]),
        lambda: classification_arrays()),
    "subclassed": (
        lambda opt: compiled(SubclassedClassifier, opt,
                             keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                             ["accuracy"]),
        lambda: classification_arrays()),
}


def case(name: str, optimizer: str):
    """(build_and_compile, x, y, fit kwargs) of one test case: 2 epochs of global batches
    of 32, sample weights, validation data, shuffled by tfdist's seeded order."""
    build, data = CASES[name]
    x, y, weights = data()
    validation = (_head(x, 64), y[:64])
    fit_kwargs = dict(batch_size=GLOBAL_BATCH, epochs=2, sample_weight=weights,
                      validation_data=validation)
    return build(optimizer), x, y, fit_kwargs


def _head(x, n):
    return {k: v[:n] for k, v in x.items()} if isinstance(x, dict) else x[:n]


CALLBACK_EPOCHS = 4   # asked for; EarlyStopping below ends the run after the 2nd


def file_callbacks(files_dir):
    """Keras' own callbacks that write files or take decisions from the logs."""
    import os
    return [keras.callbacks.ModelCheckpoint(os.path.join(files_dir, "ckpt_{epoch}.keras")),
            keras.callbacks.TensorBoard(os.path.join(files_dir, "tensorboard")),
            keras.callbacks.CSVLogger(os.path.join(files_dir, "log.csv")),
            # min_delta larger than any improvement: stops after the 2nd epoch
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=1e9),
            # likewise: halves the learning rate from the 2nd epoch on
            keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0, min_delta=1e9,
                                              factor=0.5)]
