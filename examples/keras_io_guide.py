"""keras-io's guide "Multi-GPU distributed training with TensorFlow"
(keras-team/keras-io, guides/distributed_training_with_tensorflow.py), run by tfdist.

The guide's two functions are below as it defines them (a 784-256-256-10 MLP on
logits, Adam, sparse cross-entropy, SparseCategoricalAccuracy; MNIST as float32
pixels and float32 labels, batched by 32), with one change: MNIST is a download,
so get_dataset() returns an offline set of the same shapes and dtypes (10 noisy,
overlapping clusters, pixels in [0, 1]). The guide's own main part becomes, in tfdist:

    import tfdist                                          # + 1 line
    strategy = tfdist.Strategy("mirrored")                 # was tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = get_compiled_model()
    train_dataset, val_dataset, test_dataset = get_dataset()
    strategy.fit(model, train_dataset, epochs=2, validation_data=val_dataset)  # was model.fit(
    strategy.evaluate(model, test_dataset)                 # was model.evaluate(

So a user adds 1 line and changes 3 (the strategy, fit and evaluate), and the same
code runs under every mode:

    python examples/keras_io_guide.py mirrored
    tfdist launch --workers 2 -- python examples/keras_io_guide.py multi_worker_mirrored
    python examples/keras_io_guide.py dtensor      # batch=2,model=2, Megatron-style map
    python examples/keras_io_guide.py pipeline     # 2 stages x 4 micro-batches
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "tensorflow"

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdist  # noqa: E402

TRAIN_EXAMPLES, VAL_EXAMPLES, TEST_EXAMPLES = 4096, 1024, 1024   # MNIST: 50000, 10000, 10000
GUIDE_BATCH = 32

OPTIONS = {
    "default": {},
    "mirrored": dict(simulate_devices=2),
    "multi_worker_mirrored": {},
    # Each kernel split over `model` like Megatron: the first by columns, the second by rows.
    "dtensor": dict(simulate_devices=4, mesh="batch=2,model=2", layout={
        "dense/kernel": (None, "model"), "dense/bias": ("model",),
        "dense_1/kernel": ("model", None)}),
    "pipeline": dict(simulate_devices=2, pipeline_stages=2, microbatches=4),
}


def get_compiled_model():
    inputs = keras.Input(shape=(784,))
    x = keras.layers.Dense(256, activation="relu", name="dense")(inputs)
    x = keras.layers.Dense(256, activation="relu", name="dense_1")(x)
    outputs = keras.layers.Dense(10, name="dense_2")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model


def offline_digits(n, seed):
    """MNIST-shaped stand-in: (n, 784) float32 pixels in [0, 1], float32 labels 0..9."""
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(1234).uniform(0.4, 0.6, size=(10, 784))
    labels = rng.integers(0, 10, size=n)
    pixels = np.clip(centers[labels] + rng.normal(0, 0.5, size=(n, 784)), 0, 1)
    return pixels.astype("float32"), labels.astype("float32")


def get_dataset():
    import tensorflow as tf
    splits = [offline_digits(n, seed) for n, seed in
              ((TRAIN_EXAMPLES, 0), (VAL_EXAMPLES, 1), (TEST_EXAMPLES, 2))]
    return tuple(tf.data.Dataset.from_tensor_slices(split).batch(GUIDE_BATCH) for split in splits)


def main(mode: str = "mirrored", epochs: int = 2, record: str = None):
    """Runs the guide's training in `mode`; with `record`, every process writes its
    per-step losses and final weights to RECORD.rankR.npz (for the tests)."""
    strategy = tfdist.Strategy(mode, **OPTIONS[mode])
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = get_compiled_model()
    train_dataset, val_dataset, test_dataset = get_dataset()
    history = strategy.fit(model, train_dataset, epochs=int(epochs),
                           validation_data=val_dataset, verbose=2 if strategy.is_chief else 0)
    results = strategy.evaluate(model, test_dataset)
    print(f"test loss and accuracy: {results}")
    if record:
        rank = os.environ.get("TFDIST_RANK", "0")
        np.savez(f"{record}.rank{rank}.npz", np.array(strategy.last_result.losses),
                 *model.get_weights())
    return strategy, model, history, results


if __name__ == "__main__":
    main(*sys.argv[1:])
