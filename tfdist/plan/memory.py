"""Bytes per device of one candidate plan: state (exact), gradients, activations.

State is parameters plus optimizer state, counted the way the modes store it
(and report it as `param_bytes_per_device`):
- variables are float32 under every dtype policy (Keras keeps mixed-precision
  variables in float32); optimizer slots are float32 too: sgd 0 per trainable
  weight, momentum 1, adam and adamw 2 (none for BatchNorm's moving statistics);
- every optimizer instance also holds `iteration` (int64) and `learning_rate`
  (float32), and a mixed_float16 LossScaleOptimizer adds `iteration`,
  `learning_rate`, `step_counter` and `dynamic_scale` of its own;
- data parallel keeps a full copy per device; DTensor cuts each variable and
  its slots into the shards its layout names; a pipeline stage's device holds
  its layers, their slots and its own optimizer's scalars.
Gradients take the trainable weights' bytes (float32), sharded like them.
Activations are the inventory's per-example estimate times the examples a device
holds at the peak (GPipe: all M micro-batches in flight; 1F1B: min(M, S - k)). Under
--remat=full a recomputed block holds only its input, plus one block's own activations
while it is recomputed (tfdist/train/remat.py).
"""

import contextlib
import dataclasses
import logging
from typing import Dict, List, Optional, Sequence

from tfdist.plan.inventory import PARAMS_ONLY, Inventory, Layer

