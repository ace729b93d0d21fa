"""The interleaved_1f1b and zero_bubble pipeline schedules (tfdist/parallel/pipeline/schedule.py).

Orders: every chunk runs each micro-batch's forward once and its backward once (B then
W for zero_bubble), backwards in micro-batch order; interleaved_1f1b with V=1 is 1f1b.
Memory: per device, the most micro-batches held at once (forward built, its last
backward op not yet), replayed in pure Python (schedule.peak_live) AND counted while
the real step's graph is built, equals each schedule's bound. Bubble: the replay with
unit op costs gives each schedule's formula. The B/W split: the zero_bubble step holds
exactly the fused backward's matmul FLOPs (nothing recomputed).
Equivalence: per-step losses and final weights of EVERY replica and chunk within 1e-5
relative of `default`, for mlp and the transformer (sparse embedding gradients), sgd
and adam, S in {2, 4}, M in {1, 4, 8} where valid, and 2 stages x 2 replicas.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

from helpers import run_cli
from test_pipeline_parallel import (assert_every_replica_and_stage_equivalent, classify,
                                    cross_device_sends, same_device)
from tfdist import data, parallel as parallel_lib
from tfdist.config import PIPELINE_SCHEDULES, DataConfig, ModelConfig, RunConfig
from tfdist.errors import UsageError
from tfdist.parallel.pipeline import PipelineParallelism, schedule
from tfdist.testing import equivalence
from tfdist.train import runner

STEPS = 4
GLOBAL_BATCH = 32
F, B, W, BW = (schedule.FORWARD, schedule.BACKWARD_INPUT, schedule.BACKWARD_WEIGHT,
               schedule.BACKWARD)
# Nine cuttable layers each, so that S x V = 4 x 2 chunks fit.
MODELS = {
    "mlp": (ModelConfig(name="mlp", hidden_sizes=(16,) * 6), DataConfig(name="digits")),
    "transformer": (ModelConfig(name="transformer", num_layers=4, d_model=16, num_heads=2,
                                d_ff=32), DataConfig(name="text", seq_len=8)),
}


def make_config(strategy, model, optimizer, devices=4, stages=2, microbatches=1, **overrides):
    model_config, data_config = MODELS[model]
    fields = dict(strategy=strategy, simulate_devices=devices, model=model_config,
                  data=data_config, optimizer=optimizer, global_batch_size=GLOBAL_BATCH,
                  train_steps=STEPS, seed=11, log_every=STEPS, pipeline_stages=stages,
                  microbatches=microbatches)
    fields.update(overrides)
    return RunConfig(**fields)


def build(config):
    """(parallelism, model, optimizer, source) as tfdist.run builds them.

    build_pipeline does not pass config.virtual_stages on yet (its owner adds
    `config.virtual_stages` to its PipelineParallelism(...) call); until then the
    parallelism is rebuilt here with it."""
    parallel = parallel_lib.build_parallelism(config)
    if parallel.virtual_stages != config.virtual_stages:
        parallel = PipelineParallelism(parallel.devices, config.pipeline_stages,
                                       config.microbatches, config.pipeline_split,
                                       config.pipeline_schedule, config.virtual_stages)
    parallel.validate_global_batch(config.global_batch_size)
    source = data.get_source(config.data)
    model, optimizer = runner.build_model_and_optimizer(config, parallel, source.info)
    return parallel, model, optimizer, source


@functools.lru_cache(maxsize=None)
def reference(model: str, optimizer: str):
    results, trained = runner.run(make_config("default", model, optimizer), return_model=True)
    return (equivalence.Record("default", results["losses"], trained.get_weights()),
            [v.path for v in trained.weights])


def train(config, label):
    """(replica 0's Record, its weight paths, {(replica, chunk): (Record, paths)}, parallel)."""
    import keras
    keras.mixed_precision.set_dtype_policy("float32")
    parallel, model, optimizer, source = build(config)
    try:
        losses = runner.train(config, parallel, source, model, optimizer,
                              runner.resolve_steps(config, source)).losses
    finally:
        parallel.close()
    chunks = {(r, stage.index): (
        equivalence.Record(f"{label} replica {r} chunk {stage.index}", losses,
                           [v.numpy() for v in stage.variables]),
        [v.path for v in stage.variables])
        for r, replica in enumerate(parallel.replicas) for stage in replica.stages}
    return (equivalence.Record(label, losses, model.get_weights()),
            [v.path for v in model.weights], chunks, parallel)


def assert_trains_like_default(model, optimizer, devices, stages, microbatches, **overrides):
    ref, ref_paths = reference(model, optimizer)
    config = make_config("pipeline", model, optimizer, devices, stages, microbatches,
                         **overrides)
    label = (f"pipeline {config.pipeline_schedule} V={config.virtual_stages} S={stages} "
             f"M={microbatches} R={devices // stages}")
    got, paths, chunks, parallel = train(config, label)
    assert paths == ref_paths
    equivalence.assert_equivalent(ref, got)
    num_chunks = stages * config.virtual_stages
    assert_every_replica_and_stage_equivalent(ref, ref_paths, chunks, devices // stages,
                                              num_chunks)
    # Chunk c of replica r, its variables and its optimizer slots, on device r*S + c mod S.
    for r, replica in enumerate(parallel.replicas):
        assert len(replica.stages) == num_chunks
        for stage in replica.stages:
            expected = parallel.devices[r * stages + stage.index % stages]
            assert stage.device == expected
            for v in list(stage.variables) + list(stage.optimizer.variables):
                assert same_device(v.value.device, expected), (r, stage.index, v.path)


# --------------------------------------------------------------------------- orders

ORDER_CASES = [(s, m, name, v) for s in (2, 4) for m in (1, 2, 4, 8)
               for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 1),
                               ("interleaved_1f1b", 2), ("interleaved_1f1b", 3),
                               ("zero_bubble", 1)]
               if v == 1 or m % s == 0]


