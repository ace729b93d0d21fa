"""The optimizer update for sharded variables, written out in TF ops.

Keras' own `optimizer.apply` is exact on DTensor variables for SGD, but not for
stateful rules on a batch-sharded mesh: measured on the transformer with
momentum on mesh batch=4,model=1 (every variable replicated, all slots
DVariables), the losses left the single-device run at step 2 (0.34 relative
by step 20), while sgd matched to 1e-7. Keras' update writes a slot and then
reads it back (`m.assign(...)`, then `variable.assign_add(m)`; Adam's
`m.assign_add(...)` then a read of m and v), which relies on the ordering of
resource reads after writes; inside DTensor's lowered SPMD program that
ordering is evidently not kept. (A nested tf.function for the loss and gradients
made the same drift appear on the MLP.)

So each rule here reads every slot and the parameter ONCE, computes the new
values as tensors, writes them, and never reads a written value back. The
arithmetic is Keras 3.15's `optimizer.apply` on the TensorFlow backend,
operation for operation, applied shard by shard:
  1. gradients that are None are skipped (no decay, no update);
  2. clipping (clipnorm / global_clipnorm / clipvalue) on the whole gradient
     list, tfdist/train/clipping.py (the gradients are the full logical ones,
     so the norms are global);
  3. decoupled weight decay, var -= var * wd * lr, before the rule, for every
     optimizer with `weight_decay` set, honouring exclude_from_weight_decay;
  4. the rule of SGD (momentum, nesterov), Adam / AdamW (amsgrad too), RMSprop (rho,
     momentum, centered) or Adagrad, at lr = the schedule's value at the
     current `iterations` (evaluated once: Keras evaluates it at the same step
     for the decay and the rule);
  5. the variable's constraint, if any; then iterations += 1.
Anything else is a UsageError before training (check_supported).
"""

from typing import Callable, Dict, Mapping

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.errors import UsageError
from tfdist.train import clipping

# Exact types: a subclass may override update_step, which these rules would ignore.
SUPPORTED = (keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW,
             keras.optimizers.RMSprop, keras.optimizers.Adagrad)
SUPPORTED_TEXT = "SGD (momentum, nesterov), Adam, AdamW, RMSprop, Adagrad"
# Options the rules do not reproduce: (attribute, its value when off).
UNSUPPORTED_OPTIONS = (("use_ema", False),
                       ("gradient_accumulation_steps", None), ("loss_scale_factor", None))


def check_supported(optimizer, variables=None) -> None:
    """UsageError unless the rules below reproduce `optimizer.apply` exactly.

    With the (sharded) trainable `variables`, also the checks that need them;
    call it so before the step is traced: apply() repeats them, but an error
    raised while autograph traces reaches the user as a StagingError with a
    traceback.
    """
    name = type(optimizer).__name__
    if type(optimizer) not in SUPPORTED:
        raise UsageError(
            f"--strategy=dtensor updates sharded variables exactly with {SUPPORTED_TEXT}; "
            f"got {name}. Keras' own optimizer.apply is not exact on sharded variables for "
            f"stateful rules, so tfdist writes each rule out and refuses the others (and "
            f"subclasses, whose update_step it cannot see). Use one of those, or a "
            f"tf.distribute strategy (mirrored, multi_worker_mirrored), which runs any Keras "
            f"optimizer.")
    for option, off in UNSUPPORTED_OPTIONS:
        value = getattr(optimizer, option, off)
        if value not in (off, None, 0):
            raise UsageError(
                f"--strategy=dtensor updates sharded variables exactly with {SUPPORTED_TEXT} "
                f"and the options weight_decay, exclude_from_weight_decay, learning-rate "
                f"schedules, clipnorm, clipvalue and global_clipnorm; got {name}({option}="
                f"{value!r}). Create the optimizer without {option}.")
    if variables is not None:
        _check_no_overwrite_with_gradient(variables)
        _check_weight_decay_exclusions(optimizer, variables)


