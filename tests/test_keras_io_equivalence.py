"""tfdist's guarantee on models of the shapes keras-io's examples write
(tests/keras_io_models.py), which its own registry models never had:

- a position table looked up with ops.arange beside a token table, under Adam, with and
  without global_clipnorm: each replica, worker and micro-batch holds the same position
  rows, which must add up row by row (tfdist/train/sparse_rows.py); before, mirrored
  ended 44% off one device;
- Conv1D + BatchNormalization, and a masked BatchNormalization after a padded Embedding:
  global batch statistics by default in the data-parallel modes
  (tfdist/train/batch_stats.py), refused by the pipeline's micro-batches;
- frozen layers (top-level, and inside a custom layer) stay bit-identical.

Every comparison: 8 steps, per-step losses and every replica's final weights within
1e-5 relative of one device. 2 launched workers over every CPU collective run in
test_two_workers_*.
"""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

import keras_io_models
from helpers import REPO
from test_mpi import mpi_unavailable
from tfdist.errors import UsageError
from tfdist.testing import equivalence

MODES = {
    "mirrored": dict(strategy="mirrored", simulate_devices=2),
    "pipeline_2x4": dict(strategy="pipeline", simulate_devices=2, pipeline_stages=2,
                         microbatches=4),
    "hybrid_2x2": dict(strategy="pipeline", simulate_devices=4, pipeline_stages=2,
                       microbatches=2),
}
CASES = ("text:adam", "text:adam_clip", "timeseries:adam", "frozen:adam")
# Launched workers train the clipped text case only (its rows are summed before the
# clip, which covers the unclipped path's sum too) to keep 5 launches short.
LAUNCHED_CASES = ("text:adam_clip", "timeseries:adam", "frozen:adam")
# tfdist's own collectives pack every gradient into one buffer: a float64 model's must
# be summed in float64 (TF's auto and ring keep each tensor's dtype themselves).
FLOAT64_CASE = "text64:adam"


def launched_cases(collective):
    return LAUNCHED_CASES + ((FLOAT64_CASE,) if collective in ("tcp", "shm", "mpi") else ())
_references = {}


def one_device(case: str) -> equivalence.KerasRun:
    if case not in _references:
        build, x, y, fit_kwargs = keras_io_models.case(*case.split(":"))
        _references[case] = equivalence.train_keras("default", build, x, y,
                                                    fit_kwargs=fit_kwargs)
    return _references[case]


def in_mode(case: str, mode: str, **extra) -> equivalence.KerasRun:
    build, x, y, fit_kwargs = keras_io_models.case(*case.split(":"))
    options = dict(MODES[mode], **extra)
    return equivalence.train_keras(options.pop("strategy"), build, x, y,
                                   fit_kwargs=fit_kwargs, label=mode, **options)


def initial_frozen_values():
    """The frozen variables' values at the start, in weight order (the same seed builds
    the same model)."""
    import keras
    keras.utils.set_random_seed(0)
    model = keras_io_models.frozen_base()
    return [np.array(v.numpy()) for v in keras_io_models.frozen_variables(model)]


def assert_frozen_unchanged(run, label=""):
    """Every replica's four frozen variables hold their initial values, bit for bit."""
    initial = initial_frozen_values()
    assert len(initial) == 4
    for replica, weights in run.replica_weights.items():
        final = frozen_values(run.paths, weights)
        assert len(final) == 4
        assert all(np.array_equal(a, b) for a, b in zip(final, initial)), f"{label} {replica}"


def frozen_values(paths, weights):
    return [w for path, w in zip(paths, weights) if path.endswith(keras_io_models.FROZEN_PATHS)]


def assert_exact(case, run):
    reference = one_device(case)
    assert len(reference.losses) == keras_io_models.STEPS
    report = equivalence.compare_runs(reference, run)
    assert report.equivalent, f"{case}: {report}"
    return report


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", ["text:adam", "text:adam_clip"])
def test_token_and_position_tables_train_like_one_device(case, mode):
    assert_exact(case, in_mode(case, mode))


