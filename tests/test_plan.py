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
from tfdist.plan import command, inventory as inventory_lib
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


def reported_bytes(flags, strategy_flags, optimizer, mixed=None):
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


# Memory per device chosen so each registry model gets a different kind of plan.
RECOMMENDED_RUNS = {
    "mlp": (["--model=mlp", "--hidden_sizes=256,256", "--dataset=digits",
             "--global_batch_size=32"], "600KiB", "dtensor"),
    "cnn": (["--model=cnn", "--dataset=digits", "--global_batch_size=32"], "400KiB", "pipeline"),
    "resnet": (["--model=resnet", "--filters=8,16", "--dataset=digits",
                "--global_batch_size=32"], "512KiB", "mirrored"),
    "transformer": (["--model=transformer", "--dataset=text", "--seq_len=32",
                     "--global_batch_size=8"], "2.5MiB", "dtensor"),
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
    reported = json.loads(results.read_text())["param_bytes_per_device"]
    assert reported == plan["recommended"]["param_bytes_per_device"]


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


def test_plans_the_modes_refuse_are_not_recommended(capsys):
    """dtensor and pipeline refuse mixed_float16 (a dynamic loss scale): the planner says so."""
    assert cli.main(["plan", "--devices=4", "--memory_per_device=600KiB", "--model=mlp",
                     "--hidden_sizes=256,256", "--global_batch_size=32", "--dtype=mixed_float16",
                     "--json"]) == command.EXIT_NO_FIT
    answer = json.loads(capsys.readouterr().out)
    problems = {c["strategy"]: c["problem"] for c in answer["candidates"] if c["problem"]}
    assert problems == {"dtensor": "dtensor does not support mixed_float16 (use mixed_bfloat16)",
                        "pipeline": "pipeline does not support mixed_float16"}
