"""--strategy=dtensor: tensor parallel and 2-D hybrid, held to the default run's numbers.

Real TensorFlow on the 4 simulated CPUs (conftest), no mocks. Reference runs
are shared across parametrised cases (lru_cache).

What is compared: per-step losses (20 steps, batch 32, seed 7) within 1e-5
relative of `default`, and final weights within 1e-5 relative norm per
variable.
"""

import collections
import dataclasses
import functools
import json
import logging
import os
import re

import numpy as np
import pytest

from tfdist.config import DataConfig, ModelConfig, RunConfig
from tfdist.errors import UsageError
from tfdist.testing import equivalence

from helpers import run_cli

STEPS = 20
GLOBAL_BATCH = 32
MESHES = [("batch=1,model=4", "megatron"), ("batch=2,model=2", "megatron"),
          ("batch=4,model=1", "data")]
REPORT = os.environ.get("TFDIST_DTENSOR_REPORT")  # optional: append max errors as JSON lines


def model_and_data(model: str):
    if model == "mlp":
        return ModelConfig(name="mlp"), DataConfig(name="digits")
    return (ModelConfig(name="transformer", num_layers=2, d_model=32, num_heads=4, d_ff=64),
            DataConfig(name="text", seq_len=16))


def make_config(strategy, model="mlp", optimizer="sgd", mesh=None, layout="data", **overrides):
    model_config, data_config = model_and_data(model)
    fields = dict(strategy=strategy, simulate_devices=4, model=model_config, data=data_config,
                  optimizer=optimizer, global_batch_size=GLOBAL_BATCH, train_steps=STEPS,
                  seed=7, log_every=STEPS)
    if strategy == "dtensor":
        fields.update(mesh=mesh, layout=layout)
    fields.update(overrides)
    return RunConfig(**fields)


def train(config, label):
    from tfdist.train import runner
    results, model = runner.run(config, return_model=True)
    record = equivalence.Record(label, results["losses"], model.get_weights())
    return record, [v.path for v in model.weights], results


@functools.lru_cache(maxsize=None)
def reference(model: str, optimizer: str):
    return train(make_config("default", model, optimizer), "default")


@pytest.mark.parametrize("mesh,layout", MESHES)
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_dtensor_matches_default(model, optimizer, mesh, layout):
    ref, ref_paths, _ = reference(model, optimizer)
    got, paths, results = train(make_config("dtensor", model, optimizer, mesh, layout),
                                f"dtensor {mesh} {layout}")
    assert paths == ref_paths
    error = equivalence.max_relative_loss_error(ref, got)
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"model": model, "optimizer": optimizer, "mesh": mesh,
                                "max_rel_loss_error": error}) + "\n")
    equivalence.assert_equivalent(ref, got)
    assert len(got.losses) == STEPS
    assert sum(got.losses[-5:]) < sum(got.losses[:5])
    assert results["num_replicas"] == int(mesh.split(",")[0].split("=")[1])


def nesterov():
    # Not in tfdist's optimizer registry (config.OPTIMIZERS); update.py has its own rule.
    import keras
    return keras.optimizers.SGD(learning_rate=0.05, momentum=0.9, nesterov=True)


def train_with_optimizer(config, optimizer_fn, label):
    """As tfdist.run trains `config`, with an optimizer the registry has no name for."""
    import keras
    from tfdist import data, models, parallel
    from tfdist.train import runner
    mode = parallel.build_parallelism(config)
    mode.validate_global_batch(config.global_batch_size)
    source = data.get_source(config.data)
    keras.mixed_precision.set_dtype_policy("float32")
    keras.utils.set_random_seed(config.seed)
    with mode.scope():   # compiled as tfdist.run compiles a registry model
        model = models.build_model(source.info, config.model)
        model.compile(optimizer=optimizer_fn(), loss=runner.registry_loss())
    model, optimizer = mode.adopt(model)
    try:
        losses = runner.train(config, mode, source, model, optimizer, config.train_steps).losses
    finally:
        mode.close()
    return equivalence.Record(label, losses, model.get_weights())


