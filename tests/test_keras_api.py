"""The public API on users' own models (tests/user_models.py): each mode trains like
one device (per-step losses, every replica's final weights, the logs a custom
callback sees, all within 1e-5), and a trained model comes out of every mode."""

import functools

import numpy as np
import pytest

import user_models
from tfdist.testing import equivalence

MODES = {
    "mirrored": dict(strategy="mirrored", simulate_devices=2),
    "pipeline": dict(strategy="pipeline", simulate_devices=2, pipeline_stages=2,
                     microbatches=2),
    "pipeline_hybrid_2x2": dict(strategy="pipeline", simulate_devices=4, pipeline_stages=2,
                                microbatches=2),
}
CASES = [
    ("dict_regression", "sgd_nesterov", ("mirrored", "pipeline", "pipeline_hybrid_2x2")),
    ("softmax_weighted", "adamw_cosine", ("mirrored", "pipeline", "pipeline_hybrid_2x2")),
    ("softmax_weighted", "rmsprop", ("mirrored", "pipeline_hybrid_2x2")),
    ("dict_regression", "rmsprop", ("pipeline",)),
    ("subclassed", "sgd_nesterov", ("mirrored",)),
]
PARAMS = [(name, opt, mode) for name, opt, modes in CASES for mode in modes]


@functools.lru_cache(maxsize=None)
def one_device(name: str, optimizer: str):
    build, x, y, fit_kwargs = user_models.case(name, optimizer)
    return equivalence.train_keras("default", build, x, y, fit_kwargs=fit_kwargs)


@pytest.mark.parametrize("name,optimizer,mode", PARAMS, ids=["-".join(p) for p in PARAMS])
def test_users_model_trains_like_one_device(name, optimizer, mode):
    build, x, y, fit_kwargs = user_models.case(name, optimizer)
    options = dict(MODES[mode])
    reference = one_device(name, optimizer)
    candidate = equivalence.train_keras(options.pop("strategy"), build, x, y,
                                        fit_kwargs=fit_kwargs, label=mode, **options)
    assert len(reference.losses) == 2 * (user_models.EXAMPLES // user_models.GLOBAL_BATCH)
    expected_replicas = 2 if mode == "pipeline_hybrid_2x2" else 1
    assert len(candidate.replica_weights) == expected_replicas
    assert {"loss", "val_loss"} <= set(candidate.epoch_logs[-1])
    report = equivalence.compare_runs(reference, candidate)
    assert report.equivalent, str(report)


def test_a_difference_is_reported_with_its_first_step_and_variable():
    """The checker is a comparison: a different learning rate in the candidate is
    found, at step 2 (step 1's loss is computed before any update)."""
    build, x, y, fit_kwargs = user_models.case("dict_regression", "sgd_nesterov")
    reference = one_device("dict_regression", "sgd_nesterov")

    def build_other():
        model = build()
        model.optimizer.learning_rate = 0.06
        return model

    candidate = equivalence.train_keras("mirrored", build_other, x, y, fit_kwargs=fit_kwargs,
                                        simulate_devices=2)
    report = equivalence.compare_runs(reference, candidate)
    assert not report.equivalent and report.first_step == 2
    assert report.first_variable in reference.paths
    assert "step 2" in str(report)


def test_dropout_is_reported_as_not_covered():
    import keras
    layers = equivalence.stochastic_layers(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dropout(0.5, name="drop"),
        keras.layers.GaussianNoise(0.1, name="noise")]))
    assert layers == ["drop (Dropout)", "noise (GaussianNoise)"]
    assert equivalence.stochastic_layers(user_models.two_input_regressor()) == []


