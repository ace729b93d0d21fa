"""The soak suite finds the workers it samples among the launcher's descendants.

tfdist launch's own workers are its children with TFDIST_RANK; under `tfdist launch
--mpi` the ranks are mpirun's children (the launcher's grandchildren) with
OMPI_COMM_WORLD_RANK, and mpirun itself has neither. A stand-in process tree (sleeps,
no TensorFlow, no MPI) of both shapes, each rank with a child of its own that inherits
its variable and must not be taken for it. Under a second.
"""

import os
import subprocess
import sys
import time

import pytest

from benchmarks import soak

# One script, run in every role of the tree: the launcher starts the ranks, or under
# --mpi "mpirun" (no rank variable), which starts them; each rank starts a helper child
# (it inherits the rank variable) and prints "RANK PID" on the pipe they all share.
TREE = """
import os, subprocess, sys, time
role, variable, shape = sys.argv[1:4]
def start(child, **env):
    subprocess.Popen([sys.executable, __file__, child, variable, shape], env=dict(os.environ, **env))
if role == "launcher" and shape == "mpirun":
    start("mpirun")
elif role in ("launcher", "mpirun"):
    for rank in (0, 1):
        start("rank", **{variable: str(rank)})
elif role == "rank":
    start("helper")
    # one write, so the two ranks' lines cannot interleave on the shared pipe even
    # when PYTHONUNBUFFERED makes print() write each piece on its own (CI sets it)
    os.write(1, f"{os.environ[variable]} {os.getpid()}\\n".encode())
time.sleep(60)
"""


def helpers_of(ranks):
    """rank -> the rank variable seen in each child of that rank's process."""
    children = soak.children_of()
    return {rank: [soak.rank_of(child) for child in children.get(pid, [])]
            for rank, pid in ranks.items()}


@pytest.mark.parametrize("variable,shape", [("TFDIST_RANK", "direct"),
                                            ("OMPI_COMM_WORLD_RANK", "mpirun")])
def test_worker_pids_finds_ranks_among_the_launchers_descendants(variable, shape, tmp_path):
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    env = {k: v for k, v in os.environ.items() if k not in ("TFDIST_RANK", "OMPI_COMM_WORLD_RANK")}
    launcher = subprocess.Popen([sys.executable, str(script), "launcher", variable, shape], env=env,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        printed = dict(tuple(map(int, launcher.stdout.readline().split())) for _ in range(2))
        deadline = time.monotonic() + 10
        found = soak.worker_pids(launcher.pid)
        while found != printed and time.monotonic() < deadline:
            time.sleep(0.05)
            found = soak.worker_pids(launcher.pid)
        assert found == printed and sorted(found) == [0, 1], (found, printed)
        # Each rank's helper carries its variable too. Polled like the ranks: Popen
        # returns once exec has closed the error pipe, which the kernel does before it
        # lays out the new program's environment, so for a moment /proc/PID/environ of
        # a just-started helper is empty (seen in CI: {0: [None], 1: [1]}).
        helpers = helpers_of(printed)
        while helpers != {0: [0], 1: [1]} and time.monotonic() < deadline:
            time.sleep(0.05)
            helpers = helpers_of(printed)
        assert helpers == {0: [0], 1: [1]}, helpers
    finally:
        os.killpg(launcher.pid, 9)
        launcher.wait()
