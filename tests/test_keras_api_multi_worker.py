"""The public API under multi_worker_mirrored: 2 real worker processes on loopback
(`tfdist launch`), users' own models (tests/user_models.py), over TF's collectives
(auto), tfdist's ring (tcp) and MPI (mpi: 2 Open MPI ranks under `tfdist launch --mpi`). Every worker's per-step losses, final weights and
callback logs equal one device's (1e-5); Keras' callbacks take the same decisions on
every worker (EarlyStopping's epoch, ReduceLROnPlateau's rate) and only the chief
leaves files (one set of checkpoints, one TensorBoard run, one CSV, one model)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import user_models
from helpers import REPO
from test_mpi import mpi_unavailable
from tfdist.testing import equivalence

CASES = ("softmax_weighted:adamw_cosine", "subclassed:sgd_nesterov", "softmax_weighted:rmsprop",
         "dict_regression:sgd_nesterov")  # the last one also runs the file-writing callbacks
# A pipeline cuts a functional model (a subclassed one is refused, tests/test_pipeline.py).
PIPELINE_CASES = ("softmax_weighted:adamw_cosine", "dict_regression:sgd_nesterov")


def launch(collective, out_dir, cases=CASES):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    mpi = ["--mpi"] if collective == "mpi" else []
    return subprocess.run(
        [sys.executable, "-m", "tfdist.launch", *mpi, "--workers", "2", "--", sys.executable,
         "tests/workers/keras_api_cases.py", collective, ",".join(cases), str(out_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def one_device_runs(tmp_path_factory):
    """case -> its one-device run, trained once for this module's tests (the same cases
    are compared over every collective and as a pipeline)."""
    files_dir, runs = tmp_path_factory.mktemp("one_device_files"), {}

    def run(case):
        if case not in runs:
            runs[case] = one_device(case, files_dir / case.replace(":", "_"))
        return runs[case]
    return run


def one_device(case, files_dir):
    name, optimizer = case.split(":")
    build, x, y, fit_kwargs = user_models.case(name, optimizer)
    callbacks = []
    if case in (CASES[-1], PIPELINE_CASES[-1]):   # the worker's last case runs the file callbacks
        fit_kwargs["epochs"] = user_models.CALLBACK_EPOCHS
        callbacks = user_models.file_callbacks(str(files_dir))
    fit_kwargs["callbacks"] = callbacks
    return equivalence.train_keras("default", build, x, y, fit_kwargs=fit_kwargs)


def worker_run(out_dir, case, rank, paths):
    stem = os.path.join(out_dir, f"{case.replace(':', '_')}.rank{rank}")
    with open(stem + ".json") as f:
        record = json.load(f)
    return record, equivalence.KerasRun(
        f"2 workers rank {rank}", record["losses"],
        {f"rank {rank}": equivalence.load_weights(stem + ".npz")}, paths,
        record["batch_logs"], record["epoch_logs"], [])


@pytest.mark.parametrize("collective", ["auto", "tcp", pytest.param("mpi", marks=pytest.mark.skipif(
    mpi_unavailable() is not None, reason=str(mpi_unavailable())))])
def test_two_workers_train_users_models_like_one_device(collective, tmp_path, one_device_runs):
    result = launch(collective, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for case in CASES:
        reference = one_device_runs(case)
        records = []
        for rank in (0, 1):
            record, run = worker_run(tmp_path, case, rank, reference.paths)
            report = equivalence.compare_runs(reference, run)
            assert report.equivalent, f"{case} over {collective}: {report}"
            records.append(record)
        assert records[0]["epochs"] == records[1]["epochs"]
        assert records[0]["learning_rate"] == records[1]["learning_rate"]
    # The callbacks case: EarlyStopping ended both workers after the 2nd of 4 epochs,
    # ReduceLROnPlateau halved the rate once (after the 2nd: the 1st is always "better").
    assert records[0]["epochs"] == 2 and records[0]["learning_rate"] == pytest.approx(0.025)
    files = tmp_path / "files"
    assert sorted(p.name for p in files.iterdir()) == [
        "ckpt_1.keras", "ckpt_2.keras", "final.keras", "log.csv", "tensorboard"]
    events = sorted(str(p.relative_to(files)) for p in (files / "tensorboard").rglob("*")
                    if p.is_file())
    assert len(events) == 2 and {e.split(os.sep)[1] for e in events} == {"train", "validation"}
    assert len((files / "log.csv").read_text().strip().splitlines()) == 1 + 2
    # The chief's .keras file, loaded by plain Keras here, predicts what both workers did.
    import keras
    import numpy as np
    x, _, _ = user_models.regression_arrays()
    loaded = keras.saving.load_model(str(files / "final.keras"))
    for rank in (0, 1):
        np.testing.assert_allclose(loaded.predict({k: v[:16] for k, v in x.items()}, verbose=0),
                                   np.load(tmp_path / f"predictions.rank{rank}.npy"),
                                   rtol=1e-6, atol=1e-7)


def test_users_models_train_as_a_pipeline_across_two_workers_like_one_device(tmp_path,
                                                                             one_device_runs):
    """tfdist.Strategy("pipeline") under `tfdist launch --workers 2`: a stage in each worker.
    Worker 1 serves its stage, and it must end with exit 0 after the user's close() (it used
    to end with 3: no run had told it the job finished). Worker 0's trained model, its
    stages read back from the worker that holds each, equals one device's."""
    result = launch("pipeline", tmp_path, PIPELINE_CASES)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "worker 0 ended with status 0" in result.stderr, result.stderr[-3000:]
    for case in PIPELINE_CASES:
        reference = one_device_runs(case)
        record, run = worker_run(tmp_path, case, 0, reference.paths)
        report = equivalence.compare_runs(reference, run)
        assert report.equivalent, f"{case} as a pipeline across 2 workers: {report}"
    assert (tmp_path / "files" / "final.keras").exists()


