"""What tfdist's guarantee (every mode trains to one device's numbers) does not cover
in a given model, said once before training rather than found after it.

- Layers whose training output is random (Dropout, GaussianNoise, random
  augmentation): a mode draws their random numbers per replica, shard or stage, so
  no mode repeats one device's draws. Exactness holds with them at rate 0.
- A bias whose every use is a BatchNormalization over its channels (keras-io's
  Conv1D -> BatchNormalization): in training the normalisation subtracts the batch
  mean, the bias with it, so its gradient is zero in exact arithmetic and rounding
  noise in float32. Optimizers that divide by the gradient's own magnitude (Adam,
  RMSprop, Adagrad...) turn that noise into steps of about the learning rate, which
  differ with any change in the order of the sums, one device against itself
  included. The loss does not see it; the bias and that layer's moving mean do.
- The key bias of an attention layer (MultiHeadAttention and its subclasses): it adds
  the same query . bias to every key's score of a query, which the softmax over keys
  cancels, so its gradient is rounding noise too, amplified the same way (keras-io's
  Vision Transformer under Adam: 1.7e-5 absolute apart under mirrored after 8 steps;
  benchmarks/results/conformance.md).
"""

import logging
from typing import List

import keras

from tfdist.train import keras_fixes

log = logging.getLogger("tfdist")


def stochastic_layers(model) -> List[str]:
    """Layers that draw random numbers while training: each holds a
    keras.random.SeedGenerator (Dropout, GaussianNoise, RandomFlip, ...)."""
    return [f"{layer.name} ({type(layer).__name__})"
            for layer in keras_fixes.all_layers(model)
            if any(isinstance(value, keras.random.SeedGenerator)
                   for value in vars(layer).values()) and not switched_off(layer)]


# Knobs that, all at 0, switch a layer's randomness off. Recurrent cells (LSTMCell,
# GRUCell, SimpleRNNCell) hold their SeedGenerator whatever their rates, and draw only for
# dropout or recurrent_dropout: keras-io's Bidirectional LSTM built at rate 0 was announced
# as random (conformance run, 2026-12-06).
SWITCHES = (("rate",), ("stddev",), ("dropout", "recurrent_dropout"))


def switched_off(layer) -> bool:
    """Dropout-like layers at rate 0, noise at stddev 0 and recurrent cells at dropout and
    recurrent_dropout 0 draw nothing (Keras skips them)."""
    for knobs in SWITCHES:
        values = [getattr(layer, knob, None) for knob in knobs]
        if all(isinstance(value, (int, float)) and value == 0 for value in values):
            return True
    return False


def biases_cancelled_by_batch_norm(model) -> List[str]:
    """Paths of the biases (and the following BatchNormalization's moving mean) of
    layers whose output feeds only a BatchNormalization over its last axis, when the
    model's optimizer amplifies their rounding noise (not plain SGD): what `announce`
    says is not one device's."""
    if not _amplifies_noise(getattr(model, "optimizer", None)):
        return []
    paths = []
    for producer, norm in _bias_then_batch_norm(model):
        paths += [producer.bias.path, norm.moving_mean.path]
    return paths


def attention_key_biases(model) -> List[str]:
    """Paths of the key biases of the model's attention layers, when its optimizer
    amplifies their rounding noise: what `announce` says is not one device's."""
    if not _amplifies_noise(getattr(model, "optimizer", None)):
        return []
    return [weight.path for layer in _attention_layers(model)
            for weight in layer.trainable_weights if weight.path.endswith("/key/bias")]


def not_covered(model) -> List[str]:
    """Every variable path `announce` names as not one device's (random layers aside)."""
    return biases_cancelled_by_batch_norm(model) + attention_key_biases(model)


def _attention_layers(model) -> List:
    return [layer for layer in keras_fixes.all_layers(model)
            if isinstance(layer, keras.layers.MultiHeadAttention)]


