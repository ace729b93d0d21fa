"""Gradient accumulation (`accumulation_steps=K`, tfdist/train/accumulation.py): each
global batch computed in K micro-batches, one optimizer update, equal to one device
training the whole global batch at once.

Every comparison: 8 steps, per-step losses and every replica's final weights within
1e-5 relative of one device at the same global batch, on models tfdist did not write:
keras-io's token + arange position tables under Adam with global_clipnorm (sparse rows
that add up row by row across micro-batches, as across replicas), a frozen sub-layer,
and a keras-hub GPT-2 from a tiny config. Bad input is refused before the first step.
dtensor's accumulation is in tests/test_accumulation_dtensor.py (its own process).
"""

import functools
import os
import subprocess
import sys

import numpy as np
import pytest

import keras_io_models
from helpers import REPO
from test_keras_io_equivalence import assert_frozen_unchanged, worker_run
from tfdist.errors import UsageError
from tfdist.testing import equivalence

MODES = {
    "default K=4": dict(strategy="default", accumulation_steps=4),
    "mirrored x2 K=4": dict(strategy="mirrored", simulate_devices=2, accumulation_steps=4),
    "pipeline 2 stages, 2 micro-batches, K=2": dict(
        strategy="pipeline", simulate_devices=2, pipeline_stages=2, microbatches=2,
        accumulation_steps=2),
}


@functools.lru_cache(maxsize=None)
def one_device(case: str) -> equivalence.KerasRun:
    build, x, y, fit_kwargs = keras_io_models.case(*case.split(":"))
    return equivalence.train_keras("default", build, x, y, fit_kwargs=fit_kwargs)


def accumulated(case: str, mode: str) -> equivalence.KerasRun:
    build, x, y, fit_kwargs = keras_io_models.case(*case.split(":"))
    options = dict(MODES[mode])
    return equivalence.train_keras(options.pop("strategy"), build, x, y,
                                   fit_kwargs=fit_kwargs, label=mode, **options)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", ["text:adam_clip", "frozen:adam"])
def test_accumulation_trains_like_one_device_at_the_whole_batch(case, mode):
    run = accumulated(case, mode)
    report = equivalence.compare_runs(one_device(case), run)
    assert len(run.losses) == keras_io_models.STEPS == 8
    assert report.equivalent, f"{case} in {mode}: {report}"
    if case.startswith("frozen"):
        assert_frozen_unchanged(run, mode)


def schedule_case():
    """keras-io's text transformer under AdamW with a decaying learning rate: the
    schedule must advance once per update (per global batch), not per micro-batch."""
    import keras
    _, x, y, fit_kwargs = keras_io_models.case("text", "adam")

    def build_and_compile():
        model = keras_io_models.text_transformer()
        rate = keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=2, decay_rate=0.5)
        model.compile(optimizer=keras.optimizers.AdamW(rate, weight_decay=0.01),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model
    return build_and_compile, x, y, fit_kwargs


def test_a_learning_rate_schedule_advances_once_per_update():
    import tfdist
    build, x, y, fit_kwargs = schedule_case()
    reference = equivalence.train_keras("default", build, x, y, fit_kwargs=fit_kwargs)
    strategy = tfdist.Strategy("mirrored", simulate_devices=2, accumulation_steps=4, seed=0)
    import keras
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build()
    recorder = equivalence.LogRecorder(lambda: model.get_weights())
    strategy.fit(model, x, y, verbose=0, callbacks=[recorder], **fit_kwargs)
    run = equivalence.KerasRun("mirrored x2 K=4", list(strategy.last_result.losses),
                               {"model": model.get_weights()}, [v.path for v in model.weights],
                               recorder.batch_logs, recorder.epoch_logs, [])
    updates = int(model.optimizer.iterations.numpy())
    strategy.close()
    assert updates == 8, f"the optimizer counted {updates} updates for 8 global batches"
    report = equivalence.compare_runs(reference, run)
    assert report.equivalent, str(report)


GPT2_FIT = dict(batch_size=16, epochs=1, shuffle=False)


def gpt2_case():
    """(build_and_compile, x, y) of a keras-hub GPT-2 from a tiny config, 8 batches of 16."""
    import keras
    from benchmarks.conformance_models import ZOO
    entry = ZOO["gpt2_lm"]
    x, y = entry.data(16 * 8, seed=3)

    def build_and_compile():
        model = entry.build(False)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=entry.loss())
        return model
    return build_and_compile, x, y


@functools.lru_cache(maxsize=None)
def gpt2_one_device() -> equivalence.KerasRun:
    build_and_compile, x, y = gpt2_case()
    return equivalence.train_keras("default", build_and_compile, x, y, fit_kwargs=GPT2_FIT)


