"""Choosing the simplest plan that fits, and the flags that run it.

Rules, in order (the first candidate that fits wins):
1. data parallel over every device (`default` on one device, `mirrored` on one
   host, `multi_worker_mirrored` across workers) when a full copy fits a device;
2. otherwise sharded data parallelism: DTensor on mesh batch=N,model=1 (layout
   data) with ZeRO stage 1, then 2, then 3 (zero.py). It keeps the model whole (any
   model, no layout) and its collectives are data parallelism's, rearranged around the
   update (stage 3 also gathers each layer's parameters), where tensor parallelism adds
   all-reduces inside every layer: so it comes before splitting the model;
3. otherwise, for each model-split degree k = 2, 3, ... dividing the device
   count (smallest first: the least communication on the critical path):
   a. DTensor megatron tensor parallelism on mesh batch=N/k,model=k, when the
      model has megatron rules (mlp, transformer) that divide its shapes; when
      it does not fit and N/k > 1, the same mesh with ZeRO stage 1, 2, 3 over
      its batch axis;
   b. a k-stage pipeline over N/k replicas with micro-batches M (the largest
      divisor of the replica batch up to 4k, so the GPipe bubble
      (k-1)/(M+k-1) stays small), GPipe, or 1F1B when only its smaller
      activation peak fits. Models with BatchNorm only pipeline with M=1 and
      one replica (a micro-batch's statistics are not the batch's). Across
      workers the stages live in different workers, so k must divide the
      workers; each worker's devices are in-node replicas of its stage
      (tfdist/parallel/pipeline/cluster.py).
A device may use (1 - reserve) of its memory: the rest is for the framework,
kernels' workspaces and fragmentation.

A ZeRO stage needs no more memory than the stage before it, so when stage 3 of a
mesh does not fit, neither does 1 or 2: only stage 3 is listed. `--zero_stage=N`
plans stage N alone, on the DTensor meshes with a batch axis > 1; `--zero_stage=0`
plans without sharded data parallelism.

mixed_float16 runs only under data parallelism: dtensor and pipeline refuse its
dynamic loss scale (run_precision). Their candidates are planned with mixed_bfloat16
(the same float32 variables, 2-byte activations, no loss scale) and the plan says so.
"""

import dataclasses
from typing import List, Optional, Tuple

from tfdist.errors import UsageError, require
from tfdist.parallel.dtensor.presets import MEGATRON
from tfdist.plan import zero
from tfdist.plan.inventory import PARAMS_ONLY, Inventory
from tfdist.plan.memory import Candidate, DeviceBytes, Workload, per_device

MAX_MICROBATCHES_PER_STAGE = 4
AUTO_ZERO = None             # --zero_stage not given: stages 1-3 where plain plans miss
# Why a mode refuses mixed_float16 (the run's own refusals: parallel/dtensor/__init__.py,
# parallel/pipeline/__init__.py); the planner runs such a mode in mixed_bfloat16.
REFUSES_FLOAT16 = {
    "dtensor": "its dynamic loss scale, a LossScaleOptimizer, has no exact sharded update",
    "pipeline": "each stage's optimizer would keep its own dynamic loss scale",
}
SHARDED_BY_STAGE = {1: "the optimizer state", 2: "the optimizer state and the gradients",
                    3: "the optimizer state, the gradients and the parameters"}


@dataclasses.dataclass(frozen=True)
class Hardware:
    devices: int
    memory_per_device: int       # bytes
    workers: int = 1
    device_type: str = "gpu"     # gpu: --num_gpus; cpu: --simulate_devices (CPU-only hosts)
    reserve: float = 0.1

    @property
    def usable(self) -> int:
        return int(self.memory_per_device * (1 - self.reserve))


@dataclasses.dataclass(frozen=True)
class Evaluated:
    candidate: Candidate
    devices: Tuple[DeviceBytes, ...]
    problem: Optional[str] = None    # why the candidate cannot run at all (not memory)

    @property
    def peak(self) -> int:
        return max(d.total for d in self.devices) if self.devices else 0

    def fits(self, hardware: Hardware) -> bool:
        return self.problem is None and self.peak <= hardware.usable


