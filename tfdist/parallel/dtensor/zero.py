"""--zero_stage: sharded data parallelism (ZeRO, Rajbhandari et al. 2020) as DTensor layouts.

Every data-parallel device of a batch-sharded mesh holds the same parameters, gradients and
optimizer state; ZeRO keeps 1/N of them on each of the N devices of the `batch` axis:
  stage 1  the optimizer's slots (Adam's m and v, momentum) are sharded over `batch`;
  stage 2  the gradients the update reads are too (DTensor reduce-scatters them);
  stage 3  the parameters are too (each is gathered where a layer reads it).

Mechanism: a variable's "zero layout" is its own layout (tensor-parallel or replicated)
with `batch` added on one more dimension. The optimizer update (update.py) is elementwise,
so computing it on a 1/N slice of every tensor is the single-device arithmetic slice by
slice: the numbers do not change, only where they live. DTensor inserts the collectives
(slice, reduce-scatter, all-gather) that each layout change needs. This is the mechanism
because it is exact and it composes: a 2-D mesh batch x model shards a tensor-parallel
variable over both axes (FSDP x TP), and a multi-client mesh shards across workers, with
no second code path; measured exact on the transformer (tests/test_zero.py).

Which dimension: the first one that the variable's layout leaves unsharded and whose size
the batch axis divides. DTensor shards only into equal pieces, so a variable with no such
dimension (a bias of 10 on 4 devices) stays replicated over `batch`, named in the log with
its share of the values. Variables the optimizer does not train (frozen layers,
BatchNormalization's moving statistics) keep their own layout.

Stage 3 gathers explicitly: a parameter stored in slices is relayouted to its own layout
where a layer reads it (sharding.ShardedVariable.compute_layout), so every op sees the
layout it would see without ZeRO. Left to DTensor's propagation, a slice over `batch` met
ops that cannot take it: a convolution's filter ("Filter for convolution must have fully
replicated layout") and a position table gathered by `arange` ("input and output layout do
not agree on non-axis dim 1", keras-io's token + position embedding).
"""

import dataclasses
import logging
import math
from typing import Collection, Dict, List, Mapping, Sequence, Tuple

from tfdist.errors import require
from tfdist.parallel.dtensor.layout_map import UNSHARDED

log = logging.getLogger("tfdist")
BATCH = "batch"
STAGE_NAMES = {1: "optimizer state", 2: "optimizer state and gradients"}


@dataclasses.dataclass
class ZeroPlan:
    """{path: spec} of what each stage keeps where; `left` are the unshardable variables,
    `frozen` the variables the optimizer does not train (no slots, no gradients), which
    stage 3 keeps whole too."""
    stage: int
    param_specs: Dict[str, Tuple[str, ...]]    # the variables' own layouts (stage 3: zero)
    update_specs: Dict[str, Tuple[str, ...]]   # where slots live and the update computes
    left: List[str]
    frozen: List[str] = dataclasses.field(default_factory=list)   # not trainable: whole

    @property
    def gradients_sharded(self) -> bool:
        return self.stage >= 2


def zero_spec(spec: Sequence[str], shape: Sequence[int], batch_size: int) -> Tuple[str, ...]:
    """`spec` with BATCH on its first unsharded dimension that `batch_size` divides
    (unchanged when there is none, or when BATCH already shards it)."""
    spec = tuple(spec)
    if BATCH in spec:
        return spec
    for dim, (axis, size) in enumerate(zip(spec, shape)):
        if axis == UNSHARDED and size % batch_size == 0 and size >= batch_size:
            return spec[:dim] + (BATCH,) + spec[dim + 1:]
    return spec


def check_batch_axis(stage: int, batch_size: int) -> None:
    require(stage == 0 or batch_size > 1,
            f"--zero_stage={stage} shards over the mesh's batch axis, which has size "
            f"{batch_size} here: there is nothing to shard over. Give the mesh a batch axis "
            f"of at least 2 devices (e.g. --mesh=batch=4 or batch=2,model=2), or use "
            f"--zero_stage=0.")


def check_accumulation(stage: int, accumulation_steps: int) -> None:
    require(stage < 3 or accumulation_steps == 1,
            f"--zero_stage=3 with --accumulation_steps={accumulation_steps} is not supported "
            f"under --strategy=dtensor: with the parameters gathered in each micro-batch, "
            f"DTensor (TF 2.21) fails to lay out the step (\"EmitAllScatter was passed a "
            f"desired_layout ... which was not more sharded\"). Use --zero_stage=2, whose "
            f"gradient sum across micro-batches is held in slices, or --accumulation_steps=1.")


def plan(stage: int, specs: Mapping[str, Sequence[str]], shapes: Mapping[str, Sequence[int]],
         batch_size: int, trainable: Collection[str] = None) -> ZeroPlan:
    """The layouts of stage `stage` for variables with tensor-parallel `specs`.

    Stage 3 stores only the variables in `trainable` (None: all) in slices: the others
    are not the optimizer's, and what a layer writes itself (BatchNormalization's moving
    statistics) DTensor cannot assign into a slice ("SPMD expansion resulted in op output
    inconsistent with the provided layout", measured)."""
    check_batch_axis(stage, batch_size)
    own = {path: tuple(spec) for path, spec in specs.items()}
    if stage == 0:
        return ZeroPlan(0, own, own, [])
    frozen = [path for path in own if trainable is not None and path not in trainable]
    sharded = {path: zero_spec(spec, shapes[path], batch_size) for path, spec in own.items()}
    left = [path for path in own if BATCH not in sharded[path]]
    if stage < 3:
        return ZeroPlan(stage, own, sharded, left, frozen)
    params = {path: own[path] if path in frozen else sharded[path] for path in own}
    return ZeroPlan(stage, params, sharded, left, frozen)


def announce(zero: ZeroPlan, shapes: Mapping[str, Sequence[int]], batch_size: int) -> None:
    """One log line of what the stage shards, and the variables it had to leave whole."""
    if zero.stage == 0:
        return
    values = {path: math.prod(shape) for path, shape in shapes.items()}
    total = sum(values.values()) or 1
    left_values = sum(values[path] for path in zero.left)
    trainable = len(shapes) - len(zero.frozen)
    sharded = len(set(shapes) - set(zero.left) - set(zero.frozen))
    parameters = ", and their parameters" if zero.stage == 3 else ""
    log.info("dtensor: zero stage %d over batch=%d shards the %s of %d of %d trainable "
             "variables%s", zero.stage, batch_size, STAGE_NAMES[min(zero.stage, 2)], sharded,
             trainable, parameters)
    if zero.left:
        log.info("dtensor: zero stage %d leaves %d variables replicated over batch (no "
                 "dimension left whole that %d divides; %.2f%% of the values): %s", zero.stage,
                 len(zero.left), batch_size, 100 * left_values / total,
                 ", ".join(zero.left[:8]) + (" ..." if len(zero.left) > 8 else ""))
