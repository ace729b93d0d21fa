"""Multi-worker throughput on a compute-bound MLP, against one worker and PyTorch DDP.

The issue's benchmark: MLP 784-1024-1024-10, global batch 512, SGD, synthetic
data, every process limited to one thread (TF_NUM_INTRAOP_THREADS=1 and
TF_NUM_INTEROP_THREADS=1; torch.set_num_threads(1)). Contenders run as separate
process groups, alternating trial by trial so machine noise hits all alike;
medians are reported. PyTorch DDP (gloo) runs only when torch is importable
(optional extra: `pip install torch`); `--collective=mpi` (under `tfdist launch
--mpi`, Open MPI's shared memory) only when mpi4py and Open MPI's mpirun are.
"""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks import allreduce   # TF-free at import

ONE_THREAD = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
              "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
TRAIN_FLAGS = ["--model=mlp", "--hidden_sizes=1024,1024", "--dataset=synthetic",
               "--synthetic_shape=784", "--synthetic_examples=16384", "--global_batch_size=512",
               "--optimizer=sgd", "--log_every=100000"]


def _tfdist_rate(workers: int, steps: int, extra_flags=(), launch_flags=()) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "r.json")
        train = [sys.executable, "-m", "experiments.train", f"--train_steps={steps}",
                 f"--results_json={results}", *TRAIN_FLAGS, *extra_flags]
        if workers == 1:
            command = train + ["--strategy=default", "--simulate_devices=0"]
        else:
            command = [sys.executable, "-m", "tfdist.launch", "--workers", str(workers),
                       *launch_flags, "--", *train, "--strategy=multi_worker_mirrored"]
        subprocess.run(command, env=dict(os.environ, **ONE_THREAD), check=True,
                       capture_output=True, text=True, timeout=1800)
        with open(results) as f:
            return json.load(f)["examples_per_sec"]


def _torch_rate(workers: int, steps: int, attempts: int = 3) -> float:
    """PyTorch's rate; a run is retried because gloo now and then aborts a rank
    (SIGABRT, "terminate called without an active exception") in this torch build."""
    script = os.path.join(os.path.dirname(__file__), "torch_ddp.py")
    for attempt in range(1, attempts + 1):
        result = subprocess.run([sys.executable, script, str(workers), str(steps)],
                                env=dict(os.environ, **ONE_THREAD),
                                capture_output=True, text=True, timeout=1800)
        if result.returncode == 0:
            return float(result.stdout.strip().splitlines()[-1])
        print(f"torch_ddp.py {workers} {steps}: attempt {attempt} failed "
              f"(exit {result.returncode}): {result.stderr.strip().splitlines()[-1:]}",
              file=sys.stderr, flush=True)
    raise RuntimeError(f"torch_ddp.py {workers} {steps} failed {attempts} times:\n"
                       f"{result.stderr[-3000:]}")


def contenders(steps: int, bytes_per_pack: int):
    runs = {
        "tfdist 1 worker": lambda: _tfdist_rate(1, steps),
        # No --collective flag: what a user gets (the fastest exact collective, chosen).
        "tfdist 2 workers": lambda: _tfdist_rate(2, steps),
        "tfdist 2 workers, --collective=auto": lambda: _tfdist_rate(2, steps, ["--collective=auto"]),
        "tfdist 2 workers, --collective=tcp": lambda: _tfdist_rate(2, steps, ["--collective=tcp"]),
        "tfdist 2 workers, --collective=shm": lambda: _tfdist_rate(2, steps, ["--collective=shm"]),
    }
    if allreduce.mpi_missing() is None:   # Open MPI's shared memory, as `tfdist launch --mpi` sets it
        runs["tfdist 2 workers, --collective=mpi"] = lambda: _tfdist_rate(
            2, steps, ["--collective=mpi"], ["--mpi"])
    else:
        print(f"throughput: no --collective=mpi contender: {allreduce.mpi_missing()}",
              file=sys.stderr, flush=True)
    if bytes_per_pack:
        runs[f"tfdist 2 workers, bytes_per_pack={bytes_per_pack}"] = lambda: _tfdist_rate(
            2, steps, ["--collective=auto", f"--bytes_per_pack={bytes_per_pack}"])
    if importlib.util.find_spec("torch") is not None:
        runs["pytorch 1 process"] = lambda: _torch_rate(1, steps)
        runs["pytorch DDP gloo 2 processes"] = lambda: _torch_rate(2, steps)
    return runs


def network_contenders(steps: int):
    """Each collective's 2 workers in `tfdist launch`'s private network and in the host's:
    the price of the private network namespace (tfdist.netns), if any."""
    collectives = ["auto", "tcp", "shm"] + (["mpi"] if allreduce.mpi_missing() is None else [])
    runs = {}
    for collective in collectives:
        for network in ("private", "host"):
            mpi = ["--mpi"] if collective == "mpi" else []
            runs[f"--collective={collective}, --network={network}"] = (
                lambda c=collective, n=network, m=mpi: _tfdist_rate(
                    2, steps, [f"--collective={c}"], [*m, f"--network={n}"]))
    return runs


def compare(steps: int = 300, trials: int = 3, bytes_per_pack: int = 0, networks=False):
    runs = network_contenders(steps) if networks else contenders(steps, bytes_per_pack)
    rates = {name: [] for name in runs}
    for _ in range(trials):
        for name, run in runs.items():
            rates[name].append(run())
    return [{"contender": name, "examples_per_sec_median": round(statistics.median(r), 1),
             "trials": " ".join(f"{x:.0f}" for x in r)} for name, r in rates.items()]
