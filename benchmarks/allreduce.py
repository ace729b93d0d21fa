"""All-reduce bandwidth across workers, in the manner of nccl-tests.

Runs inside each worker of a `tfdist launch` group under multi_worker_mirrored.
For each message size, a float32 tensor per replica is summed across all
replicas `iterations` times inside one tf.function; the median of `trials`
timings is reported. As in nccl-tests:
  algorithm bandwidth = bytes / time
  bus bandwidth       = algorithm bandwidth * 2 (n - 1) / n   (n = replicas)
the second being comparable to the hardware's link speed for a ring.
`--collective=tcp`, `=shm` and `=mpi` time tfdist's own all-reduces (tcp_ring.py,
shm_ring.py, mpi.py's MpiAllReduce) on numpy buffers, the path its gradients
take in training.

The names in --collectives are VARIANTS: a --collective value, or `mpi_tcp`, which
is `--collective=mpi` with Open MPI held to TCP. `mpi` runs under `tfdist launch
--mpi` (Open MPI's shared-memory transport, the launcher's `--mca btl self,sm`),
`mpi_tcp` under `tfdist launch --mpi --mpi_args "--mca pml ob1 --mca btl tcp,self"`.
"""

import importlib.util
import statistics
import sys
import time
from typing import List, Optional

from tfdist.errors import UsageError, require

MB = 1 << 20
DEFAULT_SIZES_MB = (1, 2, 4, 8, 16, 32, 64)
MPI_TCP_ARGS = "--mca pml ob1 --mca btl tcp,self"
# name in --collectives -> (the workers' --collective, the `tfdist launch` options)
VARIANTS = {
    "auto": ("auto", []), "ring": ("ring", []), "nccl": ("nccl", []),
    "tcp": ("tcp", []), "shm": ("shm", []),
    "mpi": ("mpi", ["--mpi"]),                                  # Open MPI, shared memory
    "mpi_tcp": ("mpi", ["--mpi", "--mpi_args", MPI_TCP_ARGS]),   # Open MPI, TCP only
}
DEFAULT_COLLECTIVES = "auto,ring,tcp,shm,mpi,mpi_tcp"
MPI_VARIANTS = ("mpi", "mpi_tcp")


def mpi_missing() -> Optional[str]:
    """Why --collective=mpi cannot run here (no mpi4py, no Open MPI mpirun), or None.
    Checked without initialising MPI."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed"
    from tfdist import launch
    try:
        launch.resolve_mpirun()
    except UsageError as error:
        return str(error)
    return None


def parse_collectives(text: str, given: bool) -> List[str]:
    """The --collectives names, checked. Where MPI is missing, the default list drops
    its variants (saying so on stderr); a list the user gave that names one fails."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    require(names, f"--collectives names none, got {text!r}.")
    unknown = [name for name in names if name not in VARIANTS]
    require(not unknown, f"Unknown collective {(unknown or [''])[0]!r} in "
                         f"--collectives={text!r}. Valid choices: {', '.join(VARIANTS)}.")
    wanted = [name for name in names if name in MPI_VARIANTS]
    missing = mpi_missing() if wanted else None
    require(not (missing and given), f"--collectives={text!r} names {', '.join(wanted)}, "
                                     f"but MPI cannot run here: {missing}")
    if missing:
        print(f"allreduce: skipping {', '.join(wanted)}: {missing}", file=sys.stderr)
        names = [name for name in names if name not in MPI_VARIANTS]
    return names


def launch_command(python: str, workers: int, name: str, sizes_mb: str) -> List[str]:
    """The `tfdist launch` of the worker group that times VARIANTS[name]."""
    return [python, "-m", "tfdist.launch", "--workers", str(workers), *VARIANTS[name][1], "--",
            python, "-m", "benchmarks", "--suite=allreduce", "--worker",
            f"--collectives={name}", f"--sizes_mb={sizes_mb}"]


def time_all_reduce(strategy, num_bytes: int, iterations: int, trials: int) -> float:
    """Median seconds for one all-reduce of num_bytes per replica."""
    import tensorflow as tf   # here: the suite's launching process never imports it
    elements = num_bytes // 4

    @tf.function
    def reduce_many():
        def replica_fn():
            value = tf.ones([elements], tf.float32)
            context = tf.distribute.get_replica_context()
            for _ in range(iterations):  # unrolled: each waits for the previous one
                value = context.all_reduce(tf.distribute.ReduceOp.SUM, value) * 0.5
            return tf.reduce_sum(value[:1])
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_fn), axis=None)

    float(reduce_many())  # trace, warm up the collective groups
    timings = []
    for _ in range(trials):
        start = time.perf_counter()
        float(reduce_many())
        timings.append((time.perf_counter() - start) / iterations)
    return statistics.median(timings)


def time_tfdist_all_reduce(reducer, num_bytes: int, iterations: int, trials: int) -> float:
    """Median seconds for one all-reduce of num_bytes per worker by a TcpRing, a
    SharedMemoryAllReduce or an MpiAllReduce (all_reduce_arrays, as in training)."""
    import numpy as np
    value = np.ones(num_bytes // 4, np.float32)
    reducer.all_reduce_arrays(value)  # warm up the sockets' buffers, map the memory
    timings = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(iterations):
            value = reducer.all_reduce_arrays(value)[0] * 0.5
        timings.append((time.perf_counter() - start) / iterations)
    return statistics.median(timings)


def sweep(parallel, collective: str, sizes_mb=DEFAULT_SIZES_MB, iterations=5, trials=5):
    """Rows per size for a MultiWorkerParallelism (tfdist's reducer when it has one);
    `collective` is the VARIANTS name the rows carry."""
    from tfdist.parallel import shm_ring
    n = parallel.strategy.num_replicas_in_sync
    rows = []
    for size_mb in sizes_mb:
        if collective == "shm":   # its regions have one size: one reducer per size
            reducer = shm_ring.SharedMemoryAllReduce(parallel.ring)
            seconds = time_tfdist_all_reduce(reducer, size_mb * MB, iterations, trials)
            reducer.close()
        elif parallel.reducer is not None:
            seconds = time_tfdist_all_reduce(parallel.reducer, size_mb * MB, iterations, trials)
        else:
            seconds = time_all_reduce(parallel.strategy, size_mb * MB, iterations, trials)
        algbw = size_mb * MB / seconds / 1e9
        rows.append({"collective": collective, "replicas": n, "bytes": size_mb * MB,
                     "time_ms": round(seconds * 1e3, 3), "algbw_GBps": round(algbw, 3),
                     "busbw_GBps": round(algbw * 2 * (n - 1) / n, 3)})
    return rows
