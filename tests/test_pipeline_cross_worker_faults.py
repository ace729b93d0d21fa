"""Failures of a pipeline whose stages live in different workers (real processes).

- A stage worker killed mid-run: worker 0 (the driver) ends at once with exit 3,
  saying a stage worker died. Worker 0 killed: the stage workers find no status
  from it and end with exit 3. A stage worker stopped (SIGSTOP): worker 0 ends
  with exit 3 within --collective_timeout (its watchdog).
- Under `tfdist launch`: SIGTERM makes worker 0 save one checkpoint (it reads every
  stage from the workers that hold them) and every worker exit 4; the rerun
  resumes exactly. A stage worker SIGKILLed under --max_restarts 1: the group
  restarts and resumes exactly.
- Workers started with other flags than worker 0: exit 2 naming the flag.
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
from test_multi_worker_failures import free_ports, rank_pids, wait_for_text
from test_restart import checkpoint_tensors
from tfdist.errors import EXIT_CLUSTER_ERROR, EXIT_PREEMPTED

STEPS = 400
FLAGS = ["--strategy=pipeline", "--pipeline_stages=2", "--microbatches=4", "--model=mlp",
         "--optimizer=adam", "--global_batch_size=32", "--seed=3", "--log_every=10"]


def start_by_hand(tmp_path, *extra, command=None):
    """Two workers with their TF_CONFIG, no launcher (so each one's own exit shows):
    experiments.train with FLAGS and `extra`, or `command`."""
    command = command or [sys.executable, "-m", "experiments.train", *FLAGS,
                          "--train_steps=1000000", "--collective_timeout=10", *extra]
    ports = free_ports(2)
    workers, logs = [], []
    for index in range(2):
        tf_config = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                "task": {"type": "worker", "index": index}})
        env = dict(os.environ, TF_CONFIG=tf_config, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
                   PYTHONUNBUFFERED="1")
        logs.append(tmp_path / f"w{index}.log")
        workers.append(subprocess.Popen(command, cwd=REPO, env=env,
                                        stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT))
    return workers, logs


def end_all(workers):
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGCONT)
            worker.kill()
            worker.wait(timeout=30)


@pytest.mark.parametrize("victim,how", [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP)],
                         ids=["stage worker killed", "driver killed", "stage worker stopped"])
def test_a_lost_worker_ends_the_others_with_exit_3(victim, how, tmp_path):
    workers, logs = start_by_hand(tmp_path)
    try:
        wait_for_text(logs[0], "step 100/", timeout=180)
        os.kill(workers[victim].pid, how)
        hit = time.monotonic()
        survivor = workers[1 - victim]
        assert survivor.wait(timeout=60) == EXIT_CLUSTER_ERROR, logs[1 - victim].read_text()[-3000:]
        assert time.monotonic() - hit < 10 + 20   # the timeout, and the machine's slack
        said = logs[1 - victim].read_text()
        if victim == 0:
            assert "worker 0, which drives the pipeline, ended without finishing" in said
        elif how == signal.SIGKILL:
            assert "a stage worker died or stopped answering" in said
        else:
            assert "made no progress for --collective_timeout=10 s" in said
        assert "Traceback" not in said
    finally:
        end_all(workers)


@pytest.mark.parametrize("when,waiting_on", [
    ("last_batch", "reading the trained weights from the stage workers"),
    ("epoch_end", "setting the stage optimizers' learning rate")])
def test_a_stage_worker_stopped_between_steps_ends_worker_0_within_the_timeout(
        when, waiting_on, tmp_path):
    """Worker 0 stops worker 1 itself, at an exact point outside the training steps, where
    it next reads or writes a stage's variables (tests/workers/stop_stage_worker.py).
    TensorFlow's remote reads have no deadline: unguarded, worker 0 waited there for good."""
    workers, logs = start_by_hand(tmp_path, command=[
        sys.executable, "tests/workers/stop_stage_worker.py", when, str(tmp_path)])
    try:
        wait_for_text(logs[0], "stopping worker 1", timeout=180)
        stopped = time.monotonic()
        assert workers[0].wait(timeout=60) == EXIT_CLUSTER_ERROR, logs[0].read_text()[-3000:]
        assert time.monotonic() - stopped < 10 + 20   # the timeout, and the machine's slack
        said = logs[0].read_text()
        assert f"{waiting_on} made no progress for --collective_timeout=10 s" in said, said[-3000:]
        assert "Traceback" not in said and "trained 3 epochs" not in said
    finally:
        end_all(workers)


def launch(model_dir, results, log_path, *launch_flags, extra=(), workers=2, steps=STEPS):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.Popen(
        [sys.executable, "-m", "tfdist.launch", "--workers", str(workers), *launch_flags, "--",
         sys.executable, "-m", "experiments.train", *FLAGS, f"--train_steps={steps}",
         "--checkpoint_every=40", f"--model_dir={model_dir}", f"--results_json={results}", *extra],
        cwd=REPO, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def finish(process, log_path, timeout=400):
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"the launch did not end:\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_reference")
    process = launch(out / "run", out / "results.json", out / "log")
    assert finish(process, out / "log") == 0, (out / "log").read_text()[-3000:]
    return json.loads((out / "results.json").read_text()), checkpoint_tensors(out / "run")


def assert_resumed_exactly(model_dir, results_path, uninterrupted, rtol=1e-6):
    reference, reference_tensors = uninterrupted
    resumed = json.loads(results_path.read_text())
    start = resumed["start_step"]
    assert 0 < start < STEPS and len(resumed["losses"]) == STEPS - start
    assert np.allclose(resumed["losses"], reference["losses"][start:], rtol=rtol, atol=0)
    tensors = checkpoint_tensors(model_dir)
    assert reference_tensors and set(tensors) == set(reference_tensors)
    for name, tensor in reference_tensors.items():
        assert np.linalg.norm(tensors[name] - tensor) <= rtol * max(np.linalg.norm(tensor), 1e-12), name
    return start


def test_sigterm_checkpoints_every_stage_exits_4_and_the_rerun_resumes_exactly(tmp_path, uninterrupted):
    model_dir, results, log_path = tmp_path / "run", tmp_path / "results.json", tmp_path / "log"
    # The launcher's default 5 s grace, as users run it: it covers worker 0's checkpoint and
    # the serving worker's end right after (it once waited 3 s more and was SIGKILLed).
    process = launch(model_dir, results, log_path)
    wait_for_text(log_path, "step 100/", timeout=180)
    process.send_signal(signal.SIGTERM)
    assert finish(process, log_path) == EXIT_PREEMPTED, log_path.read_text()[-3000:]
    log = log_path.read_text()
    assert "preempted (SIGTERM): saved a checkpoint" in log
    assert "worker 1 of 2: worker 0 ended with status 4" in log
    rerun = launch(model_dir, results, tmp_path / "rerun.log")
    assert finish(rerun, tmp_path / "rerun.log") == 0, (tmp_path / "rerun.log").read_text()[-3000:]
    assert_resumed_exactly(model_dir, results, uninterrupted)


def test_killed_stage_worker_restarts_the_group_and_it_resumes_exactly(tmp_path, uninterrupted):
    model_dir, results, log_path = tmp_path / "run", tmp_path / "results.json", tmp_path / "log"
    process = launch(model_dir, results, log_path, "--max_restarts", "1")
    wait_for_text(log_path, "step 100/", timeout=180)
    os.kill(rank_pids(process.pid)[1], signal.SIGKILL)
    assert finish(process, log_path) == 0, log_path.read_text()[-3000:]
    assert "restart 1/1" in log_path.read_text()
    start = assert_resumed_exactly(model_dir, results, uninterrupted)
    assert start >= 80 and start % 40 == 0, start


def test_a_checkpoint_of_2_stage_workers_resumes_on_4(tmp_path, uninterrupted):
    """Saved by 2 workers as 2 stages, resumed by 4 workers as 4 stages: the checkpoint
    holds every stage's state by variable, not by stage (pipeline/checkpoint.py)."""
    model_dir, results = tmp_path / "run", tmp_path / "results.json"
    first = launch(model_dir, results, tmp_path / "first.log", steps=120)
    assert finish(first, tmp_path / "first.log") == 0, (tmp_path / "first.log").read_text()[-3000:]
    second = launch(model_dir, results, tmp_path / "second.log", workers=4,
                    extra=["--pipeline_stages=4"])
    assert finish(second, tmp_path / "second.log") == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "second.log").read_text()
    assert assert_resumed_exactly(model_dir, results, uninterrupted, rtol=1e-5) == 120


