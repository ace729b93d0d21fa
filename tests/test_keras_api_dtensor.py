"""The public API under dtensor, on users' own models with the user's layout map
(a dict of regex -> Keras axes, as keras.distribution.LayoutMap takes): each trains
like one device (per-step losses, final weights, callback logs within 1e-5), the
sharded weights are really split, and the trained model comes out whole."""

import functools

import numpy as np
import pytest

import user_models
from tfdist.testing import equivalence

pytestmark = pytest.mark.dtensor

def _layout(second: str):
    """Megatron-style: the first kernel split by columns, the next by rows."""
    return {".*hidden/kernel": (None, "model"), ".*hidden/bias": ("model",),
            f".*{second}/kernel": ("model", None)}


LAYOUTS = {"dict_regression": _layout("hidden2"), "softmax_weighted": _layout("hidden2"),
           "subclassed": _layout("logits")}
CASES = [("dict_regression", "sgd_nesterov"), ("softmax_weighted", "adamw_cosine"),
         ("softmax_weighted", "rmsprop"), ("subclassed", "sgd_nesterov")]


@functools.lru_cache(maxsize=None)
def one_device(name, optimizer):
    build, x, y, fit_kwargs = user_models.case(name, optimizer)
    return equivalence.train_keras("default", build, x, y, fit_kwargs=fit_kwargs)


@pytest.mark.parametrize("name,optimizer", CASES, ids=["-".join(c) for c in CASES])
def test_users_model_under_a_user_layout_trains_like_one_device(name, optimizer):
    build, x, y, fit_kwargs = user_models.case(name, optimizer)
    candidate = equivalence.train_keras(
        "dtensor", build, x, y, fit_kwargs=fit_kwargs, label="dtensor batch=2,model=2",
        simulate_devices=4, mesh="batch=2,model=2", layout=LAYOUTS[name], layout_strict=False)
    report = equivalence.compare_runs(one_device(name, optimizer), candidate)
    assert report.equivalent, str(report)


def test_sharded_weights_are_split_and_the_saved_model_is_whole(tmp_path):
    import keras
    import tfdist
    build, x, y, fit_kwargs = user_models.case("dict_regression", "sgd_nesterov")
    strategy = tfdist.Strategy("dtensor", simulate_devices=4, mesh="batch=2,model=2",
                               layout=LAYOUTS["dict_regression"])
    keras.utils.set_random_seed(0)
    model = build()
    strategy.fit(model, x, y, verbose=0, **{k: v for k, v in fit_kwargs.items()
                                              if k != "validation_data"})
    kernel = next(v for v in model.variables if v.path.endswith("hidden/kernel"))
    from tfdist.parallel.dtensor import sharding
    shards = sharding.shard_shapes(kernel)
    assert len(shards) == 4 and {shape for _, shape in shards} == {(8, 8)}, shards  # (8, 16) / 2
    path = str(tmp_path / "m.keras")
    strategy.save(model, path)
    loaded = keras.saving.load_model(path)
    head = {k: v[:16] for k, v in x.items()}
    expected = strategy.predict(model, head)
    np.testing.assert_allclose(loaded.predict(head, verbose=0), expected, rtol=1e-6, atol=1e-7)
    strategy.export(model, str(tmp_path / "served"))
    import tensorflow as tf
    served = tf.saved_model.load(str(tmp_path / "served"))
    out = served.serve({k: tf.constant(v) for k, v in head.items()})
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-7)


def test_the_keras_io_guide_under_dtensor_trains_like_one_device():
    """keras-io's guide (examples/keras_io_guide.py) with a Megatron-style layout map."""
    import os
    import sys
    from helpers import REPO
    sys.path.insert(0, os.path.join(REPO, "examples"))
    import keras_io_guide
    runs = {}
    for mode in ("default", "dtensor"):
        strategy, model, _, _ = keras_io_guide.main(mode, 1)
        runs[mode] = equivalence.Record(mode, list(strategy.last_result.losses),
                                        model.get_weights())
    equivalence.assert_equivalent(runs["default"], runs["dtensor"])


def test_keras_callbacks_decide_as_on_one_device_under_dtensor():
    import keras

    def callbacks():
        return [keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 * 0.5 ** epoch),
                keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=1e9)]

    runs = {}
    for mode, options in (("default", {}), ("dtensor", dict(
            simulate_devices=4, mesh="batch=2,model=2", layout=LAYOUTS["dict_regression"]))):
        build, x, y, fit_kwargs = user_models.case("dict_regression", "sgd_nesterov")
        fit_kwargs.update(epochs=4, callbacks=callbacks())
        runs[mode] = equivalence.train_keras(mode, build, x, y, fit_kwargs=fit_kwargs, **options)
    assert len(runs["default"].epoch_logs) == 2
    report = equivalence.compare_runs(runs["default"], runs["dtensor"])
    assert report.equivalent, str(report)