@pytest.mark.parametrize("mode", list(MODES))
def test_frozen_layers_stay_bit_identical(mode):
    run = in_mode("frozen:adam", mode)
    assert_exact("frozen:adam", run)
    assert_frozen_unchanged(run, mode)


def test_batch_norm_trains_on_the_global_batch_under_mirrored(caplog):
    with caplog.at_level(logging.INFO, logger="tfdist"):
        report = assert_exact("timeseries:adam", in_mode("timeseries:adam", "mirrored"))
    assert "normalise by the global batch's statistics" in caplog.text
    # The conv biases that BatchNormalization cancels are announced, not compared.
    kinds = [(path.split("/")[0].rstrip("_0123456789"), path.split("/")[-1])
             for path in report.not_covered]
    assert kinds == [("conv1d", "bias"), ("batch_normalization", "moving_mean")] * 2
    assert "feeds only BatchNormalization" in caplog.text


def test_masked_batch_norm_trains_on_the_global_batch_under_mirrored():
    # The masked moments (batch_stats.global_moments' other branch): padded positions
    # count in no replica's sums.
    assert_exact("masked:adam", in_mode("masked:adam", "mirrored"))
    per_replica = in_mode("masked:adam", "mirrored", batch_statistics="per_replica")
    assert not equivalence.compare_runs(one_device("masked:adam"), per_replica).equivalent


def test_per_replica_batch_statistics_is_announced_and_differs(caplog):
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        run = in_mode("timeseries:adam", "mirrored", batch_statistics="per_replica")
    assert "batch_statistics='per_replica'" in caplog.text and "not the one-device" in caplog.text
    assert not equivalence.compare_runs(one_device("timeseries:adam"), run).equivalent


@pytest.mark.parametrize("mode", ["pipeline_2x4", "hybrid_2x2"])
def test_the_pipeline_refuses_batch_norm_over_micro_batches(mode):
    with pytest.raises(UsageError, match="BatchNormalization .*batch_normalization"):
        in_mode("timeseries:adam", mode)


def test_sparse_rows_classification_reads_the_graph():
    """Rows from ops.arange are the same in every part; rows from the batch are not;
    a table looked up both ways is split into its two lookups."""
    import tensorflow as tf
    from tfdist.train import sparse_rows
    table = tf.Variable(tf.ones([10, 3]))

    @tf.function
    def grads(ids):
        with tf.GradientTape() as tape:
            both = tf.gather(table, ids) + tf.gather(table, tf.range(4))
            loss = tf.reduce_sum(both * both)
        gradient = tape.gradient(loss, table)
        kinds = [follows for follows, _ in sparse_rows.segments(gradient)]
        assert kinds == [True, False], kinds
        return tf.convert_to_tensor(gradient)

    grads(tf.constant([1, 2, 2, 5]))

    positions = tf.range(4)   # eager: the traced function captures it as a placeholder

    @tf.function
    def captured(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids)) + tf.reduce_sum(tf.gather(table, positions))
        gradient = tape.gradient(loss, table)
        kinds = [follows for follows, _ in sparse_rows.segments(gradient)]
        assert kinds == [True, False], kinds
        return tf.convert_to_tensor(gradient)

    captured(tf.constant([1, 2, 2, 5]))


