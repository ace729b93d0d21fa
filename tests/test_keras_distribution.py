"""keras.distribution on the TensorFlow backend (tfdist.keras_distribution): Keras' own
model.fit / evaluate / predict under DataParallel and ModelParallel train like one
device (per-step losses and final weights within 1e-5 relative, float32), variables are
laid out as the LayoutMap says, and bad input is refused before training.

The one-device reference is Keras' own fit with no distribution. Keras logs a running
mean of the loss per epoch; per-step losses are recovered from it (step k's loss =
k*m_k - (k-1)*m_(k-1)) and also compared with tfdist's own record
(keras_distribution.strategy_for(distribution).last_result.losses).

Runs in the DTensor pytest process (the `dtensor` marker): 4 simulated CPUs.
"""

import functools

import numpy as np
import pytest

import keras
from keras import layers

from tfdist import keras_distribution
from tfdist.errors import UsageError
from tfdist.parallel.dtensor import sharding
from tfdist.testing import equivalence

pytestmark = pytest.mark.dtensor

RTOL = 1e-5
SEED = 5
BATCH = 16


@pytest.fixture(autouse=True)
def enabled():
    keras_distribution.enable()
    yield
    keras.distribution.set_distribution(None)


class BatchLogs(keras.callbacks.Callback):
    """Every batch's logs (Keras: running means over the epoch so far)."""

    def on_train_begin(self, logs=None):
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append([])

    def on_train_batch_end(self, batch, logs=None):
        self.epochs[-1].append({k: float(v) for k, v in logs.items()})

    def per_step_losses(self):
        losses = []
        for epoch in self.epochs:
            means = [logs["loss"] for logs in epoch]
            losses += [(k + 1) * m - k * (means[k - 1] if k else 0.0)
                       for k, m in enumerate(means)]
        return losses


def data(n=64, features=12, outputs=4, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, features)).astype("float32"),
            rng.normal(size=(n, outputs)).astype("float32"))


def functional_model(optimizer="adam", hidden=16):
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((12,), name="features")
    h = layers.Dense(hidden, activation="relu", name="hidden")(inputs)
    h = layers.Dense(8, activation="tanh", name="hidden2")(h)
    outputs = layers.Dense(4, name="out")(h)
    model = keras.Model(inputs, outputs, name="user_model")
    optimizers = {"adam": lambda: keras.optimizers.Adam(1e-2),
                  "sgd": lambda: keras.optimizers.SGD(0.05),
                  "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9)}
    model.compile(optimizer=optimizers[optimizer](), loss="mse", metrics=["mae"])
    return model


def train(distribution, build, x, y, epochs=2, **fit_kwargs):
    """Keras' own calls under `distribution` (None: one device)."""
    keras.distribution.set_distribution(distribution)
    try:
        model = build()
        logs = BatchLogs()
        model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[logs], **fit_kwargs)
        evaluation = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
        predictions = model.predict(_head(x), verbose=0)
    finally:
        keras.distribution.set_distribution(None)
    return model, logs, evaluation, predictions


def _head(x):
    return {k: v[:BATCH] for k, v in x.items()} if isinstance(x, dict) else x[:BATCH]


def relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))


def assert_like_one_device(reference, candidate, distribution):
    """Per-step losses (from the batch logs and tfdist's record) and final weights
    within 1e-5 relative (tfdist's harness: relative norm per variable); the logs
    every callback saw, evaluate and predict too."""
    ref_model, ref_logs, ref_eval, ref_pred = reference
    model, logs, evaluation, predictions = candidate
    one_device = equivalence.Record("one device", ref_logs.per_step_losses(),
                                    ref_model.get_weights())
    assert len(one_device.losses) > 0
    equivalence.assert_equivalent(one_device, equivalence.Record(
        "keras fit under the distribution", logs.per_step_losses(), model.get_weights()))
    tfdist_losses = keras_distribution.strategy_for(distribution).last_result.losses
    equivalence.assert_equivalent(one_device, equivalence.Record(
        "tfdist's per-step losses", list(tfdist_losses), model.get_weights()))
    for ref_epoch, epoch in zip(ref_logs.epochs, logs.epochs):
        for ref_batch, batch in zip(ref_epoch, epoch):
            assert sorted(batch) == sorted(ref_batch)
            assert all(relative(batch[k], ref_batch[k]) < RTOL for k in ref_batch)
    assert sorted(evaluation) == sorted(ref_eval)
    assert all(relative(evaluation[k], ref_eval[k]) < RTOL for k in ref_eval)
    assert norm_relative(predictions, ref_pred) < RTOL   # the harness' measure for weights


