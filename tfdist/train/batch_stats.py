"""BatchNormalization over the global batch in the data-parallel modes.

One device normalises each training batch by that batch's mean and variance. Under
tf.distribute each replica sees its share of the batch, so Keras' default
BatchNormalization normalises by the replica's statistics: another function of the
data than one device computes (a keras-io Conv1D + BatchNorm classifier ended 37-38%
off one device under mirrored and 2 workers). Keras' `synchronized=True` all-reduces
the statistics, but as E[x^2] - E[x]^2, which loses digits to cancellation where one
device's tf.nn.moments takes the mean of squared deviations (4.5e-5 off after a few
steps); and it ignores masks (a masked input is normalised per replica).

So tfdist's data-parallel modes (`batch_statistics="global"`, the default) give
every BatchNormalization layer the moments one device computes, summed over the
replicas: the mean from the summed sums and counts, then the variance from the summed
squared deviations from that mean (two all-reduces per layer and step, of one value
per channel). `batch_statistics="per_replica"` keeps Keras' per-replica statistics:
cheaper, and not the one-device math.
"""

import logging
from typing import List

import keras
import tensorflow as tf

from tfdist.train import keras_fixes

log = logging.getLogger("tfdist")

GLOBAL, PER_REPLICA = "global", "per_replica"   # config.BATCH_STATISTICS
SUM = tf.distribute.ReduceOp.SUM


def batch_norm_layers(model) -> List[keras.layers.BatchNormalization]:
    """Every BatchNormalization in the model, nested ones (inside custom layers, nested
    models) included."""
    return [layer for layer in keras_fixes.all_layers(model)
            if isinstance(layer, keras.layers.BatchNormalization)]


def use_global_statistics(model, num_replicas: int, mode: str) -> List[str]:
    """Makes the model's BatchNormalization layers normalise by the global batch's moments
    (every replica's examples); returns their paths. Logs what it did, once."""
    norms = batch_norm_layers(model)
    if not norms or num_replicas == 1:
        return []
    for layer in norms:
        # An instance attribute: this model's layers only, whatever else the process runs.
        # BatchNormalization._moments(inputs, mask) is private: Keras has no public hook
        # for the statistics a layer normalises by (no upstream issue asks for one).
        # Canary: tests/test_upstream_canaries.py::test_keras_private_batch_norm_api.
        layer._moments = _global_moments_of(layer)
    names = [layer.path for layer in norms]
    log.info("%s: %d BatchNormalization layer(s) normalise by the global batch's statistics "
             "over the %d replicas (2 all-reduces of one value per channel, per layer and "
             "step): %s", mode, len(norms), num_replicas, ", ".join(names))
    return names


def announce_per_replica(model, num_replicas: int, mode: str) -> List[str]:
    """With batch_statistics='per_replica': says, before training, what it costs."""
    names = [layer.path for layer in batch_norm_layers(model) if not layer.synchronized]
    if names and num_replicas > 1:
        log.warning(
            "%s with batch_statistics='per_replica': %d BatchNormalization layer(s) (%s) "
            "normalise each replica's 1/%d of the batch by its own statistics, so training "
            "is not the one-device math (a keras-io Conv1D classifier ended 37%% off one "
            "device). The default, batch_statistics='global', matches one device.",
            mode, len(names), ", ".join(names[:4]) + (", ..." if len(names) > 4 else ""),
            num_replicas)
    return names


def _global_moments_of(layer):
    """layer._moments(inputs, mask) with the replicas' examples pooled."""
    def moments(inputs, mask):
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return type(layer)._moments(layer, inputs, mask)
        return global_moments(context, inputs, mask, layer._reduction_axes)
    return moments


def global_moments(context, inputs, mask, axes):
    """(mean, variance) per channel over every replica's examples, squeezed like
    ops.moments; as tf.nn.moments computes them (mean, then the mean squared deviation
    from it), or, with a mask, as Keras' masked BatchNormalization does (its epsilon)."""
    x = tf.cast(inputs, tf.float32) if inputs.dtype in (tf.float16, tf.bfloat16) else inputs
    if mask is None:
        local_sum = tf.reduce_sum(x, axes, keepdims=True)
        examples = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
        total, count = replica_sum(context, [local_sum, examples * tf.ones_like(local_sum)])
        mean = total / count
        deviation = tf.math.squared_difference(x, tf.stop_gradient(mean))
    else:
        weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), x.dtype), tf.shape(x))
        total, count = replica_sum(context, [tf.reduce_sum(x * weights, axes, keepdims=True),
                                             tf.reduce_sum(weights, axes, keepdims=True)])
        count = count + keras.backend.epsilon()
        mean = total / count
        deviation = tf.square(tf.where(weights > 0, x - mean, 0))
    squares, = replica_sum(context, [tf.reduce_sum(deviation, axes, keepdims=True)])
    variance = squares / count
    mean, variance = tf.squeeze(mean), tf.squeeze(variance)
    if x.dtype != inputs.dtype:
        mean, variance = tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
    return mean, variance


def replica_sum(context, values: list) -> list:
    """context.all_reduce(SUM, values), differentiable (the gradient of an all-sum is the
    all-sum of the gradients), at a tracing cost that does not grow with the model.

    ReplicaContext.all_reduce is a tf.custom_gradient, which walks the graph backward
    from its outputs to its inputs to find the variables used in between. Under
    MirroredStrategy the outputs depend on every replica's inputs, and only this
    replica's stop the walk: each call walks the other replicas' whole forward (and, in
    the backward pass, backward) graph, so tracing grows with layers squared (measured:
    MobileNetV2, 52 BatchNormalization layers, mirrored x2: 135 s to trace against 21 s
    with per-replica statistics). Here the values are all-reduced behind stop_gradient,
    where that walk ends, and the gradient is given by this custom_gradient instead."""
    @tf.custom_gradient
    def summed(*xs):
        ys = context.all_reduce(SUM, [tf.stop_gradient(x) for x in xs])
        return ys, lambda *dys: replica_sum(context, list(dys))
    return list(summed(*values))
