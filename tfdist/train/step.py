"""The per-replica math of one training or eval step, shared by every mode.

The loss is the model's own compiled loss (`model.compute_loss`: the user's loss
objects, loss weights, sample weights and regularisation terms), reduced the way
Keras reduces it under tf.distribute: a `sum_over_batch_size` loss is this
replica's mean divided by the number of replicas in sync, a `sum` loss is left as
it is. Every replica holds the same number of examples (the input pipeline
guarantees it), so summing the replicas' losses and gradients (what every
all-reduce does) gives exactly the global batch's loss and gradient on one
device. Modes that split a batch without tf.distute (the pipeline's micro-batches)
scale by `batch_fraction` below.
"""

import keras
import tensorflow as tf

from tfdist.train import accumulation, keras_fixes, sparse_rows


def split_batch(batch):
    """(x, y, sample_weight) of a batch given as (x, y) or (x, y, w) (or x alone)."""
    x, y, w = keras.utils.unpack_x_y_sample_weight(tuple(batch) if isinstance(batch, list)
                                                   else batch)
    return x, y, per_example_weight(w, y)


def per_example_weight(w, y):
    """A (batch,) weight reshaped to broadcast over a single label tensor's other axes.

    Why: Keras matches a weight to the loss by squeezing or expanding one trailing
    axis of size 1 only, so a (batch,) weight against a sequence model's
    (batch, positions) loss either fails or, when positions == batch, silently
    broadcasts along the wrong axis. (batch, 1, ...) weighs each example's
    positions alike, which is what a per-example weight (and the evaluation's
    padding flag) means."""
    if w is None or not isinstance(y, tf.Tensor) or w.shape.rank != 1 or y.shape.rank is None \
            or y.shape.rank < 2:
        return w
    return tf.reshape(w, [-1] + [1] * (y.shape.rank - 1))


def first_example(structure):
    """The first example of every tensor of a batch structure (None stays None)."""
    return tf.nest.map_structure(lambda t: None if t is None else t[:1], structure)


def forward_loss(model, x, y, sample_weight, training: bool):
    """(loss, y_pred): the model's compiled loss on this batch, Keras-reduced."""
    y_pred = model(x, training=training)
    loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                              training=training)
    return loss, y_pred


def make_loss_and_grads(model, optimizer, jit_compile: bool, accumulation_steps: int = 1):
    """Returns fn(x, y, w) -> (loss, grads, y_pred); XLA-compiled when asked; over
    `accumulation_steps` micro-batches when more than 1 (train/accumulation.py).

    Only the XLA case is a nested tf.function: a synchronized BatchNorm all-reduces
    its batch statistics (a merge_call), which TF refuses inside a nested
    tf.function, so without XLA the caller's tf.function traces this directly.
    A nested function hides how its sparse gradients' rows were chosen (the caller's
    graph sees only the call), so the compiled function reads that inside and hands
    it on (sparse_rows.carry_kinds).
    """
    weight = (1.0 if accumulation_steps == 1
              else accumulation.weight_of_each(model, accumulation_steps))

    def loss_and_grads(x, y, w):
        with tf.GradientTape() as tape:
            loss, y_pred = forward_loss(model, x, y, w, training=True)
            if weight != 1.0:   # a micro-batch's share of the batch's loss
                loss = loss * tf.cast(weight, loss.dtype)
            scaled = optimizer.scale_loss(loss)  # loss scaling under mixed_float16, else identity
        grads = tape.gradient(scaled, model.trainable_variables)
        return loss, grads, y_pred

    if jit_compile:
        loss_and_grads = sparse_rows.carry_kinds(
            tf.function(sparse_rows.recording_kinds(loss_and_grads), jit_compile=True))
    return accumulation.accumulate(loss_and_grads, accumulation_steps)


def make_replica_train_step(model, optimizer, jit_compile: bool, accumulation_steps: int = 1):
    """Returns fn(batch) -> (this replica's share of the loss, (y, y_pred, w)); applies
    the update.

    With several replicas the gradients are summed here, before `optimizer.apply`,
    rather than by Keras inside it, for two reasons: Keras clips (clipnorm,
    global_clipnorm, clipvalue) each replica's own gradient before its all-reduce,
    which is not the clipping of the global batch's gradient that one device does;
    and its all-reduce concatenates every sparse gradient's rows, which is one
    device's update only for rows the batch chose (tfdist/train/sparse_rows.py)."""
    loss_and_grads = make_loss_and_grads(model, optimizer, jit_compile, accumulation_steps)
    variables = model.trainable_variables

    def replica_step(batch):
        x, y, w = split_batch(batch)
        loss, grads, y_pred = loss_and_grads(x, y, w)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            optimizer.apply(grads, variables)
        else:
            summed = sparse_rows.reduce_across(grads, replica_all_reduce, variables)
            with keras_fixes.gradients_already_summed(optimizer):
                optimizer.apply(summed, variables)
        return loss, outputs_of(y, y_pred, w)

    return replica_step


def replica_all_reduce(items, owners=None):
    """tf.distribute's SUM over the replicas (IndexedSlices: every replica's rows)."""
    del owners
    if not items:
        return []
    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, items)


def replica_eval_step(model):
    """fn(batch) -> (this replica's share of the loss, (y, y_pred, w))."""
    def eval_step(batch):
        x, y, w = split_batch(batch)
        loss, y_pred = forward_loss(model, x, y, w, training=False)
        return loss, outputs_of(y, y_pred, w)
    return eval_step


def outputs_of(y, y_pred, w):
    """What metrics are updated from; a missing weight becomes ones (tf.function
    outputs cannot be None), so every mode returns the same structure."""
    if w is None:
        w = per_example_weight(tf.ones(tf.shape(keras.tree.flatten(y_pred)[0])[:1]), y)
    return y, y_pred, w