def norm_relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def shard_shapes(model):
    return {v.path: sorted({shape for _, shape in sharding.shard_shapes(v)})
            for v in model.variables}


def data_model_map(mesh, batch="data", model="model"):
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, model)
    layout_map["hidden/bias"] = (model,)
    layout_map["hidden2/kernel"] = (model, batch)
    layout_map["out/output"] = (batch, None)     # an activation layout
    return layout_map


# ------------------------------------------------------------------------ the backend

def test_devices_mesh_and_distribute_tensor():
    from tensorflow.experimental import dtensor
    assert keras.distribution.list_devices() == [f"cpu:{i}" for i in range(4)]
    assert keras.distribution.get_device_count() == 4
    assert keras.distribution.get_device_count("cpu") == 4
    mesh = keras.distribution.DeviceMesh((2, 2), ["data", "model"])
    assert mesh.backend_mesh.dim_names == ["data", "model"]
    layout = keras.distribution.TensorLayout(("data", "model"), mesh)
    value = np.arange(32, dtype="float32").reshape(8, 4)
    tensor = keras.distribution.distribute_tensor(value, layout)
    assert dtensor.fetch_layout(tensor).sharding_specs == ["data", "model"]
    assert {tuple(c.shape) for c in dtensor.unpack(tensor)} == {(4, 2)}
    np.testing.assert_array_equal(
        keras.distribution.distribute_tensor(tensor, keras.distribution.TensorLayout(
            (None, None), mesh)).numpy(), value)   # relayout of a DTensor
    keras.distribution.initialize()   # one process: nothing to join


def test_without_a_distribution_fit_is_keras_own():
    x, y = data()
    before = dict(keras_distribution._strategies)
    model, logs, _, _ = train(None, functional_model, x, y, epochs=1)
    assert keras_distribution._strategies == before
    assert len(logs.per_step_losses()) == len(x) // BATCH
    assert keras.Model.fit.__wrapped__.__qualname__ == "TensorFlowTrainer.fit"


# ------------------------------------------------------------------------ equivalence

@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_data_parallel_fit_trains_like_one_device(optimizer):
    x, y = data()
    build = lambda: functional_model(optimizer)   # noqa: E731
    reference = train(None, build, x, y)
    distribution = keras.distribution.DataParallel()
    candidate = train(distribution, build, x, y)
    assert_like_one_device(reference, candidate, distribution)
    assert keras_distribution.strategy_for(distribution).config.mesh == "batch=4,model=1"
    assert shard_shapes(candidate[0])["hidden/kernel"] == [(12, 16)]   # replicated


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_model_parallel_fit_trains_like_one_device_with_the_layout_map(optimizer, tmp_path):
    x, y = data()
    build = lambda: functional_model(optimizer)   # noqa: E731
    reference = train(None, build, x, y)
    mesh = keras.distribution.DeviceMesh((2, 2), ["data", "model"])
    distribution = keras.distribution.ModelParallel(layout_map=data_model_map(mesh),
                                                    batch_dim_name="data")
    candidate = train(distribution, build, x, y)
    assert_like_one_device(reference, candidate, distribution)
    shapes = shard_shapes(candidate[0])
    assert shapes["hidden/kernel"] == [(12, 8)]     # (12, 16) / model=2 on dim 1
    assert shapes["hidden/bias"] == [(8,)]
    assert shapes["hidden2/kernel"] == [(8, 4)]     # (16, 8): model on dim 0, data on dim 1
    assert shapes["out/kernel"] == [(8, 4)]         # no key: replicated
    # the saved model is whole and loads on one device
    path = str(tmp_path / "model.keras")
    candidate[0].save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.predict(x[:BATCH], verbose=0), candidate[3],
                               rtol=1e-5, atol=1e-6)   # sharded vs one-device sums