FLOAT32 = 4
OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
OPTIMIZER_SCALARS = 8 + 4                  # iteration (int64) + learning_rate (float32)
LOSS_SCALE_SCALARS = 2 * OPTIMIZER_SCALARS + 8 + 4  # its own 2 + the inner 2 + step_counter, dynamic_scale
ACTIVATION_BYTES = {None: 4, "mixed_bfloat16": 2, "mixed_float16": 2}  # by mixed policy


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run on `devices` devices (see recommend.py for how they are chosen)."""
    strategy: str                 # default, mirrored, multi_worker_mirrored, dtensor, pipeline
    devices: int
    replicas: int                 # ways each global batch is split
    model_ways: int = 1           # dtensor model-axis size
    layout: str = "data"          # dtensor layout preset
    stages: int = 1               # pipeline stages
    microbatches: int = 1
    schedule: str = "gpipe"

    def describe(self) -> str:
        if self.strategy == "dtensor":
            return f"dtensor mesh batch={self.replicas},model={self.model_ways} ({self.layout})"
        if self.strategy == "pipeline":
            hybrid = f" x {self.replicas} replicas" if self.replicas > 1 else ""
            return (f"pipeline {self.stages} stages{hybrid}, M={self.microbatches} "
                    f"{self.schedule}")
        return f"{self.strategy} x {self.devices}"


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
    device: int
    params: int
    optimizer: int
    gradients: int
    activations: int

    @property
    def state(self) -> int:
        """What the run reports as param_bytes_per_device for this device."""
        return self.params + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.gradients + self.activations


@dataclasses.dataclass(frozen=True)
class Workload:
    """What does not change between candidates."""
    inventory: Inventory
    optimizer: str
    global_batch_size: int
    mixed_precision: Optional[str] = None
    activations_known: bool = True
    remat: Optional[str] = None   # "full": blocks keep their input, one recomputed at a time

    @property
    def slots(self) -> int:
        return OPTIMIZER_SLOTS[self.optimizer]

    @property
    def scalars(self) -> int:
        return LOSS_SCALE_SCALARS if self.mixed_precision == "mixed_float16" else OPTIMIZER_SCALARS


def per_device(candidate: Candidate, work: Workload) -> List[DeviceBytes]:
    """DeviceBytes for device 0..devices-1 (in the order the mode lists its devices)."""
    if candidate.strategy == "pipeline":
        return _pipeline(candidate, work)
    if candidate.strategy == "dtensor" and candidate.model_ways > 1:
        shards = shard_counts(work.inventory, candidate)
    else:
        shards = {w.path: 1 for w in work.inventory.weights}
    layers = work.inventory.layers
    examples = work.global_batch_size / candidate.replicas
    one = _device_bytes(0, layers, shards, work, examples, candidate.model_ways)
    return [dataclasses.replace(one, device=i) for i in range(candidate.devices)]


def _device_bytes(device: int, layers: Sequence[Layer], shards: Dict[str, int], work: Workload,
                  examples: float, model_ways: int) -> DeviceBytes:
    params = trainable = 0
    for layer in layers:
        for weight in layer.weights:
            size = weight.size // shards[weight.path]
            params += size
            trainable += size if weight.trainable else 0
    return DeviceBytes(device=device, params=params * FLOAT32,
                       optimizer=trainable * work.slots * FLOAT32 + work.scalars,
                       gradients=trainable * FLOAT32,
                       activations=_activation_bytes(layers, work, examples, model_ways))


def _activation_bytes(layers, work: Workload, examples: float, model_ways: int) -> int:
    if not work.activations_known:
        return 0
    itemsize = ACTIVATION_BYTES[work.mixed_precision]
    per_example = recomputing = 0.0
    for layer in layers:
        full = layer.saved - layer.saved_split
        saved = (full + layer.saved_split / model_ways) * itemsize
        if work.remat == "full" and layer.kept_when_recomputed is not None:
            # Until the backward pass reaches it, a recomputed block holds its input; then
            # its own activations come back, one block at a time.
            kept = layer.kept_when_recomputed * itemsize
            per_example += kept
            recomputing = max(recomputing, saved - kept)
        else:
            per_example += saved
        per_example += layer.saved_float32 * FLOAT32
    return int(round((per_example + recomputing) * examples))


def shard_counts(inventory: Inventory, candidate: Candidate) -> Dict[str, int]:
    """{variable path: pieces it is cut into} under the candidate's DTensor layout.

    Uses the mode's own LayoutMap resolution, so a layout that does not fit the
    model raises the same UsageError the run would.
    """
    from tfdist.parallel.dtensor import presets
    from tfdist.parallel.dtensor.layout_map import shards_per_variable
    if inventory.model == PARAMS_ONLY:  # no layout to resolve: assume an even split
        return {w.path: candidate.model_ways for w in inventory.weights}
    axes = {"batch": candidate.replicas, "model": candidate.model_ways}
    layout_map = presets.layout_map_for(candidate.layout, inventory.model)
    with _quiet_layout_warnings():
        specs = layout_map.resolve([(w.path, w.shape) for w in inventory.weights], axes)
    return {path: shards_per_variable(spec, axes) for path, spec in specs.items()}


@contextlib.contextmanager
def _quiet_layout_warnings():
    """A preset's rule for a layer this size of model lacks is not news to a planner."""
    logger = logging.getLogger("tfdist")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def pipeline_stages(inventory: Inventory, num_stages: int) -> List[List[Layer]]:
    """The layers of each stage, cut exactly where tfdist's partitioner cuts."""
    from tfdist.parallel.pipeline_balance import balanced_cuts
    layers = inventory.layers
    valid = [i for i, layer in enumerate(layers) if i > 0 and layer.cut_before]
    cuts = balanced_cuts([layer.params for layer in layers], num_stages, valid, inventory.model)
    bounds = [0] + list(cuts) + [len(layers)]
    return [list(layers[bounds[k]:bounds[k + 1]]) for k in range(num_stages)]


def _pipeline(candidate: Candidate, work: Workload) -> List[DeviceBytes]:
    stages = pipeline_stages(work.inventory, candidate.stages)
    shards = {w.path: 1 for w in work.inventory.weights}
    microbatch = work.global_batch_size / candidate.replicas / candidate.microbatches
    out = []
    for replica in range(candidate.replicas):
        for k, layers in enumerate(stages):
            in_flight = candidate.microbatches
            if candidate.schedule == "1f1b":
                in_flight = min(candidate.microbatches, candidate.stages - k)
            out.append(_device_bytes(replica * candidate.stages + k, layers, shards, work,
                                     microbatch * in_flight, 1))
    return out
