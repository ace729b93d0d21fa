"""`tfdist plan`: its model inventory is the real model's, its per-device state bytes are
what the modes report (exactly), its recommendation runs with the flags it prints, and
bad input gets a clear answer. DTensor's exact bytes: tests/test_dtensor_plan.py."""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO
from tfdist import cli, config as cfg, data, models, parallel as parallel_lib
from tfdist.parallel.pipeline import partition
from tfdist.plan import command, inventory as inventory_lib, memory, zero
from tfdist.plan.memory import Candidate, per_device
from tfdist.train import runner

MODEL_FLAGS = {
    "mlp-digits": ["--model=mlp", "--dataset=digits"],
    "mlp-wide": ["--model=mlp", "--hidden_sizes=64,32,16", "--dataset=synthetic",
                 "--synthetic_shape=12,4", "--synthetic_classes=7"],
    "cnn-digits": ["--model=cnn", "--dataset=digits"],
    "cnn-rgb": ["--model=cnn", "--filters=8,16,8", "--dataset=synthetic",
                "--synthetic_shape=16,12,3"],
    "resnet-digits": ["--model=resnet", "--filters=8,16", "--dataset=digits"],
    "resnet-rgb": ["--model=resnet", "--filters=8,8,16", "--dataset=synthetic",
                   "--synthetic_shape=9,9,3"],
    "transformer": ["--model=transformer", "--dataset=text", "--seq_len=16"],
    "transformer-deep": ["--model=transformer", "--num_layers=3", "--d_model=32",
                         "--num_heads=2", "--d_ff=48", "--dataset=text", "--seq_len=8"],
}


def parse(flags, devices=4, memory="1GiB", extra=()):
    return command.parse([f"--devices={devices}", f"--memory_per_device={memory}",
                          "--device_type=cpu", *flags, *extra])


def real_model(args):
    source = data.get_source(command.data_config(args))
    return models.build_model(source.info, command.model_config(args)), source.info


@pytest.mark.parametrize("name", sorted(MODEL_FLAGS))
def test_inventory_is_the_real_models_variables_layers_and_cuts(name):
    args, work, _ = parse(MODEL_FLAGS[name])
    model, info = real_model(args)
    planned = work.inventory
    assert [(w.path, w.shape, w.trainable) for w in planned.weights] == \
           [(v.path, tuple(v.shape), v.trainable) for v in model.variables]
    layers = partition.chain_layers(model)
    assert [layer.name for layer in planned.layers] == [layer.name for layer in layers]
    assert [layer.params for layer in planned.layers] == \
           [partition.layer_params(layer) for layer in layers]
    real_cuts = [i for i in range(1, len(layers))
                 if partition._cut_problem(model, layers, i) is None]  # our own helper
    assert [i for i, layer in enumerate(planned.layers) if i and layer.cut_before] == real_cuts
    assert inventory_lib.dataset_shape(command.data_config(args)) == \
           inventory_lib.ModelShape(tuple(info.input_shape), info.num_classes)


def planned_bytes(flags, strategy_flags, extra=()):
    """The planner's param_bytes_per_device for the candidate a train command would run."""
    args, work, hardware = parse(flags, extra=extra)
    candidate = candidate_for(strategy_flags, hardware)
    from tfdist.plan.recommend import evaluate
    evaluated = evaluate(candidate, work, hardware)
    assert evaluated.problem is None, evaluated.problem
    return command._candidate_json(evaluated, hardware)["param_bytes_per_device"]


def candidate_for(strategy_flags, hardware):
    from tfdist.plan.memory import Candidate
    kind = strategy_flags["strategy"]
    if kind == "pipeline":
        stages = strategy_flags["pipeline_stages"]
        return Candidate("pipeline", hardware.devices, replicas=hardware.devices // stages,
                         stages=stages, microbatches=strategy_flags.get("microbatches", 1))
    return Candidate(kind, hardware.devices, replicas=hardware.devices)


