"""A worker SIGKILLed under `tfdist launch --max_restarts 1`: the group restarts, resumes
from the chief's last checkpoint, and finishes exactly like an uninterrupted run."""

import collections
import json
import os
import signal
import subprocess
import sys

import numpy as np
import tensorflow as tf

from helpers import REPO
from test_multi_worker_failures import rank_pids, wait_for_text
from tfdist import data
from tfdist.config import DataConfig
from tfdist.data import pipeline

STEPS = 900
BATCH = 32
SEED = 3
FLAGS = ["--model=mlp", "--optimizer=adam", f"--global_batch_size={BATCH}", f"--seed={SEED}",
         f"--train_steps={STEPS}", "--checkpoint_every=40", "--log_every=10"]


def checkpoint_tensors(model_dir):
    newest = json.loads((model_dir / "checkpoints.json").read_text())["checkpoints"][-1]
    reader = tf.train.load_checkpoint(str(model_dir / newest))
    return {name: np.asarray(reader.get_tensor(name), np.float64)
            for name, _ in tf.train.list_variables(str(model_dir / newest))
            if name.endswith(".ATTRIBUTES/VARIABLE_VALUE")}


def examples_of_steps(first, last, start_step, workers=2):
    """Digits seen in global steps first..last by a job (re)started at start_step."""
    source = data.get_source(DataConfig(name="digits"))
    fn = pipeline.train_dataset_fn(source, BATCH, SEED, DataConfig(), start_step=start_step)
    streams = [iter(fn(tf.distribute.InputContext(workers, w, workers))) for w in range(workers)]
    seen = collections.Counter()
    for step in range(start_step + 1, last + 1):
        batches = [next(s) for s in streams]
        if step >= first:
            seen.update((x.numpy().tobytes(), int(y)) for xb, yb in batches for x, y in zip(xb, yb))
    return seen


def launch(model_dir, results, log_path):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.Popen(
        [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--max_restarts", "1", "--",
         sys.executable, "-m", "experiments.train", "--strategy=multi_worker_mirrored",
         f"--model_dir={model_dir}", f"--results_json={results}", *FLAGS],
        cwd=REPO, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def test_killed_worker_restarts_the_group_and_resumes_exactly(tmp_path):
    # The uninterrupted run, same command: over 1500 adam steps one device would
    # drift from 2 workers by float rounding (~1e-6), so compare like with like.
    uninterrupted = launch(tmp_path / "ref", tmp_path / "ref.json", tmp_path / "ref.log")
    assert uninterrupted.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    reference = json.loads((tmp_path / "ref.json").read_text())

    model_dir, results = tmp_path / "run", tmp_path / "results.json"
    log_path = tmp_path / "launch.log"
    launcher = launch(model_dir, results, log_path)
    try:
        wait_for_text(log_path, "step 100/", timeout=120)
        os.kill(rank_pids(launcher.pid)[1], signal.SIGKILL)
        assert launcher.wait(timeout=300) == 0, log_path.read_text()[-3000:]
    finally:
        launcher.kill()
    log = log_path.read_text()
    assert "restart 1/1" in log
    resumed = json.loads(results.read_text())
    start = resumed["start_step"]
    assert start >= 80 and start % 40 == 0, start

    assert np.allclose(resumed["losses"], reference["losses"][start:], rtol=1e-6, atol=0)
    for name, tensor in checkpoint_tensors(tmp_path / "ref").items():
        got = checkpoint_tensors(model_dir)[name]
        assert np.linalg.norm(got - tensor) <= 1e-6 * max(np.linalg.norm(tensor), 1e-12), name

    # Count them: over the epoch the restart fell in, every digit is trained once.
    steps_per_epoch = 1440 // BATCH
    epoch_first = (start // steps_per_epoch) * steps_per_epoch + 1
    epoch_last = epoch_first + steps_per_epoch - 1
    before = examples_of_steps(epoch_first, start, start_step=0)
    after = examples_of_steps(start + 1, epoch_last, start_step=start)
    everything = collections.Counter((x.numpy().tobytes(), int(y)) for x, y in
                                     data.get_source(DataConfig(name="digits")).examples("train"))
    assert before + after == everything
