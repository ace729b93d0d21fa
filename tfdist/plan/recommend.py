"""Choosing the simplest plan that fits, and the flags that run it.

Rules, in order (the first candidate that fits wins):
1. data parallel over every device (`default` on one device, `mirrored` on one
   host, `multi_worker_mirrored` across workers) when a full copy fits a device;
2. otherwise, for each model-split degree k = 2, 3, ... dividing the device
   count (smallest first: the least communication on the critical path):
   a. DTensor megatron tensor parallelism on mesh batch=N/k,model=k, when the
      model has megatron rules (mlp, transformer) that divide its shapes;
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
"""

import dataclasses
from typing import List, Optional, Tuple

from tfdist.errors import UsageError
from tfdist.parallel.dtensor.presets import MEGATRON
from tfdist.plan.inventory import PARAMS_ONLY, Inventory
from tfdist.plan.memory import Candidate, DeviceBytes, Workload, per_device

MAX_MICROBATCHES_PER_STAGE = 4


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


def tensor_parallel(k: int, hw: Hardware) -> Candidate:
    return Candidate("dtensor", hw.devices, replicas=hw.devices // k, model_ways=k,
                     layout="megatron")


def pipeline(k: int, work: Workload, hw: Hardware, schedule: str) -> Candidate:
    replicas = hw.devices // k
    per_replica = work.global_batch_size // replicas
    if work.inventory.has_batch_norm:
        microbatches = 1
    else:
        microbatches = max(m for m in divisors(max(per_replica, 1))
                           if m <= MAX_MICROBATCHES_PER_STAGE * k)
    return Candidate("pipeline", hw.devices, replicas=replicas, stages=k,
                     microbatches=microbatches, schedule=schedule)


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
    if work.global_batch_size % c.replicas:
        return f"global batch {work.global_batch_size} does not split over {c.replicas} replicas"
    if c.strategy == "dtensor" and inv.model not in (*MEGATRON, PARAMS_ONLY):
        return f"no megatron layout for model {inv.model!r}"
    if c.strategy == "dtensor" and work.mixed_precision == "mixed_float16":
        return "dtensor does not support mixed_float16 (use mixed_bfloat16)"
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
        if work.mixed_precision == "mixed_float16":
            return "pipeline does not support mixed_float16"
    return None


def candidates(work: Workload, hw: Hardware):
    """Yields candidates simplest first; see the module docstring."""
    yield [data_parallel(hw)]
    for k in divisors(hw.devices)[1:]:
        yield [tensor_parallel(k, hw)]
        yield [pipeline(k, work, hw, "gpipe"), pipeline(k, work, hw, "1f1b")]


def recommend(work: Workload, hw: Hardware) -> Plan:
    """Evaluates candidates simplest first; the first that fits is chosen."""
    evaluated = []
    for group in candidates(work, hw):
        for candidate in group:
            result = evaluate(candidate, work, hw)
            evaluated.append(result)
            if result.fits(hw):
                return Plan(evaluated, result, _reason(result, evaluated, work, hw))
    return Plan(evaluated, None, _no_fit_reason(evaluated, hw))


def _reason(chosen: Evaluated, evaluated: List[Evaluated], work: Workload, hw: Hardware) -> str:
    c = chosen.candidate
    fits = f"{gib(chosen.peak)} of {gib(hw.usable)} usable per device"
    if c.strategy in ("default", "mirrored", "multi_worker_mirrored"):
        return f"A full copy of the model fits on one device ({fits}), so plain data parallelism."
    full = evaluated[0]
    over = (f"A full copy needs {gib(full.peak)} per device" if full.problem is None
            else full.problem[0].upper() + full.problem[1:])
    if c.strategy == "dtensor":
        return (f"{over}, more than {gib(hw.usable)}; megatron tensor parallelism over "
                f"{c.model_ways} devices splits weights, slots and the wide activations "
                f"({fits}).")
    return (f"{over}, more than {gib(hw.usable)}; {c.stages} pipeline stages each hold a "
            f"share of the layers ({fits}).")


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
