"""Exact copies of the user's model: one per pipeline replica, and checkpoint host copies.

A copy is rebuilt layer by layer (a stage's variables must be created on its device,
placement.py), then takes the reference's weights. `keras.models.clone_model` alone
rebuilds each layer as `type(layer).from_config(layer.get_config())`, which is not
the model the user built:

- keras-io's custom layers (`def __init__(self, embed_dim, num_heads): super().__init__()`)
  crash it: Keras' automatic config records the constructor's arguments and adds
  `trainable` and `dtype`, which that `__init__` does not take. Without `name` or
  `**kwargs` in `__init__` the config also drops the layer's name.
- `__init__` rebuilds a custom layer's (or nested model's) sub-layers with their
  defaults: a sub-layer the user froze afterwards (`block.ffn.trainable = False`),
  or a weight made non-trainable, trains again.

So each layer is rebuilt from its config, and on a constructor that rejects the keys
Keras adds, again without them (its name, trainable flag and dtype policy are then set
as the original's). Nested functional and Sequential models are copied layer by layer
the same way, built on their stage's device. Once the copy is built, every sub-layer's
and every weight's `trainable` flag is copied from the original, matched by order;
the copy must hold the same sub-layer classes and dtype policies and the same weights
(shape, dtype, trainable or not) in the same order, or the layer is refused with a
UsageError naming it and the fix, before any training.
"""

import contextlib
import re
from typing import Callable, Optional

import keras
import tensorflow as tf

from tfdist.errors import UsageError, require
from tfdist.train.keras_fixes import all_layers

# Keys Keras' base Layer.get_config adds to every config; an __init__ without **kwargs
# does not take them.
BASE_KEYS = ("name", "trainable", "dtype")
# How Keras' from_config wraps the constructor's own error (keras/src/ops/operation.py).
WRAPPED = "Exception encountered:"
FIX = ("Fix: give its __init__ a **kwargs argument and pass it to super().__init__(**kwargs), "
       "and define get_config() returning every __init__ argument (from_config too if one is "
       "not plain data), so that keras.models.clone_model can rebuild it; or train with "
       "mirrored, multi_worker_mirrored or dtensor, which use the model as built.")


def copy_model(reference: keras.Model, call_function: Optional[Callable] = None,
               device_of: Callable[[str], Optional[str]] = lambda name: None) -> keras.Model:
    """A copy of functional `reference` with its weights, trainable flags and names.

    call_function(layer, *args, **kwargs) calls each top-level copy (placement.py calls
    it on its stage's device); device_of(layer name) is where a nested model is built."""
    refuse_shared_weights(reference)
    copier = _layer_copier(device_of)
    clone = keras.models.clone_model(reference, clone_function=copier,
                                     call_function=call_function)
    copies = {op.name: op for op in _top_layers(clone)}   # clone_model keeps every name
    for original in _top_layers(reference):
        match_layer(original, copies[original.name])
    _require_same_trainable_weights(reference, clone)
    clone.set_weights(reference.get_weights())
    return clone


def refuse_shared_weights(model: keras.Model) -> None:
    """Two top-level layers owning one variable (a head holding the token embedding
    layer) would be copied as two untied tables."""
    owner = {}
    for layer in _top_layers(model):
        for weight in getattr(layer, "weights", ()):   # a keras.ops call has none
            first = owner.setdefault(id(weight), layer)
            if first is not layer:
                raise UsageError(
                    f"Layer '{layer.name}' ({type(layer).__name__}) shares the weight "
                    f"'{weight.path}' with layer '{first.name}' ({type(first).__name__}); "
                    f"a pipeline copies every layer on its own, which would untie them. "
                    f"Use separate weights, or train with mirrored, multi_worker_mirrored "
                    f"or dtensor.")


def _layer_copier(device_of):
    def copy_layer(layer):
        if isinstance(layer, _GRAPH_MODELS):
            # Built here, so on its stage's device (clone_model calls this outside the
            # call_function that places the other layers).
            device = device_of(layer.name)
            with tf.device(device) if device else contextlib.nullcontext():
                return keras.models.clone_model(layer, clone_function=copy_layer)
        return rebuild_from_config(layer)
    return copy_layer


def rebuild_from_config(layer):
    """type(layer).from_config(layer.get_config()), retried without BASE_KEYS when the
    constructor rejects them; the copy gets the original's name and dtype policy."""
    config = _config_of(layer)
    try:
        copy = _from_config(layer, config)
    except TypeError:
        copy = _from_config_without_base_keys(layer, config)
    except Exception as error:
        raise UsageError(_cannot_copy(layer, "from_config(get_config()) failed", error)) from None
    if isinstance(layer, keras.layers.Layer):
        copy.name = layer.name   # stages find layers by name; an automatic config drops it
        if copy.dtype_policy.name != layer.dtype_policy.name:
            copy.dtype_policy = layer.dtype_policy
        copy.trainable = layer.trainable
    elif copy.name != layer.name:   # a keras.ops operation (x * 2) in a functional graph
        copy.name = layer.name
    return copy