def built_run(flags, strategy_flags, optimizer, mixed=None):
    """(mode, model, optimizer) as the run of these planner flags builds them."""
    args, _, _ = parse(flags)
    fields = {"simulate_devices": 4, **strategy_flags}
    config = cfg.RunConfig(model=command.model_config(args), data=command.data_config(args),
                           optimizer=optimizer, global_batch_size=16, mixed_precision=mixed,
                           **fields)
    import keras
    parallel = parallel_lib.build_parallelism(config)
    source = data.get_source(config.data)
    keras.mixed_precision.set_dtype_policy(mixed or "float32")
    try:
        model, opt = runner.build_model_and_optimizer(config, parallel, source.info)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    return parallel, model, opt


def reported_bytes(flags, strategy_flags, optimizer, mixed=None):
    parallel, model, opt = built_run(flags, strategy_flags, optimizer, mixed)
    return parallel.param_bytes_per_device(model, opt)


STATE_CASES = [
    ("mlp-digits", dict(strategy="mirrored"), "adam", None),
    ("mlp-wide", dict(strategy="mirrored"), "momentum", "mixed_float16"),
    ("cnn-rgb", dict(strategy="mirrored"), "adamw", "mixed_bfloat16"),
    ("resnet-digits", dict(strategy="mirrored"), "momentum", None),
    ("transformer", dict(strategy="mirrored"), "sgd", None),
    ("mlp-wide", dict(strategy="pipeline", pipeline_stages=2, microbatches=2), "adam", None),
    ("cnn-digits", dict(strategy="pipeline", pipeline_stages=4), "momentum", None),
    ("resnet-rgb", dict(strategy="pipeline", pipeline_stages=4), "adam", None),
    ("transformer-deep", dict(strategy="pipeline", pipeline_stages=2, microbatches=4),
     "adamw", None),
    ("transformer-deep", dict(strategy="pipeline", pipeline_stages=4), "sgd", "mixed_bfloat16"),
]


@pytest.mark.parametrize("name,strategy_flags,optimizer,mixed", STATE_CASES,
                         ids=[f"{c[0]}-{c[1]['strategy']}{c[1].get('pipeline_stages', '')}-{c[2]}"
                              f"{'-' + c[3] if c[3] else ''}" for c in STATE_CASES])
def test_state_bytes_equal_what_the_mode_reports(name, strategy_flags, optimizer, mixed):
    extra = [f"--optimizer={optimizer}", "--global_batch_size=16"]
    extra += [f"--dtype={mixed}"] if mixed else []
    planned = planned_bytes(MODEL_FLAGS[name], strategy_flags, extra)
    assert planned == reported_bytes(MODEL_FLAGS[name], strategy_flags, optimizer, mixed)


# --------------------------------------------------------------------------- the printed command runs

