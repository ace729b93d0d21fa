"""Activation recomputation (`remat=MODE`, tfdist/train/remat.py) on models tfdist did not
write: keras-io's token + position tables and transformer block under Adam with
global_clipnorm, a Conv1D + BatchNormalization timeseries net, frozen sub-layers, and a
keras-hub GPT-2 from a tiny config.

Every comparison: 8 steps, per-step losses and every replica's final weights within
1e-5 relative of one device without recomputation, and the layers recomputed are
named and counted (a run that recomputed nothing would compare equal vacuously).
What cannot be recomputed exactly is left out and said, or refused by name before the
first step. The 2-worker run and dtensor's are below (dtensor in its own process).
"""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

import keras_io_models
from helpers import REPO
from test_accumulation import GPT2_FIT, gpt2_case, gpt2_one_device, one_device
from test_keras_io_equivalence import worker_run
from tfdist import config as cfg
from tfdist.errors import UsageError
from tfdist.testing import equivalence

@pytest.fixture(autouse=True)
def grappler_as_it_was():
    """Recomputation turns grappler's dependency optimizer off for the process (remat.py);
    the tests after these get it back on (its default). Numbers do not depend on it."""
    yield
    import tensorflow as tf
    tf.config.optimizer.set_experimental_options({"dependency_optimization": True})


MODES = {
    "default full": dict(strategy="default", remat="full"),
    "mirrored x2 full": dict(strategy="mirrored", simulate_devices=2, remat="full"),
    "pipeline 2 stages full": dict(strategy="pipeline", simulate_devices=2, pipeline_stages=2,
                                   microbatches=2, remat="full"),
    "default larger_than 8": dict(strategy="default", remat="larger_than", remat_threshold=8),
    "default activations": dict(strategy="default", remat="activations"),
}
# The layers each case recomputes under --remat=full (the rest are left out, and said).
RECOMPUTED_UNDER_FULL = {"text:adam_clip": 4, "frozen:adam": 3, "timeseries:adam": 6}


def recomputing(case: str, label: str, options: dict, caplog):
    build, x, y, fit_kwargs = keras_io_models.case(*case.split(":"))
    options = dict(options)
    with caplog.at_level(logging.INFO, logger="tfdist"):
        run = equivalence.train_keras(options.pop("strategy"), build, x, y,
                                      fit_kwargs=fit_kwargs, label=label, **options)
    said = [r.getMessage() for r in caplog.records if "recomputes" in r.getMessage()]
    assert len(said) == 1, said
    return run, said[0]


def recomputed_count(message: str) -> int:
    return int(message.split(" recomputes ")[1].split(" ")[0])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", ["text:adam_clip", "frozen:adam"])
def test_recomputation_trains_like_one_device_without_it(case, mode, caplog):
    run, said = recomputing(case, mode, MODES[mode], caplog)
    report = equivalence.compare_runs(one_device(case), run)
    assert len(run.losses) == keras_io_models.STEPS == 8
    assert report.equivalent, f"{case} in {mode}: {report}"
    assert recomputed_count(said) > 0, said
    if MODES[mode]["remat"] == "full":
        assert recomputed_count(said) == RECOMPUTED_UNDER_FULL[case], said


def test_batch_normalization_and_embeddings_are_left_out_and_said(caplog):
    run, said = recomputing("timeseries:adam", "default full", MODES["default full"], caplog)
    report = equivalence.compare_runs(one_device("timeseries:adam"), run)
    assert report.equivalent, str(report)
    assert recomputed_count(said) == RECOMPUTED_UNDER_FULL["timeseries:adam"]
    left_out = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
    assert len(left_out) == 1 and left_out[0].count("writes its weights") == 2, left_out


def test_listed_layers_are_the_ones_recomputed(caplog):
    import keras
    build, x, y, fit_kwargs = keras_io_models.case("frozen", "adam")
    keras.utils.set_random_seed(0)
    names = [layer.name for layer in build().layers]   # frozen_base, frozen_inside_N, head
    run, said = recomputing("frozen:adam", "default list_of_layers",
                            dict(strategy="default", remat="list_of_layers",
                                 remat_layers=(names[-1],)), caplog)
    assert equivalence.compare_runs(one_device("frozen:adam"), run).equivalent
    assert recomputed_count(said) == 1 and said.endswith(names[-1]), said


def test_a_recomputed_layer_runs_its_forward_pass_again_for_the_gradient():
    """The mechanism, counted: the layer's call runs once forward and once more when
    the tape computes gradients, and the gradients equal the plain layer's."""
    import keras
    import tensorflow as tf
    from tfdist.train import remat
    keras.utils.set_random_seed(1)
    layer = keras.layers.Dense(4, activation="gelu")
    x = tf.random.normal((3, 5))
    layer(x)
    calls = []
    plain_call = layer.call

    def counted(*args, **kwargs):
        calls.append(1)
        return plain_call(*args, **kwargs)

    def gradients():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x, training=True) ** 2)
        return [g.numpy() for g in tape.gradient(loss, layer.trainable_variables)]

    expected = gradients()
    layer.call = remat._recomputed_call(counted)
    got = gradients()
    assert len(calls) == 2
    assert all(np.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(expected, got))


