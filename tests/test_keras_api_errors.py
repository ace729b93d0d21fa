"""Bad input to the public API: one paragraph, raised before training, naming what
was received and what would work (never a TensorFlow traceback, never a hang)."""

import keras
import numpy as np
import pytest

import tfdist
import user_models
from tfdist.errors import UsageError


def one_paragraph(error) -> str:
    text = str(error.value)
    assert "\n" not in text.strip() and "Traceback" not in text, text
    return text


def regressor(loss="mse", optimizer="sgd"):
    model = user_models.two_input_regressor()
    model.compile(optimizer=optimizer, loss=loss)
    return model


def test_a_loss_that_averages_the_batch_itself_is_refused():
    x, y, _ = user_models.regression_arrays(64)
    strategy = tfdist.Strategy("mirrored", simulate_devices=2)
    with strategy.scope():
        model = regressor(loss=lambda y_true, y_pred: keras.ops.mean((y_true - y_pred) ** 2))
    with pytest.raises(UsageError) as error:
        strategy.fit(model, x, y, batch_size=32, verbose=0)
    assert "one value per example" in one_paragraph(error)


def test_labels_that_do_not_fit_the_output_are_refused():
    x, _, _ = user_models.regression_arrays(64)
    labels = np.zeros((64, 3), "float32")   # the model has one output unit
    strategy = tfdist.Strategy("default")
    model = regressor()
    with pytest.raises(UsageError) as error:
        strategy.fit(model, x, labels, batch_size=32, verbose=0)
    text = one_paragraph(error)
    assert "(1, 3)" in text and "(1, 1)" in text and "mse" in text


def test_features_the_model_cannot_take_are_refused():
    strategy = tfdist.Strategy("default")
    model = regressor()
    with pytest.raises(UsageError) as error:
        strategy.fit(model, np.zeros((64, 7), "float32"), np.zeros((64, 1), "float32"),
                     batch_size=32, verbose=0)
    assert "cannot take the data's features" in one_paragraph(error)


def test_an_uncompiled_model_is_refused():
    strategy = tfdist.Strategy("default")
    x, y, _ = user_models.regression_arrays(64)
    with pytest.raises(UsageError) as error:
        strategy.fit(user_models.two_input_regressor(), x, y, batch_size=32, verbose=0)
    assert "model.compile(" in one_paragraph(error)


def test_a_model_built_outside_the_scope_is_refused():
    strategy = tfdist.Strategy("mirrored", simulate_devices=2)
    model = regressor()           # not in strategy.scope(): plain variables
    x, y, _ = user_models.regression_arrays(64)
    with pytest.raises(UsageError) as error:
        strategy.fit(model, x, y, batch_size=32, verbose=0)
    assert "strategy.scope()" in one_paragraph(error)


def test_a_batch_the_replicas_cannot_split_is_refused():
    strategy = tfdist.Strategy("mirrored", simulate_devices=2)
    with strategy.scope():
        model = regressor()
    x, y, _ = user_models.regression_arrays(64)
    with pytest.raises(UsageError) as error:
        strategy.fit(model, x, y, batch_size=33, verbose=0)
    assert "not divisible by the 2 replicas" in one_paragraph(error)


def test_a_subclassed_model_cannot_be_pipelined():
    strategy = tfdist.Strategy("pipeline", simulate_devices=2, pipeline_stages=2)
    model = user_models.SubclassedClassifier()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x, y, _ = user_models.classification_arrays(64)
    with pytest.raises(UsageError) as error:
        strategy.fit(model, x, y, batch_size=32, verbose=0)
    text = one_paragraph(error)
    assert "subclassed" in text and "functional" in text and "pipeline_split" in text
    assert "--" not in text   # the Python argument, not the CLI flag


def test_a_cut_that_too_many_tensors_cross_is_refused_with_how_to_fix_it():
    from tfdist.parallel.pipeline import partition
    inputs = keras.Input((8,))
    branches = [keras.layers.Dense(4, name=f"branch_{i}")(inputs)
                for i in range(partition.MAX_BOUNDARY_TENSORS + 1)]
    out = keras.layers.Dense(1, name="out")(keras.layers.Concatenate(name="join")(branches))
    model = keras.Model(inputs, out)
    model.compile(optimizer="sgd", loss="mse")
    strategy = tfdist.Strategy("pipeline", simulate_devices=2, pipeline_stages=2,
                               pipeline_split=("join",))
    with pytest.raises(UsageError) as error:
        strategy.fit(model, np.zeros((64, 8), "float32"), np.zeros((64, 1), "float32"),
                     batch_size=32, verbose=0)
    text = one_paragraph(error)
    assert f"{partition.MAX_BOUNDARY_TENSORS + 1} tensors cross the cut before 'join'" in text
    assert "between blocks" in text


def test_unknown_strategy_options_are_refused_with_the_valid_ones():
    with pytest.raises(UsageError) as error:
        tfdist.Strategy("mirrored", simulate_device=2)
    text = one_paragraph(error)
    assert "simulate_device" in text and "simulate_devices" in text


def test_a_non_keras_model_is_refused():
    strategy = tfdist.Strategy("default")
    with pytest.raises(UsageError) as error:
        strategy.fit(object(), np.zeros((4, 2)), np.zeros((4,)), batch_size=2, verbose=0)
    assert "keras.Model" in one_paragraph(error)


def test_arrays_without_labels_are_refused_by_fit_and_evaluate():
    """(predict takes features alone; fit and evaluate would train on made-up labels.)"""
    strategy = tfdist.Strategy("default")
    model = regressor()
    x, _, _ = user_models.regression_arrays(64)
    for call in (lambda: strategy.fit(model, x, batch_size=32, verbose=0),
                 lambda: strategy.evaluate(model, x, batch_size=32)):
        with pytest.raises(UsageError) as error:
            call()
        assert "arrays without labels: give y" in one_paragraph(error)
    assert strategy.predict(model, x).shape == (64, 1)
