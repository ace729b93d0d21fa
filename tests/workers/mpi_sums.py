"""An MPI test worker: MpiAllReduce's sums on every rank, written for the test to compare.

    mpirun -np N python tests/workers/mpi_sums.py OUT_DIR

Each rank sums, several times, arrays of mixed shapes whose values differ by rank
and need rounding (so the order of the additions shows in the last bits), and
writes rank R's results to OUT_DIR/sums.rankR.npz. Also proves the layout check:
rank 1 then asks for other shapes than rank 0, and every rank must raise.
No TensorFlow: this is the all-reduce alone.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tfdist.errors import ClusterError  # noqa: E402
from tfdist.parallel import mpi  # noqa: E402

SHAPES = [(3, 5), (1000,), (), (257, 3)]


def main(out_dir: str) -> None:
    MPI = mpi.load_mpi()
    world = mpi.World(MPI, MPI.COMM_WORLD, None, "mpirun")   # no TF cluster: the sums alone
    reducer = mpi.MpiAllReduce(world)
    rank = world.rank
    rng = np.random.default_rng(1234 + rank)
    sums = []
    for _ in range(3):
        arrays = [rng.standard_normal(shape).astype(np.float32) * 1e3 for shape in SHAPES]
        sums += [np.array(s, copy=True) for s in reducer.all_reduce_arrays(*arrays)]
    sums.append(reducer.all_reduce(np.full(4, rank + 0.1, np.float32)))
    np.savez(os.path.join(out_dir, f"sums.rank{rank}.npz"), *sums)
    mismatch = [np.zeros((7,) if rank == 1 else (3, 5), np.float32)]
    try:
        reducer.all_reduce_arrays(*mismatch)
    except ClusterError as error:
        print(f"rank {rank}: {error}", flush=True)
        return
    raise SystemExit(f"rank {rank}: other shapes on rank 1 were summed without an error")


if __name__ == "__main__":
    main(sys.argv[1])
