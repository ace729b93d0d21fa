"""Keras' calls and Keras' arguments through the public API (issue 37).

- Keras' own model.fit / evaluate / predict on a model compiled in a tfdist.Strategy's
  scope run tfdist's loop (strategy.last_result is theirs) and equal plain Keras on one
  device: per-epoch logs and final weights within 1e-5 (same seed, shuffle=False, no
  dropout).
- strategy.fit takes Keras' fit arguments with Keras' meaning (validation_split's last
  fraction, class_weight as per-example weights, initial_epoch, validation_freq,
  validation_batch_size), checked against plain Keras the same way; any it cannot
  honour is refused before the first step in one paragraph naming it.
- Errors from the Python API name the Python argument (batch_size=127), not a flag.
- A reloaded model (keras.saving.load_model, model.load_weights) evaluates and predicts
  in every mode; where a mode cannot carry the loaded optimizer state into training,
  training is refused, not silently restarted. The dtensor and keras.distribution
  cases are marked `dtensor` (they run in the DTensor pytest process).
"""

import gc

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
import user_models
from tfdist import api
from tfdist.errors import UsageError
from tfdist.testing import equivalence

RTOL = 1e-5
BATCH = 32
MIRRORED = dict(simulate_devices=2)
PIPELINE = dict(simulate_devices=2, pipeline_stages=2, microbatches=2)
SHARDED = dict(simulate_devices=4, mesh="batch=2,model=2",
               layout={".*hidden/kernel": (None, "model"), ".*hidden/bias": ("model",),
                       ".*hidden2/kernel": ("model", None)})
OPTIONS = {"mirrored": MIRRORED, "pipeline": PIPELINE, "dtensor": SHARDED}


def classifier(loss="sparse_categorical_crossentropy", functional=False):
    """user_models.softmax_classifier (a Sequential), or the same layers as a functional
    model: a loaded Sequential has its layers called more than once (Keras' loading
    builds it again), which the pipeline's partitioner refuses as shared layers."""
    keras.utils.set_random_seed(0)
    model = functional_classifier() if functional else user_models.softmax_classifier()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss, metrics=["accuracy"])
    return model


def functional_classifier():
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(24, activation="relu", name="hidden")(inputs)
    hidden = keras.layers.Dense(16, activation="relu", name="hidden2")(hidden)
    outputs = keras.layers.Dense(4, activation="softmax", name="probabilities")(hidden)
    return keras.Model(inputs, outputs, name="functional_classifier")


def arrays(n=256):
    x, y, _ = user_models.classification_arrays(n)
    return x, y


def one_paragraph(error) -> str:
    text = str(error.value)
    assert "\n" not in text.strip() and "Traceback" not in text, text
    return text


def assert_same_history(reference, candidate):
    """Every key and epoch of Keras' History within RTOL."""
    assert candidate.epoch == reference.epoch
    assert sorted(candidate.history) == sorted(reference.history)
    for key, values in reference.history.items():
        np.testing.assert_allclose(candidate.history[key], values, rtol=RTOL, err_msg=key)


def assert_same_weights(reference, candidate):
    problems = equivalence.weight_mismatches(
        equivalence.Record("one device", [], reference.get_weights()),
        equivalence.Record("tfdist", [], candidate.get_weights()))
    assert not problems, problems


# ------------------------------------------------------------------ Keras' own calls

def test_keras_own_fit_evaluate_predict_run_tfdists_loop_under_the_scope():
    x, y = arrays()
    fit = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
               validation_data=(x[:64], y[:64]))
    reference = classifier()
    expected = reference.fit(x, y, **fit)
    strategy = tfdist.Strategy("mirrored", **MIRRORED)
    with strategy.scope():
        model = classifier()
    history = model.fit(x, y, **fit)
    assert len(strategy.last_result.losses) == 2 * len(x) // BATCH   # tfdist's loop ran
    assert model.history is history
    assert_same_history(expected, history)
    assert_same_weights(reference, model)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0),
                               reference.evaluate(x, y, verbose=0), rtol=RTOL)
    np.testing.assert_allclose(model.predict(x[:40], batch_size=8, verbose=0),
                               reference.predict(x[:40], batch_size=8, verbose=0), rtol=RTOL)
    strategy.close()


