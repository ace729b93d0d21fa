"""Pipeline parallelism: trains like one device, lives where it says, fails clearly.

Equivalence: per-step losses and final weights within 1e-5 relative of `default`
for mlp, cnn and a small transformer, 20 steps, each in S in {2, 4} stages x M in
{1, 4} micro-batches and the hybrid 2 stages x 2 replicas (GPipe), sgd and adam
taking turns, and a subset of those with the 1F1B schedule; the final weights of
EVERY replica and every stage, not only the model tfdist.run returns (replica 0's).

Placement: every stage variable and optimizer slot is on its stage's device, and
in the step's *placed, partitioned* graph (what the executor runs, from
TensorFlow's run metadata) every cross-device transfer is a stage-boundary
activation, its gradient, an input slice, a micro-batch loss, a hybrid
gradient sum, or a control-only edge.
"""

import dataclasses
import functools
import json
import re

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context  # run metadata (partition graphs): no public API

from helpers import run_cli
from tfdist import data, models, parallel as parallel_lib
from tfdist.config import DataConfig, ModelConfig, RunConfig
from tfdist.data import pipeline as data_pipeline
from tfdist.errors import UsageError
from benchmarks import bubble
from tfdist.parallel.pipeline import partition as partition_lib, placement, schedule
from tfdist.testing import equivalence
from tfdist.train import runner

STEPS = 20
GLOBAL_BATCH = 32
# (devices, stages, micro-batches); the last is the hybrid: 2 stages x 2 replicas.
LAYOUTS = [(2, 2, 1), (2, 2, 4), (4, 4, 1), (4, 4, 4), (4, 2, 4)]


def model_and_data(model: str):
    if model == "transformer":
        return (ModelConfig(name="transformer", num_layers=2, d_model=32, num_heads=4, d_ff=64),
                DataConfig(name="text", seq_len=16))
    return ModelConfig(name=model, filters=(8, 16)), DataConfig(name="digits")


def make_config(strategy, model, optimizer, devices=4, stages=2, microbatches=1, **overrides):
    model_config, data_config = model_and_data(model)
    fields = dict(strategy=strategy, simulate_devices=devices, model=model_config,
                  data=data_config, optimizer=optimizer, global_batch_size=GLOBAL_BATCH,
                  train_steps=STEPS, seed=7, log_every=STEPS, pipeline_stages=stages,
                  microbatches=microbatches)
    fields.update(overrides)
    return RunConfig(**fields)


def train_default(config, label):
    results, model = runner.run(config, return_model=True)
    paths = [v.path for v in model.weights]
    return equivalence.Record(label, results["losses"], model.get_weights()), paths


def train(config, label):
    """(replica 0's Record, its weight paths, {(replica, stage): (Record, variable paths)}).

    As tfdist.run trains, but keeping the mode: run() returns replica 0's model
    only, and every other replica (the hybrid's) must end with the same weights.
    """
    import keras
    keras.mixed_precision.set_dtype_policy("float32")
    parallel, model, optimizer, source = build(config)
    try:
        losses = runner.train(config, parallel, source, model, optimizer,
                              runner.resolve_steps(config, source)).losses
    finally:
        parallel.close()
    stages = {(r, stage.index): (
        equivalence.Record(f"{label} replica {r} stage {stage.index}", losses,
                           [v.numpy() for v in stage.variables]),
        [v.path for v in stage.variables])
        for r, replica in enumerate(parallel.replicas) for stage in replica.stages}
    return equivalence.Record(label, losses, model.get_weights()), \
        [v.path for v in model.weights], stages


