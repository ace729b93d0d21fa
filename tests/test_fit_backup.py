"""Keras fit with BackupAndRestore under multi_worker_mirrored, through a crash and restart."""

import json
import os
import subprocess
import sys

import keras
import numpy as np

from helpers import REPO, small_config
from tfdist.config import ModelConfig
from tfdist.testing import equivalence
from tfdist.train import keras_fixes

STEPS = 30
CRASH_AFTER = 12


def test_fit_resumes_after_all_workers_crash(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
               TFDIST_FAILPOINT=f"fit_epoch_end:{CRASH_AFTER}")
    results = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--max_restarts", "1", "--",
         sys.executable, "-m", "experiments.train", "--strategy=multi_worker_mirrored",
         "--trainer=fit", "--model=mlp", "--optimizer=sgd", "--global_batch_size=32",
         "--seed=2", f"--train_steps={STEPS}", f"--model_dir={tmp_path / 'run'}",
         f"--results_json={results}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "restart 1/1" in result.stdout + result.stderr
    resumed = json.loads(results.read_text())
    assert resumed["start_step"] == CRASH_AFTER
    reference = equivalence.train(small_config(model=ModelConfig(name="mlp"), optimizer="sgd",
                                               seed=2, train_steps=STEPS), "default loop")
    candidate = equivalence.Record("resumed fit", resumed["losses"], None)   # losses only
    tail = equivalence.Record("default loop", reference.losses[CRASH_AFTER:], None)
    assert not equivalence.loss_mismatches(tail, candidate)


def test_non_chief_backup_writes_nothing(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.zeros((4, 2)), np.zeros((4, 1)), verbose=0,
              callbacks=[keras_fixes.ChiefOnlyBackupAndRestore(str(tmp_path / "b"),
                                                               is_chief=False)])
    assert not (tmp_path / "b").exists()
    model.fit(np.zeros((4, 2)), np.zeros((4, 1)), verbose=0,
              callbacks=[keras_fixes.ChiefOnlyBackupAndRestore(
                  str(tmp_path / "c"), is_chief=True, delete_checkpoint=False)])
    assert keras_fixes.backed_up_epoch(str(tmp_path / "c")) == 1
