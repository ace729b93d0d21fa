"""keras-io's "Distributed training with Keras 3" (guides/distribution.py, its first
version, 2023-11-07, written for the JAX backend), on TensorFlow with tfdist.

The same program shapes as the guide: a 2x4 "data" x "model" mesh over 8 devices,
DataParallel from a device list and from a 1-D mesh, then ModelParallel with a
LayoutMap (d1's kernel and bias over "model", d2's output over "data"), each
training a small MNIST-shaped model with Keras' own `model.fit` / `evaluate` on a
batched tf.data set of random normal data (the guide's own data: nothing to
download). What changed for TensorFlow, and nothing else:
- KERAS_BACKEND is "tensorflow", and one line is added before the mesh is built:
  `tfdist.enable_keras_distribution()`;
- the devices come from `keras.distribution.list_devices()` (the guide asks JAX
  for its GPUs);
- `ModelParallel(layout_map=...)` by keyword: Keras 3.15 made its arguments
  keyword-only, so the guide's positional call fails on every backend today.

Run it on 8 simulated CPUs:

    TFDIST_SIMULATE_DEVICES=8 python examples/keras_distribution_guide_2023.py

tests/test_keras_distribution.py runs it in a subprocess and checks that its
variables are laid out as its LayoutMap says and that every fit step equals a
one-device run (with the Dropout rate at 0 there: a stochastic layer draws its own
random numbers per shard, so no distributed run equals one device step for step).
"""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402
from tensorflow import data as tf_data  # noqa: E402  (the guide's input pipeline)

import tfdist  # noqa: E402

tfdist.enable_keras_distribution()   # the one added line

# ---- DeviceMesh and TensorLayout ------------------------------------------------------
# All the devices, as a 2 x 4 mesh: 2-way data parallel, 4-way model parallel.
devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh(shape=(2, 4), axis_names=["data", "model"],
                                     devices=devices)

# A layout names, per tensor dimension, the mesh axis it is split over: here rows over
# "model" (4 ways) and columns over "data" (2 ways).
layout_2d = keras.distribution.TensorLayout(axes=("model", "data"), device_mesh=mesh)
# An image batch split over "data" only.
replicated_layout_4d = keras.distribution.TensorLayout(axes=("data", None, None, None),
                                                       device_mesh=mesh)

# ---- DataParallel ---------------------------------------------------------------------
# Weights replicated on every device, each batch split over them. Either from a list of
# devices, or from a 1-D mesh.
data_parallel = keras.distribution.DataParallel(devices=devices)
mesh_1d = keras.distribution.DeviceMesh(shape=(8,), axis_names=["data"], devices=devices)
data_parallel = keras.distribution.DataParallel(device_mesh=mesh_1d)

inputs = np.random.normal(size=(128, 28, 28, 1))
labels = np.random.normal(size=(128, 10))
dataset = tf_data.Dataset.from_tensor_slices((inputs, labels)).batch(16)

keras.distribution.set_distribution(data_parallel)

# Built as usual; fit and evaluate split every batch of 16 over the 8 devices.
inputs = layers.Input(shape=(28, 28, 1))
y = layers.Flatten()(inputs)
y = layers.Dense(units=200, use_bias=False, activation="relu")(y)
y = layers.Dropout(0.4)(y)
y = layers.Dense(units=10, activation="softmax")(y)
model = keras.Model(inputs=inputs, outputs=y)

model.compile(loss="mse")
model.fit(dataset, epochs=3)
model.evaluate(dataset)

# ---- ModelParallel and LayoutMap ------------------------------------------------------
# Keys are regexes matched against each variable's path (and "<layer>/output" against
# a layer's output); values give the layout. Unmatched variables are replicated.
mesh_2d = keras.distribution.DeviceMesh(shape=(2, 4), axis_names=["data", "model"],
                                        devices=devices)
layout_map = keras.distribution.LayoutMap(mesh_2d)
layout_map["d1/kernel"] = (None, "model")     # d1's 200 units split 4 ways
layout_map["d1/bias"] = ("model",)
layout_map["d2/output"] = ("data", None)      # d2's activations split over the batch

model_parallel = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")
keras.distribution.set_distribution(model_parallel)

inputs = layers.Input(shape=(28, 28, 1))
y = layers.Flatten()(inputs)
y = layers.Dense(units=200, use_bias=False, activation="relu", name="d1")(y)
y = layers.Dropout(0.4)(y)
y = layers.Dense(units=10, activation="softmax", name="d2")(y)
model = keras.Model(inputs=inputs, outputs=y)

# Batches split 2 ways over "data"; d1's kernel lives in 4 pieces.
model.compile(loss="mse")
model.fit(dataset, epochs=3)
model.evaluate(dataset)

# ---- Other mesh shapes ----------------------------------------------------------------
# The balance between data and model parallelism is the mesh's shape; nothing else in
# the program changes.
full_data_parallel_mesh = keras.distribution.DeviceMesh(
    shape=(8, 1), axis_names=["data", "model"], devices=devices)
more_data_parallel_mesh = keras.distribution.DeviceMesh(
    shape=(4, 2), axis_names=["data", "model"], devices=devices)
more_model_parallel_mesh = keras.distribution.DeviceMesh(
    shape=(2, 4), axis_names=["data", "model"], devices=devices)
full_model_parallel_mesh = keras.distribution.DeviceMesh(
    shape=(1, 8), axis_names=["data", "model"], devices=devices)