def run_plan(args, timeout=60):
    return subprocess.run([sys.executable, "-m", "tfdist.cli", "plan", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


# Memory per device chosen so each registry model gets a different kind of plan. The
# tensor-parallel ones plan with --zero_stage=0: ZeRO over the data layout, which the
# planner tries first, would fit them too; mlp-zero gets it (ZeRO stage 2).
RECOMMENDED_RUNS = {
    "mlp": (["--model=mlp", "--hidden_sizes=256,256", "--dataset=digits",
             "--global_batch_size=32", "--zero_stage=0"], "600KiB", "dtensor"),
    "mlp-zero": (["--model=mlp", "--hidden_sizes=256,256", "--dataset=digits",
                  "--global_batch_size=32"], "900KiB", "dtensor"),
    "cnn": (["--model=cnn", "--dataset=digits", "--global_batch_size=32"], "400KiB", "pipeline"),
    "resnet": (["--model=resnet", "--filters=8,16", "--dataset=digits",
                "--global_batch_size=32"], "512KiB", "mirrored"),
    "transformer": (["--model=transformer", "--dataset=text", "--seq_len=32",
                     "--global_batch_size=8", "--zero_stage=0"], "2.5MiB", "dtensor"),
}


@pytest.mark.parametrize("model", sorted(RECOMMENDED_RUNS))
def test_recommendation_runs_with_its_flags_and_reports_its_bytes(model, tmp_path):
    flags, memory, expected = RECOMMENDED_RUNS[model]
    result = run_plan(["--devices=4", f"--memory_per_device={memory}", "--device_type=cpu",
                       *flags, "--json"])
    assert result.returncode == 0, result.stdout + result.stderr
    plan = json.loads(result.stdout)
    assert plan["recommended"]["strategy"] == expected, plan["reason"]
    python, module, *train_flags = plan["command"]
    assert (python, module) == ("python", "-m") and train_flags[0] == "experiments.train"
    results = tmp_path / "results.json"
    run = subprocess.run([sys.executable, "-m", *train_flags, "--train_steps=2",
                          f"--results_json={results}"], cwd=REPO, capture_output=True, text=True,
                         timeout=180, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert run.returncode == 0, run.stderr[-3000:]
    reported = json.loads(results.read_text())
    assert reported["param_bytes_per_device"] == plan["recommended"]["param_bytes_per_device"]
    if "gradient_bytes_per_device" in reported:   # the modes that shard gradients report them
        assert (reported["gradient_bytes_per_device"]
                == plan["recommended"]["gradient_bytes_per_device"])
    zero_stage = plan["recommended"]["zero_stage"]
    assert (f"--zero_stage={zero_stage}" in plan["command"]) == (model == "mlp-zero")


def test_recomputation_counts_each_block_by_its_input_and_one_block_at_a_time():
    """--remat=full (tfdist/train/remat.py): a recomputed transformer block holds its
    input until the backward pass reaches it, then its own activations, one block at a
    time; the plan's command carries the flag."""
    flags = ["--model=transformer", "--num_layers=8", "--dataset=text", "--seq_len=16",
             "--global_batch_size=8"]
    args, plain, _ = parse(flags, devices=1)
    _, recomputing, _ = parse(flags, devices=1, extra=["--remat=full"])
    assert recomputing.remat == "full" and plain.remat is None
    one = Candidate("default", 1, replicas=1)
    before, after = per_device(one, plain)[0], per_device(one, recomputing)[0]
    blocks = [layer for layer in plain.inventory.layers if layer.name.startswith("block_")]
    assert len(blocks) == 8
    block, kept = blocks[0].saved * 4, blocks[0].kept_when_recomputed * 4
    assert before.activations - after.activations == 8 * (8 * (block - kept)) - 8 * (block - kept)
    assert after.gradients == before.gradients and after.params == before.params


def test_the_plan_command_asks_for_the_recomputation_it_counted(capsys):
    assert cli.main(["plan", "--devices=1", "--memory_per_device=16GiB", "--model=transformer",
                     "--dataset=text", "--remat=full", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert "--remat=full" in answer["command"]


# --------------------------------------------------------------------------- answers and errors

def test_model_that_fits_nowhere_says_by_how_much(capsys):
    status = cli.main(["plan", "--devices=2", "--memory_per_device=64KiB",
                       "--model=mlp", "--hidden_sizes=512,512", "--json"])
    answer = json.loads(capsys.readouterr().out)
    assert status == command.EXIT_NO_FIT and not answer["fits"] and answer["command"] is None
    smallest = min(c["peak_bytes"] for c in answer["candidates"] if c["problem"] is None)
    assert answer["shortfall_bytes"] == smallest - answer["usable_per_device"] > 0
    assert "Does not fit" in answer["reason"] and "more than the" in answer["reason"]


def test_table_names_the_plan_and_the_command(capsys):
    assert cli.main(["plan", "--devices=4", "--memory_per_device=16GiB", "--model=mlp"]) == 0
    out = capsys.readouterr().out
    assert "mirrored x 4" in out and "fits on one device" in out
    assert "python -m experiments.train --strategy=mirrored --model=mlp" in out


def test_parameter_count_plans_without_a_runnable_command(capsys):
    status = cli.main(["plan", "--params=7e9", "--num_layers=32", "--devices=8",
                       "--memory_per_device=80GiB", "--optimizer=adam", "--json"])
    answer = json.loads(capsys.readouterr().out)
    assert status == 0 and answer["num_params"] == 7 * 10**9 and answer["command"] is None
    # 16 bytes per parameter (weight, gradient, 2 Adam slots) do not fit 72 GiB usable:
    assert answer["recommended"]["strategy"] in ("dtensor", "pipeline")


@pytest.mark.parametrize("args,needle", [
    (["--devices=0", "--memory_per_device=1GiB"], "--devices must be >= 1, got 0"),
    (["--devices=4", "--memory_per_device=lots"], "--memory_per_device must be a positive size"),
    (["--devices=4", "--memory_per_device=-1GiB"], "got '-1GiB'"),
    (["--devices=4", "--memory_per_device=1GiB", "--workers=3"], "divide --devices"),
    (["--devices=4", "--memory_per_device=1GiB", "--model=vgg"], "Unknown model 'vgg'"),
    (["--devices=4", "--memory_per_device=1GiB", "--dtype=int8"], "Valid choices: float32"),
    (["--devices=4", "--memory_per_device=1GiB", "--optimizer=lamb"], "Unknown --optimizer"),
    (["--devices=4", "--memory_per_device=1GiB", "--global_batch_size=0"], "got 0"),
    (["--devices=4", "--memory_per_device=1GiB", "--params=0"], "--params must be >= 1"),
    (["--devices=4", "--memory_per_device=1GiB", "--dataset=tfds:mnist"], "--synthetic_shape"),
    (["--devices=4", "--memory_per_device=1GiB", "--reserve=1"], "--reserve must be in [0, 1)"),
    (["--devices=4"], "--memory_per_device"),
])
def test_impossible_input_is_a_usage_error(args, needle, capsys):
    assert cli.main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_cli_plan_imports_no_tensorflow():
    code = ("import sys; from tfdist import cli; "
            "cli.main(['plan', '--devices=2', '--memory_per_device=1GiB', '--model=transformer',"
            " '--dataset=text']); assert 'tensorflow' not in sys.modules, 'imported TF'")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_memory_sizes_parse_binary_and_decimal():
    assert command.parse_bytes("16GiB") == 16 * 2**30 == command.parse_bytes("16G")
    assert command.parse_bytes("80GB") == 80 * 10**9
    assert command.parse_bytes("512MiB") == 512 * 2**20
    assert command.parse_bytes("1e6") == 10**6


def test_transient_estimate_is_within_a_third_of_the_allocator_peak():
    """Gradients + activations against TF's allocator on one CPU device (docs/planner.md).

    In a fresh process without TF_CPU_ALLOCATOR_USE_BFC, as a user's would be: the
    allocator that keeps statistics has to be chosen before TensorFlow's devices exist,
    and the executor's thread counts before its context does (one each: a fixed op order);
    the step is traced without grappler's rewrites, which chose per process between peaks
    7.3 and 11.5-12.5 MB (benchmarks/memory.py).
    The default allocator (oneDNN's, on AVX512), in 64 KiB steps: within a third. BFC
    counts chunks up to twice the request, so its peak is 1-2x the bytes asked for: an
    estimate within a third of those is -2/3 to +1/3 of BFC's peak.
    """
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    script = ("import json; from benchmarks import memory; "
              "print(json.dumps(memory.compare(list(memory.CONFIGS[0]))))")  # --suite=memory's mlp
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(result.stdout.strip().splitlines()[-1])
    lowest = -1 / 3 if row["allocator"] == "default" else -2 / 3
    assert row["measured"] > 0 and lowest < row["error"] < 1 / 3, row


def test_a_process_whose_allocator_keeps_no_statistics_gets_told_how_to_measure(monkeypatch):
    import tensorflow as tf
    from benchmarks import memory
    monkeypatch.setenv(memory.ALLOCATOR_STATS_ENV, "false")  # TF's plain CPU allocator
    tf.constant(1.0)  # TensorFlow's devices exist from here on
    try:
        tf.config.experimental.get_memory_info("CPU:0")
    except ValueError:
        with pytest.raises(RuntimeError, match="TF_CPU_ALLOCATOR_USE_BFC=true.*--suite=memory"):
            memory.require_allocator_stats()
    else:   # oneDNN's allocator (the default on AVX512 CPUs) keeps them: nothing to refuse
        memory.require_allocator_stats()


def test_a_process_already_on_several_threads_gets_told_how_to_measure(monkeypatch):
    import tensorflow as tf
    from benchmarks import memory
    for name in memory.THREAD_ENVS:
        monkeypatch.delenv(name, raising=False)
    tf.constant(1.0)  # the context exists, on TensorFlow's default thread counts
    with pytest.raises(RuntimeError, match="TF_NUM_INTEROP_THREADS=1 TF_NUM_INTRAOP_THREADS=1.*"
                                           "--suite=memory"):
        memory.require_one_thread_executor()
    for name in memory.THREAD_ENVS:  # a context started on one thread of each is what it needs
        monkeypatch.setenv(name, "1")
    memory.require_one_thread_executor()


def test_graph_rewrites_are_off_only_inside_the_measurement():
    import tensorflow as tf
    from benchmarks import memory
    assert not tf.config.optimizer.get_experimental_options().get("disable_meta_optimizer", False)
    with memory._without_graph_rewrites():
        assert tf.config.optimizer.get_experimental_options()["disable_meta_optimizer"]
    assert not tf.config.optimizer.get_experimental_options().get("disable_meta_optimizer", False)


def test_several_workers_get_a_launcher_on_cpu_and_a_per_host_command_on_gpus(capsys):
    flags = ["plan", "--devices=4", "--workers=2", "--memory_per_device=1GiB", "--model=mlp",
             "--json"]
    assert cli.main(flags + ["--device_type=cpu"]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert cpu["command"][:6] == ["tfdist", "launch", "--workers", "2", "--devices_per_worker", "2"]
    assert "--strategy=multi_worker_mirrored" in cpu["command"] and cpu["run_on"] == "this host"
    assert cli.main(flags + ["--device_type=gpu"]) == 0
    gpu = json.loads(capsys.readouterr().out)
    assert gpu["command"][:3] == ["python", "-m", "experiments.train"]
    assert "--num_gpus=2" in gpu["command"] and gpu["run_on"] == "every worker host"
    assert "--collective=shm" not in cpu["command"] + gpu["command"]  # 2 devices per worker
    assert cli.main(["plan", "--devices=2", "--workers=2", "--memory_per_device=1GiB",
                     "--model=mlp", "--json", "--device_type=cpu"]) == 0
    assert "--collective=shm" in json.loads(capsys.readouterr().out)["command"]


def test_a_mode_that_refuses_mixed_float16_is_planned_in_mixed_bfloat16_and_says_so(capsys):
    """dtensor and pipeline refuse mixed_float16 (a dynamic loss scale); data parallelism,
    which runs it, does not fit, so the plan runs mixed_bfloat16 and its reason says why."""
    assert cli.main(["plan", "--devices=4", "--memory_per_device=600KiB", "--model=mlp",
                     "--hidden_sizes=256,256", "--global_batch_size=32", "--dtype=mixed_float16",
                     "--device_type=cpu", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    policies = {c["strategy"]: c["mixed_precision"] for c in answer["candidates"]}
    assert policies == {"mirrored": None, "dtensor": "mixed_bfloat16"}
    assert answer["recommended"]["plan"].endswith(", mixed_bfloat16")
    assert "--mixed_precision=mixed_bfloat16" in answer["command"]
    assert not any("float16" in flag and "bfloat16" not in flag for flag in answer["command"])
    assert ("It runs mixed_bfloat16, not the mixed_float16 asked" in answer["reason"]
            and "no exact sharded update" in answer["reason"])


def test_a_candidate_run_in_mixed_float16_is_still_refused():
    """What the run refuses (parallel/dtensor, parallel/pipeline), the planner refuses too,
    when a candidate is evaluated in the workload's own mixed_float16."""
    from tfdist.plan.recommend import evaluate
    _, work, hardware = parse(MODEL_FLAGS["mlp-wide"], extra=["--dtype=mixed_float16"])
    problems = {c.strategy: evaluate(c, work, hardware).problem for c in (
        Candidate("dtensor", 4, replicas=2, model_ways=2, layout="megatron"),
        Candidate("pipeline", 4, replicas=2, stages=2))}
    assert problems == {"dtensor": "dtensor does not support mixed_float16 (use mixed_bfloat16)",
                        "pipeline": "pipeline does not support mixed_float16"}


# --------------------------------------------------------------------------- ZeRO (--zero_stage)

PAPER_FIGURE_1_GB = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}   # Rajbhandari et al. 2020, Figure 1
TFDIST_GB = {0: 120, 1: 60.9375, 2: 31.40625, 3: 1.875}  # float32 weights and gradients, K=8


def test_the_paper_formula_reproduces_figure_1():
    """7.5e9 parameters, 64 devices, mixed-precision Adam (2 + 2 + K=12 bytes a parameter)."""
    for stage, gigabytes in PAPER_FIGURE_1_GB.items():
        computed = zero.model_state_bytes(7.5e9, 64, stage, **zero.PAPER_BYTES) / 1e9
        assert computed == pytest.approx(gigabytes, rel=0.02), (stage, computed)


def test_the_planner_counts_what_keras_allocates_for_the_same_model():
    """Keras keeps float32 variables under a mixed policy: 4 + 4 + 8 bytes a parameter, no
    master copy. The planner's state + gradients on batch=64 are that formula's bytes plus
    Adam's two replicated scalars, byte for byte (the stand-in's variables divide by 64)."""
    _, work, _ = command.parse(["--params=7.5e9", "--devices=64", "--memory_per_device=80GB",
                                "--dtype=mixed_bfloat16"])
    for stage, gigabytes in TFDIST_GB.items():
        candidate = Candidate("dtensor", 64, replicas=64, zero_stage=stage)
        device = per_device(candidate, work)[0]
        formula = zero.model_state_bytes(7.5e9, 64, stage, **zero.TFDIST_ADAM_BYTES)
        assert device.state + device.gradients == formula + memory.OPTIMIZER_SCALARS
        assert formula == gigabytes * 1e9


def test_the_zero_layout_is_the_runs_rule():
    """The planner cuts with tfdist/parallel/dtensor/zero.py's zero_spec: batch on the first
    dimension the spec leaves unsharded and the batch axis divides."""
    from tfdist.parallel.dtensor.zero import zero_spec
    u, m, b = "unsharded", "model", "batch"
    assert zero_spec((u, m), (64, 100), 4) == (b, m)
    assert zero_spec((m, u), (100, 50), 2) == (m, b)
    assert zero_spec((u, u), (50, 12), 4) == (u, b)      # 50 does not divide by 4
    assert zero_spec((u,), (10,), 4) == (u,)              # nothing divides: replicated
    assert zero_spec((m,), (100,), 2) == (m,)             # no unsharded dimension
    assert zero_spec((b, u), (8, 8), 2) == (b, u)         # a spec already on batch


def test_each_stage_cuts_its_parts_of_every_variable_in_the_zero_layout():
    """mlp 64-100-50-10 (digits) on batch=2,model=2, megatron: each variable's pieces by
    hand: tensor-parallel (megatron spec) and zero layout (batch on the first unsharded
    dimension it divides); the stage says which parts take which."""
    _, work, _ = parse(MODEL_FLAGS["mlp-digits"])
    tensor_parallel = {"dense_0/kernel": 2, "dense_0/bias": 2, "dense_1/kernel": 2,
                       "dense_1/bias": 1, "logits/kernel": 1, "logits/bias": 1}
    zero_layout = {"dense_0/kernel": 4,   # [unsharded, model] (64, 100): batch on 64
                   "dense_0/bias": 2,     # [model]: no unsharded dimension left
                   "dense_1/kernel": 4,   # [model, unsharded] (100, 50): batch on 50
                   "dense_1/bias": 2, "logits/kernel": 2, "logits/bias": 2}
    for stage in zero.STAGES:
        candidate = Candidate("dtensor", 4, replicas=2, model_ways=2, layout="megatron",
                              zero_stage=stage)
        pieces = memory.shard_counts(work.inventory, candidate)
        for part in ("params", "optimizer", "gradients"):
            chosen = zero_layout if zero.shards(stage, part) else tensor_parallel
            assert {path: getattr(p, part) for path, p in pieces.items()} == chosen, (stage, part)


def test_stage_bytes_shrink_part_by_part():
    """mlp 64-100-50-10 on batch=4 (data layout), Adam: 12,060 parameters, 3,435 per device
    in the zero layout (the kernels and dense_0/bias cut in 4; dense_1/bias (50), the logits
    (50x10, 10) replicated: 4 divides none of their dimensions)."""
    _, work, _ = parse(MODEL_FLAGS["mlp-digits"])
    full, shard = 12060 * 4, 3435 * 4
    expected = {0: (full, 2 * full, full), 1: (full, 2 * shard, full),
                2: (full, 2 * shard, shard), 3: (shard, 2 * shard, shard)}
    for stage, (params, optimizer, gradients) in expected.items():
        device = per_device(Candidate("dtensor", 4, replicas=4, zero_stage=stage), work)[0]
        assert (device.params, device.optimizer, device.gradients) == \
               (params, optimizer + memory.OPTIMIZER_SCALARS, gradients), stage


def test_zero_is_tried_after_a_full_copy_and_before_the_model_is_split(capsys):
    assert cli.main(["plan", "--devices=4", "--memory_per_device=900KiB", "--model=mlp",
                     "--hidden_sizes=256,256", "--global_batch_size=32", "--device_type=cpu",
                     "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert [c["plan"] for c in answer["candidates"]] == [
        "mirrored x 4", "dtensor mesh batch=4,model=1 (data), zero stage 1",
        "dtensor mesh batch=4,model=1 (data), zero stage 2"]
    assert answer["command"][-3:] == ["--mesh=batch=4,model=1", "--layout=data", "--zero_stage=2"]
    assert "ZeRO stage 2 shards the optimizer state and the gradients" in answer["reason"]
    recommended = answer["recommended"]
    assert recommended["gradient_bytes_per_device"] == {
        d["device"]: d["gradients"] for d in recommended["per_device"]}


def test_a_mesh_whose_stage_3_does_not_fit_lists_only_stage_3(capsys):
    """Each stage needs no more than the one before: when stage 3 misses, so do 1 and 2."""
    assert cli.main(["plan", "--devices=4", "--memory_per_device=1.2MiB", "--model=transformer",
                     "--dataset=text", "--seq_len=32", "--global_batch_size=8",
                     "--device_type=cpu", "--json"]) == command.EXIT_NO_FIT
    plans = [c["plan"] for c in json.loads(capsys.readouterr().out)["candidates"]]
    assert plans[:4] == ["mirrored x 4", "dtensor mesh batch=4,model=1 (data), zero stage 3",
                         "dtensor mesh batch=2,model=2 (megatron)",
                         "dtensor mesh batch=2,model=2 (megatron), zero stage 3"], plans


def test_zero_stage_0_plans_as_before_and_a_given_stage_alone(capsys):
    flags = ["plan", "--devices=4", "--memory_per_device=600KiB", "--model=mlp",
             "--hidden_sizes=256,256", "--global_batch_size=32", "--device_type=cpu", "--json"]
    assert cli.main(flags + ["--zero_stage=0"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert all(c["zero_stage"] == 0 for c in plain["candidates"])
    assert "--zero_stage" not in " ".join(plain["command"])
    assert cli.main(flags + ["--zero_stage=1", "--memory_per_device=650KiB"]) == 0
    given = json.loads(capsys.readouterr().out)
    # stage 1 alone, on the meshes with a batch axis to shard over (batch=4, then batch=2)
    assert [c["plan"] for c in given["candidates"]] == [
        "dtensor mesh batch=4,model=1 (data), zero stage 1",
        "dtensor mesh batch=2,model=2 (megatron), zero stage 1"]
    assert given["command"][-3:] == ["--mesh=batch=2,model=2", "--layout=megatron",
                                     "--zero_stage=1"]
    assert given["reason"].startswith("Planned at --zero_stage 1, as asked; megatron tensor "
                                      "parallelism over 2 devices")


ISSUE = ["plan", "--params", "7.5e9", "--devices", "64", "--workers", "8", "--memory_per_device",
         "80GB", "--optimizer", "adam", "--dtype", "mixed_float16", "--device_type", "gpu"]


def test_the_issues_7_5b_model_on_64_gpus_gets_a_zero_plan_with_flags(capsys):
    """The issue's command found no plan: a full copy needs 120 GB and every mode that
    splits the state refused mixed_float16. ZeRO stage 1 on batch=64 in mixed_bfloat16 fits
    (60.94 GB of 72 GB usable), and its flags make a valid RunConfig with the user's model."""
    assert cli.main([*ISSUE, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    recommended = answer["recommended"]
    assert (recommended["strategy"], recommended["replicas"], recommended["model_ways"],
            recommended["layout"], recommended["zero_stage"], recommended["mixed_precision"]) \
        == ("dtensor", 64, 1, "data", 1, "mixed_bfloat16")
    assert recommended["peak_bytes"] == 60_937_500_012 <= answer["usable_per_device"]
    assert answer["command"] is None   # a --params model: the flags, without a model
    assert answer["flags"] == [
        "--strategy=dtensor", "--optimizer=adam", "--global_batch_size=64",
        "--mixed_precision=mixed_bfloat16", "--num_gpus=8", "--mesh=batch=64,model=1",
        "--layout=data", "--zero_stage=1"]
    assert "It runs mixed_bfloat16, not the mixed_float16 asked" in answer["reason"]
    config = run_config_from([*answer["flags"], *USER_MODEL])
    assert (config["strategy"], config["zero_stage"], config["mixed_precision"],
            config["num_gpus"] * 8) == ("dtensor", 1, "mixed_bfloat16", 64)
    assert config["mesh_axes"] == [["batch", 64], ["model", 1]]


def test_the_issues_table_says_how_to_run_it_with_your_model(capsys):
    assert cli.main(ISSUE) == 0
    out = capsys.readouterr().out
    assert ("Run it with your model (add --model=MODULE:FUNCTION --dataset=MODULE:FUNCTION; "
            "the estimate assumed its variables split evenly) on each of the 8 worker hosts, "
            "with its DTENSOR_* variables:") in out
    assert out.rstrip().endswith("--layout=data --zero_stage=1")


USER_MODEL = ["--model=my_model:build", "--dataset=my_data:build"]


def run_config_from(flags):
    """experiments/train.py's own flag parsing and RunConfig validation, in a process of its
    own (absl's FLAGS are global); no TensorFlow, no devices."""
    code = ("import json, sys; from experiments import train; "
            "from tfdist.parallel.dtensor import mesh; "
            "train.FLAGS(['train', *sys.argv[1:]]); c = train.config_from_flags(); "
            "print(json.dumps(dict(strategy=c.strategy, zero_stage=c.zero_stage, "
            "mixed_precision=c.mixed_precision, num_gpus=c.num_gpus, "
            "mesh_axes=mesh.parse_mesh(c.mesh, 64))))")
    done = subprocess.run([sys.executable, "-c", code, *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args,needle", [
    (["--zero_stage=4"], "Unknown --zero_stage 4. Valid choices: 0, 1, 2, 3"),
    (["--zero_stage=-1"], "Unknown --zero_stage -1. Valid choices: 0, 1, 2, 3"),
    (["--zero_stage=two"], "--zero_stage: invalid int value: 'two'"),
    (["--zero_stage=1", "--devices=1"],
     "--devices 1 has no second one. Valid choices with --devices 1: --zero_stage 0"),
    (["--zero_stage=2", "--model=cnn"],
     "--zero_stage 2 is run by --strategy=dtensor only, which tfdist plan plans for models "
     "mlp, transformer and --params only, not 'cnn'. Valid choices for model 'cnn': "
     "--zero_stage 0"),
])
def test_a_zero_stage_that_cannot_be_planned_is_a_usage_error(args, needle, capsys):
    assert cli.main(["plan", "--devices=4", "--memory_per_device=1GiB", *args]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert needle in err and "Traceback" not in err


def test_a_zero_stage_on_a_mode_that_cannot_run_it_is_refused():
    from tfdist.errors import UsageError
    with pytest.raises(UsageError, match="zero_stage=1 is run by strategy 'dtensor' only.*"
                                         "got strategy 'mirrored'. Valid choices for "
                                         "'mirrored': zero_stage 0"):
        Candidate("mirrored", 4, replicas=4, zero_stage=1)
    with pytest.raises(UsageError, match="Unknown --zero_stage 5. Valid choices: 0, 1, 2, 3"):
        Candidate("dtensor", 4, replicas=4, zero_stage=5)
    from tfdist.plan.recommend import evaluate
    _, work, hardware = parse(MODEL_FLAGS["mlp-wide"])
    one_replica = Candidate("dtensor", 4, replicas=1, model_ways=4, layout="megatron",
                            zero_stage=2)
    assert evaluate(one_replica, work, hardware).problem == \
        "zero stage 2 shards over the batch axis, which has 1 device here"
    with pytest.raises(UsageError, match="Unknown --zero_stage 4"):
        zero.model_state_bytes(7.5e9, 64, 4, **zero.PAPER_BYTES)
