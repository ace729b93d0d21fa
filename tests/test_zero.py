"""--zero_stage: sharded data parallelism (ZeRO stages 1-3) under --strategy=dtensor.

Equivalence: every stage trains the transformer (an embedding: sparse gradients) like one
device, per-step losses and every final weight within 1e-5, on a batch-sharded mesh and on
the 2-D mesh (FSDP x tensor parallel), with Adam, AdamW under a learning-rate schedule and
SGD momentum (each stage with two of them, each pair of mesh and optimizer once); and with
accumulation and recomputation on, and across a checkpoint that changes mesh and stage.
Memory: each device's parameter, optimizer and gradient bytes are the ZeRO formula's
exactly, from the variables' own shards. Bad input: refused before the first step.
"""

import pytest

from tfdist.config import RunConfig
from tfdist.errors import UsageError
from tfdist.testing import equivalence

import keras_io_models
import test_dtensor as dtensor_cases   # the one-device references of these two modules
import test_keras_io_dtensor as keras_io_dtensor   # are cached per process
from helpers import run_cli
from test_keras_io_equivalence import assert_frozen_unchanged

pytestmark = pytest.mark.dtensor   # the DTensor process (conftest.DTENSOR says why)

BATCH_4 = ("batch=4,model=1", "data")
HYBRID = ("batch=2,model=2", "megatron")
# (stage, mesh, optimizer): each stage on both meshes, with two of the three optimizers;
# every mesh meets every optimizer once.
CASES = [(1, BATCH_4, "adam"), (1, HYBRID, "adamw_schedule"),
         (2, BATCH_4, "momentum"), (2, HYBRID, "adam"),
         (3, BATCH_4, "adamw_schedule"), (3, HYBRID, "momentum")]


def adamw_with_schedule():
    import keras
    schedule = keras.optimizers.schedules.CosineDecay(
        1e-2, decay_steps=dtensor_cases.STEPS, warmup_target=2e-2, warmup_steps=5)
    return keras.optimizers.AdamW(learning_rate=schedule, weight_decay=0.01)


def train(optimizer, strategy="default", mesh=BATCH_4, **fields):
    config = dtensor_cases.make_config(strategy, "transformer", "adam" if optimizer ==
                                       "adamw_schedule" else optimizer, *mesh, **fields)
    label = f"{strategy} {dict(fields)} {mesh[0]}"
    if optimizer == "adamw_schedule":
        return dtensor_cases.train_with_optimizer(config, adamw_with_schedule, label)
    return dtensor_cases.train(config, label)[0]


_references = {}


def reference(optimizer):
    if optimizer not in _references:
        _references[optimizer] = (dtensor_cases.reference("transformer", optimizer)[0]
                                  if optimizer != "adamw_schedule"
                                  else train("adamw_schedule"))
    return _references[optimizer]


@pytest.mark.parametrize("stage,mesh,optimizer", CASES,
                         ids=[f"stage {s}-{m[0]}-{o}" for s, m, o in CASES])
def test_every_stage_trains_like_one_device(stage, mesh, optimizer):
    got = train(optimizer, "dtensor", mesh, zero_stage=stage)
    assert len(got.losses) == dtensor_cases.STEPS
    equivalence.assert_equivalent(reference(optimizer), got)


def test_accumulation_and_recomputation_at_stage_2_train_like_one_device():
    """K=4 micro-batches (their gradient sum held in slices), every transformer block
    recomputed: one update per global batch, as one device at it."""
    got = train("adam", "dtensor", HYBRID, zero_stage=2, accumulation_steps=4, remat="full")
    equivalence.assert_equivalent(reference("adam"), got)


def test_recomputation_at_stage_3_trains_like_one_device():
    got = train("adam", "dtensor", BATCH_4, zero_stage=3, remat="full")
    equivalence.assert_equivalent(reference("adam"), got)


def test_accumulation_at_stage_3_is_refused_naming_stage_2():
    from tfdist import parallel
    with pytest.raises(UsageError, match=r"--zero_stage=3 with --accumulation_steps=4 .*"
                                         r"Use --zero_stage=2"):
        parallel.build_parallelism(dtensor_cases.make_config(
            "dtensor", "transformer", "adam", *BATCH_4, zero_stage=3, accumulation_steps=4))


@pytest.mark.parametrize("case", ["text:adam_clip", "timeseries:adam", "frozen:adam"])
def test_keras_io_patterns_at_stage_3_train_like_one_device(case):
    """keras-io's token + position tables under global_clipnorm (the norm of gradients
    held in slices), a Conv1D + BatchNormalization net (a convolution's parameters stay
    whole, said in the log; the moving statistics too) and frozen layers (bit-identical
    after training), parameters sharded over batch=4."""
    build, x, y, fit_kwargs = keras_io_models.case(*case.split(":"))
    run = equivalence.train_keras("dtensor", build, x, y, fit_kwargs=fit_kwargs,
                                  label="dtensor batch=4 zero_stage=3", simulate_devices=4,
                                  mesh="batch=4", zero_stage=3)
    report = equivalence.compare_runs(keras_io_dtensor.one_device(case), run)
    assert report.equivalent, f"{case}: {report}"
    if case.startswith("frozen"):
        assert_frozen_unchanged(run, "batch=4 zero_stage=3")