@pytest.mark.parametrize("stages,microbatches,name,virtual", ORDER_CASES)
def test_every_order_runs_each_microbatch_once_each_way_in_order(stages, microbatches, name,
                                                                 virtual):
    orders = schedule.device_orders(name, stages, microbatches, virtual)
    assert len(orders) == stages
    for d, order in enumerate(orders):
        chunks = sorted({c for _, c, _ in order})
        assert chunks == list(range(d, stages * virtual, stages))   # chunk c on device c mod S
        for c in chunks:
            kinds = [(kind, m) for kind, chunk, m in order if chunk == c]
            of = {kind: [m for k, m in kinds if k == kind] for kind in (F, BW, B, W)}
            assert of[F] == list(range(microbatches)), (d, c, order)
            if name == "zero_bubble":
                # W (the variable gradients, summed) in micro-batch order: the same sums.
                assert of[B] == of[W] == list(range(microbatches)) and not of[BW]
                for m in range(microbatches):
                    assert kinds.index((F, m)) < kinds.index((B, m)) < kinds.index((W, m))
            else:
                assert of[BW] == list(range(microbatches)) and not of[B] and not of[W]
                for m in range(microbatches):
                    assert kinds.index((F, m)) < kinds.index((BW, m))
    schedule.simulate(name, stages, microbatches, virtual)   # raises if the orders deadlock


@pytest.mark.parametrize("stages,microbatches", [(2, 1), (2, 3), (4, 4), (4, 8), (4, 2)])
def test_interleaved_with_one_virtual_stage_is_exactly_1f1b(stages, microbatches):
    for d in range(stages):
        assert schedule.interleaved_order(stages, microbatches, d, 1) == [
            (kind, d, m) for kind, m in schedule.one_f_one_b_order(stages, microbatches, d)]