@pytest.mark.parametrize("optimizer", ["adamw", "nesterov"])
def test_dtensor_adamw_and_nesterov_match_default(optimizer, model="mlp"):
    """update.py's AdamW (the registry's: weight decay 0.004) and SGD nesterov momentum,
    on the 2-D mesh: per-step losses and final weights within 1e-5 of `default`.
    The mlp only: the rules differ from Adam's and momentum's (which run on the
    transformer above) in dense arithmetic alone, and the transformer costs minutes."""
    from tfdist.train import optimizers
    assert optimizers.ADAMW_WEIGHT_DECAY > 0  # else this would not test the decay
    mesh = dict(mesh="batch=2,model=2", layout="megatron")
    if optimizer == "adamw":
        ref = reference(model, "adamw")[0]
        got = train(make_config("dtensor", model, "adamw", **mesh), "dtensor adamw")[0]
    else:  # the config's optimizer name is unused: nesterov() replaces it
        ref = train_with_optimizer(make_config("default", model, "momentum"), nesterov,
                                   "default nesterov")
        got = train_with_optimizer(make_config("dtensor", model, "momentum", **mesh),
                                   nesterov, "dtensor nesterov")
    if REPORT:
        weight_error = max(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-12)
                           for r, g in zip(ref.weights, got.weights))
        with open(REPORT, "a") as f:
            f.write(json.dumps({"model": model, "optimizer": optimizer, "mesh": mesh["mesh"],
                                "max_rel_loss_error": equivalence.max_relative_loss_error(ref, got),
                                "max_rel_weight_error": float(weight_error)}) + "\n")
    equivalence.assert_equivalent(ref, got)
    assert len(got.losses) == STEPS
    assert sum(got.losses[-5:]) < sum(got.losses[:5])


# ---- memory: every shard is exactly its share -------------------------------------------

def build(config):
    from tfdist import data, parallel
    from tfdist.train import runner
    mode = parallel.build_parallelism(config)
    source = data.get_source(config.data)
    model, optimizer = runner.build_model_and_optimizer(config, mode, source.info)
    return mode, model, optimizer


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_every_shard_holds_exactly_its_share(model):
    from tensorflow.experimental import dtensor
    from tfdist.parallel.dtensor import sharding
    mode, keras_model, optimizer = build(
        make_config("dtensor", model, "adam", "batch=2,model=2", "megatron"))
    axes = mode.axes
    expected_totals = collections.Counter()
    params = {v.path: v for v in keras_model.variables}
    sharded_seen = 0
    for variable in list(keras_model.variables) + list(optimizer.variables):
        layout = dtensor.fetch_layout(variable.value)
        ways = 1
        for axis in layout.sharding_specs:
            ways *= axes[axis] if axis != "unsharded" else 1
        total = int(np.prod(variable.shape)) * variable.value.dtype.size
        shards = sharding.shard_shapes(variable)
        assert len(shards) == 4
        for device, shape in shards:
            got = int(np.prod(shape)) * variable.value.dtype.size
            assert got * ways == total, (variable.path, shape, layout.sharding_specs)
            expected_totals[device] += got
        sharded_seen += ways > 1
    # slots take their parameter's layout
    for (path, _), slot in mode.slots.items():
        assert (dtensor.fetch_layout(slot.value).sharding_specs
                == dtensor.fetch_layout(params[path].value).sharding_specs)
    assert sharded_seen > 0
    assert mode.param_bytes_per_device(keras_model, optimizer) == dict(expected_totals)


def test_results_json_reports_per_device_bytes(tmp_path):
    from tfdist.train import runner
    path = str(tmp_path / "results.json")
    runner.run(make_config("dtensor", "mlp", "momentum", "batch=2,model=2", "megatron",
                           train_steps=2, results_json=path))
    with open(path) as f:
        per_device = json.load(f)["param_bytes_per_device"]
    assert len(per_device) == 4
    # mlp 64-100-50-10, megatron on model=2: dense_0 (kernel + bias) and dense_1/kernel
    # are halved, dense_1/bias and logits replicated; one momentum slot per parameter.
    halved = (64 * 100 + 100 + 100 * 50) // 2
    replicated = 50 + 50 * 10 + 10
    scalars = 8 + 4  # iterations (int64) and learning_rate
    assert set(per_device.values()) == {2 * 4 * (halved + replicated) + scalars}