@pytest.mark.parametrize("from_logits", [False, True])
def test_model_parallel_trains_a_float64_classifier_with_its_classes_split(from_logits):
    """The Keras distribution guide's pattern on a float64 MobileNet-shaped classifier
    (conv, BatchNormalization, global pooling, softmax Dense): the classes' kernel columns
    over `model`, trained exactly. DTensor computes the sparse cross-entropy of split
    float64 classes as 0 or -inf where its propagation keeps the classes split up to the
    loss (the canary in test_dtensor_auto_layout.py; ResNet50 and MobileNetV2 in the
    conformance corpus); a model this small may gather them first, so this holds the
    rewrite (rewrites.py) to one device's numbers rather than reproducing the bug."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8, 8, 3)), rng.integers(0, 10, 64).astype("int32")

    def build():
        keras.utils.set_random_seed(SEED)
        with equivalence.dtype_policy("float64"):
            inputs = keras.Input((8, 8, 3))
            h = layers.Conv2D(8, 3, use_bias=False, name="conv")(inputs)
            h = layers.BatchNormalization(name="bn")(h)
            h = layers.ReLU(6.0)(h)
            h = layers.GlobalAveragePooling2D()(h)
            outputs = layers.Dense(10, activation=None if from_logits else "softmax",
                                   name="classes")(h)
            model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits))
        return model

    reference = train(None, build, x, y, epochs=1)
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["classes/kernel"] = (None, "model")
    layout_map["classes/bias"] = ("model",)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map,
                                                    batch_dim_name="batch")
    candidate = train(distribution, build, x, y, epochs=1)
    assert candidate[0].get_weights()[0].dtype == np.float64
    assert shard_shapes(candidate[0])["classes/kernel"] == [(8, 5)]
    assert_like_one_device(reference, candidate, distribution)


def test_the_distribution_scope_routes_fit_and_activation_layouts_are_applied():
    x, y = data()
    reference = train(None, functional_model, x, y, epochs=1)
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    distribution = keras.distribution.ModelParallel(
        layout_map=data_model_map(mesh, batch="batch"), batch_dim_name="batch")
    asked = []
    relayout = keras_distribution.Route.relayout

    def recording(self, tensor, layout):
        import tensorflow as tf
        asked.append((tf.executing_eagerly(), tuple(layout.axes)))
        return relayout(self, tensor, layout)

    keras_distribution.Route.relayout = recording
    try:
        with distribution.scope():
            model = functional_model()
            logs = BatchLogs()
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=[logs])
    finally:
        keras_distribution.Route.relayout = relayout
    assert keras.distribution.distribution() is None
    assert relative(logs.per_step_losses(), reference[1].per_step_losses()) < RTOL
    # traced into the sharded step (not eager) with out/output's layout
    assert (False, ("batch", None)) in asked, asked


# Mixed precision: the sharded program rounds some partial sums (a matmul's contraction
# split over "model", a batch split over "batch") to bfloat16 where one device rounds the
# whole sum once; one extra bfloat16 rounding is a relative error of at most its unit
# roundoff u = 2**-8. So each step's loss is held to u, and the final weights, where every
# step's update may carry one such error and they add up in the worst case, to steps * u.
# That holds for an update linear in the gradient, so these runs use plain SGD. Adam divides
# each update by sqrt(v): a bias whose gradient is near 0 takes a full step whose size the
# rounding decides. Measured with Adam (8 steps): weights 6.0e-3 (ModelParallel) on a CPU
# with AVX512-BF16, but 3.4e-2 (a bias, over the 3.1e-2 bound) on an AVX2-only EPYC, where
# oneDNN rounds bfloat16 matmuls differently; losses 1.7e-3 there and here (bound 3.9e-3).
BFLOAT16_U = 2.0 ** -8


@pytest.mark.parametrize("kind", ["data", "model"])
def test_mixed_bfloat16_trains_like_one_device_mixed_bfloat16(kind):
    x, y = data()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        build = functools.partial(functional_model, "sgd")
        reference = train(None, build, x, y)
        if kind == "data":
            distribution = keras.distribution.DataParallel()
        else:
            mesh = keras.distribution.DeviceMesh((2, 2), ["data", "model"])
            distribution = keras.distribution.ModelParallel(layout_map=data_model_map(mesh),
                                                            batch_dim_name="data")
        candidate = train(distribution, build, x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model = candidate[0]
    assert model.get_layer("hidden").compute_dtype == "bfloat16"
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    one_device = equivalence.Record("one device mixed_bfloat16",
                                    reference[1].per_step_losses(), reference[0].get_weights())
    got = equivalence.Record(f"{type(distribution).__name__} mixed_bfloat16",
                             candidate[1].per_step_losses(), model.get_weights())
    steps = len(one_device.losses)
    assert steps == 8
    assert not equivalence.loss_mismatches(one_device, got, rtol=BFLOAT16_U)
    assert not equivalence.weight_mismatches(one_device, got, rtol=steps * BFLOAT16_U)
    if kind == "model":
        assert shard_shapes(model)["hidden/kernel"] == [(12, 8)]


# ------------------------------------------------------------------------ keras-hub Gemma

def test_gemma_backbone_with_its_own_layout_map_trains_like_one_device(tmp_path):
    """keras-hub's GemmaCausalLM (its tied-embedding head; tests/keras_hub_models.py's
    functional gemma_lm cannot be saved by Keras even on one device: the shared
    token_embedding loads with no variables) over a tiny random GemmaBackbone."""
    pytest.importorskip("keras_hub")
    import keras_hub
    import keras_hub_models
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, keras_hub_models.TEXT_VOCABULARY,
                          size=(64, keras_hub_models.TEXT_SEQ_LEN + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones_like(tokens[:, :-1])}
    y = tokens[:, 1:]

    def build():
        keras.utils.set_random_seed(SEED)
        backbone = keras_hub_models.build_backbone("gemma", keras_hub_models.TEXT_VOCABULARY,
                                                   keras_hub_models._tiny_config())
        model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference = train(None, build, x, y, epochs=1)
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map,
                                                    batch_dim_name="batch")
    candidate = train(distribution, build, x, y, epochs=1)
    assert_like_one_device(reference, candidate, distribution)
    model = candidate[0]
    both_axes = [v for v in model.variables
                 if _axes(layout_map[v.path]) >= {"batch", "model"}]
    assert len(both_axes) >= 4, [v.path for v in model.variables]
    for variable in both_axes:
        total = int(np.prod(variable.shape)) * 4
        per_device = {}
        for device, shape in sharding.shard_shapes(variable):
            per_device[device] = per_device.get(device, 0) + int(np.prod(shape)) * 4
        assert len(per_device) == 4 and set(per_device.values()) == {total // 4}, variable.path
    path = str(tmp_path / "gemma.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert norm_relative(loaded.predict({k: v[:BATCH] for k, v in x.items()}, verbose=0),
                         candidate[3]) < RTOL


def _axes(layout):
    return set() if layout is None else {a for a in layout.axes if a is not None}


# ------------------------------------------------------------------------ bad input

def _untrained_fit(distribution, build=functional_model, **fit_kwargs):
    """fit under `distribution`; returns (error, model) with the model's weights before."""
    x, y = data()
    keras.distribution.set_distribution(distribution)
    model = build()
    before = [w.copy() for w in model.get_weights()]
    try:
        with pytest.raises((ValueError, UsageError)) as error:
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, **fit_kwargs)
    finally:
        keras.distribution.set_distribution(None)
    for w, b in zip(model.get_weights(), before):   # refused before any step
        np.testing.assert_array_equal(w, b)
    return str(error.value)