@pytest.mark.parametrize("mode", ["default", "mirrored", "pipeline", "pipeline_hybrid_2x2"])
def test_the_trained_model_comes_out_whole(mode, tmp_path):
    """The .keras file, loaded by plain Keras on one device, and the SavedModel predict
    what the distributed model predicts (1e-6 relative)."""
    import keras
    import tensorflow as tf
    import tfdist
    build, x, y, fit_kwargs = user_models.case("dict_regression", "sgd_nesterov")
    options = dict(MODES.get(mode, dict(strategy="default")))
    strategy = tfdist.Strategy(options.pop("strategy"), **options)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build()
    strategy.fit(model, x, y, verbose=0, **fit_kwargs)
    head = {k: v[:16] for k, v in x.items()}
    expected = strategy.predict(model, head)
    strategy.save(model, str(tmp_path / "m.keras"))
    strategy.export(model, str(tmp_path / "served"))
    loaded = keras.saving.load_model(str(tmp_path / "m.keras"))
    np.testing.assert_allclose(loaded.predict(head, verbose=0), expected, rtol=1e-6, atol=1e-7)
    served = tf.saved_model.load(str(tmp_path / "served"))
    np.testing.assert_allclose(served.serve({k: tf.constant(v) for k, v in head.items()}),
                               expected, rtol=1e-6, atol=1e-7)
    assert loaded.optimizer.__class__.__name__ == "SGD" and loaded.loss == "mse"


def _callbacks():
    import keras
    return [keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 * 0.5 ** epoch),
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=1e9)]


@functools.lru_cache(maxsize=None)
def one_device_with_callbacks():
    build, x, y, fit_kwargs = user_models.case("dict_regression", "sgd_nesterov")
    fit_kwargs.update(epochs=4, callbacks=_callbacks())
    return equivalence.train_keras("default", build, x, y, fit_kwargs=fit_kwargs)


@pytest.mark.parametrize("mode", ["mirrored", "pipeline", "pipeline_hybrid_2x2"])
def test_keras_callbacks_decide_as_on_one_device(mode):
    """LearningRateScheduler sets the rate every epoch (the pipeline's stage optimizers
    follow it), EarlyStopping ends the run after the 2nd of 4 epochs, and the logs a
    recording callback sees are one device's."""
    build, x, y, fit_kwargs = user_models.case("dict_regression", "sgd_nesterov")
    fit_kwargs.update(epochs=4, callbacks=_callbacks())
    options = dict(MODES[mode])
    candidate = equivalence.train_keras(options.pop("strategy"), build, x, y,
                                        fit_kwargs=fit_kwargs, label=mode, **options)
    reference = one_device_with_callbacks()
    assert len(reference.epoch_logs) == 2
    assert reference.epoch_logs[-1]["learning_rate"] == pytest.approx(0.025)
    report = equivalence.compare_runs(reference, candidate)
    assert report.equivalent, str(report)


def test_a_rerun_on_the_same_model_dir_resumes_exactly(tmp_path):
    """model_dir: a run stopped after epoch 1 and rerun for 2 epochs trains epoch 2 only,
    and its losses and final weights are those of one uninterrupted run."""
    build, x, y, fit_kwargs = user_models.case("dict_regression", "sgd_nesterov")
    whole = equivalence.train_keras("mirrored", build, x, y, fit_kwargs=fit_kwargs,
                                    simulate_devices=2)
    first_epoch = dict(fit_kwargs, epochs=1)
    first = equivalence.train_keras("mirrored", build, x, y, fit_kwargs=first_epoch,
                                    simulate_devices=2, model_dir=str(tmp_path))
    rest = equivalence.train_keras("mirrored", build, x, y, fit_kwargs=fit_kwargs,
                                   simulate_devices=2, model_dir=str(tmp_path))
    steps = user_models.EXAMPLES // user_models.GLOBAL_BATCH
    assert len(first.losses) == steps and len(rest.losses) == steps
    resumed = equivalence.Record("resumed", first.losses + rest.losses,
                                 rest.replica_weights["model"])
    equivalence.assert_equivalent(whole.record(), resumed)