def _amplifies_noise(optimizer) -> bool:
    """SGD (with or without momentum) steps in proportion to the gradient, so rounding
    noise stays rounding noise; optimizers that divide by the gradient's running
    magnitude (Adam, RMSprop, Adagrad, ...) do not. Unknown: assume they amplify."""
    return optimizer is None or not isinstance(optimizer, keras.optimizers.SGD)


def announce(model, mode: str) -> None:
    """Logs, once per model, what the guarantee does not cover in it."""
    if getattr(model, "_tfdist_announced", False):
        return
    model._tfdist_announced = True
    random_layers = stochastic_layers(model)
    if random_layers:
        log.warning(
            "%s: %s draw random numbers while training; tfdist's modes draw them per "
            "replica, shard or stage, so this model does not train to one device's numbers "
            "step for step (exactness holds with them at rate 0).", mode,
            # Every one named: each is a layer the user must set to rate 0 to compare.
            ", ".join(random_layers))
    pairs = _bias_then_batch_norm(model) if _amplifies_noise(model.optimizer) else []
    if pairs:
        log.warning(
            "%s: the bias of %s feeds only BatchNormalization, which subtracts it in "
            "training: its gradient is zero up to rounding, which %s turns into steps of "
            "about the learning rate, different under any split of the batch (one device "
            "included). The loss is unaffected; those biases and the moving means after "
            "them are not one device's. Build those layers with use_bias=False to "
            "train them exactly.", mode,
            _listed([producer.name for producer, _ in pairs]), _optimizer_name(model))
    keyed = [layer.name for layer in _attention_layers(model)
             if any(w.path.endswith("/key/bias") for w in layer.trainable_weights)]
    if keyed and _amplifies_noise(model.optimizer):
        log.warning(
            "%s: the key bias of %s adds the same amount to every key's score, which the "
            "attention's softmax cancels: its gradient is zero up to rounding, which %s "
            "turns into steps of about the learning rate, different under any split of the "
            "batch (one device included). The loss is unaffected; those key biases are not "
            "one device's. Build the attention with use_bias=False, or train with SGD, to "
            "compare them exactly.", mode, _listed(keyed), _optimizer_name(model))


def _optimizer_name(model) -> str:
    optimizer = getattr(model, "optimizer", None)
    return type(optimizer).__name__ if optimizer is not None else "an adaptive optimizer"


def _listed(names: List[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _bias_then_batch_norm(model) -> List:
    """(layer with a bias, BatchNormalization) pairs where the layer's output has no
    other consumer and the normalisation runs over the bias's (last) axis. Graph
    models only (functional, Sequential): a subclassed call() has no graph to read."""
    layers = [layer for layer in getattr(model, "layers", []) if _called_once(layer)]
    operations = [op for op in getattr(model, "operations", layers) if _called_once(op)]
    outputs = [id(t) for t in keras.tree.flatten(model.outputs)] if layers else []
    pairs = []
    for norm in layers:
        if not _normalises_last_axis(norm):
            continue
        producer = next((layer for layer in layers if layer.output is norm.input), None)
        if (producer is not None and getattr(producer, "bias", None) is not None
                and getattr(producer, "use_bias", True)
                and _consumers(operations, norm.input) == 1 and id(norm.input) not in outputs):
            pairs.append((producer, norm))
    return pairs


def _normalises_last_axis(layer) -> bool:
    """A BatchNormalization of one input over its last (channel) axis."""
    return (isinstance(layer, keras.layers.BatchNormalization)
            and not isinstance(layer.input, (list, tuple, dict))
            and layer.axis in (-1, len(layer.input.shape) - 1))


def _called_once(layer) -> bool:
    """Whether layer.input / layer.output are defined (Keras raises for a layer called
    more than once, or never)."""
    try:
        return layer.input is not None and layer.output is not None
    except (AttributeError, ValueError):
        return False


def _consumers(operations, tensor) -> int:
    return sum(1 for op in operations
               if any(t is tensor for t in keras.tree.flatten(op.input)))
