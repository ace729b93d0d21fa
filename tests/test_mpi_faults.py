"""--collective=mpi under `tfdist launch --mpi`: preemption and restarts as for the other
collectives, with real Open MPI ranks and real signals.

- SIGTERM to the launcher reaches the ranks (not mpirun, which would abort the job
  and exit 1): they agree on a step, save one checkpoint and exit 4, which mpirun
  and the launcher report; the same command then resumes and finishes exactly like
  the uninterrupted run (per-step losses and the final checkpoint's tensors).
- A rank SIGKILLed under --max_restarts 1: mpirun ends the job, the launcher
  restarts it, and it resumes from the last checkpoint, exactly.
- A rank stopped mid-run (SIGSTOP, so mpirun sees nothing): the other rank ends
  with exit 3 within --collective_timeout, and the launcher leaves nothing behind.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import REPO
from test_mpi import mpi_unavailable
from test_multi_worker_failures import wait_for_text
from test_restart import checkpoint_tensors
from tfdist.launch import mpirun as launch_mpirun
from tfdist.errors import EXIT_CLUSTER_ERROR, EXIT_PREEMPTED

pytestmark = pytest.mark.skipif(mpi_unavailable() is not None, reason=str(mpi_unavailable()))
STEPS = 1200    # a SIGTERM sent at step 100 landed at 137 here; about 2 ms a step, so 1,000 steps of slack
FLAGS = ["--strategy=multi_worker_mirrored", "--collective=mpi", "--model=mlp",
         "--optimizer=adam", "--global_batch_size=32", "--seed=3", f"--train_steps={STEPS}",
         "--checkpoint_every=40", "--log_every=10"]


def start(model_dir, results, log_path, *launch_flags, extra=()):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    return subprocess.Popen(
        [sys.executable, "-m", "tfdist.launch", "--mpi", "--workers", "2", *launch_flags, "--",
         sys.executable, "-m", "experiments.train", *FLAGS, *extra, f"--model_dir={model_dir}",
         f"--results_json={results}"],
        cwd=REPO, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def finish(process, log_path, timeout=300):
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"the launch did not end:\n{log_path.read_text()[-3000:]}")


def mpi_rank_pids(launcher_pid):
    """rank -> pid of the ranks under the launcher's mpirun (its child's session)."""
    children = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True,
                              text=True).stdout.split()
    found = {}
    for child in children:
        for pid in launch_mpirun.session_members(int(child)) or []:
            try:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            ranks = [e for e in environ if e.startswith(b"OMPI_COMM_WORLD_RANK=")]
            if ranks:
                found[int(ranks[0].split(b"=")[1])] = pid
    return found


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("mpi_reference")
    process = start(out / "run", out / "results.json", out / "log")
    assert finish(process, out / "log") == 0, (out / "log").read_text()[-3000:]
    return json.loads((out / "results.json").read_text()), checkpoint_tensors(out / "run")


def assert_resumed_exactly(model_dir, results_path, uninterrupted):
    reference, reference_tensors = uninterrupted
    resumed = json.loads(results_path.read_text())
    start_step = resumed["start_step"]
    assert 0 < start_step < STEPS and len(resumed["losses"]) == STEPS - start_step
    assert np.allclose(resumed["losses"], reference["losses"][start_step:], rtol=1e-6, atol=0)
    tensors = checkpoint_tensors(model_dir)
    assert reference_tensors and set(tensors) == set(reference_tensors)
    for name, tensor in reference_tensors.items():
        assert np.linalg.norm(tensors[name] - tensor) <= 1e-6 * max(np.linalg.norm(tensor), 1e-12), name
    return start_step


def test_sigterm_checkpoints_exits_4_and_the_rerun_resumes_exactly(tmp_path, uninterrupted):
    model_dir, results, log_path = tmp_path / "run", tmp_path / "results.json", tmp_path / "log"
    process = start(model_dir, results, log_path)
    wait_for_text(log_path, "step 100/", timeout=180, process=process)
    process.send_signal(signal.SIGTERM)
    assert finish(process, log_path) == EXIT_PREEMPTED, log_path.read_text()[-3000:]
    log = log_path.read_text()
    assert "mpirun exited with code 4" in log and "preempted (SIGTERM): saved a checkpoint" in log
    rerun = start(model_dir, results, tmp_path / "rerun.log")
    assert finish(rerun, tmp_path / "rerun.log") == 0, (tmp_path / "rerun.log").read_text()[-3000:]
    assert_resumed_exactly(model_dir, results, uninterrupted)


def test_killed_rank_restarts_the_job_and_it_resumes_exactly(tmp_path, uninterrupted):
    model_dir, results, log_path = tmp_path / "run", tmp_path / "results.json", tmp_path / "log"
    process = start(model_dir, results, log_path, "--max_restarts", "1")
    wait_for_text(log_path, "step 100/", timeout=180, process=process)
    os.kill(mpi_rank_pids(process.pid)[1], signal.SIGKILL)
    assert finish(process, log_path) == 0, log_path.read_text()[-3000:]
    assert "restart 1/1" in log_path.read_text()
    start_step = assert_resumed_exactly(model_dir, results, uninterrupted)
    assert start_step >= 80 and start_step % 40 == 0, start_step


def test_stopped_rank_ends_the_other_with_exit_3_and_nothing_is_left(tmp_path):
    log_path = tmp_path / "log"
    process = start(tmp_path / "run", tmp_path / "results.json", log_path,
                    extra=["--train_steps=100000", "--collective_timeout=10"])
    wait_for_text(log_path, "step 100/", timeout=180, process=process)
    ranks = mpi_rank_pids(process.pid)
    os.kill(ranks[1], signal.SIGSTOP)
    stopped = time.monotonic()
    code = finish(process, log_path, timeout=120)
    assert code == EXIT_CLUSTER_ERROR, log_path.read_text()[-3000:]
    assert time.monotonic() - stopped < 10 + 20
    # Two detectors end rank 0, both correct: tfdist's watchdog ("made no progress for
    # --collective_timeout=10 s") and TensorFlow's coordination service, whose heartbeat
    # loss aborts the collective ("stopped sending heartbeats") at about the same time.
    # Which one wins is a race: 3 of 7 runs here (2026-12-02) ended by heartbeat and failed
    # when this test asked for the watchdog's words; it had been marked a known defect after
    # two unread failures on a slower machine. Both endings tell users the same.
    log = log_path.read_text()
    assert "tfdist: cluster error: worker 0 of 2: a" in log, log[-3000:]
    assert ("made no progress for --collective_timeout=10 s: a peer died or stopped answering"
            in log or "a peer died or stopped answering during training" in log), log[-3000:]
    for pid in ranks.values():
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()