def test_a_keras_hub_model_with_recomputation_trains_like_one_device(caplog):
    build_and_compile, x, y = gpt2_case()
    reference = gpt2_one_device()
    with caplog.at_level(logging.INFO, logger="tfdist"):
        run = equivalence.train_keras("mirrored", build_and_compile, x, y,
                                      fit_kwargs=GPT2_FIT, label="mirrored x2 full",
                                      simulate_devices=2, remat="full")
    said = [r.getMessage() for r in caplog.records if "recomputes" in r.getMessage()]
    assert len(said) == 1 and "transformer_layer_0" in said[0], said
    report = equivalence.compare_runs(reference, run)
    assert len(run.losses) == 8
    assert report.equivalent, str(report)


@pytest.mark.slow
def test_two_workers_recompute_like_one_device(tmp_path):
    cases = "text:adam_clip,frozen:adam"
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--", sys.executable,
         "tests/workers/keras_io_cases.py", "tcp", cases, str(tmp_path), "remat=full"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "--remat=full recomputes 4 layer(s)" in result.stdout + result.stderr
    for case in cases.split(","):
        reference = one_device(case)
        for rank in (0, 1):
            run, _ = worker_run(tmp_path, case, rank, reference.paths)
            report = equivalence.compare_runs(reference, run)
            assert len(run.losses) == 8
            assert report.equivalent, f"{case} over tcp with --remat=full, rank {rank}: {report}"


@pytest.mark.dtensor
def test_dtensor_recomputes_like_one_device(caplog):
    from test_keras_io_dtensor import MESHES
    mesh = list(MESHES)[0]
    run, said = recomputing("text:adam_clip", f"dtensor {mesh} full",
                            dict(strategy="dtensor", simulate_devices=4, remat="full",
                                 **MESHES[mesh]), caplog)
    report = equivalence.compare_runs(one_device("text:adam_clip"), run)
    assert report.equivalent, str(report)
    assert recomputed_count(said) == RECOMPUTED_UNDER_FULL["text:adam_clip"], said


# ------------------------------------------------------------------ refused before the first step

@pytest.mark.parametrize("options,expected", [
    (dict(remat="everything"), "Unknown --remat 'everything'. Valid choices: full, activations"),
    (dict(remat="full", remat_layers=("dense",)), "--remat_layers='dense' goes with "
     "--remat=list_of_layers"),
    (dict(remat="list_of_layers"), "goes with --remat=list_of_layers, and that mode needs it"),
    (dict(remat="larger_than", remat_threshold=0), "--remat_threshold must be > 0, got 0"),
])
def test_bad_options_are_refused_with_the_choices(options, expected):
    with pytest.raises(UsageError, match=expected.replace("(", r"\(")):
        cfg.RunConfig(**options)


@pytest.mark.parametrize("layer,expected", [
    ("batch_normalization", "its training call writes its weights"),
    ("nowhere", "does not have. Its layers:"),
])
def test_listing_a_layer_that_cannot_be_recomputed_is_refused_by_name(layer, expected):
    import keras
    import tfdist
    build, x, y, fit_kwargs = keras_io_models.case("timeseries", "adam")
    keras.utils.set_random_seed(0)
    model = build()
    before = [w.copy() for w in model.get_weights()]
    if layer == "batch_normalization":   # Keras numbers layers per process: its name here
        layer = next(l.name for l in model.layers if isinstance(l, keras.layers.BatchNormalization))
    strategy = tfdist.Strategy("default", seed=0, remat="list_of_layers", remat_layers=(layer,))
    with pytest.raises(UsageError, match=expected) as caught:
        strategy.fit(model, x, y, verbose=0, **fit_kwargs)
    assert layer in str(caught.value)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


# ------------------------------------------------------------------ upstream canary

def test_keras_remat_scope_still_fails_in_a_tf_function():
    """keras-team/keras#21207: Keras' RematScope('full') on TensorFlow fails in a
    tf.function for a layer called with training=. When this fails, Keras fixed it:
    tfdist/train/remat.py could then hand its modes to Keras."""
    import keras
    import tensorflow as tf
    with keras.RematScope(mode="full"):
        layer = keras.layers.Dense(2)
    x = tf.ones((2, 3))
    with pytest.raises(ValueError, match="keywords arguments only when eager"):
        tf.function(lambda t: layer(t, training=True))(x)


# ------------------------------------------------------------------ Keras' own RematScope