def launch(collective, out_dir):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    mpi = ["--mpi"] if collective == "mpi" else []
    return subprocess.run(
        [sys.executable, "-m", "tfdist.launch", *mpi, "--workers", "2", "--", sys.executable,
         "tests/workers/keras_io_cases.py", collective, ",".join(launched_cases(collective)),
         str(out_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def worker_run(out_dir, case, rank, paths):
    stem = os.path.join(out_dir, f"{case.replace(':', '_')}.rank{rank}")
    with open(stem + ".json") as f:
        record = json.load(f)
    arrays = equivalence.load_weights(stem + ".npz")
    frozen = record["frozen_count"]
    weights, initial = arrays[:len(arrays) - frozen], arrays[len(arrays) - frozen:]
    run = equivalence.KerasRun(f"2 workers rank {rank}", record["losses"],
                               {f"rank {rank}": weights}, paths, record["batch_logs"],
                               record["epoch_logs"], [])
    return run, initial


@pytest.mark.slow
@pytest.mark.parametrize("collective", [
    "auto", "ring", "tcp", "shm",
    pytest.param("mpi", marks=pytest.mark.skipif(mpi_unavailable() is not None,
                                                 reason=str(mpi_unavailable())))])
def test_two_workers_train_keras_io_models_like_one_device(collective, tmp_path):
    result = launch(collective, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for case in launched_cases(collective):
        reference = one_device(case)
        for rank in (0, 1):
            run, initial_frozen = worker_run(tmp_path, case, rank, reference.paths)
            report = equivalence.compare_runs(reference, run)
            assert report.equivalent, f"{case} over {collective}, rank {rank}: {report}"
            if case == FLOAT64_CASE:
                assert_float64_to_the_last_bits(reference, run)
            if case.startswith("frozen"):
                frozen = frozen_values(reference.paths, run.replica_weights[f"rank {rank}"])
                assert len(frozen) == len(initial_frozen) == 4
                assert all(np.array_equal(a, b) for a, b in zip(frozen, initial_frozen))


def assert_float64_to_the_last_bits(reference, run):
    """A float64 run's weights held to float64's precision: a gradient sum that passed
    through float32 would be off by about 1e-8 relative, far inside RTOL but far outside
    1e-12. (The losses tfdist records are float32: compared at RTOL by assert_exact.)"""
    expected = reference.record().weights
    for replica, weights in run.replica_weights.items():
        assert len(weights) == len(expected) > 0
        for got, want in zip(weights, expected):
            assert got.dtype == want.dtype
            # Not weight_mismatches: its absolute floor (ATOL, 1e-6) would pass float32's
            # rounding of these small updates. Relative to at least 1: the attention's
            # key bias is cancelled by the softmax and holds only rounding noise (1e-15).
            error = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0)
            assert error < 1e-12, (replica, error, got.shape)


def test_a_float64_model_trains_in_float64_under_mirrored():
    run = in_mode(FLOAT64_CASE, "mirrored")
    assert_exact(FLOAT64_CASE, run)
    assert_float64_to_the_last_bits(one_device(FLOAT64_CASE), run)


def test_position_rows_are_summed_under_jit_compile_too():
    """An XLA-compiled gradient is a nested function: its sparse rows' kind is read
    inside and carried out (sparse_rows.carry_kinds)."""
    assert_exact("text:adam", in_mode("text:adam", "mirrored", jit_compile=True))


def test_plain_keras_under_mirrored_strategy_has_the_defect_tfdist_fixes():
    """Upstream's figure for the docs (docs/equivalence.md, "The guarantee on the models you bring"):
    Keras 3.15's own fit under tf.distribute.MirroredStrategy on 2 devices concatenates
    the position table's rows, so Adam's update is not one device's. If this starts
    failing, upstream changed: update the figure in docs/equivalence.md."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "tests/workers/plain_keras_mirrored.py",
                             "text:adam"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"plain Keras, MirroredStrategy x2 vs one device after {figures['steps']} steps: "
          f"epoch loss {figures['loss_error']:.1e}, " + ", ".join(
              f"{name} {error:.1e}" for name, error in figures["embedding_errors"].items()))
    assert max(figures["embedding_errors"].values()) > 1e-3


DOCS_HEADING = "## The guarantee on the models you bring"   # docs/equivalence.md


def test_the_readme_example_runs_as_written(caplog):
    import pathlib
    import re
    text = (pathlib.Path(REPO) / "docs" / "equivalence.md").read_text()
    section = text.split(DOCS_HEADING, 1)[1].split("\n#", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    with caplog.at_level(logging.INFO, logger="tfdist"):
        namespace = {}
        exec(compile(blocks[0], "docs/equivalence.md", "exec"), namespace)
    assert "normalise by the global batch's statistics" in caplog.text
    assert namespace["strategy"].last_result.losses
