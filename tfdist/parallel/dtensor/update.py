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

So each rule here reads every slot ONCE, computes the new values as tensors,
writes them, and updates the parameter from the computed tensors, never from
a re-read. The arithmetic is Keras 3.15's, operation for operation (the update
rules of keras.optimizers.SGD / Adam / AdamW), applied shard by shard.
Supported: SGD (with or without momentum / nesterov), Adam, AdamW; anything
else is a UsageError before training.
"""

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist.errors import UsageError

SUPPORTED = (keras.optimizers.AdamW, keras.optimizers.Adam, keras.optimizers.SGD)


def check_supported(optimizer) -> None:
    if type(optimizer) not in SUPPORTED:
        raise UsageError(
            f"--strategy=dtensor updates sharded variables with its own exact rules for "
            f"SGD, momentum, Adam and AdamW; got {type(optimizer).__name__}.")
    if getattr(optimizer, "amsgrad", False):
        raise UsageError("--strategy=dtensor: Adam(amsgrad=True) is not supported.")
    for option in ("clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps",
                   "loss_scale_factor"):
        if getattr(optimizer, option, None):
            raise UsageError(f"--strategy=dtensor: optimizer option {option} is not supported.")
    if getattr(optimizer, "use_ema", False):
        raise UsageError("--strategy=dtensor: optimizer option use_ema is not supported.")
    # Private Keras attributes, no public getter (keras-team/keras#16274; Keras 3.15 base_optimizer.py): canary in tests/test_upstream_canaries.py
    if getattr(optimizer, "_exclude_from_weight_decay", None) or getattr(
            optimizer, "_exclude_from_weight_decay_pattern", None):
        raise UsageError("--strategy=dtensor: exclude_from_weight_decay is not supported.")


def densify(grad, layout):
    """(gradient, its elementwise square) as dense tensors with `layout`.

    Bug-compatible with Keras on purpose: for a tf.IndexedSlices gradient (an
    embedding lookup), Keras' `ops.square` squares each slice BEFORE slices of
    the same row are summed (keras.src.backend.tensorflow.sparse.
    elementwise_unary), so Adam's second moment gets sum(g_i^2), not
    (sum g_i)^2, for a token seen several times in a batch. The single-device
    run does that, so we do too (measured: without it the transformer's Adam
    losses drifted 5.7e-3 from default by step 20).
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


def apply(optimizer, slots, grads, variables, layouts) -> None:
    """One update of `variables` (Keras variables) by `grads`; then iterations += 1.

    `slots` maps (parameter path, slot name) -> the optimizer's slot variable;
    `layouts` are the variables' layouts (the gradients are brought to them).
    """
    for grad, variable, layout in zip(grads, variables, layouts):
        if grad is None:
            continue
        dtype = variable.dtype
        lr = tf.cast(optimizer.learning_rate, dtype)
        grad, square = densify(grad, layout)
        grad = tf.cast(grad, dtype)
        if isinstance(optimizer, (keras.optimizers.Adam, keras.optimizers.AdamW)):
            square = tf.square(grad) if square is None else tf.cast(square, dtype)
            _adam(optimizer, slots, grad, square, variable, lr)
        else:
            _sgd(optimizer, slots, grad, variable, lr)
    optimizer.iterations.assign_add(1)


def _sgd(optimizer, slots, grad, variable, lr) -> None:
    if optimizer.momentum == 0:
        variable.assign_sub(grad * lr)
        return
    slot = slots[(variable.path, "momentum")]
    momentum = tf.cast(optimizer.momentum, variable.dtype)
    m = slot.value.read_value() * momentum - grad * lr
    slot.assign(m)
    if optimizer.nesterov:
        variable.assign_add(m * momentum - grad * lr)
    else:
        variable.assign_add(m)


def _adam(optimizer, slots, grad, square, variable, lr) -> None:
    dtype = variable.dtype
    current = variable.value.read_value()
    if isinstance(optimizer, keras.optimizers.AdamW) and optimizer.weight_decay:
        # Keras applies decay (var -= var * wd * lr) before the Adam step.
        current = current - current * tf.cast(optimizer.weight_decay, dtype) * lr
    local_step = tf.cast(optimizer.iterations + 1, dtype)
    beta_1_power = tf.pow(tf.cast(optimizer.beta_1, dtype), local_step)
    beta_2_power = tf.pow(tf.cast(optimizer.beta_2, dtype), local_step)
    m_slot = slots[(variable.path, "momentum")]
    v_slot = slots[(variable.path, "velocity")]
    alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    m_old = m_slot.value.read_value()
    v_old = v_slot.value.read_value()
    m = m_old + (grad - m_old) * (1 - optimizer.beta_1)
    v = v_old + (square - v_old) * (1 - optimizer.beta_2)
    m_slot.assign(m)
    v_slot.assign(v)
    variable.assign(current - (m * alpha) / (tf.sqrt(v) + optimizer.epsilon))