def test_a_keras_hub_model_accumulates_like_one_device():
    build_and_compile, x, y = gpt2_case()
    fit_kwargs = GPT2_FIT
    reference = gpt2_one_device()
    run = equivalence.train_keras("mirrored", build_and_compile, x, y, fit_kwargs=fit_kwargs,
                                  label="mirrored x2 K=4", simulate_devices=2,
                                  accumulation_steps=4)
    report = equivalence.compare_runs(reference, run)
    assert len(run.losses) == 8
    assert report.equivalent, str(report)


@pytest.mark.slow
def test_two_workers_accumulate_like_one_device(tmp_path):
    """tfdist's own ring (tcp): one reduction per update, of the K micro-batches' sum."""
    cases = "text:adam_clip,frozen:adam"
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--", sys.executable,
         "tests/workers/keras_io_cases.py", "tcp", cases, str(tmp_path),
         "accumulation_steps=4"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for case in cases.split(","):
        reference = one_device(case)
        for rank in (0, 1):
            run, _ = worker_run(tmp_path, case, rank, reference.paths)
            report = equivalence.compare_runs(reference, run)
            assert len(run.losses) == 8
            assert report.equivalent, f"{case} over tcp, K=4, rank {rank}: {report}"


# ------------------------------------------------------------------ refused before the first step

def fit_refusal(build_and_compile, x, y, batch_size=16, **options) -> str:
    import keras
    import tfdist
    strategy = tfdist.Strategy(options.pop("strategy", "default"), seed=0, **options)
    keras.utils.set_random_seed(0)
    try:
        with strategy.scope():
            model = build_and_compile()
        before = [w.copy() for w in model.get_weights()]
        with pytest.raises(UsageError) as caught:
            strategy.fit(model, x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False)
        after = model.get_weights()
        assert all(np.array_equal(a, b) for a, b in zip(before, after)), "a step ran"
    finally:
        strategy.close()
    message = str(caught.value)
    assert "Traceback" not in message and "tensorflow" not in message.lower(), message
    return message


def test_batch_normalization_is_refused_naming_the_layer():
    build, x, y, _ = keras_io_models.case("timeseries", "adam")
    message = fit_refusal(build, x, y, strategy="mirrored", simulate_devices=2,
                          accumulation_steps=2)
    assert "BatchNormalization (batch_normalization" in message, message
    assert "accumulation_steps=2" in message and "--" not in message, message
    assert "trainable=False" in message, message


def test_a_batch_the_micro_batches_cannot_divide_is_refused():
    build, x, y, _ = keras_io_models.case("text", "adam")
    message = fit_refusal(build, x, y, batch_size=12, strategy="mirrored",
                          simulate_devices=2, accumulation_steps=4)
    assert "batch_size=12" in message and "6 examples" in message, message
    assert "accumulation_steps=4" in message and "multiple of 8" in message, message


def test_keras_own_gradient_accumulation_is_refused_naming_tfdists():
    import keras
    _, x, y, _ = keras_io_models.case("text", "adam")

    def build_and_compile():
        model = keras_io_models.text_transformer()
        model.compile(optimizer=keras.optimizers.Adam(gradient_accumulation_steps=4),
                      loss="sparse_categorical_crossentropy")
        return model

    message = fit_refusal(build_and_compile, x, y, strategy="mirrored", simulate_devices=2)
    assert "gradient_accumulation_steps=4" in message, message
    assert "accumulation_steps=4 with a global batch 4 times as large" in message, message


def test_a_sum_loss_with_regularisation_is_refused():
    import keras
    _, x, y, _ = keras_io_models.case("text", "adam")

    def build_and_compile():
        inputs = keras.Input((keras_io_models.MAXLEN,), dtype="int32")
        hidden = keras.layers.Embedding(keras_io_models.VOCAB, 8)(inputs)
        hidden = keras.layers.GlobalAveragePooling1D()(hidden)
        outputs = keras.layers.Dense(2, kernel_regularizer="l2")(hidden)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum"))
        return model

    message = fit_refusal(build_and_compile, x, y, accumulation_steps=2)
    assert "'sum' loss and 1 regularisation" in message, message


def test_bad_accumulation_options_are_refused_at_once():
    from tfdist import config
    with pytest.raises(UsageError, match=r"--accumulation_steps must be > 0, got 0"):
        config.RunConfig(accumulation_steps=0)
    with pytest.raises(UsageError, match=r"--accumulation_steps=2 works with --trainer=loop"):
        config.RunConfig(accumulation_steps=2, trainer="fit")
    import tfdist
    with pytest.raises(UsageError, match=r"enable_keras_distribution\(accumulation_steps=0\): "
                                         r"give a whole number > 0"):
        tfdist.enable_keras_distribution(accumulation_steps=0)


def test_the_flag_refuses_an_indivisible_batch_in_one_paragraph():
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--strategy=mirrored",
         "--simulate_devices=2", "--accumulation_steps=3", "--global_batch_size=64",
         "--train_steps=1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=REPO))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--accumulation_steps=3 cannot cut into equal micro-batches" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
