"""keras-io's "Distributed training with Keras" (guides/distribution.py, its current
version, last modified 2026-08-13, written for JAX and PyTorch), on TensorFlow with tfdist.

The same program shapes as the guide: `keras.distribution.initialize()` (tolerated to
fail, as the guide does), the devices, a "data" x "model" mesh (2 x 4 on 8 devices,
else N x 1), a 2-D TensorLayout, DataParallel over every device with a small
MNIST-shaped functional model compiled with MSE and Adam, then ModelParallel with a
LayoutMap (d1's kernel and bias over "model", d2's output over "data") and a
Sequential model built under it. This version of the guide trains nothing (the 2023
one does: examples/keras_distribution_guide_2023.py). What changed for TensorFlow:
KERAS_BACKEND is "tensorflow", and one line is added before the mesh is built,
`tfdist.enable_keras_distribution()`.

    TFDIST_SIMULATE_DEVICES=8 python examples/keras_distribution_guide.py

Worth knowing, on every backend: the Sequential model's variable paths are
"sequential/d1/kernel", ..., and LayoutMap keys are matched against the whole path
(re.fullmatch), so this guide's keys "d1/kernel", "d1/bias" match none of them and
its ModelParallel replicates everything (tfdist says so in a warning when the model
trains; keys like ".*d1/kernel" would shard it). tests/test_keras_distribution.py runs
this guide on 8 simulated CPUs, trains its two models under their distributions on
offline data of the guide's shapes, and checks the layouts and every step against one
device.
"""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"

import keras  # noqa: E402
import numpy as np  # noqa: E402,F401  (the guide imports it)
from keras import layers  # noqa: E402

import tfdist  # noqa: E402

tfdist.enable_keras_distribution()   # the one added line

# One process here; with several, initialize() joins them (it reads
# KERAS_DISTRIBUTION_JOB_ADDRESSES / _NUM_PROCESSES / _PROCESS_ID when given no
# arguments). Like the guide, carry on when there is nothing to join.
try:
    keras.distribution.initialize()
    print("Keras distribution initialized.")
except Exception as error:
    print(f"Keras distribution initialization skipped or failed: {error}")

# ---- DeviceMesh and TensorLayout ------------------------------------------------------
devices = keras.distribution.list_devices()
print(f"Global devices: {devices}")

# 2-way data parallel x 4-way model parallel on 8 devices; data parallel only otherwise.
mesh_shape = (2, 4) if len(devices) >= 8 else (len(devices), 1)
mesh = keras.distribution.DeviceMesh(shape=mesh_shape, axis_names=["data", "model"],
                                     devices=devices)
print(f"DeviceMesh created with shape: {mesh_shape}")

# Rows split over "model", columns over "data".
layout_2d = keras.distribution.TensorLayout(axes=("model", "data"), device_mesh=mesh)
print(f"TensorLayout created: {layout_2d}")

# ---- DataParallel ---------------------------------------------------------------------
# Every device found, weights replicated, batches split over the devices.
data_parallel = keras.distribution.DataParallel()
keras.distribution.set_distribution(data_parallel)
print(f"Active distribution: {keras.distribution.distribution()}")

inputs = layers.Input(shape=(28, 28, 1))
y = layers.Flatten()(inputs)
y = layers.Dense(units=200, activation="relu")(y)
y = layers.Dropout(0.4)(y)
outputs = layers.Dense(units=10, activation="softmax")(y)
model = keras.Model(inputs=inputs, outputs=outputs)

model.compile(loss="mse", optimizer="adam")
model.summary()

# ---- ModelParallel and LayoutMap ------------------------------------------------------
# Regex keys over variable paths (and "<layer>/output" for a layer's activations).
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["d1/kernel"] = (None, "model")
layout_map["d1/bias"] = ("model",)
layout_map["d2/output"] = ("data", None)

model_parallel = keras.distribution.ModelParallel(layout_map=layout_map,
                                                  batch_dim_name="data")
keras.distribution.set_distribution(model_parallel)
print(f"Active distribution: {keras.distribution.distribution()}")

# On TensorFlow the variables are ordinary until the first fit, evaluate or predict,
# where tfdist lays them out on the mesh as the LayoutMap says.
model = keras.Sequential([
    layers.Input(shape=(784,)),
    layers.Dense(200, activation="relu", name="d1"),
    layers.Dense(10, activation="softmax", name="d2"),
])
model.summary()
