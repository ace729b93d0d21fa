"""Layers whose training call cannot be split into micro-batches exactly.

A step over micro-batches (the pipeline's, gradient accumulation's) is one device's
full-batch step only where a layer's training call depends on its own examples alone
and changes nothing but its outputs. Two kinds of layer break that, and are refused
when a batch is split that way (the pipeline's --microbatches > 1 or several replica
copies; --accumulation_steps > 1), naming the layer:

- batch statistics: a BatchNormalization in training mode (trainable; a frozen one
  runs in inference mode on its moving statistics, and is exact), at any depth;
- weights written by the forward pass (a custom layer's running statistic updated in
  call, SpectralNormalization's power iteration, a stateful RNN): each micro-batch
  and each replica's copy would write its own, M or R times a step, from a part of
  the batch.
"""

from typing import Dict, List

import keras
import tensorflow as tf

from tfdist.train.keras_fixes import all_layers

# Keras' reductions that make a mean of replica means the global mean (the
# default), or a sum of replica sums the global sum. "mean_with_sample_weight"
# divides by each replica's own weight sum, which no split of the batch keeps.
EXACT_REDUCTIONS = ("sum_over_batch_size", "sum", "mean")

# Ops that read a variable's handle; any other consumer may write it.
READ_OPS = {"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
            "VarIsInitializedOp"}


def batch_statistics_layers(model) -> List[str]:
    """Paths of the BatchNormalization layers (nested too) that normalise by the batch."""
    return [_name(layer) for layer in _sub_layers(model)
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable]


def loss_reductions(model):
    """The reduction of every compiled loss ('sum_over_batch_size' for names and
    plain functions, which Keras wraps with its default)."""
    losses = keras.tree.flatten(model.loss) if model.loss is not None else []
    return [loss.reduction if isinstance(loss, keras.losses.Loss) else "sum_over_batch_size"
            for loss in losses]


def layers_writing_weights(model) -> List[str]:
    """"'layer' (class) writes path" for every weight the model's training forward pass writes.

    Traced only when the model has non-trainable weights: every layer known to write
    in call keeps such a weight (a statistic, a power-iteration vector, a state)."""
    owners = _owners(model)
    return [f"'{_name(owners[id(w)])}' ({type(owners[id(w)]).__name__}) writes {w.path}"
            for w in written_weights(model)]


def written_weights(model) -> list:
    """The weights the model's training forward pass writes (traced only when it has
    non-trainable weights, as above)."""
    if not model.non_trainable_weights:
        return []
    written = _written_variables(model)
    return [w for w in model.weights if id(w.value.handle) in written]


def _written_variables(model) -> set:
    """ids of the handles of variables the traced training call consumes other than by
    reading them (Keras' TensorFlow variables: `weight.value` is the tf.Variable)."""
    specs = keras.tree.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), model.input)
    graph = tf.function(lambda inputs: model(inputs, training=True)).get_concrete_function(
        specs).graph
    written = set()
    for external, internal in graph.captures:
        if any(op.type not in READ_OPS for op in internal.consumers()):
            written.add(id(external))
    return written


def _owners(model) -> Dict[int, object]:
    """id(weight) -> the deepest layer holding it (children come after their parents)."""
    return {id(weight): layer for layer in _sub_layers(model) for weight in layer.weights}


def _sub_layers(model) -> list:
    return [layer for layer in all_layers(model) if layer is not model]


def _name(layer) -> str:
    return layer.path or layer.name
