"""--collective=mpi over real MPI ranks on this host, started by `tfdist launch --mpi`.

- MpiAllReduce alone (no TensorFlow): 2 and 3 ranks, over Open MPI's shared memory
  and over TCP only, sum arrays of mixed shapes to within float32 rounding of the
  float64 sum, every rank bitwise the same; ranks that sum other shapes all fail
  with the layout error instead of summing.
- Equivalence: 2 and 3 ranks, mlp, cnn and the transformer (an embedding: sparse
  gradients) with sgd and adam: per-step losses and every rank's final weights
  within 1e-5 relative of one device, the ranks bitwise equal.
Skips, saying what to install, without mpi4py or Open MPI's mpirun (the test
extra installs both: pip install -e ".[test]").
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, from_json_overrides, small_config
from tfdist.testing import equivalence

sys.path.insert(0, os.path.join(REPO, "tests", "workers"))
import mpi_sums  # noqa: E402  (its SHAPES: what every rank sums)


def mpi_unavailable():
    """Why MPI tests cannot run here, or None."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return 'mpi4py is not installed: pip install -e ".[mpi]"'
    from tfdist import launch
    from tfdist.errors import UsageError
    try:
        launch.resolve_mpirun()
    except UsageError as error:
        return str(error)
    return None


pytestmark = pytest.mark.skipif(mpi_unavailable() is not None, reason=str(mpi_unavailable()))
TCP_ONLY = "--mca pml ob1 --mca btl tcp,self"
STEPS = 20
TRANSFORMER = dict(model=dict(name="transformer", num_layers=1, d_model=32, num_heads=4,
                              d_ff=64), data=dict(name="text", seq_len=16))
CONFIGS = {f"{model}_{optimizer}": dict(model=model, optimizer=optimizer)
           for model in ("mlp", "cnn") for optimizer in ("sgd", "adam")}
CONFIGS.update({f"transformer_{optimizer}": dict(TRANSFORMER, optimizer=optimizer)
                for optimizer in ("sgd", "adam")})
GLOBAL_BATCH = 48   # divides over 2 and 3 ranks


def launch_mpi(workers, command, mpi_args="", timeout=900):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    flags = ["--mpi", "--workers", str(workers)] + ([f"--mpi_args={mpi_args}"] if mpi_args else [])
    return subprocess.run([sys.executable, "-m", "tfdist.launch", *flags, "--", *command],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def expected_sums(workers):
    """What mpi_sums.py's ranks sum, in float64."""
    generators = [np.random.default_rng(1234 + rank) for rank in range(workers)]
    expected = []
    for _ in range(3):
        per_rank = [[g.standard_normal(shape).astype(np.float32) * 1e3 for shape in mpi_sums.SHAPES]
                    for g in generators]
        expected += [sum(arrays[i].astype(np.float64) for arrays in per_rank)
                     for i in range(len(mpi_sums.SHAPES))]
    expected.append(np.full(4, sum(rank + 0.1 for rank in range(workers))))
    return expected


@pytest.mark.parametrize("workers,mpi_args", [(2, ""), (3, ""), (2, TCP_ONLY), (3, TCP_ONLY)],
                         ids=["2-shm", "3-shm", "2-tcp", "3-tcp"])
def test_all_reduce_sums_and_every_rank_gets_the_same_bits(workers, mpi_args, tmp_path):
    result = launch_mpi(workers, [sys.executable, "tests/workers/mpi_sums.py", str(tmp_path)],
                        mpi_args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [list(np.load(tmp_path / f"sums.rank{rank}.npz").values()) for rank in range(workers)]
    expected = expected_sums(workers)
    assert len(ranks[0]) == len(expected) == 3 * len(mpi_sums.SHAPES) + 1
    for got, want in zip(ranks[0], expected):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-3)
    for rank in range(1, workers):
        for first, other in zip(ranks[0], ranks[rank]):
            assert first.tobytes() == other.tobytes(), f"rank {rank} got other bits than rank 0"
    for rank in range(workers):   # the layout check: every rank refused the mismatched shapes
        assert (f"[worker {rank}] rank {rank}: MPI rank {rank} of {workers}: rank 1 sum other "
                f"gradient shapes than rank 0") in result.stdout


def reference(name):
    overrides = from_json_overrides(dict(CONFIGS[name], trainer="loop"))
    return equivalence.train(small_config(train_steps=STEPS, global_batch_size=GLOBAL_BATCH,
                                          **overrides), name)


@pytest.fixture(scope="module")
def references():
    return {name: reference(name) for name in CONFIGS}


@pytest.mark.parametrize("workers", [2, 3])
def test_ranks_train_like_one_device(workers, references, tmp_path):
    """Every config in one launch of `workers` ranks: per-step losses and EVERY rank's
    final weights against one device, and the ranks bitwise equal."""
    configs = {name: dict(config, train_steps=STEPS, collective="mpi",
                          global_batch_size=GLOBAL_BATCH) for name, config in CONFIGS.items()}
    result = launch_mpi(workers, [sys.executable, "tests/workers/train_configs.py",
                                  json.dumps(configs), str(tmp_path)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(configs) == 6
    for name in configs:
        results = json.loads((tmp_path / f"{name}.json").read_text())
        assert results["num_replicas"] == workers and len(results["losses"]) == STEPS
        weights = [equivalence.load_weights(tmp_path / f"{name}.rank{rank}.npz")
                   for rank in range(workers)]
        for rank, rank_weights in enumerate(weights):
            candidate = equivalence.Record(f"{workers} MPI ranks {name} rank {rank}",
                                           results["losses"], rank_weights)
            equivalence.assert_equivalent(references[name], candidate)
        for rank in range(1, workers):
            bitwise = equivalence.weight_mismatches(
                equivalence.Record("rank 0", [], weights[0]),
                equivalence.Record(f"rank {rank} {name}", [], weights[rank]), rtol=0)
            assert not bitwise, bitwise


def test_doctor_reports_the_mpi_library_without_starting_mpi():
    from tfdist.parallel import mpi
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-m", "tfdist.cli", "doctor"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    section = result.stdout.split("\nMPI\n")[1].split("\nCluster environment")[0]
    import mpi4py
    assert f"mpi4py: {mpi4py.__version__}" in section
    assert "MPI library: Open MPI v5" in section and "mpirun (" in section, section
    assert "this process: not under an MPI launch" in section
    assert mpi.launcher_of(os.environ) is None   # nor is this test process


def test_canary_mpi_init_is_reachable_through_mpi4pys_extension():
    """tfdist initialises MPI with MPI_Init_thread looked up through mpi4py's extension
    module (mpi.initialise_releasing_the_gil), because mpi4py's own initialisation holds
    the GIL (no upstream issue found; mpi4py 4.1). If a new mpi4py stops linking its MPI
    library that way, the fallback keeps working but holds the GIL again, and
    test_mpi_errors.py's rank-stuck-before-MPI_Init test would hang to its timeout:
    this fails first, by name."""
    code = ("import ctypes, mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(bool(ctypes.CDLL(MPI.__file__).MPI_Init_thread), MPI.Is_initialized())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["True", "False"], result.stderr[-2000:]