def keras_calls_worker():
    """tests/workers/keras_calls_worker.py as a module (its build, data and FIT)."""
    import importlib.util
    path = os.path.join(REPO, "tests", "workers", "keras_calls_worker.py")
    spec = importlib.util.spec_from_file_location("keras_calls_worker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_keras_own_calls_on_two_workers_run_tfdists_loop_and_a_usage_error_exits_2(tmp_path):
    """Keras' model.fit / evaluate / predict on a model built in the scope of
    tfdist.Strategy("multi_worker_mirrored") equal plain Keras on one device (History with
    validation_split and class_weight, final weights); then a batch_size the 2 replicas
    cannot split ends both workers with status 2 and one paragraph naming batch_size=127,
    and the launcher does not advise --max_restarts for it."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--", sys.executable,
         "tests/workers/keras_calls_worker.py", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "tfdist: error: batch_size=127 is not divisible by the 2 replicas" in output, output[-3000:]
    assert "usage error" in result.stderr and "--max_restarts" not in result.stderr, output[-3000:]
    assert "Traceback" not in output and "PerReplica" not in output and "unreachable" not in output
    worker = keras_calls_worker()
    x, y = worker.data()
    reference = worker.build()
    expected = reference.fit(x, y, **worker.FIT)
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as f:
            record = json.load(f)
        assert record["epoch"] == expected.epoch and len(record["losses"]) == 2 * 6
        for key, values in expected.history.items():
            np.testing.assert_allclose(record["history"][key], values, rtol=1e-5, err_msg=key)
        np.testing.assert_allclose(record["evaluate"], reference.evaluate(x, y, verbose=0),
                                   rtol=1e-5)
        problems = equivalence.weight_mismatches(
            equivalence.Record("one device", [], reference.get_weights()),
            equivalence.Record(f"rank {rank}", [], equivalence.load_weights(
                str(tmp_path / f"rank{rank}.npz"))))
        assert not problems, problems
        np.testing.assert_allclose(np.load(tmp_path / f"predictions{rank}.npy"),
                                   reference.predict(x[:16], verbose=0), rtol=1e-5, atol=1e-7)