def test_a_model_built_under_keras_remat_scope_trains_like_one_device(caplog):
    """Keras' RematScope alone fails in tfdist's (and any) tf.function on TensorFlow
    (keras-team/keras#21207, the canary above); tfdist recomputes those layers itself."""
    import keras
    build, x, y, fit_kwargs = keras_io_models.case("frozen", "adam")

    def build_in_scope():
        with keras.RematScope(mode="full"):
            return build()

    with caplog.at_level(logging.INFO, logger="tfdist"):
        run = equivalence.train_keras("mirrored", build_in_scope, x, y, fit_kwargs=fit_kwargs,
                                      label="mirrored x2 under keras.RematScope",
                                      simulate_devices=2)
    said = [r.getMessage() for r in caplog.records if "recomputes" in r.getMessage()]
    assert len(said) == 1 and "keras.RematScope" in said[0], said
    # frozen_base, frozen_inside and its two Dense, head: Keras' "full" is every layer.
    assert recomputed_count(said[0]) == 5, said
    report = equivalence.compare_runs(one_device("frozen:adam"), run)
    assert report.equivalent, str(report)


def test_a_keras_remat_scope_and_the_option_together_are_refused():
    import keras
    import tfdist
    build, x, y, fit_kwargs = keras_io_models.case("frozen", "adam")
    keras.utils.set_random_seed(0)
    with keras.RematScope(mode="full"):
        model = build()
    strategy = tfdist.Strategy("default", seed=0, remat="full")
    with pytest.raises(UsageError, match="built under keras.RematScope .* and "
                                         "remat='full' is set too: choose one"):
        strategy.fit(model, x, y, verbose=0, **fit_kwargs)


def test_keras_remat_inside_a_users_layer_trains_like_one_device_without_it():
    """keras.remat(f) in a custom layer's call (Keras' other public API): on TensorFlow it
    is tf.recompute_grad of a function called without keyword arguments, which works in
    tfdist's steps as it is."""
    import keras

    class Recomputed(keras.layers.Layer):
        def __init__(self, use_remat, **kwargs):
            super().__init__(**kwargs)
            self.inner = keras.layers.Dense(16, activation="gelu")
            self.forward = keras.remat(self.scaled) if use_remat else self.scaled

        def scaled(self, x):
            return self.inner(x) * 0.5

        def call(self, x):
            return self.forward(x)

    _, x, y, fit_kwargs = keras_io_models.case("frozen", "adam")

    def build(use_remat):
        def build_and_compile():
            inputs = keras.Input((12,))
            hidden = Recomputed(use_remat)(inputs)
            model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
            model.compile(optimizer=keras.optimizers.Adam(0.01),
                          loss="sparse_categorical_crossentropy")
            return model
        return build_and_compile

    reference = equivalence.train_keras("default", build(False), x, y, fit_kwargs=fit_kwargs)
    run = equivalence.train_keras("mirrored", build(True), x, y, fit_kwargs=fit_kwargs,
                                  label="mirrored x2 with keras.remat", simulate_devices=2)
    report = equivalence.compare_runs(reference, run)
    assert len(run.losses) == 8
    assert report.equivalent, str(report)


def test_keras_still_records_the_remat_scope_on_each_layer():
    """Canary for tfdist/train/remat.py's private read of Operation._remat_mode."""
    import keras
    with keras.RematScope(mode="larger_than", output_size_threshold=7):
        layer = keras.layers.Dense(2)
    assert layer._remat_mode.mode == "larger_than"
    assert layer._remat_mode.output_size_threshold == 7
    assert keras.layers.Dense(2)._remat_mode is None


@pytest.mark.dtensor
def test_keras_distribution_trains_a_model_built_under_keras_remat_scope(caplog):
    """Keras' own model.fit under DataParallel (tfdist.enable_keras_distribution), the
    model built under keras.RematScope: tfdist's steps recompute those layers."""
    import keras
    import tfdist
    from tfdist import keras_distribution
    case = "frozen:adam"
    build, x, y, fit_kwargs = keras_io_models.case(*case.split(":"))
    tfdist.enable_keras_distribution()
    keras.distribution.set_distribution(keras.distribution.DataParallel(
        devices=keras.distribution.list_devices("cpu")[:4]))
    try:
        keras.utils.set_random_seed(0)
        with keras.RematScope(mode="full"):
            model = build()
        recorder = equivalence.LogRecorder(lambda: model.get_weights())
        with caplog.at_level(logging.INFO, logger="tfdist"):
            model.fit(x, y, verbose=0, callbacks=[recorder], **fit_kwargs)
        strategy = keras_distribution.strategy_for(keras.distribution.distribution())
        run = equivalence.KerasRun("keras DataParallel x4 under RematScope",
                                   list(strategy.last_result.losses),
                                   {"model": model.get_weights()},
                                   [v.path for v in model.weights], recorder.batch_logs,
                                   recorder.epoch_logs, [])
    finally:
        keras.distribution.set_distribution(None)
    said = [r.getMessage() for r in caplog.records if "recomputes" in r.getMessage()]
    assert len(said) == 1 and recomputed_count(said[0]) == 5, said
    report = equivalence.compare_runs(one_device(case), run)
    assert len(run.losses) == 8
    assert report.equivalent, str(report)