def assert_every_replica_and_stage_equivalent(ref, ref_paths, stages, replicas, num_stages):
    """Each stage of each replica holds its share of the variables, equal to one device's."""
    assert sorted(stages) == [(r, k) for r in range(replicas) for k in range(num_stages)]
    for r in range(replicas):
        held = sorted(path for k in range(num_stages) for path in stages[(r, k)][1])
        assert held == sorted(ref_paths), f"replica {r}'s stages hold {held}"
    by_path = dict(zip(ref_paths, ref.weights))
    for record, paths in stages.values():
        if not paths:  # e.g. a stage of Flatten alone; the loop above saw every variable held
            continue
        equivalence.assert_equivalent(
            equivalence.Record("default", ref.losses, [by_path[p] for p in paths]), record)


@functools.lru_cache(maxsize=None)
def reference(model: str, optimizer: str):
    return train_default(make_config("default", model, optimizer), "default")


# Every model in every layout; the optimizers take turns, so each layout and each model
# meets both (the optimizer runs after the pipeline has produced the gradients).
MODEL_OPTIMIZER_LAYOUTS = [
    (model, ("sgd", "adam")[i % 2], *layout)
    for i, (model, layout) in enumerate((m, l) for m in ("mlp", "cnn", "transformer")
                                        for l in LAYOUTS)]