# ---- memory: the ZeRO formula, from the variables' own shards ---------------------------

def bytes_per_device(stage, mesh=BATCH_4):
    mode, model, optimizer = dtensor_cases.build(dtensor_cases.make_config(
        "dtensor", "transformer", "adam", *mesh, zero_stage=stage))
    params = sum(v.value.dtype.size * v.shape.num_elements() for v in model.variables)
    state = set(mode.param_bytes_per_device(model, optimizer).values())
    gradients = set(mode.gradient_bytes_per_device(model).values())
    assert len(state) == len(gradients) == 1, (state, gradients)   # every device alike
    return params, state.pop(), gradients.pop()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_device_holds_the_zero_formulas_bytes(stage):
    """Adam in float32: 4 bytes of parameter, 4 of gradient and 8 of optimizer state per
    parameter (the paper's 2 + 2 + K with float32's sizes). On batch=4 every variable of the
    transformer has a dimension 4 divides, so the shares are exact: N = 4 for what the stage
    shards, 1 for the rest; iterations and learning_rate (12 bytes) stay replicated."""
    params, state, gradients = bytes_per_device(stage)
    def share(sharded_from_stage):
        return 4 if stage >= sharded_from_stage else 1
    assert state == params // share(3) + 2 * params // share(1) + 12
    assert gradients == params // share(2)


def test_the_2d_mesh_shards_what_tensor_parallelism_left_over_batch_too():
    """batch=2,model=2: stage 3 holds about half of stage 0's bytes (what the megatron
    layout already split over `model`, split again over `batch`); the few biases already
    split over `model` with no dimension left stay replicated over `batch` (announced)."""
    _, stage_0, _ = bytes_per_device(0, HYBRID)
    _, stage_3, _ = bytes_per_device(3, HYBRID)
    assert abs(stage_3 / (stage_0 / 2) - 1) < 0.05, (stage_0, stage_3)


def test_the_benchmarks_bytes_are_the_formulas():
    """benchmarks/zero.py's table: exact on batch=4; on batch=2,model=2 the few biases
    that only `model` splits stay whole over `batch` (within 1%)."""
    from benchmarks import zero as zero_benchmark
    rows = zero_benchmark.measure_bytes()
    assert len(rows) == 8
    for row in rows:
        bound = 0 if row["mesh"].startswith("batch=4") else 0.01
        assert abs(row["total / formula"] - 1) <= bound, row


# ---- checkpoints: resume onto another mesh and stage -------------------------------------

def test_a_stage_3_checkpoint_resumes_on_another_mesh_at_stage_1(tmp_path):
    run_dir = str(tmp_path / "run")
    straight = reference("adam")
    train("adam", "dtensor", BATCH_4, zero_stage=3, train_steps=10, model_dir=run_dir)
    resumed = train("adam", "dtensor", HYBRID, zero_stage=1, model_dir=run_dir)
    assert len(resumed.losses) == dtensor_cases.STEPS - 10
    equivalence.assert_equivalent(
        equivalence.Record("uninterrupted", straight.losses[10:], straight.weights), resumed)


# ---- bad input: a UsageError before any device is set up ----------------------------------

@pytest.mark.parametrize("strategy", ["mirrored", "multi_worker_mirrored", "pipeline",
                                      "default"])
def test_a_mode_without_sharded_data_parallelism_refuses_a_stage(strategy):
    from tfdist import parallel
    config = RunConfig(strategy=strategy, zero_stage=2)
    with pytest.raises(UsageError, match=rf"--zero_stage=2 is not supported by "
                                         rf"--strategy={strategy}.*--strategy=dtensor"):
        parallel.build_parallelism(config)


@pytest.mark.parametrize("value", [4, -1, True, "2"])
def test_an_unknown_stage_names_the_valid_ones(value):
    with pytest.raises(UsageError, match=r"Unknown --zero_stage .*Valid choices: 0, 1, 2, 3"):
        RunConfig(strategy="dtensor", zero_stage=value)


def test_a_mesh_without_a_batch_axis_to_shard_over_is_refused():
    from tfdist import parallel
    with pytest.raises(UsageError, match=r"batch axis, which has size 1"):
        parallel.build_parallelism(dtensor_cases.make_config(
            "dtensor", "transformer", "adam", "batch=1,model=4", "megatron", zero_stage=1))


def test_the_flag_refuses_a_mode_before_tensorflow_trains():
    result = run_cli(["--strategy=mirrored", "--zero_stage=1", "--train_steps=1"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--zero_stage=1 is not supported by --strategy=mirrored" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_python_api_names_its_own_arguments():
    import tfdist
    with pytest.raises(UsageError, match=r"zero_stage=3 is not supported by "
                                         r"strategy='mirrored'.*strategy='dtensor'"):
        tfdist.Strategy("mirrored", zero_stage=3)
