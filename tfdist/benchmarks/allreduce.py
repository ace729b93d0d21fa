"""All-reduce bandwidth across workers, in the manner of nccl-tests.

Runs inside each worker of a `tfdist launch` group under multi_worker_mirrored.
For each message size, a float32 tensor per replica is summed across all
replicas `iterations` times inside one tf.function; the median of `trials`
timings is reported. As in nccl-tests:
  algorithm bandwidth = bytes / time
  bus bandwidth       = algorithm bandwidth * 2 (n - 1) / n   (n = replicas)
the second being comparable to the hardware's link speed for a ring.
`--collective=tcp` and `--collective=shm` time tfdist's own all-reduces
(tcp_ring.py, shm_ring.py) on numpy buffers, the path its gradients take in
training.
"""

import statistics
import time

import tensorflow as tf

MB = 1 << 20
DEFAULT_SIZES_MB = (1, 2, 4, 8, 16, 32, 64)


def time_all_reduce(strategy, num_bytes: int, iterations: int, trials: int) -> float:
    """Median seconds for one all-reduce of num_bytes per replica."""
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
    """Median seconds for one all-reduce of num_bytes per worker by a TcpRing or a
    SharedMemoryAllReduce (all_reduce_arrays, as in training)."""
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
    """Rows per size for a MultiWorkerParallelism (tfdist's reducer when it has one)."""
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