def _from_config(layer, config: dict):
    config = dict(config)   # from_config may replace its entries (Lambda's function)
    if isinstance(layer, keras.layers.Lambda):
        # Keras' safe mode refuses a Python lambda read back from a config (since it
        # fails closed outside a deserialization scope, clone_model cannot copy one);
        # it guards files from elsewhere, and this function is the user's own, live in
        # this process. Canary: tests/test_pipeline_user_layers.py::
        # test_keras_lambda_from_config_still_takes_safe_mode.
        return type(layer).from_config(config, safe_mode=False)
    return type(layer).from_config(config)


def _config_of(layer) -> dict:
    try:
        return layer.get_config()
    except Exception as error:
        raise UsageError(_cannot_copy(layer, "get_config() failed", error)) from None


def _from_config_without_base_keys(layer, config: dict):
    trimmed = {key: value for key, value in config.items() if key not in BASE_KEYS}
    try:
        return _from_config(layer, trimmed)
    except Exception as error:
        raise UsageError(_cannot_copy(
            layer, "from_config(get_config()) failed, also without the keys Keras adds "
                   f"({', '.join(BASE_KEYS)})", error)) from None


def _cannot_copy(layer, why: str, error: Exception) -> str:
    return (f"Layer '{layer.name}' ({type(layer).__name__}) cannot be copied onto a "
            f"pipeline stage: {why} ({type(error).__name__}: {_gist(error)}). "
            f"--strategy=pipeline rebuilds every layer on its stage's device from its "
            f"config, as keras.models.clone_model does. {FIX}")


def _gist(error: Exception, limit: int = 300) -> str:
    """An upstream error's reason in one line: Keras' "Exception encountered:" paragraph
    when it wraps one, else its first paragraph (not its example code)."""
    paragraphs = [" ".join(line.strip() for line in block.splitlines() if line.strip())
                  for block in re.split(r"\n\s*\n", str(error))]
    paragraphs = [p for p in paragraphs if p] or [""]
    wrapped = [p for p in paragraphs if p.startswith(WRAPPED)]
    text = wrapped[0][len(WRAPPED):].strip() if wrapped else paragraphs[0]
    return text if len(text) <= limit else text[:limit] + "..."


def match_layer(original, copy) -> None:
    """Copies every trainable flag of `original`'s sub-layers and weights onto the built
    `copy`, after checking the copy has the same sub-layers and weights."""
    if not isinstance(original, keras.layers.Layer):
        return   # a keras.ops operation: no weights, no flags
    originals, copies = all_layers(original), all_layers(copy)
    require([type(x) for x in originals] == [type(x) for x in copies],
            _differs(original, "sub-layers", _classes(originals), _classes(copies)))
    require([x.dtype_policy.name for x in originals] == [x.dtype_policy.name for x in copies],
            _differs(original, "dtype policies", [x.dtype_policy.name for x in originals],
                     [x.dtype_policy.name for x in copies]))
    _require_same_weights(original, copy)
    for source, target in zip(originals, copies):
        # Parents come first: a parent's setter resets its children, set after it.
        if target.trainable != source.trainable:
            target.trainable = source.trainable
    for source, target in zip(original.weights, copy.weights):
        target.trainable = source.trainable   # add_weight(trainable=False), or set later


def _require_same_weights(original, copy) -> None:
    def signature(layer):
        return [(tuple(w.shape), str(w.dtype)) for w in layer.weights]
    require(signature(original) == signature(copy),
            _differs(original, "weights (shape, dtype)", signature(original), signature(copy)))


def _require_same_trainable_weights(reference, clone) -> None:
    """The optimizer of a stage trains exactly what the reference's would."""
    def trainable_mask(model):
        trainable = {id(v) for v in model.trainable_weights}
        return [(tuple(w.shape), id(w) in trainable) for w in model.weights]
    require(trainable_mask(reference) == trainable_mask(clone),
            f"The pipeline's copy of model '{reference.name}' does not hold the same "
            f"weights as the model (shape, trainable) in the same order: "
            f"{trainable_mask(clone)} vs {trainable_mask(reference)}. {FIX}")


def _differs(layer, what: str, expected, got) -> str:
    return (f"Layer '{layer.name}' ({type(layer).__name__}) cannot be copied onto a pipeline "
            f"stage: its copy rebuilt from get_config() has other {what} than the layer "
            f"(copy: {got}; layer: {expected}), so the copy would not compute what the "
            f"layer does (an attribute changed after construction is not in its config). {FIX}")


def _classes(layers) -> list:
    return [type(x).__name__ for x in layers]


def _top_layers(model) -> list:
    """The model's operations with weights or flags: layers and keras.ops calls, no inputs."""
    operations = model.operations if hasattr(model, "operations") else model.layers
    return [op for op in operations if not isinstance(op, keras.layers.InputLayer)]


# Keras exports no class for functional models (canary: the test named in
# keras_fixes.all_layers).
_GRAPH_MODELS = (keras.Sequential, keras.src.models.functional.Functional)
