"""Gradient accumulation under dtensor (its own process: see conftest's DTENSOR): each
micro-batch holds 1/K of every device's shard (dtensor/step.py micro_batches), on a
batch=4 mesh and on batch=2 x model=2 with layout="auto"; keras-io's token + arange
position tables under Adam with global_clipnorm, 8 steps against one device at the same
global batch within 1e-5."""

import pytest

import keras_io_models
from test_keras_io_dtensor import MESHES, one_device
from tfdist.testing import equivalence

pytestmark = pytest.mark.dtensor


@pytest.mark.parametrize("mesh", list(MESHES))
def test_dtensor_accumulates_like_one_device(mesh):
    case = "text:adam_clip"
    build, x, y, fit_kwargs = keras_io_models.case(*case.split(":"))
    run = equivalence.train_keras("dtensor", build, x, y, fit_kwargs=fit_kwargs,
                                  label=f"dtensor {mesh} K=2", simulate_devices=4,
                                  accumulation_steps=2, **MESHES[mesh])
    report = equivalence.compare_runs(one_device(case), run)
    assert len(run.losses) == 8
    assert report.equivalent, f"{case} on {mesh}: {report}"

