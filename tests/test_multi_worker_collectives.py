"""Under tfdist's own collectives (shm and mpi here; tcp shares shm's ring for the eval
loss) no training or eval step of multi_worker_mirrored traces a TensorFlow collective.

Why it matters: TensorFlow's collective all-reduce goes over gRPC whatever
--collective says, and leaks memory per call (tensorflow#42616). Two had crept in:
the eval step's loss was summed by strategy.reduce, and tf.distribute adds an
all-reduce to every get_next of a finite dataset in multi-worker mode (its
partial-batch handling), which the evaluation's padded split was (its dataset now
is repeated without end: EvalData.batches). With the dataset also distributed anew per
evaluation, 2 workers grew 120 KB an epoch of a user's fit with 40 validation batches
(docs/benchmarks.md, Soak). The traced graphs are read in 2 real worker processes
(tests/workers/step_collectives.py); under --collective=auto the same check finds
TensorFlow's collectives, so it can see them.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO
from test_mpi import mpi_unavailable

NEEDS_MPI = pytest.mark.skipif(mpi_unavailable() is not None, reason=str(mpi_unavailable()))


def traced_ops(collective, out_dir):
    """{rank: {"train"|"eval": {"ops": [...], "loss": float}}} from 2 launched workers."""
    mpi = ["--mpi"] if collective == "mpi" else []
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.launch", *mpi, "--workers", "2", "--", sys.executable,
         "tests/workers/step_collectives.py", collective, str(out_dir)],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = {}
    for rank in (0, 1):
        with open(out_dir / f"ops.rank{rank}.json") as f:
            records[rank] = json.load(f)
    return records


@pytest.mark.parametrize("collective", ["shm", pytest.param("mpi", marks=NEEDS_MPI)])
def test_no_step_traces_a_tensorflow_collective_under_tfdists_own(collective, tmp_path):
    records = traced_ops(collective, tmp_path)
    for rank, record in records.items():
        assert record["train"]["ops"] == [], (rank, record)
        assert record["eval"]["ops"] == [], (rank, record)
    # the losses were summed over both workers all the same: every worker holds the sum
    for step in ("train", "eval"):
        assert records[0][step]["loss"] == records[1][step]["loss"] > 0


def test_the_check_finds_tensorflows_collectives_under_auto(tmp_path):
    records = traced_ops("auto", tmp_path)
    for record in records.values():
        for step in ("train", "eval"):
            assert any(op.startswith("CollectiveReduce") for op in record[step]["ops"]), record