def test_a_variable_matching_two_keys_is_refused_naming_it():
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["hidden.*/kernel"] = (None, "model")
    layout_map[".*den/kernel"] = ("model", None)
    message = _untrained_fit(keras.distribution.ModelParallel(layout_map=layout_map))
    assert "hidden/kernel" in message and "hidden.*/kernel" in message, message


def test_an_axis_not_in_the_mesh_is_refused_naming_it():
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    with pytest.raises(ValueError, match="modle"):   # Keras' own check, at insertion
        layout_map["hidden/kernel"] = (None, "modle")
    layout_map["hidden/kernel"] = (None, "model")
    message = _untrained_fit(keras.distribution.ModelParallel(layout_map=layout_map,
                                                              batch_dim_name="data"))
    assert "'data'" in message and "batch_dim_name" in message, message


def test_a_dimension_not_divisible_is_refused_naming_the_variable():
    mesh = keras.distribution.DeviceMesh((1, 4), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, "model")     # 6 columns over model=4
    message = _untrained_fit(keras.distribution.ModelParallel(layout_map=layout_map),
                             build=lambda: functional_model(hidden=6))
    assert "hidden/kernel" in message, message


def test_a_mesh_that_is_not_the_device_count_is_refused():
    mesh = keras.distribution.DeviceMesh((2,), ["batch"], devices=["cpu:0", "cpu:1"])
    message = _untrained_fit(keras.distribution.DataParallel(device_mesh=mesh))
    assert "2 devices" in message and "4 cpu devices" in message, message