@dataclasses.dataclass(frozen=True)
class Plan:
    evaluated: List[Evaluated]
    chosen: Optional[Evaluated]
    reason: str


def divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def data_parallel(hw: Hardware) -> Candidate:
    strategy = ("default" if hw.devices == 1 else
                "multi_worker_mirrored" if hw.workers > 1 else "mirrored")
    return Candidate(strategy, hw.devices, replicas=hw.devices)


def run_precision(strategy: str, work: Workload) -> Optional[str]:
    """The policy a candidate of `strategy` runs when it differs from the workload's:
    mixed_bfloat16 for a mode that refuses mixed_float16 (REFUSES_FLOAT16), else None."""
    if work.mixed_precision == "mixed_float16" and strategy in REFUSES_FLOAT16:
        return "mixed_bfloat16"
    return None


def sharded_data_parallel(stage: int, work: Workload, hw: Hardware) -> Candidate:
    """ZeRO over every device: DTensor's data layout (nothing split over a model axis)."""
    return Candidate("dtensor", hw.devices, replicas=hw.devices, layout="data",
                     zero_stage=stage, mixed_precision=run_precision("dtensor", work))


def tensor_parallel(k: int, work: Workload, hw: Hardware, stage: int = 0) -> Candidate:
    return Candidate("dtensor", hw.devices, replicas=hw.devices // k, model_ways=k,
                     layout="megatron", zero_stage=stage,
                     mixed_precision=run_precision("dtensor", work))


def pipeline(k: int, work: Workload, hw: Hardware, schedule: str) -> Candidate:
    replicas = hw.devices // k
    per_replica = work.global_batch_size // replicas
    if work.inventory.has_batch_norm:
        microbatches = 1
    else:
        microbatches = max(m for m in divisors(max(per_replica, 1))
                           if m <= MAX_MICROBATCHES_PER_STAGE * k)
    return Candidate("pipeline", hw.devices, replicas=replicas, stages=k,
                     microbatches=microbatches, schedule=schedule,
                     mixed_precision=run_precision("pipeline", work))


def evaluate(candidate: Candidate, work: Workload, hw: Hardware) -> Evaluated:
    problem = runnable_problem(candidate, work, hw)
    if problem:
        return Evaluated(candidate, (), problem)
    try:
        return Evaluated(candidate, tuple(per_device(candidate, work)))
    except UsageError as error:  # e.g. a megatron split that does not divide a dimension
        return Evaluated(candidate, (), str(error))


def runnable_problem(c: Candidate, work: Workload, hw: Hardware) -> Optional[str]:
    """Why tfdist could not run the candidate at all, or None."""
    inv = work.inventory
    policy = c.mixed_precision or work.mixed_precision
    if work.global_batch_size % c.replicas:
        return f"global batch {work.global_batch_size} does not split over {c.replicas} replicas"
    if c.strategy == "dtensor" and inv.model not in (*MEGATRON, PARAMS_ONLY):
        if c.layout == "megatron":
            return f"no megatron layout for model {inv.model!r}"
        return f"tfdist plan plans dtensor for {DTENSOR_MODELS}, not {inv.model!r}"
    if c.strategy == "dtensor" and policy == "mixed_float16":
        return "dtensor does not support mixed_float16 (use mixed_bfloat16)"
    if c.zero_stage and c.replicas == 1:
        return f"zero stage {c.zero_stage} shards over the batch axis, which has 1 device here"
    if c.strategy == "pipeline":
        if hw.workers > 1 and hw.workers % c.stages:
            return (f"{c.stages} stages do not divide the {hw.workers} workers (stages live in "
                    f"different workers, W/S groups of S workers each hold a replica)")
        if hw.workers > 1 and hw.device_type != "cpu":
            return "a pipeline across workers places its stages on CPU devices only (this version)"
        if c.stages > len(inv.layers):
            return f"{c.stages} stages but the model has {len(inv.layers)} layers"
        if inv.has_batch_norm and c.replicas > 1:
            return "BatchNorm: a pipeline needs one replica (devices = stages)"
        if policy == "mixed_float16":
            return "pipeline does not support mixed_float16"
    return None