def test_fits_callbacks_get_kerass_test_hooks_during_validation():
    """Keras' fit hands its callbacks to evaluate: on_test_begin, each test batch and
    on_test_end, after each validated epoch."""
    x, y = arrays(128)

    def hooks_seen(fit):
        seen = []

        class Hooks(keras.callbacks.Callback):
            def on_test_begin(self, logs=None):
                seen.append("begin")

            def on_test_batch_end(self, batch, logs=None):
                seen.append(batch)

            def on_test_end(self, logs=None):
                seen.append(("end", round(logs["loss"], 4)))

        fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
            validation_data=(x[:64], y[:64]), callbacks=[Hooks()])
        return seen

    expected = hooks_seen(classifier().fit)
    strategy = tfdist.Strategy("mirrored", **MIRRORED)
    with strategy.scope():
        model = classifier()
    assert hooks_seen(model.fit) == expected
    assert expected[:4] == ["begin", 0, 1, ("end", expected[3][1])]
    strategy.close()


def test_a_model_whose_strategy_is_gone_is_refused_naming_strategy_fit():
    x, y = arrays(64)
    with tfdist.Strategy("mirrored", **MIRRORED).scope():   # no reference kept
        model = classifier()
    gc.collect()
    with pytest.raises(UsageError) as error:
        model.fit(x, y, batch_size=BATCH, verbose=0)
    assert "strategy.fit(model, ...)" in one_paragraph(error)
    strategy = tfdist.Strategy("mirrored", **MIRRORED)
    with strategy.scope():
        model = classifier()
    strategy.close()
    with pytest.raises(UsageError) as error:
        model.fit(x, y, batch_size=BATCH, verbose=0)
    assert "was closed" in one_paragraph(error) and "strategy.fit(model, ...)" in str(error.value)


# ------------------------------------------------------------------ Keras' arguments

def test_validation_split_class_weight_initial_epoch_and_validation_freq_are_keras():
    """The held-out last quarter (before shuffling), class weights as per-example weights,
    epochs 1..3 of 4 with validation after the 2nd and 4th, validated in batches of 16
    (4 batches: validation_steps=4 is the whole split, as Keras then validates it)."""
    x, y = arrays()
    fit = dict(batch_size=BATCH, epochs=4, initial_epoch=1, validation_split=0.25,
               class_weight={0: 2.0, 3: 0.5}, validation_freq=2, validation_batch_size=16,
               validation_steps=4, shuffle=False, verbose=0)
    reference = classifier()
    expected = reference.fit(x, y, **fit)
    strategy = tfdist.Strategy("mirrored", **MIRRORED)
    with strategy.scope():
        model = classifier()
    history = strategy.fit(model, x, y, **fit)
    assert history.epoch == [1, 2, 3] and len(history.history["val_loss"]) == 2
    assert_same_history(expected, history)
    assert_same_weights(reference, model)
    strategy.close()


def test_steps_per_epoch_that_divides_the_data_is_keras():
    """Keras keeps its iterator across epochs when steps_per_epoch is given: 3 epochs of
    2 steps over 4 batches read batches 0-1, 2-3, 0-1, as tfdist's stream does."""
    x, y = arrays(128)
    fit = dict(batch_size=BATCH, epochs=3, steps_per_epoch=2, shuffle=False, verbose=0)
    reference = classifier()
    expected = reference.fit(x, y, **fit)
    strategy = tfdist.Strategy("mirrored", **MIRRORED)
    with strategy.scope():
        model = classifier()
    assert_same_history(expected, strategy.fit(model, x, y, **fit))
    assert_same_weights(reference, model)
    strategy.close()


def test_class_weight_on_a_batched_dataset_of_one_hot_labels_is_keras():
    """Keras' Dataset rule: the class of a one-hot row is its argmax; Keras' model.fit
    routed here keeps the Dataset's order (Keras never shuffles one)."""
    x, y = arrays(128)
    dataset = tf.data.Dataset.from_tensor_slices((x, np.eye(4, dtype="float32")[y])).batch(BATCH)
    fit = dict(epochs=2, class_weight={0: 0.5, 1: 3.0, 2: 0.25, 3: 1.5}, verbose=0)
    reference = classifier("categorical_crossentropy")
    expected = reference.fit(dataset, **fit)
    strategy = tfdist.Strategy("mirrored", **MIRRORED)
    with strategy.scope():
        model = classifier("categorical_crossentropy")
    assert_same_history(expected, model.fit(dataset, **fit))
    assert_same_weights(reference, model)
    strategy.close()