# ---- bad input: clear UsageError before training -------------------------------------

def write_layout(tmp_path, rules) -> str:
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(rules))
    return str(path)


def run_expecting_usage_error(config, match):
    from tfdist.train import runner
    with pytest.raises(UsageError, match=match):
        runner.run(config)


def test_mesh_size_must_equal_device_count():
    run_expecting_usage_error(make_config("dtensor", mesh="batch=2,model=3"),
                              r"batch=2,model=3 has 6 devices, but this process has 4")


def test_mesh_spec_is_parsed_with_clear_errors():
    run_expecting_usage_error(make_config("dtensor", mesh="batch=2,model=x"), r"bad part 'model=x'")
    run_expecting_usage_error(make_config("dtensor", mesh="model=4"), r"no 'batch' axis")


def test_sharded_dimension_must_divide(tmp_path):
    layout = write_layout(tmp_path, {"logits/kernel": ["unsharded", "model"]})
    run_expecting_usage_error(
        make_config("dtensor", mesh="batch=1,model=4", layout=layout),
        r"'logits/kernel' \(shape \[50, 10\]\): dimension 1 of size 10 is not divisible by "
        r"mesh axis 'model' of size 4")


def test_axis_must_be_in_mesh(tmp_path):
    layout = write_layout(tmp_path, {"dense_0/kernel": ["unsharded", "tensor"]})
    run_expecting_usage_error(make_config("dtensor", mesh="batch=2,model=2", layout=layout),
                              r"mesh axis 'tensor', which is not in the mesh \(axes: batch=2, model=2\)")


def test_regex_matching_nothing_warns_or_fails_when_strict(tmp_path, caplog):
    from tfdist.train import runner
    layout = write_layout(tmp_path, {"dense_0/kernel": ["unsharded", "model"],
                                     "no_such_layer/.*": None})
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        runner.run(make_config("dtensor", mesh="batch=2,model=2", layout=layout, train_steps=1))
    assert "'no_such_layer/.*'" in caplog.text and "matched no variable" in caplog.text
    run_expecting_usage_error(
        make_config("dtensor", mesh="batch=2,model=2", layout=layout, layout_strict=True),
        r"matched no variable: 'no_such_layer/\.\*'")


def test_strict_mode_rejects_unmatched_variables(tmp_path):
    layout = write_layout(tmp_path, {"dense_\\d+/.*": None})
    run_expecting_usage_error(
        make_config("dtensor", mesh="batch=2,model=2", layout=layout, layout_strict=True),
        r"2 variable\(s\) match no layout map key: logits/kernel, logits/bias")


def test_variable_matching_two_keys_is_named(tmp_path):
    layout = write_layout(tmp_path, {"dense_0/.*": None, ".*/kernel": ["unsharded", "model"]})
    run_expecting_usage_error(make_config("dtensor", mesh="batch=2,model=2", layout=layout),
                              r"Variable 'dense_0/kernel' matches 2 layout map keys: "
                              r"'dense_0/\.\*', '\.\*/kernel'")


def test_layout_names_are_checked(tmp_path):
    run_expecting_usage_error(make_config("dtensor", mesh="batch=2,model=2",
                                          layout=str(tmp_path / "missing.json")),
                              r"neither a preset \(data, megatron, auto\)")
    cnn = dataclasses.replace(make_config("dtensor", mesh="batch=2,model=2", layout="megatron"),
                              model=ModelConfig(name="cnn", filters=(8, 16)))
    run_expecting_usage_error(cnn, r"megatron has rules for models mlp, transformer")


def test_python_layout_file(tmp_path):
    path = tmp_path / "layout.py"
    path.write_text("LAYOUT_MAP = {r'dense_0/kernel': ['unsharded', 'model']}\n")
    mode, model, _ = build(make_config("dtensor", mesh="batch=2,model=2", layout=str(path)))
    assert mode.specs["dense_0/kernel"] == ("unsharded", "model")
    assert mode.specs["logits/kernel"] == ("unsharded", "unsharded")