DTENSOR_MODELS = "models mlp, transformer and --params only"


def check_zero_stage(stage: Optional[int], work: Workload, hw: Hardware) -> None:
    """A requested --zero_stage that no candidate could run is a UsageError, with the
    valid choices (checked before anything is planned)."""
    if stage is AUTO_ZERO:
        return
    zero.validate_stage(stage)
    if stage == 0:
        return
    require(hw.devices > 1,
            f"--zero_stage {stage} shards over the data-parallel devices (the DTensor mesh's "
            f"batch axis), and --devices 1 has no second one. Valid choices with --devices 1: "
            f"--zero_stage 0, or leave it out.")
    model = work.inventory.model
    require(model in (*MEGATRON, PARAMS_ONLY),
            f"--zero_stage {stage} is run by --strategy=dtensor only, which tfdist plan plans "
            f"for {DTENSOR_MODELS}, not {model!r}. Valid choices for model {model!r}: "
            f"--zero_stage 0, or leave it out.")


def candidates(work: Workload, hw: Hardware, zero_stage: Optional[int] = AUTO_ZERO):
    """Yields groups of candidates simplest first; see the module docstring."""
    if zero_stage:   # that stage only, on every mesh with a batch axis to shard over
        yield [sharded_data_parallel(zero_stage, work, hw)]
        for k in divisors(hw.devices)[1:-1]:
            yield [tensor_parallel(k, work, hw, zero_stage)]
        return
    stages = zero.STAGES[1:] if zero_stage is AUTO_ZERO else ()
    yield [data_parallel(hw)]
    if hw.devices > 1 and stages:
        yield [sharded_data_parallel(stage, work, hw) for stage in stages]
    for k in divisors(hw.devices)[1:]:
        yield [tensor_parallel(k, work, hw)]
        if hw.devices // k > 1 and stages:
            yield [tensor_parallel(k, work, hw, stage) for stage in stages]
        yield [pipeline(k, work, hw, "gpipe"), pipeline(k, work, hw, "1f1b")]


def recommend(work: Workload, hw: Hardware, zero_stage: Optional[int] = AUTO_ZERO) -> Plan:
    """Evaluates candidates simplest first; the first that fits is chosen."""
    evaluated = []
    for group in candidates(work, hw, zero_stage):
        results = _evaluate_group(group, work, hw)
        if _refused_as_before(results, evaluated):
            continue
        evaluated += results
        if results[-1].fits(hw):
            chosen = results[-1]
            return Plan(evaluated, chosen, _reason(chosen, evaluated, work, hw))
    return Plan(evaluated, None, _no_fit_reason(evaluated, hw))


def _refused_as_before(results: List[Evaluated], evaluated: List[Evaluated]) -> bool:
    """A mesh's ZeRO stages refused for the reason its plain plan was: said once."""
    last = results[-1]
    return (bool(evaluated) and last.candidate.zero_stage > 0 and last.problem is not None
            and last.problem == evaluated[-1].problem)


def _evaluate_group(group: List[Candidate], work: Workload, hw: Hardware) -> List[Evaluated]:
    """The group's candidates in order, up to the first that fits. The ZeRO stages of one
    mesh need less memory stage by stage: when the last does not fit, no other does, and
    it alone is listed (the table stays short)."""
    if len(group) > 1 and all(c.zero_stage for c in group):
        most_sharded = evaluate(group[-1], work, hw)
        if not most_sharded.fits(hw):
            return [most_sharded]
    results = []
    for candidate in group:
        results.append(evaluate(candidate, work, hw))
        if results[-1].fits(hw):
            break
    return results