@pytest.mark.parametrize("model,optimizer,devices,stages,microbatches", MODEL_OPTIMIZER_LAYOUTS)
def test_pipeline_matches_default(model, optimizer, devices, stages, microbatches):
    ref, ref_paths = reference(model, optimizer)
    label = f"pipeline S={stages} M={microbatches} R={devices // stages}"
    got, paths, placed = train(
        make_config("pipeline", model, optimizer, devices, stages, microbatches), label)
    assert paths == ref_paths
    equivalence.assert_equivalent(ref, got)
    assert_every_replica_and_stage_equivalent(ref, ref_paths, placed, devices // stages, stages)
    assert len(got.losses) == STEPS
    assert sum(got.losses[-5:]) < sum(got.losses[:5])  # it trained


@pytest.mark.parametrize("model,optimizer,devices,stages", [
    ("mlp", "adam", 4, 4), ("cnn", "sgd", 4, 2), ("transformer", "adam", 4, 4)])
def test_1f1b_matches_default(model, optimizer, devices, stages):
    ref, ref_paths = reference(model, optimizer)
    label = f"pipeline 1f1b S={stages} M=4 R={devices // stages}"
    got, paths, placed = train(make_config("pipeline", model, optimizer, devices, stages, 4,
                                           pipeline_schedule="1f1b"), label)
    equivalence.assert_equivalent(ref, got)
    assert_every_replica_and_stage_equivalent(ref, ref_paths, placed, devices // stages, stages)


def peak_activations(order) -> int:
    """Most micro-batches whose forward ran and backward did not, over a stage's order."""
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == schedule.FORWARD else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("stages,microbatches", [(2, 1), (2, 4), (4, 4), (4, 8), (4, 2)])
def test_schedule_orders(stages, microbatches):
    for k in range(stages):
        for name, order_fn in schedule.SCHEDULES.items():
            order = order_fn(stages, microbatches, k)
            forwards = [m for kind, m in order if kind == schedule.FORWARD]
            backwards = [m for kind, m in order if kind == schedule.BACKWARD]
            # Each micro-batch once each way, backwards in micro-batch order (same sums).
            assert forwards == backwards == list(range(microbatches)), (name, order)
            assert order.index((schedule.FORWARD, 0)) < order.index((schedule.BACKWARD, 0))
        assert peak_activations(schedule.gpipe_order(stages, microbatches, k)) == microbatches
        assert peak_activations(schedule.one_f_one_b_order(stages, microbatches, k)) == min(
            stages - k, microbatches)


def build(config):
    """(parallelism, model, optimizer, source) as tfdist.run builds them."""
    parallel = parallel_lib.build_parallelism(config)
    parallel.validate_global_batch(config.global_batch_size)
    source = data.get_source(config.data)
    model, optimizer = runner.build_model_and_optimizer(config, parallel, source.info)
    return parallel, model, optimizer, source


def same_device(a: str, b: str) -> bool:
    a, b = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return (a.device_type.upper(), a.device_index) == (b.device_type.upper(), b.device_index)


@pytest.mark.parametrize("model,devices,stages", [("mlp", 4, 2), ("transformer", 4, 4)])
def test_every_variable_and_slot_is_on_its_stage_device(model, devices, stages):
    parallel, replica0_model, optimizer, _ = build(
        make_config("pipeline", model, "adam", devices, stages, 2))
    assert len(parallel.replicas) == devices // stages
    for r, replica in enumerate(parallel.replicas):
        placed = set()
        for k, stage in enumerate(replica.stages):
            expected = parallel.devices[r * stages + k]
            assert stage.device == expected
            assert stage.variables, f"stage {k} has no variables"
            for v in list(stage.variables) + list(stage.optimizer.variables):
                assert same_device(v.value.device, expected), (r, k, v.path, v.value.device)
            placed.update(id(v) for v in stage.variables)
        # Every variable of the replica belongs to one stage.
        assert placed == {id(v) for v in replica.model.trainable_variables}
    assert replica0_model is parallel.replicas[0].model
    per_device = parallel.param_bytes_per_device(replica0_model, optimizer)
    assert len(per_device) == devices
    everything = [v for rep in parallel.replicas for v in rep.model.variables]
    everything += list(optimizer.variables)
    assert sum(per_device.values()) == sum(v.value.shape.num_elements() * v.value.dtype.size
                                           for v in everything)


def placed_run_metadata(step, iterator):
    """Run metadata (the partition graphs the executor ran) of one step, Grappler off."""
    previous = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    context.enable_run_metadata()
    try:
        step(iterator)
        return context.export_run_metadata()
    finally:
        context.disable_run_metadata()
        tf.config.optimizer.set_experimental_options(
            {"disable_meta_optimizer": previous.get("disable_meta_optimizer", False)})


def cross_device_sends(step, iterator):
    """[(producer node name, sending device, receiving device)] of one placed step.

    Run metadata holds the partition graphs the executor ran: every tensor
    crossing devices is a _Send/_Recv pair there. Grappler is off so that the
    producers keep our names (it would fold the identities; it never moves
    ops between devices).
    """
    metadata = placed_run_metadata(step, iterator)
    sends = []
    for function_graph in metadata.function_graphs:
        if not _is_train_step(function_graph):
            continue  # e.g. tf.data functions that ran during the step
        for graph in function_graph.partition_graphs:
            nodes = {node.name: node for node in graph.node}
            for node in graph.node:
                if node.op not in ("_Send", "_HostSend"):
                    continue
                producer = nodes[node.input[0].split(":")[0].lstrip("^")]
                control_only = producer.op == "Const" and "/ctrl/" in producer.name
                if not control_only:
                    sends.append((producer.name, node.attr["send_device"].s.decode(),
                                  node.attr["recv_device"].s.decode()))
    assert sends, "no cross-device transfers found: run metadata format changed?"
    return sends


def _is_train_step(function_graph) -> bool:
    return any(node.name.startswith(schedule.INPUT)
               for graph in function_graph.partition_graphs for node in graph.node)


def classify(name: str, source: str, target: str, position, stages: int) -> str:
    """Which allowed transfer a send is; fails on any other."""
    (r1, k1), (r2, k2) = position(source), position(target)
    leaf = name.rsplit("/", 1)[-1]
    if leaf.startswith(schedule.BOUNDARY_ACTIVATION):
        assert (r2, k2) == (r1, k1 + 1), f"activation {name} sent {source} -> {target}"
        return "activation"
    if leaf.startswith(schedule.BOUNDARY_GRADIENT):
        assert (r2, k2) == (r1, k1 - 1), f"gradient {name} sent {source} -> {target}"
        return "gradient"
    if leaf.startswith(schedule.STAGE_GRADIENT):
        assert r1 != 0 and (r2, k2) == (0, k1), f"stage gradient {name}: {source} -> {target}"
        return "stage_gradient"
    if leaf.startswith(schedule.GRADIENT_SUM):
        assert r1 == 0 and k1 == k2 and r2 != 0, f"gradient sum {name}: {source} -> {target}"
        return "gradient_sum"
    if leaf.startswith(schedule.MICROBATCH_LOSS):
        assert k1 == stages - 1, f"loss {name} sent from stage {k1}"
        return "loss"
    if re.match(schedule.INPUT + r"(_\d+)?/", name):
        # The batch, read and split on the host, goes to first (x) and last (y) stages.
        assert k2 in (0, stages - 1), f"input {name} sent to stage {k2}"
        return "input"
    raise AssertionError(f"unexpected cross-device tensor {name!r}: {source} -> {target}")


ISOLATED = "TFDIST_PIPELINE_PLACEMENT_CHECK"


def test_placement_check_in_a_fresh_process(run_own_process):
    """Runs the cross-device check below in its own process: a user's run is one
    fresh program, and in a long shared test process one run once placed an input
    split on stage 1 after dozens of earlier models (not reproducible alone)."""
    result, requested, passed = run_own_process(ISOLATED, ["tests/test_pipeline_parallel.py"],
                                                timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert len(passed) == 3 and set(requested) <= passed, (requested, passed)


@pytest.mark.own_process(ISOLATED)
@pytest.mark.parametrize("model,devices,stages,schedule_name", [
    ("cnn", 4, 4, "gpipe"), ("mlp", 4, 2, "gpipe"), ("mlp", 4, 2, "1f1b")])
def test_only_boundary_tensors_cross_devices(model, devices, stages, schedule_name):
    microbatches = 2
    config = make_config("pipeline", model, "adam", devices, stages, microbatches,
                         pipeline_schedule=schedule_name)
    parallel, model_, optimizer, source = build(config)
    step = parallel.make_train_step(model_, optimizer, GLOBAL_BATCH, False)
    dataset_fn = data_pipeline.train_dataset_fn(source, GLOBAL_BATCH, config.seed, config.data)
    index = {tf.DeviceSpec.from_string(d).device_index: i for i, d in enumerate(parallel.devices)}

    def position(device):
        i = index[tf.DeviceSpec.from_string(device).device_index]
        return divmod(i, stages)

    sends = cross_device_sends(step, iter(parallel.distribute(dataset_fn)))
    kinds = [classify(name, s, t, position, stages) for name, s, t in sends]
    replicas = devices // stages
    boundaries = replicas * (stages - 1) * microbatches
    assert kinds.count("activation") == boundaries
    assert kinds.count("gradient") == boundaries


def test_partition_report_and_balance():
    parallel, _, _, _ = build(make_config("pipeline", "mlp", "sgd", 4, 4, 1))
    partition = parallel.partition
    # Cost = parameters; the most expensive stage is as cheap as possible (ties: earliest cuts).
    assert [s.layers for s in partition.stages] == [
        ("flatten",), ("dense_0",), ("dense_1",), ("logits", "float32_logits")]
    assert [s.params for s in partition.stages] == [0, 6500, 5050, 510]
    assert partition.imbalance == pytest.approx(6500 / (12060 / 4))
    assert "imbalance" in partition.describe()
    fresh = models.build_model(data.get_source(DataConfig()).info, ModelConfig(name="mlp"))
    split = partition_lib.partition_model(fresh, 2, ("logits",))
    assert split.stages[1].layers == ("logits", "float32_logits")


def residual_model():
    import keras
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4, name="a")(inputs)
    y = keras.layers.Dense(4, name="b")(x)
    y = keras.layers.Add(name="add")([x, y])
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(y))


def test_a_cut_inside_a_residual_block_is_made_only_when_named():
    model = residual_model()
    # Before 'add' both the skip (a) and the branch (b) cross: a named split sends both.
    stages = partition_lib.partition_model(model, 2, ("add",)).stages
    assert [t.producer for t in stages[0].boundary] == ["a", "b"]
    # Before 'b' only a's output crosses (used twice in stage 2): allowed.
    assert partition_lib.partition_model(model, 2, ("b",)).stages[1].layers == ("b", "add", "out")
    # The automatic split never picks the cut before 'add'.
    assert partition_lib.partition_model(model, 3).stages[1].layers != ("b",)


def test_a_shared_layer_is_refused():
    # Also notices if Keras renames `_inbound_nodes` (partition.py reads it: no public API).
    import keras
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    model = keras.Model(inputs, shared(shared(inputs)))
    with pytest.raises(UsageError, match="Layer 'shared' is called 2 times"):
        partition_lib.partition_model(model, 1)


@pytest.mark.parametrize("overrides,expected", [
    (dict(model=ModelConfig(name="mlp", hidden_sizes=()), pipeline_stages=4),
     r"--pipeline_stages=4 is more than the 3 layers of model 'mlp' \(flatten, logits, "
     r"float32_logits\)"),
    (dict(pipeline_split=("dense_9",)),
     r"'dense_9' is not a layer of model 'mlp'. Valid layer names: flatten, dense_0, "),
    (dict(microbatches=3), r"per-replica batch of 16 examples .* --microbatches=3"),
    (dict(simulate_devices=2, pipeline_stages=4),
     r"--pipeline_stages=4 is more than the 2 device\(s\)"),
    (dict(pipeline_stages=3), r"4 devices .* do not divide into replicas of "
                              r"--pipeline_stages=3 stages"),
    (dict(model=ModelConfig(name="resnet", filters=(4,)), microbatches=4),
     r"Model 'resnet' has BatchNormalization \(stem_norm, .*--microbatches=4"),
])
def test_bad_pipeline_input_fails_before_training(overrides, expected):
    config = dataclasses.replace(make_config("pipeline", "mlp", "sgd"), **overrides)
    with pytest.raises(UsageError, match=expected):
        runner.run(config)


def test_cli_pipeline_run(tmp_path):
    results = tmp_path / "r.json"
    done = run_cli(["--strategy=pipeline", "--simulate_devices=4", "--pipeline_stages=2",
                    "--microbatches=4", "--model=mlp", "--train_steps=5",
                    f"--results_json={results}"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tfdist: pipeline x2 | mlp on digits | 5 steps" in done.stdout
    assert "imbalance" in done.stderr
    written = json.loads(results.read_text())
    assert len(written["param_bytes_per_device"]) == 4
    assert np.isfinite(written["final_loss"])


def test_sequential_models_are_placed_too():
    import keras
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="a"),
                              keras.layers.Dense(16, name="b"), keras.layers.Dense(4, name="c")])
    partition = partition_lib.partition_model(model, 3)
    devices = ["/cpu:1", "/cpu:2", "/cpu:3"]
    replica = placement.place_replica(model, partition, devices, lambda: keras.optimizers.SGD())
    for stage, device in zip(replica.stages, devices):
        assert all(same_device(v.value.device, device) for v in stage.variables)
    x = tf.random.normal((2, 8))
    h = x
    for stage in replica.stages:
        h = stage.model(h)
    np.testing.assert_array_equal(h.numpy(), model(x).numpy())


def test_bubble_benchmark_rows():
    rows = bubble.bubble_rows(stages=(2,), microbatches=(1, 4), steps=2, global_batch_size=64)
    assert [(r["stages"], r["microbatches"]) for r in rows] == [(2, 1), (2, 4)]
    assert [r["bubble_formula"] for r in rows] == [0.5, 0.2]
    assert [r["formula_ratio"] for r in rows] == [2.0, 1.25]
    assert all(r["step_seconds"] > 0 for r in rows)
