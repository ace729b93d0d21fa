"""Putting each stage's variables, optimizer slots and computation on its device.

A pipeline replica is a clone of the reference model (built by model_fn on the
host CPU) in which every layer is *called, and therefore built,* under
`tf.device(its stage's device)`: Keras creates a layer's variables on its first
call, so they are created on that device (public API: clone_model's
call_function). The clone then copies the reference weights exactly, so every
replica starts from the single-device initialisation.

Each stage of each replica gets its own optimizer, created and built under the
stage's device, so its iteration counter, learning rate and slots live there
(Keras also colocates a slot with its variable). Stage k's computation is a
sub-model of the clone from boundary tensor k-1 to boundary tensor k.
"""

import dataclasses
from typing import Callable, List

import keras
import tensorflow as tf

from tfdist.parallel.pipeline.partition import Partition


@dataclasses.dataclass
class PlacedStage:
    index: int
    device: str
    model: keras.Model          # sub-model: boundary tensor in -> boundary tensor out
    variables: List             # its trainable Keras variables
    optimizer: keras.optimizers.Optimizer


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
    """A copy of `reference` with stage k on devices[k], plus one optimizer per stage."""
    device_of = {name: devices[stage.index]
                 for stage in partition.stages for name in stage.layers}

    def call_on_stage_device(layer, *args, **kwargs):
        with tf.device(device_of[layer.name]):
            return layer(*args, **kwargs)

    if isinstance(reference, keras.Sequential):
        # clone_model's call_function needs a functional model; same layers, same order.
        reference = keras.Model(reference.inputs, reference.outputs, name=reference.name)
    clone = keras.models.clone_model(reference, call_function=call_on_stage_device)
    clone.set_weights(reference.get_weights())
    stages = []
    for stage in partition.stages:
        sub_model = _stage_model(clone, partition, stage.index)
        with tf.device(devices[stage.index]):
            optimizer = optimizer_fn()
            optimizer.build(sub_model.trainable_variables)
        stages.append(PlacedStage(stage.index, devices[stage.index], sub_model,
                                  list(sub_model.trainable_variables), optimizer))
    return PlacedReplica(clone, stages)


def _stage_model(clone: keras.Model, partition: Partition, index: int) -> keras.Model:
    """The sub-model of `clone` computing stage `index` alone."""
    stages = partition.stages
    inputs = _single(clone.inputs) if index == 0 else clone.get_layer(
        stages[index - 1].output_layer).output
    last = stages[index].output_layer
    outputs = _single(clone.outputs) if last is None else clone.get_layer(last).output
    sub_model = keras.Model(inputs, outputs, name=f"stage_{index}")
    got = [layer.name for layer in sub_model.layers
           if not isinstance(layer, keras.layers.InputLayer)]
    # The cut check guarantees this; a mismatch would silently move work across devices.
    assert sorted(got) == sorted(stages[index].layers), (got, stages[index].layers)
    return sub_model


def _single(tensors):
    """One tensor rather than a list of one, so a stage maps a tensor to a tensor."""
    return tensors[0] if len(tensors) == 1 else tensors