def apply(optimizer, slots, grads, variables, layouts, update_layouts=None,
          gradients_sharded: bool = False) -> None:
    """One update of `variables` (Keras variables) by `grads`; then iterations += 1.

    `slots` maps (parameter path, slot name) -> the optimizer's slot variable
    (tfdist.parallel.dtensor.sharding.build_sharded_optimizer records them);
    `layouts` are the variables' layouts. The update is computed in `update_layouts`
    (the slots' layouts: a variable's own, or under --zero_stage its slice of it, zero.py)
    and written back in the variable's layout. The gradients are brought to the
    variable's layout first (all-reduced), or with `gradients_sharded` straight to
    the update's (reduce-scattered: ZeRO stage 2 and 3).
    """
    check_supported(optimizer, variables)
    update_layouts = update_layouts or layouts
    present = [(g, v, l, u) for g, v, l, u in zip(grads, variables, layouts, update_layouts)
               if g is not None]
    if not present:
        raise UsageError(f"No gradients for any of the {len(variables)} trainable variables: "
                         f"the loss does not depend on them.")
    clipped = clipping.clip_like_keras([g for g, _, _, _ in present], optimizer)
    learning_rate = optimizer.learning_rate  # a schedule is evaluated at `iterations` here
    rule = RULES[type(optimizer)]
    for grad, (_, variable, layout, target) in zip(clipped, present):
        dtype = variable.dtype
        moved = target != layout   # --zero_stage: the update runs on this device's slice
        grad, square = densify(grad, target if gradients_sharded else layout)
        if moved and not gradients_sharded:   # a slice of the all-reduced gradient
            grad, square = _relayout(grad, target), _relayout(square, target)
        grad = tf.cast(grad, dtype)
        square = tf.square(grad) if square is None else tf.cast(square, dtype)
        lr = tf.cast(learning_rate, dtype)
        current = variable.value.read_value()
        current = _relayout(current, target) if moved else current
        if optimizer.weight_decay is not None and _decays(optimizer, variable):
            current = current - current * tf.cast(optimizer.weight_decay, dtype) * lr
        new = rule(optimizer, _Slots(slots, variable.path), grad, square, lr, current)
        if variable.constraint is not None:
            new = variable.constraint(new)
        variable.assign(_relayout(new, layout) if moved else new)   # gathered back
    optimizer.iterations.assign_add(1)


def _relayout(tensor, layout):
    return None if tensor is None else dtensor.relayout(tensor, layout)


def densify(grad, layout):
    """(gradient, its elementwise square) as dense tensors with `layout`; square None if dense.

    Bug-compatible with Keras on purpose: for a tf.IndexedSlices gradient (an
    embedding lookup), Keras' `ops.square` squares each slice BEFORE slices of
    the same row are summed (keras.src.backend.tensorflow.sparse.
    elementwise_unary), so Adam's and RMSprop's second moment and Adagrad's
    accumulator get sum(g_i^2), not (sum g_i)^2, for a token seen several times
    in a batch. The single-device run does that, so we do too (measured: without
    it the transformer's Adam losses drifted 5.7e-3 from default by step 20).
    Every other operation of the rules is linear in the gradient, where slices
    and their dense sum agree.
    """
    if isinstance(grad, tf.IndexedSlices):
        square = tf.IndexedSlices(tf.square(grad.values), grad.indices, grad.dense_shape)
        dense, square = tf.convert_to_tensor(grad), tf.convert_to_tensor(square)
    else:
        dense = tf.convert_to_tensor(grad)
        square = None
    dense = dtensor.relayout(dense, layout)
    if square is not None:
        square = dtensor.relayout(square, layout)
    return dense, square


class _Slots:
    """One parameter's slots: read once (`read`), written once (`write`)."""

    def __init__(self, slots: Mapping, path: str):
        self.slots, self.path = slots, path

    def read(self, name: str) -> tf.Tensor:
        return self.slots[(self.path, name)].value.read_value()

    def write(self, name: str, value: tf.Tensor) -> None:
        self.slots[(self.path, name)].assign(value)


def _decays(optimizer, variable) -> bool:
    """Keras' own decision (name pattern and var_list), on the storage it consults.

    Private Keras API: `_use_weight_decay`, which the TF backend's optimizer
    calls with the backing tf.Variable (here the DVariable); no public getter
    for exclude_from_weight_decay exists (it came in keras-team/keras#16274
    without one). Canary: tests/test_dtensor_optimizers.py::
    test_keras_weight_decay_decision_canary.
    """
    return optimizer._use_weight_decay(variable.value)


