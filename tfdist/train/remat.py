"""Activation recomputation: chosen layers of a model keep only their inputs for the
backward pass and run their forward pass again there, instead of keeping every
activation inside them (memory for compute, as "gradient checkpointing").

`remat=MODE` (`--remat=MODE`) takes Keras' RematScope mode names and applies them to a
model already built, one the user did not write for it, in every mode: each chosen
layer's `call` is wrapped in `tf.recompute_grad` on the model the mode trains (after the
mode copied or sharded it), so the same code runs under one device, mirrored,
multi_worker_mirrored, dtensor and the pipeline's stages.

- `full`: every layer of the model. A nested Keras model (a keras-hub backbone, a
  keras.applications base) is entered, not recomputed whole, so a transformer's blocks
  are what is recomputed, each once: recomputing a whole backbone would rebuild all its
  activations at once in the backward pass and save nothing.
- `larger_than`: those layers whose output holds more than `remat_threshold` values per
  example (Keras' `output_size_threshold`, default 1024).
- `list_of_layers`: the layers named by `remat_layers` (at any depth).
- `activations`: only the activation function of layers that have one (Dense(...,
  activation="gelu")), Keras' meaning.

Why not Keras' own RematScope: it applies when layers are created, so the user's model
code must run inside it, and on TensorFlow its `full` and `larger_than` modes fail in any
tf.function for a layer called with a keyword argument such as `training=`
(keras-team/keras#21207, open: `tf.custom_gradient` takes keyword arguments only
eagerly). Here keyword tensors are passed positionally and the rest by closure; the
canary tests/test_remat.py::test_keras_remat_scope_still_fails_in_a_tf_function
fails when Keras fixes it.

Exactness: a recomputed layer gives the same gradients (tests compare every mode with
and without it). What recomputation cannot give back is not recomputed, and said once:
a layer that draws random numbers while training (a second forward pass draws other
ones), one whose training call writes its own weights (BatchNormalization's moving
statistics would be updated twice), and one holding an Embedding (its sparse gradient
rows would come back as a dense tensor, which Keras' optimizers apply differently).
`list_of_layers` naming such a layer is refused before the first step.
"""

import functools
import logging
import math
from typing import Iterable, List, Optional

import keras
import tensorflow as tf

from tfdist import config
from tfdist.errors import UsageError, require
from tfdist.train import guarantee, split_state
from tfdist.train.keras_fixes import all_layers

log = logging.getLogger("tfdist")

MODES = config.REMAT_MODES   # validated in RunConfig (--remat, tfdist.Strategy(remat=...))
DEFAULT_THRESHOLD = 1024   # Keras' RematScope output_size_threshold


def apply(model, mode: Optional[str], layer_names: Iterable[str] = (),
          threshold: int = DEFAULT_THRESHOLD, where: str = "") -> List[str]:
    """Wraps the chosen layers of `model` (the one the steps call; before their first
    trace). Returns the names of the recomputed layers; logs the ones left out."""
    if mode is None or getattr(model, "_tfdist_remat", None) == mode:
        return recomputed_layers(model)
    model._tfdist_remat = mode
    if mode == "activations":
        chosen = [layer for layer in all_layers(model) if _has_activation(layer)]
        for layer in chosen:
            layer.activation = _recomputed(layer.activation)
        model._tfdist_recomputed = [layer.name for layer in chosen]
        return _said(where, mode, model._tfdist_recomputed, [])
    unsafe = _not_recomputable(model)
    if mode == "list_of_layers":
        candidates = _named(model, tuple(layer_names))
        refused = [f"{layer.name}: {unsafe[id(layer)]}" for layer in candidates
                   if id(layer) in unsafe]
        require(not refused,
                f"{where}--remat=list_of_layers cannot recompute {'; '.join(refused)}. "
                f"Leave those out of --remat_layers.")
    else:
        candidates = _blocks(model)
    left_out = [f"{layer.name} ({unsafe[id(layer)]})" for layer in candidates
                if id(layer) in unsafe]
    chosen = [layer for layer in candidates if id(layer) not in unsafe]
    if mode == "larger_than":
        chosen = [layer for layer in chosen if _values_per_example(layer) > threshold]
    for layer in chosen:
        layer.call = _recomputed_call(layer.call)
    model._tfdist_recomputed = [layer.name for layer in chosen]
    return _said(where, mode, model._tfdist_recomputed, left_out)


