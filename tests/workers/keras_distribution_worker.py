"""Runs one of the keras.distribution guides (examples/keras_distribution_guide*.py) and
writes what every `model.fit` did to a JSON file, for tests/test_keras_distribution.py.

    python tests/workers/keras_distribution_worker.py GUIDE MODE OUT.json [--no-dropout]
        [--train-built-models]

MODE "distributed": the guide as it is (TFDIST_SIMULATE_DEVICES=8 gives it 8 CPUs).
MODE "one_device": the same program with keras.distribution.set_distribution made a
no-op, so every fit is Keras' own on one device: the reference.
--train-built-models: after the guide (the current one trains nothing), every model it
compiled, and its last `model`, is trained for one epoch under the distribution that was
set when it was built, on offline random data of its input shape (MSE, Adam if the guide
did not compile it), as the 2023 guide trains its models.
Or a user's program across processes (tests/test_keras_distribution_multi_process.py):

    tfdist launch --workers 2 --devices_per_worker 2 --dtensor -- \
        python tests/workers/keras_distribution_worker.py multi_process KIND OUT_PREFIX

enable, keras.distribution.initialize() (from the DTENSOR_* launch sets), KIND "data"
(DataParallel over the 4 devices) or "model" (ModelParallel on batch=2,model=2), Keras'
own fit; process C writes OUT_PREFIX.C.json (losses) and OUT_PREFIX.C.npz (weights).

--no-dropout sets every Dropout's rate to 0 (a stochastic layer draws per shard, so no
distributed run equals one device step for step; both modes get the same change).

Both modes seed NumPy before the guide and Keras at every set_distribution call (the
guide builds each model right after one), so each model starts from the same weights
and data in both modes. Per fit: the batch logs (Keras' running means), the per-step
losses they imply, tfdist's own per-step losses, the final weights (OUT.json's .npz),
and per variable its shape, the layout the LayoutMap gives it and its shard shapes.
"""

import json
import os
import runpy
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["KERAS_BACKEND"] = "tensorflow"

import numpy as np  # noqa: E402

SEED = 0


def main(guide, mode, out, no_dropout, train_built_models):
    from tfdist import keras_distribution
    keras_distribution.enable()       # what the guide's own call does (idempotent)
    import keras
    records, compiled = [], []
    one_device = mode == "one_device"
    intended = _seed_at_set_distribution(keras, one_device)
    if no_dropout:
        _zero_dropout(keras)
    _record_fits(keras, keras_distribution, records)
    _record_compiles(keras, intended, compiled)
    np.random.seed(SEED)
    namespace = runpy.run_path(guide, run_name="__main__")
    if train_built_models:
        last = namespace["model"]
        if all(model is not last for model, _ in compiled):
            compiled.append((last, intended[0]))
        for model, distribution in list(compiled):   # _train may compile (and record)
            _train(keras, model, None if one_device else distribution)
    weights = {f"fit{i}_{j}": w for i, r in enumerate(records) for j, w in
               enumerate(r.pop("weights"))}
    np.savez(out + ".npz", **weights)
    summary = {"fits": records, "devices": keras.distribution.list_devices(),
               "mesh_shapes": {name: list(value.shape) for name, value in namespace.items()
                               if isinstance(value, keras.distribution.DeviceMesh)}}
    with open(out, "w") as f:
        json.dump(summary, f)


def _seed_at_set_distribution(keras, one_device):
    """Returns [the distribution the guide set last] (whatever the mode)."""
    public_set = keras.distribution.set_distribution
    intended = [None]

    def set_distribution(value):
        keras.utils.set_random_seed(SEED)
        intended[0] = value
        public_set(None if one_device else value)

    keras.distribution.set_distribution = set_distribution
    return intended


def _record_compiles(keras, intended, compiled):
    compile_ = keras.Model.compile

    def recording_compile(model, *args, **kwargs):
        compiled.append((model, intended[0]))
        return compile_(model, *args, **kwargs)

    keras.Model.compile = recording_compile


def _train(keras, model, distribution):
    import tensorflow as tf
    from keras.src.distribution import distribution_lib
    distribution_lib.set_distribution(distribution)   # Keras' own (not the seeding wrapper)
    if not model.compiled:
        model.compile(loss="mse", optimizer="adam")
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(128,) + tuple(model.input_shape[1:])).astype("float32")
    y = rng.normal(size=(128,) + tuple(model.output_shape[1:])).astype("float32")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1)