def test_a_named_dataset_and_a_dataset_fn_train_like_one_device():
    """fit on a dataset name (its train split; evaluate reads its test split), and on a
    user's dataset_fn(input_context), under mirrored x2, equal to one device."""
    import keras
    import tensorflow as tf

    def build():
        model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                  keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y, _ = user_models.classification_arrays()

    def dataset_fn(context):
        """The user's own: in order, sharded by input pipeline, per-replica batches."""
        data = tf.data.Dataset.from_tensor_slices((x, y)).shard(
            context.num_input_pipelines, context.input_pipeline_id)
        return data.batch(context.get_per_replica_batch_size(32), drop_remainder=True).repeat()

    def build_mlp():
        model = user_models.softmax_classifier()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
        return model

    for data, builder, kwargs in (("digits", build, dict(batch_size=64, epochs=1)),
                                  (dataset_fn, build_mlp, dict(batch_size=32, epochs=2,
                                                               steps_per_epoch=5))):
        runs = [equivalence.train_keras(mode, builder, data, fit_kwargs=kwargs, **options)
                for mode, options in (("default", {}), ("mirrored", dict(simulate_devices=2)))]
        assert len(runs[0].losses) >= 10
        report = equivalence.compare_runs(*runs)
        assert report.equivalent, str(report)


def test_global_clipnorm_is_computed_over_every_pipeline_stage():
    """global_clipnorm under pipeline: the norm over all stages' gradients (each stage
    optimizer alone would clip by its own part), equal to one device; the threshold
    is low enough that every step clips."""
    import keras
    build, x, y, fit_kwargs = user_models.case("dict_regression", "sgd_nesterov")

    def clipped():
        model = user_models.two_input_regressor()
        model.compile(optimizer=keras.optimizers.Adam(1e-2, global_clipnorm=0.05), loss="mse")
        return model

    runs = [equivalence.train_keras(mode, clipped, x, y, fit_kwargs=fit_kwargs, **options)
            for mode, options in (("default", {}), ("pipeline", dict(
                simulate_devices=4, pipeline_stages=2, microbatches=2)))]
    report = equivalence.compare_runs(*runs)
    assert report.equivalent, str(report)


def test_every_validation_reads_one_whole_pass_of_one_kept_iterator():
    """Evaluations take their batches from one iterator per evaluation data
    (EvalData.batches): a new one per evaluation kept 13-21 KB of TensorFlow's memory
    each under tf.distribute (docs/benchmarks.md, Soak). With a learning rate of 0 the model never
    changes, so every epoch's validation must equal a fresh evaluation exactly: each
    reads one whole pass from its first batch (45 examples: the last global batch
    padded). An evaluation stopped part-way must not shift the next one."""
    import keras
    import tfdist
    from tfdist import api
    from tfdist.train import loop
    rng = np.random.default_rng(0)
    x = rng.normal(size=(70, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    x_val, y_val = x[:45], y[:45]
    strategy = tfdist.Strategy("mirrored", simulate_devices=2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.0), "mse", metrics=["mae"])
    history = strategy.fit(model, x, y, batch_size=16, epochs=3, verbose=0,
                           validation_data=(x_val, y_val))
    fresh = strategy.evaluate(model, x_val, y_val, batch_size=16, return_dict=True)
    assert history.history["val_loss"] == [fresh["loss"]] * 3
    assert history.history["val_mae"] == [fresh["mae"]] * 3

    data = api._Data.of(x_val, y_val, None, 16, False, "evaluation data")
    config = strategy._config_for(16, False)
    trainer = strategy._loop(model, config, data.sample_batch(config))
    evaluation = data.eval_data(config)

    class StopAtSecondBatch(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("stopped part-way")

    with pytest.raises(RuntimeError, match="stopped part-way"):
        trainer.evaluate(evaluation, keras.callbacks.CallbackList([StopAtSecondBatch()],
                                                                  model=model))
    assert trainer.evaluate(evaluation) == fresh
    kept = evaluation.batches(strategy.parallel)
    assert trainer.evaluate(evaluation) == fresh
    assert evaluation.batches(strategy.parallel) is kept and loop._LAST_ITERATORS["eval"] is kept
    strategy.close()