def test_interleaved_order_is_megatrons():
    # S=2, V=2, M=4; device d's local chunk j is model chunk 2j + d. Warm-up 2(S-d-1) +
    # (V-1)S: 4 forwards on device 0, 2 on device 1; groups of S micro-batches per chunk.
    def text(d):
        return " ".join(f"{'F' if k == F else 'B'}{c}.{m}"
                        for k, c, m in schedule.interleaved_order(2, 4, d, 2))
    assert text(0) == ("F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 "
                       "B2.2 B2.3 B0.2 B0.3")
    assert text(1) == ("F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 "
                       "F3.3 B3.3 B1.2 B1.3")


def test_zero_bubble_order_is_zb_h1():
    # S=4, M=8: stage k defers k W ops; the last stage runs F B pairs until 3 W wait.
    def text(k):
        return " ".join({F: "F", B: "B", W: "W"}[kind] + str(m)
                        for kind, m in schedule.zero_bubble_order(4, 8, k))
    assert text(0) == ("F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 "
                       "B7 W7")
    assert text(3) == ("F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 "
                       "W6 W7")


# --------------------------------------------------------------------------- memory, bubble

@pytest.mark.parametrize("stages,microbatches", [(2, 1), (2, 4), (2, 8), (4, 1), (4, 4),
                                                 (4, 8), (4, 16)])
def test_peak_live_microbatches_per_device_are_the_stated_bounds(stages, microbatches):
    S, M = stages, microbatches
    assert schedule.peak_live("gpipe", S, M) == [M] * S
    assert schedule.peak_live("1f1b", S, M) == [min(S - k, M) for k in range(S)]
    # ZB-H1: every stage holds what 1F1B's stage 0 does (W keeps the activations until it runs).
    assert schedule.peak_live("zero_bubble", S, M) == [min(S, M)] * S
    assert max(schedule.peak_live("zero_bubble", S, M)) == max(schedule.peak_live("1f1b", S, M))
    for name in PIPELINE_SCHEDULES:
        for d, peak in enumerate(schedule.peak_live(name, S, M)):
            assert peak == schedule.live_bound(name, S, M, 1, d)
    if M % S:
        return
    for V in (2, 3):
        peaks = schedule.peak_live("interleaved_1f1b", S, M, V)
        assert peaks == [schedule.live_bound("interleaved_1f1b", S, M, V, d) for d in range(S)]
        megatron = [V * M if M == S else min(2 * (S - d - 1) + (V - 1) * S + 1, V * M)
                    for d in range(S)]
        assert peaks == megatron
        # A chunk holds 1/V of a stage's activations: device 0 holds S + (S-1)/V stages'
        # worth in the steady state, more than 1F1B's S (Megatron's memory cost).
        if M > S:
            assert peaks[0] / V == pytest.approx(S + (S - 1) / V) and peaks[0] / V > S


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16)])
def test_simulated_bubbles_are_the_formulas(stages, microbatches):
    S, M = stages, microbatches
    for name in ("gpipe", "1f1b"):
        assert schedule.simulate(name, S, M).bubble == pytest.approx((S - 1) / M)
    for V in (2, 4):
        assert schedule.simulate("interleaved_1f1b", S, M, V).bubble == pytest.approx(
            (S - 1) / (V * M))
    assert schedule.simulate("zero_bubble", S, M).bubble == pytest.approx((S - 1) / (3 * M))
    for f, b, w in [(1.0, 2.0, 1.0), (1.0, 1.0, 0.5)]:   # ZB-H1: (S-1)(F+B-W) idle
        assert schedule.simulate("zero_bubble", S, M, costs=(f, b, w)).bubble == \
            pytest.approx((S - 1) * (f + b - w) / (M * (f + b + w)))


def traced_step(config, stats_per_replica):
    """The step's graph, traced (not run), with each replica's run_replica stats."""
    parallel, model, optimizer, source = build(config)
    original = schedule.run_replica

    def recording(*args, **kwargs):
        stats = {}
        stats_per_replica.append(stats)
        return original(*args, stats=stats, **kwargs)

    schedule.run_replica = recording
    try:
        step = parallel.make_train_step(model, optimizer, config.global_batch_size, False)
        from tfdist.data import pipeline as data_pipeline
        dataset_fn = data_pipeline.train_dataset_fn(source, config.global_batch_size,
                                                    config.seed, config.data)
        graph = step.get_concrete_function(iter(parallel.distribute(dataset_fn))).graph
    finally:
        schedule.run_replica = original
    return graph


