"""Plain Keras 3 `fit` under MultiWorkerMirroredStrategy, without tfdist's repair.

Prints UPSTREAM-BREAK-PRESENT when it fails the known way (keras-team/keras#20585,
tensorflow/tensorflow#72388), UPSTREAM-FIXED when fit runs. Started by
tests/test_upstream_canaries.py under `tfdist launch --workers 2`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
features = np.random.default_rng(0).random((64, 4), dtype=np.float32)
labels = np.zeros((64,), dtype=np.int32)
dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(16)
try:
    model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
    print("UPSTREAM-FIXED")
except Exception as error:  # the upstream break surfaces as a TypeError or ValueError
    print(f"UPSTREAM-BREAK-PRESENT {type(error).__name__}: {str(error)[:200]}")
