"""keras-io's guide "Multi-GPU distributed training with TensorFlow", its
get_compiled_model() and get_dataset() (examples/keras_io_guide.py: offline data of
MNIST's shapes), trained through the public API under mirrored, 2 workers launched
by `tfdist launch`, and pipeline (dtensor: tests/test_keras_api_dtensor.py): every
step's loss and the final weights equal one device's."""

import functools
import os
import subprocess
import sys

import pytest

from helpers import REPO
from tfdist.testing import equivalence

sys.path.insert(0, os.path.join(REPO, "examples"))
import keras_io_guide  # noqa: E402

EPOCHS = 1


@functools.lru_cache(maxsize=None)
def guide_run(mode: str) -> equivalence.Record:
    strategy, model, _, results = keras_io_guide.main(mode, EPOCHS)
    assert len(results) == 2   # loss, sparse_categorical_accuracy
    return equivalence.Record(mode, list(strategy.last_result.losses), model.get_weights())


@pytest.mark.parametrize("mode", ["mirrored", "pipeline"])
def test_the_guide_trains_like_one_device(mode):
    reference = guide_run("default")
    assert len(reference.losses) == keras_io_guide.TRAIN_EXAMPLES // keras_io_guide.GUIDE_BATCH
    equivalence.assert_equivalent(reference, guide_run(mode))


def test_the_guide_on_two_launched_workers_trains_like_one_device(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    record = str(tmp_path / "guide")
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--", sys.executable,
         "examples/keras_io_guide.py", "multi_worker_mirrored", str(EPOCHS), record],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reference = guide_run("default")
    for rank in (0, 1):
        saved = equivalence.load_weights(f"{record}.rank{rank}.npz")
        candidate = equivalence.Record(f"2 workers rank {rank}", list(saved[0]), saved[1:])
        equivalence.assert_equivalent(reference, candidate)