def test_meshes_can_be_created_repeatedly():
    from tfdist.parallel.dtensor import mesh as mesh_lib
    local = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]
    first = mesh_lib.build_local_mesh([("batch", 2), ("model", 2)], local)
    second = mesh_lib.build_local_mesh([("batch", 2), ("model", 2)], local)
    other = mesh_lib.build_local_mesh([("batch", 1), ("model", 4)], local)
    assert first == second and first != other


# ---- collectives of a megatron MLP block -----------------------------------------------

def collectives_on_one_device(fn, *args):
    """The collective ops one device runs when DTensor executes fn(*args).

    DTensor lowers the traced function to one SPMD program per device; with run
    metadata on, TF returns those programs as the function's partition graphs.
    We count the Collective* ops placed on CPU:0 (every device runs the same).
    Private TF API (tensorflow.python.eager.context run metadata): no public API
    returns the graphs DTensor lowers to; if it moves, this test fails, not passes.
    """
    from tensorflow.python.eager import context
    context.enable_run_metadata()
    try:
        fn(*args)
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    names = []
    for function in metadata.function_graphs:
        for graph in function.partition_graphs:
            names += [node.name for node in graph.node
                      if node.op.startswith("Collective") and node.device.endswith("CPU:0")]
    return names


def test_megatron_mlp_block_has_one_all_reduce_each_way():
    import keras
    from tensorflow.experimental import dtensor
    from tfdist import devices
    from tfdist.parallel.dtensor import mesh as mesh_lib, presets, sharding
    from tfdist.parallel.dtensor import step as dtensor_step
    from tfdist.parallel.dtensor.layout_map import LayoutMap
    mesh = mesh_lib.build_local_mesh([("batch", 1), ("model", 4)], devices.configure(4))
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    # A replicated layer before the block, so the block's input gradient is needed
    # (as in a transformer's residual stream); its output feeds a replicated head.
    x = keras.layers.Dense(16, name="embed")(inputs)
    x = keras.layers.Dense(64, activation="relu", name="mlp_fc_in")(x)
    x = keras.layers.Dense(16, name="mlp_fc_out")(x)
    model = keras.Model(inputs, keras.layers.Dense(10, name="head")(x))
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))   # the step trains with the compiled loss
    rules = {k.replace(r"block_\d+/", ""): v for k, v in presets.MEGATRON_TRANSFORMER.items()
             if "mlp_fc" in k}
    specs = LayoutMap(rules).resolve([(v.path, v.shape) for v in model.variables],
                                     mesh_lib.axes_of(mesh))
    layouts = sharding.shard_model(model, specs, mesh)
    optimizer, slots = sharding.build_sharded_optimizer(
        lambda: keras.optimizers.SGD(0.1), model, layouts, mesh)
    step = dtensor_step.make_train_step(model, optimizer, slots, global_batch_size=8)
    x = sharding.pack(np.ones((8, 16), "float32"), dtensor.Layout.batch_sharded(mesh, "batch", 2))
    y = sharding.pack(np.arange(8, dtype="int32"), dtensor.Layout.batch_sharded(mesh, "batch", 1))
    collectives = collectives_on_one_device(step.sharded_step, (x, y))
    forward = [n for n in collectives if "gradient_tape" not in n]
    backward = [n for n in collectives if "gradient_tape" in n]
    assert len(forward) == 1 and "mlp_fc_out" in forward[0], collectives
    assert len(backward) == 1 and "mlp_fc_in" in backward[0], collectives


# ---- upstream canaries: private Keras API and Keras behaviour we depend on ------------