def test_a_mesh_of_three_axes_is_refused_naming_them():
    mesh = keras.distribution.DeviceMesh((1, 2, 2), ["batch", "model", "seq"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, "model")
    message = _untrained_fit(keras.distribution.ModelParallel(layout_map=layout_map))
    assert "'seq'" in message, message


def test_initialize_with_only_a_coordinator_address_is_refused():
    """JAX needs only process 0's address; DTensor clients need every process's."""
    with pytest.raises(ValueError, match="job_addresses='10.0.0.1:1234' has 1.*num_processes=2"):
        keras.distribution.initialize("10.0.0.1:1234", num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="process_id=2"):
        keras.distribution.initialize("a:1,b:2", num_processes=2, process_id=2)


def test_unsupported_fit_arguments_are_refused_naming_them():
    """validation_split, class_weight and initial_epoch are Keras' (tests/test_keras_calls.py);
    a validation window that moves across epochs is refused."""
    x, y = data()
    message = _untrained_fit(keras.distribution.DataParallel(), validation_data=(x, y),
                             validation_steps=1)
    assert "validation_steps=1" in message, message


def test_enable_under_another_backend_is_refused():
    """The check enable() makes on keras.backend.backend() (no other backend can be
    imported here: Keras' numpy backend needs jax, which is not installed)."""
    for backend in ("jax", "torch", "numpy"):
        with pytest.raises(ValueError, match=f"KERAS_BACKEND='{backend}'.*tensorflow"):
            keras_distribution.require_tensorflow_backend(backend)
    keras_distribution.require_tensorflow_backend("tensorflow")


# ------------------------------------------------------------------------ canaries

def test_canary_keras_tf_backend_still_lacks_what_tfdist_provides():
    """keras-team/keras#18473: when Keras' TF distribution_lib gets these, revisit
    tfdist.keras_distribution (its functions would then replace Keras' own)."""
    import inspect
    from keras.src.backend.tensorflow import distribution_lib
    source = inspect.getsource(distribution_lib)
    for name in ("get_device_count", "distribute_tensor", "distribute_data_input",
                 "num_processes", "process_id", "initialize"):
        assert f"def {name}(" not in source, f"Keras' TF backend now has {name}"
    assert "def distribute_value(" in source and "# TODO" in source


def test_canary_public_keras_distribution_calls_the_tf_backend_module():
    """The functions tfdist installs are the ones keras.distribution calls."""
    from keras.src.backend.tensorflow import distribution_lib as backend
    from keras.src.distribution import distribution_lib as public
    assert public.distribution_lib is backend
    assert backend.distribute_tensor is keras_distribution.distribute_tensor
    assert backend.initialize is keras_distribution.initialize


def test_canary_layers_ask_the_distribution_for_output_layouts():
    """Keras' Layer.__call__ asks get_tensor_layout('<path>/output') and then calls the
    backend's distribute_tensor: how activation layouts reach tfdist."""
    asked = []

    class Recording(keras.distribution.DataParallel):
        def get_tensor_layout(self, path):
            asked.append(path)
            return None

    with Recording().scope():
        layers.Dense(2, name="probe")(np.ones((1, 3), "float32"))
    assert asked == ["probe/output"], asked


def test_canary_keras_fit_signature_is_what_the_routes_read():
    import inspect
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    for name, route_args in (("fit", ["x", "y", "batch_size", "epochs", "verbose", "callbacks",
                                      "validation_split", "validation_data", "shuffle",
                                      "class_weight", "sample_weight", "initial_epoch",
                                      "steps_per_epoch", "validation_steps",
                                      "validation_batch_size", "validation_freq"]),
                             ("evaluate", ["x", "y", "batch_size", "verbose", "sample_weight",
                                           "steps", "callbacks", "return_dict"]),
                             ("predict", ["x", "batch_size", "verbose", "steps", "callbacks"])):
        keras_method = getattr(TensorFlowTrainer, name)
        assert getattr(keras.Model, name).__wrapped__ is keras_method
        params = list(inspect.signature(keras_method).parameters)[1:]
        assert params[:len(route_args)] == route_args, (name, params)


# ------------------------------------------------------------------------ keras-io's guides

GUIDES = {"2023": "examples/keras_distribution_guide_2023.py",
          "current": "examples/keras_distribution_guide.py"}
WORKER = "tests/workers/keras_distribution_worker.py"
GUIDE_AXES = {"DataParallel": {"data": 8, "batch": 8}, "ModelParallel": {"data": 2, "model": 4}}


def _run(args, tmp_path, timeout=300):
    import os
    import subprocess
    import sys
    from helpers import REPO
    env = dict(os.environ, TFDIST_SIMULATE_DEVICES="8", TF_CPP_MIN_LOG_LEVEL="3",
               KERAS_BACKEND="tensorflow", PYTHONPATH=REPO)
    result = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def guide_runs(tmp_path_factory):
    """{(guide, mode): (summary, weights)} from the worker, 8 simulated CPUs each."""
    import json
    tmp_path = tmp_path_factory.mktemp("guides")
    runs = {}
    for guide, extra in (("2023", ["--no-dropout"]),
                         ("current", ["--no-dropout", "--train-built-models"])):
        for mode in ("distributed", "one_device"):
            out = str(tmp_path / f"{guide}_{mode}.json")
            _run([WORKER, GUIDES[guide], mode, out, *extra], tmp_path)
            with open(out) as f:
                runs[guide, mode] = json.load(f), dict(np.load(out + ".npz"))
    return runs


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_the_guide_runs_unchanged_on_8_simulated_cpus(guide, tmp_path):
    result = _run([GUIDES[guide]], tmp_path)
    if guide == "current":
        assert "Keras distribution initialized." in result.stdout
        assert "DeviceMesh created with shape: (2, 4)" in result.stdout


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_the_guide_trains_step_for_step_like_one_device(guide, guide_runs):
    distributed, weights = guide_runs[guide, "distributed"]
    one_device, ref_weights = guide_runs[guide, "one_device"]
    assert distributed["devices"] == [f"cpu:{i}" for i in range(8)]
    fits = list(zip(one_device["fits"], distributed["fits"]))
    assert [got["distribution"] for _, got in fits] == ["DataParallel", "ModelParallel"]
    for index, (ref, got) in enumerate(fits):
        assert ref["distribution"] is None and len(ref["losses"]) >= 8
        count = sum(1 for key in ref_weights if key.startswith(f"fit{index}_"))
        record = lambda label, losses, w: equivalence.Record(   # noqa: E731
            label, losses, [w[f"fit{index}_{j}"] for j in range(count)])
        reference = record("one device", ref["losses"], ref_weights)
        equivalence.assert_equivalent(reference, record(got["distribution"], got["losses"],
                                                        weights))
        equivalence.assert_equivalent(reference, record("tfdist", got["tfdist_losses"],
                                                        weights))


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_the_guide_variables_are_laid_out_as_its_layout_map_says(guide, guide_runs):
    distributed, _ = guide_runs[guide, "distributed"]
    for fit in distributed["fits"]:
        axes = GUIDE_AXES[fit["distribution"]]
        for variable in fit["variables"]:
            expected = [size // axes[axis] if axis else size
                        for size, axis in zip(variable["shape"], variable["axes"])]
            assert variable["shards"] == [expected] and variable["devices"] == 8, variable
    layouts = {v["path"]: v["axes"] for fit in distributed["fits"] for v in fit["variables"]}
    if guide == "2023":
        assert layouts["d1/kernel"] == [None, "model"]    # 784 x 200 -> 784 x 50 per device
    else:
        # The Sequential's paths are "sequential/d1/kernel": the guide's keys match none
        # (Keras' own lookup says so too), so every variable is replicated.
        assert "sequential/d1/kernel" in layouts
        assert all(axis is None for spec in layouts.values() for axis in spec)
