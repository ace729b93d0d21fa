"""Fault tolerance: exact resume after SIGTERM, a crash mid-save, a corrupt checkpoint.

Every run is the real CLI in a subprocess; "exact" means the resumed run's
per-step losses after the checkpoint step, and its final checkpoint's tensors,
equal the uninterrupted run's within 1e-6 relative.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from helpers import REPO, run_cli
from tfdist.errors import EXIT_PREEMPTED, EXIT_USAGE_ERROR

RTOL = 1e-6
# The uninterrupted reference's length. A SIGTERM sent once "step 20/" is in the log landed
# at steps 25-46 here (mlp, batch 32: about a millisecond a step), so a reference of 60 steps
# left a loaded machine 14 steps of slack; 300 costs a fraction of a second.
STEPS = 300
FLAGS = ["--strategy=default", "--simulate_devices=0", "--model=mlp", "--optimizer=adam",
         "--global_batch_size=32", "--seed=3", "--log_every=10"]


def train(model_dir, steps, *extra, env=None):
    results = os.path.join(model_dir + ".json")
    result = run_cli([*FLAGS, f"--train_steps={steps}", f"--model_dir={model_dir}",
                      f"--results_json={results}", *extra], env=env)
    loaded = json.load(open(results)) if os.path.exists(results) else None
    return result, loaded


def final_tensors(model_dir):
    with open(os.path.join(model_dir, "checkpoints.json")) as f:
        newest = json.load(f)["checkpoints"][-1]
    reader = tf.train.load_checkpoint(os.path.join(model_dir, newest))
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(
        os.path.join(model_dir, newest)) if "OPTIMIZER_SLOT" in name or "/.ATTRIBUTES" in name}


def assert_same_tensors(a, b):
    assert a.keys() == b.keys() and a
    for name in a:
        ref, got = np.asarray(a[name], np.float64), np.asarray(b[name], np.float64)
        assert np.linalg.norm(got - ref) <= RTOL * max(np.linalg.norm(ref), 1e-12), name


def assert_resumed_exactly(reference, resumed):
    start = resumed["start_step"]
    assert start > 0 and len(resumed["losses"]) == reference["steps"] - start
    expected = reference["losses"][start:]
    assert np.allclose(resumed["losses"], expected, rtol=RTOL, atol=0), (resumed["losses"][:3],
                                                                       expected[:3])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("reference") / "run")
    result, results = train(model_dir, STEPS, "--checkpoint_every=10")
    assert result.returncode == 0, result.stderr[-2000:]
    return results, final_tensors(model_dir)


def test_sigterm_saves_at_a_step_boundary_and_resume_is_exact(tmp_path, uninterrupted):
    model_dir = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    log_path = tmp_path / "log"
    # Enough steps that SIGTERM lands mid-run; --train_steps differs only in when it ends.
    process = subprocess.Popen(
        [sys.executable, "-m", "experiments.train", *FLAGS, "--train_steps=100000",
         f"--model_dir={model_dir}", "--log_every=5"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))
    deadline = time.monotonic() + 90
    while "step 20/" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == EXIT_PREEMPTED
    assert "preempted (SIGTERM): saved a checkpoint at step" in log_path.read_text()
    saved = json.load(open(os.path.join(model_dir, "checkpoints.json")))["checkpoints"][-1]
    assert 20 <= int(saved.split("-")[1]) < STEPS, saved
    # The same command again (here: with the reference's STEPS) resumes.
    result, resumed = train(model_dir, STEPS)
    assert result.returncode == 0, result.stderr[-2000:]
    reference, reference_tensors = uninterrupted
    assert_resumed_exactly(reference, resumed)
    assert_same_tensors(reference_tensors, final_tensors(model_dir))


def test_crash_during_a_save_keeps_the_previous_checkpoint(tmp_path, uninterrupted):
    model_dir = str(tmp_path / "run")
    crashed, _ = train(model_dir, STEPS, "--checkpoint_every=10",
                       env={"TFDIST_FAILPOINT": "crash_before_commit:30"})
    assert crashed.returncode == 9
    assert json.load(open(os.path.join(model_dir, "checkpoints.json")))["checkpoints"][-1] == \
        "ckpt-20"
    result, resumed = train(model_dir, STEPS, "--checkpoint_every=10")
    assert result.returncode == 0 and resumed["start_step"] == 20
    assert_resumed_exactly(uninterrupted[0], resumed)


def test_corrupt_newest_checkpoint_is_named_and_skipped(tmp_path, uninterrupted):
    model_dir = str(tmp_path / "run")
    first, _ = train(model_dir, 30, "--checkpoint_every=10")
    assert first.returncode == 0
    data_file = os.path.join(model_dir, "ckpt-30.data-00000-of-00001")
    with open(data_file, "r+b") as f:
        f.truncate(os.path.getsize(data_file) // 2)
    result, resumed = train(model_dir, STEPS, "--checkpoint_every=10")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ckpt-30 is unusable" in result.stderr and resumed["start_step"] == 20
    assert_resumed_exactly(uninterrupted[0], resumed)


def test_every_checkpoint_corrupt_is_an_error_not_a_silent_restart(tmp_path):
    model_dir = str(tmp_path / "run")
    assert train(model_dir, 20, "--checkpoint_every=10")[0].returncode == 0
    for name in os.listdir(model_dir):
        if ".data-" in name:
            open(os.path.join(model_dir, name), "wb").close()
    result, _ = train(model_dir, 30)
    assert result.returncode == EXIT_USAGE_ERROR
    assert "Refusing to start over" in result.stderr and "Traceback" not in result.stderr


def test_checkpoint_of_another_model_is_refused(tmp_path):
    model_dir = str(tmp_path / "run")
    assert train(model_dir, 10)[0].returncode == 0
    result, _ = train(model_dir, 20, "--hidden_sizes=64,32")
    assert result.returncode == EXIT_USAGE_ERROR
    assert "holds checkpoints of another run (model:" in result.stderr