def _zero_dropout(keras):
    init = keras.layers.Dropout.__init__

    def zero_rate(self, rate, *args, **kwargs):
        init(self, 0.0, *args, **kwargs)

    keras.layers.Dropout.__init__ = zero_rate


def _record_fits(keras, keras_distribution, records):
    fit = keras.Model.fit   # tfdist's routed fit (Keras' own without a distribution)

    class Logs(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.epochs = []

        def on_epoch_begin(self, epoch, logs=None):
            self.epochs.append([])

        def on_train_batch_end(self, batch, logs=None):
            self.epochs[-1].append(float(logs["loss"]))

    def recording_fit(model, *args, **kwargs):
        logs = Logs()
        kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + [logs]
        kwargs.setdefault("verbose", 0)
        history = fit(model, *args, **kwargs)
        records.append(_record(keras, keras_distribution, model, logs))
        return history

    keras.Model.fit = recording_fit


def _record(keras, keras_distribution, model, logs):
    distribution = keras.distribution.distribution()
    steps = []
    for means in logs.epochs:
        steps += [(k + 1) * m - k * (means[k - 1] if k else 0.0) for k, m in enumerate(means)]
    record = {"batch_means": logs.epochs, "losses": steps, "weights": model.get_weights(),
              "distribution": type(distribution).__name__ if distribution else None,
              "variables": [_variable(v, distribution) for v in model.variables]}
    if distribution is not None:
        record["tfdist_losses"] = list(
            keras_distribution.strategy_for(distribution).last_result.losses)
        record["tfdist_mesh"] = keras_distribution.strategy_for(distribution).config.mesh
    return record


def _variable(variable, distribution):
    entry = {"path": variable.path, "shape": list(variable.shape)}
    if distribution is None:
        return entry
    from tfdist.parallel.dtensor import sharding
    layout = distribution.get_variable_layout(variable)
    entry["axes"] = list(layout.axes)
    entry["shards"] = sorted({tuple(s) for _, s in sharding.shard_shapes(variable)})
    entry["devices"] = len(sharding.shard_shapes(variable))
    return entry


# ---- a user's program across processes ----------------------------------------------

EPOCHS, BATCH = 2, 16


def user_model():
    import keras
    keras.utils.set_random_seed(1)
    inputs = keras.Input((12,), name="features")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="out")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def user_data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(64, 12)).astype("float32"),
            rng.normal(size=(64, 4)).astype("float32"))


def user_fit(model, callbacks=()):
    x, y = user_data()
    return model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                     callbacks=list(callbacks))


def user_distribution(keras, kind):
    if kind == "data":
        return keras.distribution.DataParallel()
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, "model")
    layout_map["hidden/bias"] = ("model",)
    layout_map["out/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def multi_process(kind, out_prefix):
    import tfdist
    tfdist.enable_keras_distribution()
    import keras
    keras.distribution.initialize()
    distribution = user_distribution(keras, kind)
    keras.distribution.set_distribution(distribution)
    model = user_model()
    history = user_fit(model)
    from tfdist import keras_distribution
    process = keras_distribution.process_id()
    weights = model.get_weights()   # a gather every process joins
    with open(f"{out_prefix}.{process}.json", "w") as f:
        json.dump({"losses": list(keras_distribution.strategy_for(distribution).last_result.losses),
                   "history": history.history, "devices": keras.distribution.list_devices(),
                   "num_processes": distribution.num_processes,
                   "mesh": keras_distribution.strategy_for(distribution).config.mesh}, f)
    np.savez(f"{out_prefix}.{process}.npz", *weights)
    # Nobody leaves before everyone has gathered (a leaving client cancels the others').
    from tensorflow.experimental import dtensor
    dtensor.barrier(dtensor.fetch_layout(model.weights[0].value).mesh, "written",
                    timeout_in_ms=120_000)


if __name__ == "__main__" and sys.argv[1] == "multi_process":
    multi_process(sys.argv[2], sys.argv[3])
elif __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(*arguments, no_dropout="--no-dropout" in sys.argv,
         train_built_models="--train-built-models" in sys.argv)
