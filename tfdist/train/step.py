"""The per-replica math of one training or eval step, shared by tf.distribute modes.

The loss is the per-example loss summed over this replica's examples and divided
by the GLOBAL batch size, so that summing replica gradients (what every
all-reduce does) gives exactly the full-batch mean gradient of one device.
"""

import keras
import tensorflow as tf


def per_example_loss(labels, logits):
    """Cross-entropy per example; a language model averages over positions."""
    loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    if loss.shape.rank > 1:
        loss = tf.reduce_mean(loss, axis=list(range(1, loss.shape.rank)))
    return loss


def per_example_correct(labels, logits):
    """1.0 for a right prediction; a language model averages over positions."""
    predictions = tf.argmax(logits, axis=-1, output_type=tf.int32)
    correct = tf.cast(tf.equal(predictions, tf.cast(labels, tf.int32)), tf.float32)
    if correct.shape.rank > 1:
        correct = tf.reduce_mean(correct, axis=list(range(1, correct.shape.rank)))
    return correct


def make_loss_and_grads(model, optimizer, global_batch_size: int, jit_compile: bool):
    """Returns fn(x, y) -> (loss, grads); XLA-compiled when asked (no collectives inside).

    Only the XLA case is a nested tf.function: a synchronized BatchNorm all-reduces
    its batch statistics (a merge_call), which TF refuses inside a nested
    tf.function, so without XLA the caller's tf.function traces this directly.
    """

    def loss_and_grads(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.nn.compute_average_loss(
                per_example_loss(y, logits), global_batch_size=global_batch_size)
            scaled = optimizer.scale_loss(loss)  # loss scaling under mixed_float16, else identity
        grads = tape.gradient(scaled, model.trainable_variables)
        return loss, grads

    return tf.function(loss_and_grads, jit_compile=True) if jit_compile else loss_and_grads


def make_replica_train_step(model, optimizer, global_batch_size: int, jit_compile: bool):
    """Returns fn(x, y) -> this replica's share of the loss; applies the update."""
    loss_and_grads = make_loss_and_grads(model, optimizer, global_batch_size, jit_compile)

    def replica_step(x, y):
        loss, grads = loss_and_grads(x, y)
        # Keras' TF optimizer all-reduces (sums) gradients across replicas here.
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return replica_step


def replica_eval_step(model):
    def eval_step(x, y, weight):
        logits = model(x, training=False)
        return (tf.reduce_sum(per_example_loss(y, logits) * weight),
                tf.reduce_sum(per_example_correct(y, logits) * weight),
                tf.reduce_sum(weight))
    return eval_step

