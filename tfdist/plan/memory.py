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
  its layers, their slots and its own optimizer's scalars;
- a DTensor ZeRO stage cuts the slots (1), the gradients too (2) and the parameters
  too (3) in their zero layout, over the mesh's batch axis (zero.py); the scalars
  stay replicated.
Gradients take the trainable weights' bytes (float32), sharded like the weights, or in
the zero layout from stage 2: what the update reads (the run's gradient_bytes_per_device).
Activations are the inventory's per-example estimate times the examples a device
holds at the peak (GPipe: all M micro-batches in flight; 1F1B: min(M, S - k)). Under
--remat=full a recomputed block holds only its input, plus one block's own activations
while it is recomputed (tfdist/train/remat.py).
"""

import contextlib
import dataclasses
import logging
from typing import Dict, List, Optional, Sequence

from tfdist.errors import require
from tfdist.parallel.dtensor.mesh import BATCH, MODEL
from tfdist.plan import zero
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
    zero_stage: int = 0           # dtensor: ZeRO stage over the batch axis (zero.py)
    # The policy this candidate runs when it is not the workload's: a mode that refuses
    # mixed_float16 is planned with mixed_bfloat16 (recommend.run_precision says why).
    mixed_precision: Optional[str] = None

    def __post_init__(self):
        zero.validate_stage(self.zero_stage)
        require(self.zero_stage == 0 or self.strategy == "dtensor",
                f"zero_stage={self.zero_stage} is run by strategy 'dtensor' only (it shards "
                f"over the mesh's batch axis); got strategy {self.strategy!r}. Valid choices "
                f"for {self.strategy!r}: zero_stage 0.")

    def describe(self) -> str:
        if self.strategy == "dtensor":
            zero_part = f", zero stage {self.zero_stage}" if self.zero_stage else ""
            policy = f", {self.mixed_precision}" if self.mixed_precision else ""
            return (f"dtensor mesh batch={self.replicas},model={self.model_ways} "
                    f"({self.layout}){zero_part}{policy}")
        if self.strategy == "pipeline":
            hybrid = f" x {self.replicas} replicas" if self.replicas > 1 else ""
            policy = f", {self.mixed_precision}" if self.mixed_precision else ""
            return (f"pipeline {self.stages} stages{hybrid}, M={self.microbatches} "
                    f"{self.schedule}{policy}")
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


@dataclasses.dataclass(frozen=True)
class Pieces:
    """How many pieces each part of one variable is cut into (each device holds one)."""
    params: int = 1
    optimizer: int = 1      # each slot, cut like this
    gradients: int = 1


WHOLE = Pieces()


def per_device(candidate: Candidate, work: Workload) -> List[DeviceBytes]:
    """DeviceBytes for device 0..devices-1 (in the order the mode lists its devices)."""
    if candidate.mixed_precision is not None:
        work = dataclasses.replace(work, mixed_precision=candidate.mixed_precision)
    if candidate.strategy == "pipeline":
        return _pipeline(candidate, work)
    if candidate.strategy == "dtensor":
        pieces = shard_counts(work.inventory, candidate)
    else:
        pieces = {w.path: WHOLE for w in work.inventory.weights}
    layers = work.inventory.layers
    examples = work.global_batch_size / candidate.replicas
    one = _device_bytes(0, layers, pieces, work, examples, candidate.model_ways)
    return [dataclasses.replace(one, device=i) for i in range(candidate.devices)]


def _device_bytes(device: int, layers: Sequence[Layer], pieces: Dict[str, Pieces],
                  work: Workload, examples: float, model_ways: int) -> DeviceBytes:
    params = slot = gradients = 0
    for layer in layers:
        for weight in layer.weights:
            cut = pieces[weight.path]
            params += weight.size // cut.params
            if weight.trainable:
                slot += weight.size // cut.optimizer
                gradients += weight.size // cut.gradients
    return DeviceBytes(device=device, params=params * FLOAT32,
                       optimizer=slot * work.slots * FLOAT32 + work.scalars,
                       gradients=gradients * FLOAT32,
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


def shard_counts(inventory: Inventory, candidate: Candidate) -> Dict[str, Pieces]:
    """{variable path: Pieces} under the candidate's DTensor layout and ZeRO stage.

    Uses the mode's own LayoutMap resolution, so a layout that does not fit the
    model raises the same UsageError the run would.
    """
    axes = {BATCH: candidate.replicas, MODEL: candidate.model_ways}
    if inventory.model == PARAMS_ONLY:
        # No shapes to lay out: assume every variable splits evenly over the model axis,
        # and over the batch axis too in its zero layout.
        return {w.path: _pieces(candidate, candidate.model_ways,
                                candidate.model_ways * candidate.replicas)
                for w in inventory.weights}
    from tfdist.parallel.dtensor import presets
    from tfdist.parallel.dtensor import zero as run_zero   # the run's own zero layout rule
    from tfdist.parallel.dtensor.layout_map import shards_per_variable
    layout_map = presets.layout_map_for(candidate.layout, inventory.model)
    shapes = {w.path: w.shape for w in inventory.weights}
    with _quiet_layout_warnings():
        specs = layout_map.resolve(shapes.items(), axes)
    return {path: _pieces(candidate, shards_per_variable(spec, axes),
                          shards_per_variable(run_zero.zero_spec(spec, shapes[path],
                                                                 candidate.replicas), axes))
            for path, spec in specs.items()}


def _pieces(candidate: Candidate, tensor_parallel: int, zero_layout: int) -> Pieces:
    """Each part cut as its layout at the candidate's stage says (zero.SHARDED_PARTS)."""
    stage = candidate.zero_stage
    return Pieces(**{part: zero_layout if zero.shards(stage, part) else tensor_parallel
                     for part in ("params", "optimizer", "gradients")})


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
    pieces = {w.path: WHOLE for w in work.inventory.weights}
    microbatch = work.global_batch_size / candidate.replicas / candidate.microbatches
    out = []
    for replica in range(candidate.replicas):
        for k, layers in enumerate(stages):
            in_flight = candidate.microbatches
            if candidate.schedule == "1f1b":
                in_flight = min(candidate.microbatches, candidate.stages - k)
            out.append(_device_bytes(replica * candidate.stages + k, layers, pieces, work,
                                     microbatch * in_flight, 1))
    return out