def _check_weight_decay_exclusions(optimizer, variables) -> None:
    """exclude_from_weight_decay(var_list=...) keys variables by their storage's id.

    Sharding replaces each variable's storage (sharding.give_dtensor_storage), so
    a var_list given before the model was sharded names storage that no longer
    trains: Keras would silently decay those variables. Refuse instead.
    Private Keras API, as in _decays (canary in the same test).
    """
    excluded = getattr(optimizer, "_exclude_from_weight_decay", None) or set()
    if optimizer.weight_decay is None or not excluded:
        return
    known = {optimizer._var_key(v) for v in variables}
    stale = len(excluded - known)
    if stale:
        raise UsageError(
            f"--strategy=dtensor: {stale} of the {len(excluded)} variables given to "
            f"{type(optimizer).__name__}.exclude_from_weight_decay(var_list=...) are not "
            f"among the sharded model's {len(variables)} trainable variables (sharding gives "
            f"every variable new storage, so a var_list taken before the model was sharded "
            f"no longer matches). Call exclude_from_weight_decay inside the optimizer "
            f"builder, after sharding, or use var_names=[...] (matched by name).")


def _check_no_overwrite_with_gradient(variables) -> None:
    # Keras assigns such variables (float8 scales) their gradient instead of updating them.
    overwritten = [v.path for v in variables if getattr(v, "overwrite_with_gradient", False)]
    if overwritten:
        raise UsageError(
            f"--strategy=dtensor does not update variables with overwrite_with_gradient=True "
            f"(float8 training); got {overwritten[:5]}. Train them with a tf.distribute "
            f"strategy.")


# ---- the rules: (optimizer, slots, grad, square, lr, current value) -> new value ----------

def _sgd(optimizer, slots, grad, square, lr, current):
    if optimizer.momentum == 0:  # Keras' test: `if self.momentum != 0` makes the slot
        return current - grad * lr
    momentum = tf.cast(optimizer.momentum, current.dtype)
    m = slots.read("momentum") * momentum - grad * lr
    slots.write("momentum", m)
    if optimizer.nesterov:
        return current + (m * momentum - grad * lr)
    return current + m


def _adam(optimizer, slots, grad, square, lr, current):
    dtype = current.dtype
    local_step = tf.cast(optimizer.iterations + 1, dtype)
    beta_1_power = tf.pow(tf.cast(optimizer.beta_1, dtype), local_step)
    beta_2_power = tf.pow(tf.cast(optimizer.beta_2, dtype), local_step)
    alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    m_old, v_old = slots.read("momentum"), slots.read("velocity")
    m = m_old + (grad - m_old) * (1 - optimizer.beta_1)
    v = v_old + (square - v_old) * (1 - optimizer.beta_2)
    slots.write("momentum", m)
    slots.write("velocity", v)
    if optimizer.amsgrad:  # the step divides by the running maximum of v instead
        v = tf.maximum(slots.read("velocity_hat"), v)
        slots.write("velocity_hat", v)
    return current - (m * alpha) / (tf.sqrt(v) + optimizer.epsilon)


def _rmsprop(optimizer, slots, grad, square, lr, current):
    rho = optimizer.rho
    velocity = rho * slots.read("velocity") + (1 - rho) * square
    slots.write("velocity", velocity)
    if optimizer.centered:
        average = rho * slots.read("average_gradient") + (1 - rho) * grad
        slots.write("average_gradient", average)
        denominator = velocity - tf.square(average) + optimizer.epsilon
    else:
        denominator = velocity + optimizer.epsilon
    increment = (lr * grad) / tf.sqrt(denominator)
    if optimizer.momentum > 0:  # Keras' test for making the momentum slot
        momentum = optimizer.momentum * slots.read("momentum") + increment
        slots.write("momentum", momentum)
        return current - momentum
    return current - increment


def _adagrad(optimizer, slots, grad, square, lr, current):
    accumulator = slots.read("accumulator") + square
    slots.write("accumulator", accumulator)
    return current - (lr * grad) / tf.sqrt(accumulator + optimizer.epsilon)


Rule = Callable[..., tf.Tensor]
RULES: Dict[type, Rule] = {
    keras.optimizers.SGD: _sgd,
    keras.optimizers.Adam: _adam,
    keras.optimizers.AdamW: _adam,  # AdamW is Adam plus the generic decay above
    keras.optimizers.RMSprop: _rmsprop,
    keras.optimizers.Adagrad: _adagrad,
}
