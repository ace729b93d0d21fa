"""Putting each stage's variables, optimizer slots and computation on its device.

A pipeline replica is a clone of the reference model (built by model_fn on the
host CPU) in which every layer is *called, and therefore built,* under
`tf.device(its stage's device)`: Keras creates a layer's variables on its first
call, so they are created on that device (public API: clone_model's
call_function; a nested model is built under its stage's device as it is copied).
The clone is the user's model as built (copying.py: custom layers, trainable flags
of every sub-layer and weight) and copies the reference weights exactly, so every
replica starts from the single-device initialisation.

With the interleaved schedule the partition has S * V stages (model chunks) for S
devices: chunk c lives on devices[c mod S], so a device holds V chunks, each a
PlacedStage of its own (sub-model, variables, optimizer); the schedule chains the
ops of a device, not of a chunk.

Each stage of each replica gets its own optimizer, created and built under the
stage's device, so its iteration counter, learning rate and slots live there
(Keras also colocates a slot with its variable). Stage k's computation is a
sub-model of the clone from the tensors crossing cut k-1 (one tensor, or a list
in the partition's order; stage 0 takes the model's inputs as the model does) to
the tensors of cut k that the stage computes (the last stage: the model's
outputs). A tensor crossing both cuts (a skip connection over the stage, the
padding mask) is handed on by the schedule, not by the sub-model: Keras cannot
build a sub-model that returns one of its intermediate inputs (clone_graph_nodes
re-maps that tensor to its producer, "Graph disconnected").
"""

import dataclasses
from typing import Callable, List, Tuple

import keras
import tensorflow as tf

from tfdist.parallel.pipeline import copying
from tfdist.parallel.pipeline.partition import (BoundaryTensor, Partition, chain_layers,
                                                flat_tensors)


@dataclasses.dataclass
class PlacedStage:
    index: int
    device: str
    model: keras.Model          # sub-model: boundary tensor(s) in -> boundary tensor(s) out
    variables: List             # its trainable Keras variables
    optimizer: keras.optimizers.Optimizer
    # Per boundary tensor it takes (none for stage 0) and sends (none for the last):
    # True where it is float and computed, so a gradient flows back through it.
    differentiable_inputs: Tuple[bool, ...] = ()
    differentiable_outputs: Tuple[bool, ...] = ()
    # Per tensor it sends: (True, i) the i-th tensor it received, handed on;
    # (False, j) the j-th output of `model`.
    sends: Tuple[Tuple[bool, int], ...] = ()


@dataclasses.dataclass
class PlacedReplica:
    model: keras.Model          # the whole clone: get_weights() in single-device order
    stages: List[PlacedStage]


class StageOptimizers:
    """Stands in for 'the optimizer': all stage optimizers of all replicas."""

    def __init__(self, replicas: List[PlacedReplica]):
        self.optimizers = [stage.optimizer for replica in replicas for stage in replica.stages]

    @property
    def variables(self):
        return [v for optimizer in self.optimizers for v in optimizer.variables]


def place_replica(reference: keras.Model, partition: Partition, devices: List[str],
                  optimizer_fn: Callable) -> PlacedReplica:
    """A copy of `reference` with stage k on devices[k mod len(devices)] (one stage per
    device, or V interleaved chunks per device), plus one optimizer per stage."""
    assert len(partition.stages) % len(devices) == 0, (len(partition.stages), devices)
    chunk_device = [devices[stage.index % len(devices)] for stage in partition.stages]
    device_of = {name: chunk_device[stage.index]
                 for stage in partition.stages for name in stage.layers}

    def call_on_stage_device(layer, *args, **kwargs):
        with tf.device(device_of[layer.name]):
            return layer(*args, **kwargs)

    if isinstance(reference, keras.Sequential):
        # clone_model's call_function needs a functional model; same layers, same order.
        reference = keras.Model(reference.inputs, reference.outputs, name=reference.name)
    clone = copying.copy_model(reference, call_on_stage_device, device_of.get)
    stages = []
    for stage in partition.stages:
        sub_model, sends = _stage_model(clone, partition, stage.index)
        with tf.device(chunk_device[stage.index]):
            optimizer = optimizer_fn()
            optimizer.build(sub_model.trainable_variables)
        before = partition.stages[stage.index - 1].boundary if stage.index else ()
        stages.append(PlacedStage(stage.index, chunk_device[stage.index], sub_model,
                                  list(sub_model.trainable_variables), optimizer,
                                  tuple(t.differentiable for t in before),
                                  tuple(t.differentiable for t in stage.boundary), sends))
    return PlacedReplica(clone, stages)


def _stage_model(clone: keras.Model, partition: Partition, index: int):
    """The sub-model of `clone` computing stage `index` alone, and its `sends`."""
    stages = partition.stages
    received = _find(clone, stages[index - 1].boundary) if index else []
    inputs = _single(received) if index else _model_inputs(clone)
    if index == len(stages) - 1:
        outputs, sends = _single(clone.outputs), ()
    else:
        outputs, sends = _outputs_and_sends(received, _find(clone, stages[index].boundary))
    sub_model = keras.Model(inputs, outputs, name=f"stage_{index}")
    got = [op.name for op in chain_layers(sub_model)]
    # The cut check guarantees this; a mismatch would silently move work across devices.
    assert sorted(got) == sorted(stages[index].layers), (got, stages[index].layers)
    return sub_model, sends


def _outputs_and_sends(received: list, boundary: list):
    """What the sub-model returns (the boundary tensors it did not receive) and, per
    boundary tensor, where the schedule takes it from (see PlacedStage.sends)."""
    position = {id(t): i for i, t in enumerate(received)}
    computed, sends = [], []
    for t in boundary:
        if id(t) in position:
            sends.append((True, position[id(t)]))
        else:
            sends.append((False, len(computed)))
            computed.append(t)
    return _single(computed), tuple(sends)


def _model_inputs(clone: keras.Model):
    """Stage 0 takes the features as the model does: a dict stays a dict (keras-hub
    backbones take {"token_ids", "padding_mask"}), else a tensor or a list."""
    return clone.input if isinstance(clone.input, dict) else _single(clone.inputs)


def _find(clone: keras.Model, boundary: Tuple[BoundaryTensor, ...]):
    """The clone's tensors for a cut's boundary (the clone keeps the reference's names)."""
    operations = {op.name: op for op in clone.operations}
    return [clone.inputs[t.index] if t.producer is None
            else flat_tensors(operations[t.producer].output)[t.index]
            for t in boundary]


def _single(tensors):
    """One tensor rather than a list of one, so a stage maps a tensor to a tensor."""
    return tensors[0] if len(tensors) == 1 else list(tensors)