@pytest.mark.parametrize("name,virtual,stages,microbatches", [
    ("zero_bubble", 1, 4, 8), ("interleaved_1f1b", 2, 2, 4), ("gpipe", 1, 2, 4),
    ("1f1b", 1, 4, 8)])
def test_the_built_step_holds_what_the_replay_predicts(name, virtual, stages, microbatches):
    stats = []
    traced_step(make_config("pipeline", "mlp", "sgd", 4, stages, microbatches,
                            pipeline_schedule=name, virtual_stages=virtual), stats)
    assert [s["peak_live"] for s in stats] == [
        schedule.peak_live(name, stages, microbatches, virtual)] * (4 // stages)


def matmul_flops(operations) -> int:
    """2 x (multiply-adds) of the MatMul / BatchMatMul / Einsum ops among `operations`."""
    total = 0
    for op in operations:
        if op.type == "MatMul":
            a, out = op.inputs[0].shape, op.outputs[0].shape
            inner = a[0] if op.get_attr("transpose_a") else a[1]
            total += 2 * out.num_elements() * inner
        elif op.type in ("BatchMatMulV2", "BatchMatMulV3"):
            a, out = op.inputs[0].shape, op.outputs[0].shape
            inner = a[-2] if op.get_attr("adj_x") else a[-1]
            total += 2 * out.num_elements() * inner
        elif op.type == "Einsum":
            inputs, _ = op.get_attr("equation").decode().split("->")
            sizes = {}
            for letters, t in zip(inputs.split(","), op.inputs):
                sizes.update(zip(letters, t.shape.as_list()))
            total += 2 * int(np.prod(list(sizes.values())))
    return total


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_zero_bubble_b_and_w_are_the_fused_backward_split_not_recomputed(model):
    """The same matmul FLOPs as 1F1B's fused backward (B's and W's ops are disjoint parts
    of one tape.gradient); W's part is held back (gated) until W's turn."""
    flops, backward, held = {}, {}, {}
    for name in ("1f1b", "zero_bubble"):
        stats = []
        graph = traced_step(make_config("pipeline", model, "sgd", 4, 4, 4,
                                        pipeline_schedule=name), stats)
        flops[name] = matmul_flops(graph.get_operations())
        backward[name] = matmul_flops(op for op in graph.get_operations()
                                      if "gradient_tape" in op.name)
        held[name] = stats[0]
    assert flops["zero_bubble"] == flops["1f1b"] > 0
    held = held["zero_bubble"]
    split = held["split"]
    assert len(split) == 4 * 4   # every chunk's every micro-batch
    b_flops = sum(matmul_flops(b_ops) for b_ops, _ in split.values())
    w_flops = sum(matmul_flops(w_ops) for _, w_ops in split.values())
    assert b_flops > 0 and w_flops > 0
    assert b_flops + w_flops == backward["zero_bubble"] == backward["1f1b"]
    assert all(not set(b_ops) & set(w_ops) for b_ops, w_ops in split.values())
    # W's first ops (those no other W op feeds) wait for the op before W on the device.
    for key, (_, w_ops) in split.items():
        gate = held["gates"][key]
        assert gate or not w_ops   # a chunk without variables (mlp's Flatten) has no W work
        inside = set(w_ops)
        for op in w_ops:
            if not any(t.op in inside for t in op.inputs) and not set(op.control_inputs) & inside:
                assert set(gate) <= set(op.control_inputs), (key, op.name)
    print(f"\n{model}: backward matmul FLOPs per step B {b_flops} W {w_flops} "
          f"(W/B {w_flops / b_flops:.3f}); step total {flops['zero_bubble']}")


def test_add_control_input_canary():
    """schedule.py gates W's ops with the private Operation._add_control_inputs (no public
    API orders an op after it was created); this notices if TensorFlow changes it."""
    @tf.function
    def gated():
        first = tf.constant(1.0, name="first")
        second = tf.constant(2.0, name="second")
        second.op._add_control_inputs([first.op])
        assert first.op in second.op.control_inputs
        return second
    assert float(gated()) == 2.0


# --------------------------------------------------------------------------- equivalence

# In one process, the mlp (the transformer costs 15-35 s a config here): the schedules' code
# is the same across workers, where test_pipeline_cross_worker.py runs the transformer under
# every schedule (and tests/pipeline_full_product.py the whole matrix).
@pytest.mark.parametrize("model,optimizer,devices,stages,microbatches", [
    ("mlp", "sgd", 2, 2, 4), ("mlp", "adam", 4, 4, 8),
    ("mlp", "adam", 4, 2, 4)])   # 2 stages x 2 replicas
def test_interleaved_1f1b_matches_default(model, optimizer, devices, stages, microbatches):
    assert_trains_like_default(model, optimizer, devices, stages, microbatches,
                               pipeline_schedule="interleaved_1f1b", virtual_stages=2)


@pytest.mark.parametrize("model,optimizer,devices,stages,microbatches", [
    ("mlp", "sgd", 2, 2, 1), ("mlp", "adam", 4, 4, 8),
    ("mlp", "sgd", 4, 2, 8)])    # 2 stages x 2 replicas
def test_zero_bubble_matches_default(model, optimizer, devices, stages, microbatches):
    assert_trains_like_default(model, optimizer, devices, stages, microbatches,
                               pipeline_schedule="zero_bubble")


# --------------------------------------------------------------------------- placement

ISOLATED = "TFDIST_PIPELINE_SCHEDULES_PLACEMENT"


def test_placement_check_in_a_fresh_process(run_own_process):
    """The cross-device check below, in its own process (as test_pipeline_parallel.py's)."""
    result, requested, passed = run_own_process(ISOLATED, ["tests/test_pipeline_schedules.py"],
                                                timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert len(passed) == 2 and set(requested) <= passed, (requested, passed)


@pytest.mark.own_process(ISOLATED)
@pytest.mark.parametrize("name,virtual", [("zero_bubble", 1), ("interleaved_1f1b", 2)])
def test_only_boundary_tensors_cross_devices(name, virtual):
    """In the placed step (2 stages x 2 replicas, M=2) only what crosses a chunk boundary
    crosses devices: chunk c on device c mod S sends to c+1, the next device round the ring."""
    from tfdist.data import pipeline as data_pipeline
    devices, stages, microbatches = 4, 2, 2
    config = make_config("pipeline", "mlp", "adam", devices, stages, microbatches,
                         pipeline_schedule=name, virtual_stages=virtual)
    parallel, model, optimizer, source = build(config)
    step = parallel.make_train_step(model, optimizer, GLOBAL_BATCH, False)
    dataset_fn = data_pipeline.train_dataset_fn(source, GLOBAL_BATCH, config.seed, config.data)
    index = {tf.DeviceSpec.from_string(d).device_index: i for i, d in enumerate(parallel.devices)}

    def position(device):
        return divmod(index[tf.DeviceSpec.from_string(device).device_index], stages)

    def ring(device, shift):   # the device `shift` stages round the ring, for classify
        r, d = position(device)
        return parallel.devices[r * stages + (d + shift) % stages]

    kinds = []
    for producer, source_device, target in cross_device_sends(
            step, iter(parallel.distribute(dataset_fn))):
        leaf = producer.rsplit("/", 1)[-1]
        if leaf.startswith(schedule.BOUNDARY_ACTIVATION):    # c -> c+1: device d -> d+1 mod S
            assert same_device(target, ring(source_device, 1)), (producer, source_device,
                                                                   target)
            kinds.append("activation")
        elif leaf.startswith(schedule.BOUNDARY_GRADIENT):
            assert same_device(target, ring(source_device, -1)), (producer, source_device,
                                                                    target)
            kinds.append("gradient")
        else:
            kinds.append(classify(producer, source_device, target, position, stages))
    chunks = parallel.replicas[0].stages
    boundaries = (devices // stages) * (len(chunks) - 1) * microbatches
    # A gradient goes back to chunk c only if it uses it (a chunk of Flatten alone does not:
    # TensorFlow prunes the send).
    used = sum(1 for c in chunks[:-1] if c.variables or any(c.differentiable_inputs))
    assert kinds.count("activation") == boundaries
    assert kinds.count("gradient") == (devices // stages) * used * microbatches
    assert used >= len(chunks) - 2


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("overrides,expected", [
    (dict(pipeline_schedule="interleaved_1f1b", pipeline_stages=2, microbatches=3,
          virtual_stages=2),
     r"--pipeline_schedule=interleaved_1f1b needs --microbatches to be a multiple of "
     r"--pipeline_stages .* got --microbatches=3 with --pipeline_stages=2 "
     r"\(--virtual_stages=2\). Use --microbatches=2 or 4, or --pipeline_schedule=1f1b"),
    (dict(pipeline_schedule="interleaved_1f1b", pipeline_stages=4, microbatches=2),
     r"got --microbatches=2 with --pipeline_stages=4 .* Use --microbatches=4, or"),
    (dict(pipeline_schedule="1f1b", virtual_stages=2),
     r"--virtual_stages=2 only applies to --pipeline_schedule=interleaved_1f1b \(got "
     r"--pipeline_schedule=1f1b"),
    (dict(pipeline_schedule="zero_bubble", virtual_stages=3), r"--virtual_stages=3 only"),
    (dict(pipeline_schedule="interleaved_1f1b", virtual_stages=0),
     r"--virtual_stages must be > 0, got 0"),
    (dict(pipeline_schedule="zb"),
     r"Unknown --pipeline_schedule 'zb'. Valid choices: gpipe, 1f1b, interleaved_1f1b, "
     r"zero_bubble."),
])
def test_bad_schedule_input_is_refused_before_anything_is_built(overrides, expected):
    with pytest.raises(UsageError, match=expected):
        make_config("pipeline", "mlp", "sgd", **overrides)
    if "virtual_stages" in overrides and overrides.get("pipeline_schedule") != "zb":
        with pytest.raises(UsageError, match=expected):   # a PipelineParallelism built by hand
            PipelineParallelism(["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"],
                                overrides.get("pipeline_stages", 2),
                                overrides.get("microbatches", 1),
                                schedule_name=overrides["pipeline_schedule"],
                                virtual_stages=overrides["virtual_stages"])


def test_more_chunks_than_layers_is_refused_before_training():
    config = make_config("pipeline", "mlp", "sgd", 4, 2, 4, pipeline_schedule="interleaved_1f1b",
                         virtual_stages=5)
    with pytest.raises(UsageError, match=r"--pipeline_stages=2 x --virtual_stages=5 \(10 model "
                                         r"chunks\) is more than the 9 layers of model 'mlp'"):
        build(config)


def test_cli_refuses_virtual_stages_without_interleaving():
    done = run_cli(["--strategy=pipeline", "--simulate_devices=2", "--pipeline_stages=2",
                    "--pipeline_schedule=zero_bubble", "--virtual_stages=2", "--model=mlp",
                    "--train_steps=1"])
    assert done.returncode != 0
    assert "--virtual_stages=2 only applies to --pipeline_schedule=interleaved_1f1b" in (
        done.stderr + done.stdout)


def test_run_config_virtual_stages_reach_the_parallelism():
    config = make_config("pipeline", "mlp", "sgd", 4, 2, 4, pipeline_schedule="interleaved_1f1b",
                         virtual_stages=2)
    assert parallel_lib.build_parallelism(config).virtual_stages == 2
