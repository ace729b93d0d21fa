"""Checks of a user's compiled model against one example of their data, before any
step is traced: a mistake here is a one-paragraph UsageError, not a TensorFlow
traceback from inside a distributed step."""

import keras
import tensorflow as tf

from tfdist.errors import UsageError
from tfdist.train import step as step_math


def check_model_on_example(model, sample_batch, predict=None) -> None:
    """The model runs on the features, the compiled loss fits its output and the
    labels, and each loss function returns one value per example. `predict(x)` runs
    the model where it cannot be called eagerly on plain tensors (a sharded one)."""
    x, y, w = step_math.split_batch(sample_batch)
    x, y, w = step_math.first_example((x, y, w))
    try:
        y_pred = predict(x) if predict else model(x, training=False)
    except (ValueError, TypeError) as error:
        raise UsageError(f"Model '{model.name}' cannot take the data's features "
                         f"({_shapes(x)}): {_first_line(error)}") from None
    _check_per_example_losses(model, y, y_pred)
    _check_label_shape(model, y, y_pred)
    try:
        model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=w, training=False)
    except (ValueError, TypeError, tf.errors.InvalidArgumentError) as error:
        raise UsageError(
            f"The labels ({_shapes(y)}) do not fit the output of model '{model.name}' "
            f"({_shapes(y_pred)}) for its loss {_loss_names(model)}: {_first_line(error)} "
            f"Check the loss (e.g. sparse_categorical_crossentropy takes integer class "
            f"labels, categorical_crossentropy one-hot ones, mse targets shaped like the "
            f"output).") from None


def _check_per_example_losses(model, y, y_pred) -> None:
    """A plain loss function must return one value per example: Keras then reduces it
    by the replica-aware rule; an already-averaged scalar would be summed over the
    replicas unscaled, so no mode would equal one device."""
    for loss in keras.tree.flatten(model.loss):
        if isinstance(loss, (str, keras.losses.Loss)) or not callable(loss):
            continue
        if not (isinstance(y, tf.Tensor) and isinstance(y_pred, tf.Tensor)):
            continue   # several outputs: Keras maps them; their shapes are Keras' to check
        try:
            value = loss(y, y_pred)
        except (ValueError, TypeError, tf.errors.InvalidArgumentError):
            return   # compute_loss below reports it with the shapes
        if getattr(value, "shape", None) is not None and value.shape.rank == 0:
            raise UsageError(
                f"The loss function {getattr(loss, '__name__', loss)!r} returns one number "
                f"for the whole batch (shape ()); it must return one value per example "
                f"(shape (batch,) or (batch, ...)), as Keras' own losses do, and let Keras "
                f"reduce it. Remove the final mean or sum from it.")


def _check_label_shape(model, y, y_pred) -> None:
    """Keras broadcasts (batch, 3) labels against a (batch, 1) output without a word;
    the loss is then not the one the user meant. A sparse loss takes class indices,
    shaped like the output without its class axis (or with it as 1); any other loss
    takes labels shaped like the output."""
    if not (isinstance(y, tf.Tensor) and isinstance(y_pred, tf.Tensor)):
        return
    losses = keras.tree.flatten(model.loss)
    if len(losses) != 1:
        return
    label, output = tuple(y.shape), tuple(y_pred.shape)
    if "sparse" in _loss_names(model).lower():
        fits = label in (output[:-1], output[:-1] + (1,))
        expected = f"{output[:-1]} (class indices)"
    else:
        fits = label == output or (output[-1:] == (1,) and label == output[:-1])
        expected = str(output)
    if not fits:
        raise UsageError(
            f"The labels (shape {label}) do not fit the output of model '{model.name}' "
            f"(shape {output}) for its loss {_loss_names(model)}: it expects labels of shape "
            f"{expected}. Check the labels or the loss (sparse_categorical_crossentropy takes "
            f"integer class labels, categorical_crossentropy one-hot ones, mse targets "
            f"shaped like the output).")


def _shapes(structure) -> str:
    shapes = tf.nest.map_structure(lambda t: tuple(getattr(t, "shape", ())), structure)
    return f"shape {shapes}" if not isinstance(shapes, dict) else f"shapes {shapes}"


def _loss_names(model) -> str:
    return ", ".join(getattr(loss, "name", None) or getattr(loss, "__name__", str(loss))
                     for loss in keras.tree.flatten(model.loss))


def _first_line(error) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:300]
