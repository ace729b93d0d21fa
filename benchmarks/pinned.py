"""Runs a command on one CPU core: `python -m benchmarks.pinned COMMAND ...`.

The core is the TFDIST_RANK-th (modulo the cores this process may use) under `tfdist
launch`, the first outside one. The pipeline overlap suite runs every contender this way, so
that each process computes on exactly one core whatever its thread pools hold: a stage
process needs a second inter-op thread to hand its tensors over while it computes
(tfdist/parallel/pipeline/cluster.py), and pinned, that thread cannot add a second core of
compute to the comparison with one process on one thread.
"""

import os
import sys


def core_for(rank: int, cores) -> int:
    cores = sorted(cores)
    return cores[rank % len(cores)]


def main(argv) -> None:
    if not argv:
        sys.exit("usage: python -m benchmarks.pinned COMMAND [ARGS...]")
    rank = int(os.environ.get("TFDIST_RANK", "0") or 0)
    os.sched_setaffinity(0, {core_for(rank, os.sched_getaffinity(0))})
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