def adopt_keras_scopes(user_model, trained, where: str = "",
                       option: Optional[str] = None) -> List[str]:
    """Layers the user built under `keras.RematScope` are recomputed by tfdist's wrapping
    instead of Keras' (which fails in any tf.function on TensorFlow, keras-team/keras#21207),
    on the model the mode trains (a copy keeps no scope: clone_model rebuilds layers
    outside it), matched by name. Keras' mode per layer, with the same exclusions as
    the option (and `larger_than` counted per example, as the option counts it; Keras
    counts the whole output where the batch size is known); a nested model is entered, not recomputed whole. Returns the names
    recomputed. `option`: the run's remat; both at once is a UsageError.

    Private: Keras records a layer's scope only in `Operation._remat_mode` (no public
    accessor); the canary tests/test_remat.py::test_keras_still_records_the_remat_scope_on_each_layer
    fails when that changes."""
    marks = getattr(user_model, "_tfdist_keras_remat", None)
    if marks is None:   # read once: the marks are cleared below, and a new compile comes back
        marks = {layer.name: layer._remat_mode for layer in all_layers(user_model)
                 if getattr(layer, "_remat_mode", None) is not None}
        user_model._tfdist_keras_remat = marks
    if not marks or getattr(trained, "_tfdist_remat", None) is not None:
        return []
    require(option is None,   # before anything is wrapped
            f"{where}model '{user_model.name}' has layers built under keras.RematScope "
            f"({_listed(sorted(marks), 3)}) and remat={option!r} is set too: choose one.")
    trained._tfdist_remat = "keras.RematScope"
    for model in {id(user_model): user_model, id(trained): trained}.values():
        for layer in all_layers(model):
            if getattr(layer, "_remat_mode", None) is not None:
                layer._remat_mode = None   # Keras' own path off: tfdist's wrapping runs instead
    unsafe = _not_recomputable(trained)
    chosen, left_out = [], []
    for layer in all_layers(trained):
        mode = marks.get(layer.name)
        if mode is None or isinstance(layer, (keras.Model, keras.layers.InputLayer)):
            continue
        if mode.mode == "activations":
            if _has_activation(layer):
                layer.activation = _recomputed(layer.activation)
                chosen.append(layer.name)
            continue
        if mode.mode == "list_of_layers" and layer.name not in mode.layer_names:
            continue
        if (mode.mode == "larger_than"
                and _values_per_example(layer) <= mode.output_size_threshold):
            continue
        if id(layer) in unsafe:
            left_out.append(f"{layer.name} ({unsafe[id(layer)]})")
            continue
        layer.call = _recomputed_call(layer.call)
        chosen.append(layer.name)
    trained._tfdist_recomputed = chosen
    return _said(where, "keras.RematScope", chosen, left_out, "")


def recomputed_layers(model) -> List[str]:
    """The names of the layers tfdist recomputes in `model` (after apply)."""
    return list(getattr(model, "_tfdist_recomputed", []))


def _said(where: str, mode: str, chosen: List[str], left_out: List[str],
          option: str = "--remat=") -> List[str]:
    log.info("%s%s%s recomputes %d layer(s) in the backward pass: %s", where, option, mode,
             len(chosen), _listed(chosen))
    if chosen:
        _keep_recomputation_in_the_backward_pass(where)
    if left_out:
        log.warning("%s%s%s leaves out, to stay exact: %s", where, option, mode,
                    _listed(left_out))
    return chosen


def _keep_recomputation_in_the_backward_pass(where: str) -> None:
    """Turns off grappler's dependency optimizer, unless the user set it.

    tf.recompute_grad holds the recomputed forward pass back with control dependencies
    until the backward pass reaches it; the dependency optimizer removes them, so the
    recomputation runs early and its activations live as long as the originals would
    (tensorflow/tensorflow#57205, closed without a fix). Measured on an 8-block
    transformer (python -m benchmarks --suite=remat): with it on, --remat=full saves
    about 45% of the step's activations; off, over 80%."""
    options = tf.config.optimizer.get_experimental_options()
    if options.get("dependency_optimization") is not None:
        return   # set already: the user's own choice (or tfdist's) stands
    tf.config.optimizer.set_experimental_options({"dependency_optimization": False})
    log.info("%srecomputation: TensorFlow's dependency optimizer (grappler) is off in this "
             "process, since it would run the recomputation early and keep its activations "
             "(tf.config.optimizer.set_experimental_options({'dependency_optimization': "
             "True}) before training keeps it on).", where)