@pytest.mark.parametrize("mode", ["mirrored", "pipeline",
                                  pytest.param("dtensor", marks=pytest.mark.dtensor)])
def test_a_second_compile_trains_with_its_optimizer_as_keras_does(mode):
    """Keras' fine-tuning pattern: fit, freeze a layer, compile again with another
    optimizer, fit on. The new compile takes effect (it used to be ignored: the first
    compile's optimizer kept training)."""
    x, y = arrays(128)
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0)

    def fine_tune(model, train):
        train(model)
        model.get_layer("hidden").trainable = False
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
        return train(model)

    reference = classifier(functional=True)
    expected = fine_tune(reference, lambda m: m.fit(x, y, **fit))
    strategy = tfdist.Strategy(mode, **OPTIONS[mode])
    with strategy.scope():
        model = classifier(functional=True)
    assert_same_history(expected, fine_tune(model, lambda m: m.fit(x, y, **fit)))
    assert_same_weights(reference, model)
    strategy.close()


@pytest.fixture(scope="module")
def mirrored_model():
    strategy = tfdist.Strategy("mirrored", **MIRRORED)
    with strategy.scope():
        model = classifier()
    yield strategy, model
    strategy.close()


X, Y = arrays(128)
W = np.ones(len(X), "float32")
DATASET = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
REFUSED = {
    "validation_split of a Dataset": (
        lambda m: m.fit(DATASET, validation_split=0.2),
        ["validation_split=0.2", "a tf.data.Dataset", "validation_data"]),
    "validation_split outside [0, 1)": (
        lambda m: m.fit(X, Y, validation_split=1.5), ["validation_split=1.5", "[0, 1)"]),
    "validation_split leaving no example": (
        lambda m: m.fit(X[:2], Y[:2], batch_size=2, validation_split=0.99),
        ["no training example of the 2"]),
    "class_weight with sample_weight": (
        lambda m: m.fit(X, Y, sample_weight=W, class_weight={0: 2.0}),
        ["class_weight and sample_weight"]),
    "class_weight not a dict of classes": (
        lambda m: m.fit(X, Y, class_weight={"cat": 2.0}), ["class_weight={'cat': 2.0}"]),
    "class_weight with several outputs": (
        lambda m: m.fit(X, {"a": Y}, class_weight={0: 2.0}), ["one output"]),
    "steps_per_epoch not dividing the batches": (
        lambda m: m.fit(X, Y, steps_per_epoch=3), ["steps_per_epoch=3", "4 full batches",
                                                   "(1, 2, 4)"]),
    "validation_steps short of the validation data": (
        lambda m: m.fit(X, Y, validation_data=(X, Y), validation_steps=1),
        ["validation_steps=1", "4 batches", "continuing where the last"]),
    "shuffle='batch'": (lambda m: m.fit(X, Y, shuffle="batch"), ["shuffle='batch'"]),
    "negative initial_epoch": (lambda m: m.fit(X, Y, initial_epoch=-1), ["initial_epoch=-1"]),
    "validation_freq=0": (lambda m: m.fit(X, Y, validation_freq=0), ["validation_freq=0"]),
    "validation_batch_size the replicas cannot split": (
        lambda m: m.fit(X, Y, validation_data=(X, Y), validation_batch_size=15),
        ["validation_batch_size=15 is not divisible by the 2 replicas"]),
    "batch_size the replicas cannot split": (
        lambda m: m.fit(X, Y, batch_size=127), ["batch_size=127 is not divisible"]),
    "an evaluate keyword Keras does not define": (
        lambda m: m.evaluate(X, Y, foo=1), ["foo=1"]),
    "evaluate steps=0": (lambda m: m.evaluate(X, Y, steps=0), ["steps=0"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_fit_arguments_are_refused_before_the_first_step(case, mirrored_model):
    strategy, model = mirrored_model
    call, fragments = REFUSED[case]
    with pytest.raises(UsageError) as error:
        call(model)
    text = one_paragraph(error)
    assert all(fragment in text for fragment in fragments), text
    assert "--" not in text, text   # Python arguments, not flags
    assert not model.optimizer.built or int(model.optimizer.iterations.numpy()) == 0


def test_evaluate_and_predict_take_keras_steps_and_callbacks(mirrored_model):
    strategy, model = mirrored_model
    reference = classifier()
    seen = []

    class Hooks(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            seen.append(("test", batch))

        def on_predict_batch_end(self, batch, logs=None):
            seen.append(("predict", batch))

    got = model.evaluate(X, Y, batch_size=16, steps=3, callbacks=[Hooks()], verbose=0)
    np.testing.assert_allclose(got, reference.evaluate(X, Y, batch_size=16, steps=3, verbose=0),
                               rtol=RTOL)
    predictions = model.predict(X, batch_size=16, steps=2, callbacks=[Hooks()], verbose=0)
    assert predictions.shape == (32, 4)
    assert seen == [("test", 0), ("test", 1), ("test", 2), ("predict", 0), ("predict", 1)]


# ------------------------------------------------------------------ Python names, not flags

def test_strategy_options_are_named_as_python_arguments():
    with pytest.raises(UsageError) as error:
        tfdist.Strategy("pipeline", microbatches=0)
    assert one_paragraph(error) == "microbatches must be > 0, got 0."
    strategy = tfdist.Strategy("pipeline", simulate_devices=2, pipeline_stages=2, microbatches=3)
    with strategy.scope():
        model = classifier()
    with pytest.raises(UsageError) as error:
        strategy.fit(model, X, Y, batch_size=BATCH, verbose=0)
    text = one_paragraph(error)
    assert "batch_size=32" in text and "microbatches=3" in text and "--" not in text, text
    strategy.close()


def test_python_names_translates_config_flags_only():
    text = ("--global_batch_size=127 over --pipeline_stages=2, --layout=megatron and "
            "--jit_compile; use --devices_per_worker 1 or srun --mpi=pmix.")
    assert api.python_names(text, api.FIT_NAMES) == (
        "batch_size=127 over pipeline_stages=2, layout='megatron' and jit_compile; use "
        "--devices_per_worker 1 or srun --mpi=pmix.")


def test_the_launcher_does_not_advise_restarts_for_a_usage_error():
    from tfdist import launch
    usage = launch.failure_advice(launch.Outcome(2, "worker 1 exited with code 2", 1), 3)
    assert "usage error" in usage and "--max_restarts" not in usage
    crash = launch.failure_advice(launch.Outcome(1, "worker 1 exited with code 1", 1), 0)
    assert "Use --max_restarts" in crash


# ------------------------------------------------------------------ reloaded models

def trained_file(tmp_path):
    """A .keras file and a .weights.h5 file of a model trained one epoch on one device
    (Adam: the file holds optimizer state), and what one device computes from them."""
    x, y = arrays(128)
    model = classifier(functional=True)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    model.save(str(tmp_path / "trained.keras"))
    model.save_weights(str(tmp_path / "trained.weights.h5"))
    return str(tmp_path / "trained.keras"), str(tmp_path / "trained.weights.h5"), model


def test_a_loaded_model_evaluates_predicts_and_trains_on_exactly_under_mirrored(tmp_path):
    path, _, one_device = trained_file(tmp_path)
    strategy = tfdist.Strategy("mirrored", **MIRRORED)
    with strategy.scope():
        loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.evaluate(X, Y, verbose=0),
                               one_device.evaluate(X, Y, verbose=0), rtol=RTOL)
    np.testing.assert_allclose(loaded.predict(X[:16], verbose=0),
                               one_device.predict(X[:16], verbose=0), rtol=RTOL)
    # Training on continues from the loaded Adam state, as on one device.
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0)
    assert_same_history(one_device.fit(X, Y, **fit), loaded.fit(X, Y, **fit))
    assert_same_weights(one_device, loaded)
    strategy.close()


def test_a_loaded_model_evaluates_under_pipeline_and_its_state_is_not_dropped(tmp_path):
    path, weights, one_device = trained_file(tmp_path)
    strategy = tfdist.Strategy("pipeline", **PIPELINE)
    with strategy.scope():
        loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.evaluate(X, Y, verbose=0),
                               one_device.evaluate(X, Y, verbose=0), rtol=RTOL)
    with pytest.raises(UsageError) as error:   # stage optimizers start fresh: refused
        loaded.fit(X, Y, batch_size=BATCH, verbose=0)
    assert "Adam, 4 steps taken" in one_paragraph(error) and "model.compile(" in str(error.value)
    # load_weights after training reaches the stages (evaluate used to read stale copies)
    with strategy.scope():
        model = classifier(functional=True)
    model.fit(X, Y, batch_size=BATCH, epochs=2, verbose=0)
    model.load_weights(weights)
    np.testing.assert_allclose(model.evaluate(X, Y, verbose=0),
                               one_device.evaluate(X, Y, verbose=0), rtol=RTOL)
    np.testing.assert_allclose(model.predict(X[:16], verbose=0),
                               one_device.predict(X[:16], verbose=0), rtol=RTOL)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    model.fit(X, Y, batch_size=BATCH, verbose=0)   # a new compile: trains from these weights
    strategy.close()



@pytest.mark.dtensor
def test_a_loaded_model_evaluates_under_dtensor_and_load_weights_reaches_the_shards(tmp_path):
    """load_model: evaluated with the loaded Adam state set aside (its slots are not
    on the shards), so training it is refused; load_weights after training assigns into
    the shards (weights and optimizer state), and training on continues exactly."""
    path, weights, one_device = trained_file(tmp_path)
    strategy = tfdist.Strategy("dtensor", **SHARDED)
    with strategy.scope():
        loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.evaluate(X, Y, verbose=0),
                               one_device.evaluate(X, Y, verbose=0), rtol=RTOL)
    np.testing.assert_allclose(loaded.predict(X[:16], verbose=0),
                               one_device.predict(X[:16], verbose=0), rtol=RTOL)
    with pytest.raises(UsageError) as error:
        loaded.fit(X, Y, batch_size=BATCH, verbose=0)
    assert "Adam, 4 steps taken" in one_paragraph(error)
    with strategy.scope():
        model = classifier(functional=True)
    model.fit(X, Y, batch_size=BATCH, epochs=2, verbose=0)
    model.load_weights(weights)
    np.testing.assert_allclose(model.evaluate(X, Y, verbose=0),
                               one_device.evaluate(X, Y, verbose=0), rtol=RTOL)
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0)
    assert_same_history(one_device.fit(X, Y, **fit), model.fit(X, Y, **fit))
    assert_same_weights(one_device, model)
    strategy.close()


