"""Gradient accumulation: each replica's batch in K micro-batches, one update.

`accumulation_steps=K` (`--accumulation_steps=K`) keeps the global batch what one
optimizer update sees and computes it in K consecutive micro-batches, so a step holds
one micro-batch's activations at a time. Written once for every mode whose replica
step computes (loss, gradients) with `step.make_loss_and_grads` (default, mirrored,
multi_worker_mirrored over every collective) and for dtensor's step; the pipeline
already splits its batch into micro-batches and runs K times as many.

Exactness, as for a split over replicas: with Keras' default `sum_over_batch_size`
(or `mean`) the loss of a micro-batch is its mean, so each is weighed 1/K and the K
gradients add up to the whole batch's; a `sum` loss adds up as it is. Sparse rows
combine as across replicas (sparse_rows.add_parts: the rows the batch chose are
concatenated, a position table's rows are added row by row). Gradients are summed
micro-batch by micro-batch, so one sum is held, not K, and the reduction over
replicas and workers happens once per update, after the last micro-batch. What a
split cannot make exact (batch statistics, weights the forward pass writes, losses
that divide by a weight sum) is refused before the first step (`check_model`).
"""

from typing import Callable

import tensorflow as tf

from tfdist.errors import UsageError, require
from tfdist.train import sparse_rows, split_state


def weight_of_each(model, steps: int) -> float:
    """What each micro-batch's compiled loss is multiplied by: 1/K for mean losses
    (the default), 1 for `sum` losses."""
    reductions = split_state.loss_reductions(model) if model.loss is not None else []
    return 1.0 if reductions and reductions[0] == "sum" else 1.0 / steps


def accumulate(loss_and_grads: Callable, steps: int, cut: Callable = None,
               join: Callable = None) -> Callable:
    """fn(x, y, w) -> (loss, grads, y_pred) of the whole batch, from `loss_and_grads`
    called on each of `steps` micro-batches (it must already weigh each micro-batch's
    loss, see weight_of_each). `cut(tensor, steps)` gives a tensor's micro-batches
    (default: consecutive pieces) and `join(pieces)` puts them back in batch order
    (default: concatenated), which is how y_pred comes back, as the whole batch's."""
    if steps == 1:
        return loss_and_grads
    cut = cut or (lambda tensor, count: tf.split(tensor, count, axis=0))
    join = join or (lambda pieces: tf.concat(pieces, axis=0))

    # Plain Python, not converted: the loop over micro-batches is unrolled while tracing.
    @tf.autograph.experimental.do_not_convert
    def accumulated(x, y, w):
        parts = [split(structure, steps, cut) for structure in (x, y, w)]
        total_loss, total_grads, outputs, after = None, None, [], []
        for k in range(steps):
            # The next micro-batch starts once this one's gradients exist: one
            # micro-batch's activations at a time, in a graph TF could run in parallel.
            with tf.control_dependencies(after):
                xk, yk, wk = (_after_identity(part[k]) for part in parts)
            loss, grads, y_pred = loss_and_grads(xk, yk, wk)
            after = [g.values if isinstance(g, tf.IndexedSlices) else g
                     for g in grads if g is not None]
            total_loss = loss if total_loss is None else total_loss + loss
            total_grads = list(grads) if total_grads is None else [
                _add(total, grad) for total, grad in zip(total_grads, grads)]
            outputs.append(y_pred)
        return total_loss, total_grads, tf.nest.map_structure(lambda *p: join(list(p)),
                                                              *outputs)

    return accumulated


def _after_identity(structure):
    """The structure's tensors through tf.identity (created under the caller's control
    dependencies); None stays None."""
    if structure is None:
        return None
    return tf.nest.map_structure(tf.identity, structure)


def _add(total, grad):
    if total is None or grad is None:
        return grad if total is None else total
    return sparse_rows.add_parts([total, grad])


def split(structure, steps: int, cut: Callable):
    """The structure's tensors cut by `cut` into `steps` micro-batches: a list of
    `steps` structures (None stays None)."""
    if structure is None:
        return [None] * steps
    flat = tf.nest.flatten(structure)
    pieces = [cut(t, steps) for t in flat]
    return [tf.nest.pack_sequence_as(structure, [p[k] for p in pieces]) for k in range(steps)]


def check_model(model, steps: int, mode: str) -> None:
    """Before the first step: a UsageError for what K micro-batches cannot compute as
    the whole batch does (Keras' own accumulation is refused in every mode, below)."""
    if steps == 1:
        return
    given = f"--accumulation_steps={steps}"
    norms = split_state.batch_statistics_layers(model)
    require(not norms,
            f"{mode} with {given}: model '{model.name}' has BatchNormalization "
            f"({_listed(norms)}), which would normalise each of the {steps} micro-batches by "
            f"its own statistics, not the global batch's. Freeze it (trainable=False: "
            f"inference mode), use a normalisation that does not depend on the batch "
            f"(LayerNormalization, GroupNormalization), or drop --accumulation_steps.")
    writers = split_state.layers_writing_weights(model)
    require(not writers,
            f"{mode} with {given}: model '{model.name}': layer {_listed(writers, '; ')} in "
            f"its training call, which each of the {steps} micro-batches would write from its "
            f"own part of the batch, not once from the global batch. Drop "
            f"--accumulation_steps.")
    _refuse_inexact_losses(model, given)


def refuse_keras_accumulation(model) -> None:
    """Keras' own optimizer accumulation (`gradient_accumulation_steps`) updates once
    every K global batches inside `optimizer.apply`; tfdist's steps apply summed
    gradients themselves and do not reproduce it, so it is refused in every mode,
    naming tfdist's option."""
    keras_steps = getattr(model.optimizer, "gradient_accumulation_steps", None)
    if keras_steps:
        raise UsageError(
            f"The optimizer of model '{model.name}' has Keras' gradient_accumulation_steps="
            f"{keras_steps}, which tfdist's steps do not reproduce. Use tfdist's "
            f"--accumulation_steps={keras_steps} with a global batch {keras_steps} times as "
            f"large (one update per global batch, computed in {keras_steps} micro-batches; "
            f"under keras.distribution: tfdist.enable_keras_distribution(accumulation_steps="
            f"{keras_steps})), and build the optimizer without gradient_accumulation_steps.")


def _refuse_inexact_losses(model, given: str) -> None:
    reductions = split_state.loss_reductions(model) if model.loss is not None else []
    require(all(r in split_state.EXACT_REDUCTIONS for r in reductions)
            and len({r == "sum" for r in reductions}) <= 1,
            f"{given}: model '{model.name}' has losses with reductions {reductions}; "
            f"micro-batches add up to the whole batch's loss when every loss reduces by "
            f"'sum_over_batch_size' (Keras' default) or every one by 'sum'.")
    require(not (reductions and reductions[0] == "sum" and model.losses),
            f"{given}: model '{model.name}' has a 'sum' loss and {len(model.losses)} "
            f"regularisation or add_loss term(s), which every micro-batch would add again. "
            f"Use a 'sum_over_batch_size' loss, or drop the option.")


def _listed(names, sep=", ") -> str:
    return sep.join(names[:3]) + (f"{sep}..." if len(names) > 3 else "")
