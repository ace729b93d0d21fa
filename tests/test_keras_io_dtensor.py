"""The keras-io-shaped models of tests/keras_io_models.py under dtensor (batch=4, and
batch=2 x model=2 with layout="auto"): the token + arange position tables under Adam
(with and without global_clipnorm), Conv1D + BatchNormalization, and frozen layers,
which stay bit-identical. DTensor runs one SPMD program over the whole batch, so the
sparse rows and the batch statistics are one device's by construction; this holds it."""

import functools

import pytest

import keras_io_models
from test_keras_io_equivalence import assert_frozen_unchanged
from tfdist.testing import equivalence

pytestmark = pytest.mark.dtensor

MESHES = {"batch=4": dict(mesh="batch=4", layout="data"),
          "batch=2,model=2": dict(mesh="batch=2,model=2", layout="auto")}


@functools.lru_cache(maxsize=None)
def one_device(case):
    build, x, y, fit_kwargs = keras_io_models.case(*case.split(":"))
    return equivalence.train_keras("default", build, x, y, fit_kwargs=fit_kwargs)


def under_dtensor(case, mesh):
    build, x, y, fit_kwargs = keras_io_models.case(*case.split(":"))
    return equivalence.train_keras("dtensor", build, x, y, fit_kwargs=fit_kwargs,
                                   label=f"dtensor {mesh}", simulate_devices=4, **MESHES[mesh])


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("case", ["text:adam", "text:adam_clip", "timeseries:adam",
                                  "frozen:adam"])
def test_keras_io_models_train_like_one_device_under_dtensor(case, mesh):
    run = under_dtensor(case, mesh)
    report = equivalence.compare_runs(one_device(case), run)
    assert report.equivalent, f"{case} on {mesh}: {report}"
    if case.startswith("frozen"):
        assert_frozen_unchanged(run, mesh)