def keras_distributions():
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, "model")
    layout_map["hidden2/kernel"] = ("model", None)
    return {"DataParallel": keras.distribution.DataParallel(),
            "ModelParallel": keras.distribution.ModelParallel(layout_map=layout_map,
                                                              batch_dim_name="batch")}


@pytest.mark.dtensor
@pytest.mark.parametrize("kind", ["DataParallel", "ModelParallel"])
def test_a_loaded_model_evaluates_and_predicts_under_keras_distribution(kind, tmp_path):
    """Used to be refused as if training ("compile the model with a new optimizer")."""
    tfdist.enable_keras_distribution()
    path, weights, one_device = trained_file(tmp_path)
    keras.distribution.set_distribution(keras_distributions()[kind])
    try:
        loaded = keras.saving.load_model(path)
        np.testing.assert_allclose(loaded.evaluate(X, Y, batch_size=16, verbose=0),
                                   one_device.evaluate(X, Y, batch_size=16, verbose=0),
                                   rtol=RTOL)
        np.testing.assert_allclose(loaded.predict(X[:16], verbose=0),
                                   one_device.predict(X[:16], verbose=0), rtol=RTOL)
        model = classifier(functional=True)
        model.fit(X, Y, batch_size=16, verbose=0)
        model.load_weights(weights)   # into the sharded variables
        np.testing.assert_allclose(model.evaluate(X, Y, batch_size=16, verbose=0),
                                   one_device.evaluate(X, Y, batch_size=16, verbose=0),
                                   rtol=RTOL)
    finally:
        keras.distribution.set_distribution(None)


# ------------------------------------------------------------------ canaries

def test_canary_a_loaded_model_is_compiled_with_the_routes_installed(tmp_path):
    """Keras' compile_from_config skips compiling a loaded model whose class's compile
    is not Trainer.compile: the routes wrap compile where Trainer defines it."""
    from tfdist import keras_calls
    keras_calls.install()
    assert keras.Model.compile.__wrapped__ is keras_calls.keras_own("compile")
    model = classifier()
    model.save(str(tmp_path / "m.keras"))
    loaded = keras.saving.load_model(str(tmp_path / "m.keras"))
    assert loaded.compiled and loaded.loss == "sparse_categorical_crossentropy"