def _recomputed_call(call):
    """`call` under tf.recompute_grad. Floating tensors (positional or keyword) are its
    differentiable arguments; everything else (flags, integer ids, None) is closed over,
    since tf.custom_gradient takes no keyword arguments in a graph and would try to
    differentiate integers."""
    def recomputed(*args, **kwargs):
        flat = tf.nest.flatten((args, kwargs))
        slots = [i for i, value in enumerate(flat)
                 if tf.is_tensor(value) and value.dtype.is_floating]

        def forward(*tensors):
            values = list(flat)
            for slot, tensor in zip(slots, tensors):
                values[slot] = tensor
            inner_args, inner_kwargs = tf.nest.pack_sequence_as((args, kwargs), values)
            return call(*inner_args, **inner_kwargs)
        if not slots:   # nothing to differentiate through (an integer-only input)
            return call(*args, **kwargs)
        return tf.recompute_grad(forward)(*[flat[slot] for slot in slots])
    return recomputed


def _recomputed(activation):
    """The activation under tf.recompute_grad, keeping its name (Keras serialises an
    activation by name when the model is saved)."""
    recompute = tf.recompute_grad(lambda x: activation(x))

    @functools.wraps(activation)
    def recomputed(x):
        return recompute(x)
    return recomputed


def _blocks(model) -> list:
    """The layers `full` recomputes: the model's own layers, nested models entered."""
    found = []
    for layer in _children(model):
        if isinstance(layer, keras.Model):
            found.extend(_blocks(layer))
        elif not isinstance(layer, keras.layers.InputLayer):
            found.append(layer)
    return found


def _children(layer) -> list:
    # keras.Model.layers lists a model's direct layers (Functional, Sequential and subclassed).
    return list(getattr(layer, "layers", []))


def _named(model, names) -> list:
    by_name = {layer.name: layer for layer in all_layers(model) if layer is not model}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise UsageError(
            f"--remat_layers names {', '.join(unknown)}, which model '{model.name}' does not "
            f"have. Its layers: {_listed(sorted(by_name), 12)}.")
    return [by_name[name] for name in names]


def _not_recomputable(model) -> dict:
    """id(layer) -> why, for every layer (at any depth) a second forward pass would not
    repeat: the reason of any of its sub-layers makes it unsafe too."""
    written = {id(weight) for weight in split_state.written_weights(model)}
    reasons = {}
    for layer in all_layers(model):
        if layer is model:
            continue
        for inner in all_layers(layer):
            reason = _reason(inner, written)
            if reason:
                reasons[id(layer)] = reason if inner is layer else f"its {inner.name}: {reason}"
                break
    return reasons


def _reason(layer, written: set) -> Optional[str]:
    if isinstance(layer, keras.layers.Embedding):
        return "an embedding, whose gradient is sparse rows"
    if any(id(weight) in written for weight in layer.weights):
        return "its training call writes its weights"
    if (any(isinstance(value, keras.random.SeedGenerator) for value in vars(layer).values())
            and not guarantee.switched_off(layer)):
        return "draws random numbers while training"
    return None


def _has_activation(layer) -> bool:
    activation = getattr(layer, "activation", None)
    return callable(activation) and activation is not keras.activations.linear


def _values_per_example(layer) -> int:
    """Values per example of the layer's output (its first inbound node's; a layer never
    called symbolically counts as large, so it is recomputed)."""
    try:
        outputs = layer.output
    except (AttributeError, ValueError):
        return math.inf
    shapes = [tensor.shape for tensor in keras.tree.flatten(outputs)]
    return sum(math.prod(dim or 1 for dim in shape[1:]) for shape in shapes)


def _listed(names: List[str], most: int = 6) -> str:
    return (", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most
                                        else "")) or "none"