def test_keras_variable_storage_canary():
    """sharding.give_dtensor_storage sets keras.Variable._value (no public way); reads and
    assigns must go through it. Fails if Keras changes where a variable keeps its storage."""
    import keras
    from tensorflow.experimental import dtensor
    from tfdist.parallel.dtensor import mesh as mesh_lib, sharding
    mesh = mesh_lib.build_local_mesh([("batch", 1), ("model", 4)], ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"])
    variable = keras.Variable(np.arange(8, dtype="float32"), name="canary")
    layout = dtensor.Layout(["model"], mesh)
    sharding.give_dtensor_storage(variable, layout)
    assert isinstance(variable.value, dtensor.DVariable)
    assert dtensor.fetch_layout(variable.value).sharding_specs == ["model"]
    variable.assign(sharding.pack(np.ones(8, "float32"), layout))
    np.testing.assert_array_equal(variable.numpy(), np.ones(8))
    assert [c.shape.as_list() for c in dtensor.unpack(variable.value.read_value())] == [[2]] * 4


def test_keras_squares_indexed_slices_before_summing_canary():
    """update.densify copies this Keras behaviour for Adam; if Keras starts summing
    duplicate rows before squaring, this fails and densify must follow."""
    import keras
    import tensorflow as tf
    grad = tf.IndexedSlices(tf.constant([[1.0], [2.0]]), tf.constant([0, 0]), tf.constant([1, 1]))
    squared = tf.convert_to_tensor(keras.ops.square(grad))
    assert squared.numpy().tolist() == [[5.0]]  # 1 + 4, not (1 + 2)^2 = 9


def test_optimizers_create_slots_through_add_variable_from_reference():
    """build_sharded_optimizer finds slots (to give them their parameter's layout) by
    recording the public add_variable_from_reference; every slot must come through it."""
    mode, model, optimizer = build(make_config("dtensor", "mlp", "adam", "batch=2,model=2",
                                               "megatron"))
    assert len(mode.slots) == 2 * len(model.trainable_variables)
    assert {name for _, name in mode.slots} == {"momentum", "velocity"}
    assert len(optimizer.variables) == len(mode.slots) + 2  # + iterations, learning_rate


def test_cli_smoke():
    result = run_cli(["--strategy=dtensor", "--simulate_devices=4", "--mesh=batch=2,model=2",
                      "--layout=megatron", "--model=mlp", "--train_steps=50"], timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"tfdist: dtensor x2 \| mlp on digits \| 50 steps \| final loss", result.stdout)


# ---- sharded checkpoints, restored onto another mesh ----------------------------------

def test_checkpoint_reshards_on_restore(tmp_path):
    """Saved on batch=2,model=2 after 3 Adam steps; restored on batch=1,model=4 and on one
    device (default): every weight and slot equal bit for bit, in the new layout."""
    import tensorflow as tf
    from tensorflow.experimental import dtensor
    from tfdist.data import pipeline
    from tfdist import data
    from tfdist.parallel.dtensor import checkpoint, sharding
    config = make_config("dtensor", "mlp", "adam", "batch=2,model=2", "megatron", train_steps=3)
    mode, model, optimizer = build(config)
    source = data.get_source(config.data)
    step = mode.make_train_step(model, optimizer, GLOBAL_BATCH, False)
    inputs = iter(mode.distribute(pipeline.train_dataset_fn(source, GLOBAL_BATCH, 7, config.data)))
    for _ in range(3):
        step(inputs)
    step_counter = tf.Variable(3, dtype=tf.int64)  # as tfdist's Checkpointer adds one
    path = checkpoint.save(model, optimizer, str(tmp_path / "ckpt"), tfdist_step=step_counter)
    saved = [(v.path, v.numpy()) for v in list(model.variables) + list(optimizer.variables)]
    assert optimizer.iterations.numpy() == 3

    for strategy, mesh in [("dtensor", "batch=1,model=4"), ("default", None)]:
        _, model2, optimizer2 = build(dataclasses.replace(config, strategy=strategy, mesh=mesh))
        checkpoint.restore(model2, optimizer2, path, tfdist_step=tf.Variable(0, dtype=tf.int64))
        restored = list(model2.variables) + list(optimizer2.variables)
        assert len(restored) == len(saved)
        for variable, (name, value) in zip(restored, saved):
            np.testing.assert_array_equal(variable.numpy(), value, name)
        if strategy == "dtensor":
            kernel = model2.get_layer("dense_0").kernel
            assert dtensor.fetch_layout(kernel.value).sharding_specs == ["unsharded", "model"]
            assert [s for _, s in sharding.shard_shapes(kernel)] == [(64, 25)] * 4


@pytest.mark.parametrize("overrides,expected", [
    (dict(trainer="fit"), "--trainer=fit is not supported by --strategy=dtensor"),
    (dict(mixed_precision="mixed_float16"), "--mixed_precision=mixed_float16 is not supported"),
])
def test_unsupported_options_are_refused_before_training(overrides, expected):
    """(mixed_bfloat16 is supported: test_mixed_bfloat16_matches_one_device_mixed_bfloat16.)"""
    from tfdist.parallel.dtensor import build_dtensor
    config = make_config("dtensor", "mlp", "sgd", "batch=2,model=2", "megatron")
    with pytest.raises(UsageError, match=expected):
        build_dtensor(dataclasses.replace(config, **overrides))


# Mixed precision: the sharded program rounds some partial sums (a matmul's contraction
# split over "model", a batch split over "batch") to bfloat16 where one device rounds the
# whole sum once; one extra bfloat16 rounding is a relative error of at most its unit
# roundoff u = 2**-8 of the parts' magnitudes. So each step's loss is held to u.
# The weights are held to the float32 run instead: the DTensor run may be no farther from
# one device's float32 weights than twice one device's mixed_bfloat16 run is (its own
# rounding). Why not steps * u relative to one device's mixed_bfloat16 weights, as before:
# a bias's gradient is a sum whose parts cancel, so a rounding relative to the parts is far
# more relative to the small sum, and the bias itself is small. Measured on an AVX512-BF16
# EPYC (2026-12-02, SGD, 8 steps): the first layer's bias of one device's mixed_bfloat16
# run is 6.0e-2 relative from float32's, the DTensor run's 5.6e-2 from float32's and 6.0e-2
# from one device's mixed_bfloat16 (over steps * u = 3.1e-2, which an AVX2 EPYC passed);
# every weight's ratio of the two distances to float32 was 0.70-1.13. The run uses plain
# SGD (an update linear in the gradient): Adam's 1/sqrt(v) turns a near-0 gradient's
# rounding into a full step.
BFLOAT16_U = 2.0 ** -8
NO_WORSE_THAN_ONE_DEVICE_BFLOAT16 = 2.0


def _relative_distance(got, ref) -> float:
    return float(np.linalg.norm(np.asarray(got) - ref) / max(np.linalg.norm(ref), 1e-12))


def test_mixed_bfloat16_matches_one_device_mixed_bfloat16():
    """--mixed_precision=mixed_bfloat16 under dtensor (megatron mlp on batch=2,model=2):
    float32 variables, bfloat16 compute; losses within u of one device's mixed_bfloat16
    run, weights no farther from one device's float32 run than the bound above."""
    steps = 8
    runs = {}
    for label, strategy, mesh, layout, policy in (
            ("float32", "default", None, "data", None),
            ("default", "default", None, "data", "mixed_bfloat16"),
            ("dtensor", "dtensor", "batch=2,model=2", "megatron", "mixed_bfloat16")):
        config = dataclasses.replace(make_config(strategy, "mlp", "sgd", mesh, layout),
                                     mixed_precision=policy, train_steps=steps)
        from tfdist.train import runner
        results, model = runner.run(config, return_model=True)
        assert all(v.dtype == "float32" for v in model.trainable_variables)
        runs[label] = equivalence.Record(label, results["losses"], model.get_weights())
        import keras
        keras.mixed_precision.set_dtype_policy("float32")
    assert len(runs["default"].losses) == steps
    assert not equivalence.loss_mismatches(runs["default"], runs["dtensor"], rtol=BFLOAT16_U)
    weights = list(zip(runs["float32"].weights, runs["default"].weights, runs["dtensor"].weights))
    assert len(weights) == len(runs["float32"].weights) > 0
    too_far = []
    for index, (exact, one_device, sharded) in enumerate(weights):
        own_rounding = _relative_distance(one_device, exact)
        assert own_rounding > 1e-5, f"weight {index}: mixed_bfloat16 computed in float32?"
        distance = _relative_distance(sharded, exact)
        if not distance <= NO_WORSE_THAN_ONE_DEVICE_BFLOAT16 * own_rounding:
            too_far.append(f"weight {index}: {distance:.2e} from float32, one device's "
                           f"mixed_bfloat16 {own_rounding:.2e}")
    assert not too_far, too_far
