"""keras.distribution across processes on TensorFlow: 2 processes x 2 simulated CPUs
under `tfdist launch --dtensor`, each calling keras.distribution.initialize() and Keras'
own model.fit under DataParallel and ModelParallel; every process's per-step losses,
History and final weights equal one device's (within 1e-5 relative, float32).

The processes run in subprocesses; the one-device reference is Keras' own fit here
(no distribution), on the same model and data (tests/workers/keras_distribution_worker.py).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO
from tfdist.testing import equivalence

sys.path.insert(0, os.path.join(REPO, "tests", "workers"))
import keras_distribution_worker as worker  # noqa: E402

WORKERS = 2


class StepLosses:
    """Per-step losses from Keras' batch logs (running means over each epoch)."""

    def __init__(self):
        import keras

        class Callback(keras.callbacks.Callback):
            def on_epoch_begin(inner, epoch, logs=None):
                self.means.append([])

            def on_train_batch_end(inner, batch, logs=None):
                self.means[-1].append(float(logs["loss"]))

        self.means, self.callback = [], Callback()

    def losses(self):
        return [(k + 1) * m - k * (epoch[k - 1] if k else 0.0)
                for epoch in self.means for k, m in enumerate(epoch)]


@pytest.fixture(scope="module")
def one_device():
    import keras
    keras.distribution.set_distribution(None)
    model = worker.user_model()
    steps = StepLosses()
    history = worker.user_fit(model, [steps.callback])
    return equivalence.Record("one device", steps.losses(), model.get_weights()), history.history


@pytest.mark.parametrize("kind", ["data", "model"])
def test_two_processes_train_like_one_device(kind, one_device, tmp_path):
    prefix = str(tmp_path / kind)
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3",
               KERAS_BACKEND="tensorflow")
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.launch", "--workers", str(WORKERS),
         "--devices_per_worker", "2", "--dtensor", "--", sys.executable,
         os.path.join("tests", "workers", "keras_distribution_worker.py"), "multi_process",
         kind, prefix], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    reference, history = one_device
    for process in range(WORKERS):
        with open(f"{prefix}.{process}.json") as f:
            summary = json.load(f)
        assert summary["num_processes"] == WORKERS
        assert summary["devices"] == [f"cpu:{i}" for i in range(4)]   # every process's
        assert summary["mesh"] == ("batch=4,model=1" if kind == "data" else "batch=2,model=2")
        with np.load(f"{prefix}.{process}.npz") as saved:
            weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        equivalence.assert_equivalent(reference, equivalence.Record(
            f"process {process}", summary["losses"], weights))
        for key, values in history.items():
            np.testing.assert_allclose(summary["history"][key], values, rtol=1e-5)
