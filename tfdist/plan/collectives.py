"""Which collective sums a plan's gradients: the fastest exact one this layout can run,
read from measurements, not guessed.

The layout tfdist's own all-reduces serve is CPU workers that `tfdist launch` starts
on this host, one device each, float32 or mixed_bfloat16 (multi_worker.check_tcp_ring_config
refuses the rest); every --collective there keeps the equivalence guarantee. The
planner takes the one with the most training examples/s in THROUGHPUT, among those that
can run here: `mpi` only where it is installed (mpi4py importable and an Open MPI mpirun
found, checked without starting MPI). Every other layout keeps TF's collectives (no
--collective flag).

Why examples/s and not bandwidth: MPI_Allreduce moves 1-16 MB 1.2-3.9x faster than the
shared-memory all-reduce in the bandwidth benchmark (BUS_GBPS), yet trains no faster
with the step's gradients (THROUGHPUT); the planner recommends what trains fastest and
prints the bandwidth beside it.

THROUGHPUT is the "Multi-worker throughput" table of docs/benchmarks.md (MLP 784-1024-1024-10, 7.1 MiB
of float32 gradients, 2 workers, one thread each), from
    python -m benchmarks --suite=throughput --steps=300 --trials=3
BUS_GBPS is its "All-reduce bandwidth" table (2 worker processes; medians over three runs) of
    python -m benchmarks --suite=allreduce --sizes_mb=1,4,16,64
both on this 2-core shared host. Re-measure with those commands and replace both together.
"""

import dataclasses
import functools
import importlib.util
import math
import os
import sys
from typing import Dict, Optional, Tuple

from tfdist.plan.recommend import gib

MB = 1 << 20
# collective -> {message MB: bus bandwidth GB/s, median of 3 runs}. "mpi" is Open MPI's shared memory
# (`tfdist launch --mpi`); "mpi_tcp" its TCP transport, measured, never chosen on one host.
# Both tables: 2026-12-05, a 2-core Intel Xeon with AVX512 (docs/benchmarks.md).
BUS_GBPS: Dict[str, Dict[int, float]] = {
    "auto": {1: 0.23, 4: 0.37, 16: 0.34, 64: 0.31},
    "ring": {1: 0.24, 4: 0.38, 16: 0.36, 64: 0.30},
    "tcp": {1: 0.73, 4: 1.04, 16: 1.12, 64: 0.80},
    "shm": {1: 0.95, 4: 2.15, 16: 2.32, 64: 1.88},
    "mpi": {1: 3.69, 4: 3.50, 16: 2.88, 64: 1.28},
    "mpi_tcp": {1: 1.85, 4: 1.55, 16: 1.39, 64: 0.81},
}
# collective -> examples/s of 2 workers (medians of 3 trials in one run). shm and mpi are level
# on this workload (paired runs: docs/benchmarks.md), so which leads a run is within its noise.
THROUGHPUT = {"auto": 8814, "tcp": 14117, "shm": 18531, "mpi": 18356}
THROUGHPUT_GRADIENT_BYTES = 4 * (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10)
ONE_HOST = tuple(THROUGHPUT)   # what `tfdist launch` runs on one host, measured end to end


@dataclasses.dataclass(frozen=True)
class Choice:
    collective: Optional[str]    # the --collective flag to add; None: TF's default (auto)
    reason: str


def mpi_installed() -> Tuple[bool, str]:
    """(usable, why not): mpi4py importable and an Open MPI mpirun found, without
    importing mpi4py's MPI module (which would initialise MPI)."""
    return _mpi_installed(sys.executable, os.environ.get("PATH", ""))


@functools.lru_cache(maxsize=4)   # one `mpirun --version` per plan, not one per printed line
def _mpi_installed(python: str, path: str) -> Tuple[bool, str]:
    if importlib.util.find_spec("mpi4py") is None:
        return False, "mpi4py is not installed"
    from tfdist.launch import mpirun   # TF-free; resolve_mpirun runs `mpirun --version` only
    from tfdist.errors import UsageError
    try:
        mpirun.resolve_mpirun()
    except UsageError as error:
        return False, str(error)
    return True, ""


def nearest_size(num_bytes: int) -> int:
    """The bandwidth table's size (MB) nearest to num_bytes on a log scale."""
    sizes = sorted(BUS_GBPS["shm"])
    return min(sizes, key=lambda mb: abs(math.log2(max(num_bytes, 1) / (mb * MB))))


def fastest(collectives) -> str:
    return max(collectives, key=lambda c: THROUGHPUT[c])


def choose(strategy: str, device_type: str, devices: int, workers: int, dtype: str,
           gradient_bytes: int) -> Choice:
    """The collective for a plan (see the module docstring for the rule)."""
    if not (strategy == "multi_worker_mirrored" and device_type == "cpu"
            and devices == workers and dtype != "mixed_float16"):
        return Choice(None, "")
    usable, why_not = mpi_installed()
    available = [c for c in ONE_HOST if c != "mpi" or usable]
    best = fastest(available)
    trains = ", ".join(f"{c} {THROUGHPUT[c]:,}" for c in sorted(available, key=lambda c: -THROUGHPUT[c]))
    size = nearest_size(gradient_bytes)
    moves = ", ".join(f"{c} {BUS_GBPS[c][size]:.2f}" for c in available)
    reason = (f"--collective={best}: the most examples/s measured for 2 workers on one host "
              f"({trains}; docs/benchmarks.md, multi-worker throughput); all-reduce bus GB/s at {size} MB, "
              f"nearest to this plan's {gib(gradient_bytes)} of gradients: {moves}")
    if not usable:
        reason += f". Without MPI ({why_not})"
        if fastest(ONE_HOST) == "mpi":
            reason += "; it would be faster"
    return Choice(best, reason + ".")