def test_workers_started_with_other_flags_are_refused_naming_the_flag(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    command = ('exec "$0" -m experiments.train --strategy=pipeline --pipeline_stages=2 '
               '--microbatches=4 --model=mlp --train_steps=5 --learning_rate=0.$((TFDIST_RANK + 1))')
    result = subprocess.run([sys.executable, "-m", "tfdist.launch", "--workers", "2", "--",
                             "sh", "-c", command, sys.executable], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    assert ("worker 1 (127.0.0.1:" in result.stderr and "was started with other flags than worker 0: "
            "learning_rate=0.2 there, 0.1 on worker 0" in result.stderr), result.stderr[-3000:]


def test_a_serving_worker_ends_at_the_first_shut_port_only_after_worker_0s_preemption_status():
    """wait_until_gone on a real port that nothing listens on: with worker 0's preemption
    status (its last word) it returns at the first failed connection, well inside the
    launcher's 5 s grace; without it, only after the port has stayed shut for 3 s (one
    failed connection on a loaded machine is not an end)."""
    from tfdist.parallel.pipeline import cluster as pipeline_cluster
    address = f"127.0.0.1:{free_ports(1)[0]}"
    started = time.monotonic()
    pipeline_cluster.wait_until_gone(address, preempted=lambda: True)
    after_preemption = time.monotonic() - started
    started = time.monotonic()
    pipeline_cluster.wait_until_gone(address, preempted=lambda: False)
    without_status = time.monotonic() - started
    assert after_preemption < pipeline_cluster.GONE_AFTER_SECONDS, after_preemption
    assert without_status >= pipeline_cluster.GONE_AFTER_SECONDS, without_status