def _reason(chosen: Evaluated, evaluated: List[Evaluated], work: Workload, hw: Hardware) -> str:
    c = chosen.candidate
    fits = f"{gib(chosen.peak)} of {gib(hw.usable)} usable per device"
    if not work.activations_known:
        fits += (f", leaving {gib(hw.usable - chosen.peak)} for the activations, which a "
                 f"--params model does not let the planner count")
    if c.strategy in ("default", "mirrored", "multi_worker_mirrored"):
        return f"A full copy of the model fits on one device ({fits}), so plain data parallelism."
    full = evaluated[0]
    if full.candidate.zero_stage:   # --zero_stage N: no full copy was planned
        over = f"Planned at --zero_stage {c.zero_stage}, as asked"
    elif full.problem is None:
        over = f"A full copy needs {gib(full.peak)} per device, more than {gib(hw.usable)}"
    else:
        over = full.problem[0].upper() + full.problem[1:]
    sharded = f"ZeRO stage {c.zero_stage} shards {SHARDED_BY_STAGE.get(c.zero_stage)} over the"
    if c.strategy == "dtensor" and c.model_ways == 1:
        why = f"{over}; {sharded} {c.replicas} data-parallel devices ({fits})."
    elif c.strategy == "dtensor":
        with_zero = (f", and {sharded} batch axis's {c.replicas} devices" if c.zero_stage
                     else "")
        why = (f"{over}; megatron tensor parallelism over {c.model_ways} devices splits "
               f"weights, slots and the wide activations{with_zero} ({fits}).")
    else:
        why = (f"{over}; {c.stages} pipeline stages each hold a share of the layers ({fits}).")
    return why + _precision_note(c)


def _precision_note(c: Candidate) -> str:
    if c.mixed_precision is None:
        return ""
    return (f" It runs {c.mixed_precision}, not the mixed_float16 asked: mixed_float16 runs "
            f"only under data parallelism, and {c.strategy} refuses it "
            f"({REFUSES_FLOAT16[c.strategy]}). mixed_bfloat16 keeps the same float32 "
            f"variables and 2-byte activations and needs no loss scale, but needs hardware "
            f"with bfloat16 (NVIDIA Ampere or newer, TPUs, recent CPUs).")


def smallest_need(evaluated: List[Evaluated]) -> Optional[Evaluated]:
    """The runnable candidate with the smallest per-device peak (None: none can run)."""
    runnable = [e for e in evaluated if e.problem is None]
    return min(runnable, key=lambda e: e.peak) if runnable else None


def _no_fit_reason(evaluated: List[Evaluated], hw: Hardware) -> str:
    best = smallest_need(evaluated)
    if best is None:
        return "No plan can run: " + "; ".join(sorted({e.problem for e in evaluated})) + "."
    short = best.peak - hw.usable
    return (f"Does not fit: the smallest per-device need is {gib(best.peak)} "
            f"({best.candidate.describe()}), {gib(short)} ({short / hw.usable:.0%}) more than "
            f"the {gib(hw.usable)} usable of {gib(hw.memory_per_device)} per device. "
            f"Add devices, shrink the batch or the model, or use a smaller optimizer.")


def gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def device_names(hw: Hardware, candidate: Optional[Candidate] = None) -> List[str]:
    """The names the run reports its devices by (param_bytes_per_device keys), in the
    order the candidate's mode lists them (a pipeline across workers: by stage)."""
    from tfdist import cluster
    kind = hw.device_type.upper()
    per_worker = hw.devices // hw.workers
    if candidate is not None and candidate.strategy == "pipeline" and hw.workers > 1:
        return cluster.pipeline_stage_devices(hw.workers, per_worker, candidate.stages, kind)
    if hw.workers == 1:
        return [f"/job:localhost/replica:0/task:0/device:{kind}:{i}" for i in range(hw.devices)]
    return [f"/job:worker/replica:0/task:{t}/device:{kind}:{i}"
            for t in range(hw.workers) for i in range(per_worker)]


def summarize(inventory: Inventory) -> str:
    return f"{inventory.model}: {inventory.num_params:,} parameters in {len(inventory.layers)} layers"
