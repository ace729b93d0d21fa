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



def test_keras_distribution_accumulates_like_one_device():
    """Keras' own model.fit under DataParallel, with enable_keras_distribution's option."""
    import keras
    import tfdist
    from tfdist import keras_distribution
    case = "text:adam_clip"
    build, x, y, fit_kwargs = keras_io_models.case(*case.split(":"))
    tfdist.enable_keras_distribution(accumulation_steps=4)
    keras.distribution.set_distribution(keras.distribution.DataParallel(
        devices=keras.distribution.list_devices("cpu")[:4]))
    try:
        keras.utils.set_random_seed(0)
        model = build()
        recorder = equivalence.LogRecorder(lambda: model.get_weights())
        model.fit(x, y, verbose=0, callbacks=[recorder], **fit_kwargs)
        strategy = keras_distribution.strategy_for(keras.distribution.distribution())
        assert strategy.config.accumulation_steps == 4
        run = equivalence.KerasRun("keras DataParallel x4 K=4", list(strategy.last_result.losses),
                                   {"model": model.get_weights()},
                                   [v.path for v in model.weights], recorder.batch_logs,
                                   recorder.epoch_logs, [])
    finally:
        keras.distribution.set_distribution(None)
        tfdist.enable_keras_distribution(accumulation_steps=1)
    report = equivalence.compare_runs(one_device(case), run)
    assert len(run.losses) == 8
    assert report.equivalent, str(report)
