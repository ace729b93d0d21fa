# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Multi-worker data parallelism over `TF_CONFIG`
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tfdist/tfdist/blob/main/colab/02_multi_worker.ipynb)
#
# `--strategy=multi_worker_mirrored` trains one Keras 3 model data-parallel across processes and
# machines with TensorFlow's `MultiWorkerMirroredStrategy` (Keras 3's own `fit` is broken under it
# upstream: keras-team/keras#20585; tfdist trains with its own loop and repairs `fit`). Each process
# learns its place in the cluster from the `TF_CONFIG` environment variable.
#
# This notebook starts 2 worker processes on this machine with `tfdist launch`, shows the
# `TF_CONFIG` each one got, reads the chief's results JSON, and checks its per-step losses against a
# single-process `default` run with the same seed and global batch.

# %%
try:
    import tfdist
except ImportError:  # a fresh Colab runtime: install tfdist (with TensorFlow 2.21 and Keras 3)
    # %pip install -q "tfdist @ git+https://github.com/tfdist/tfdist"
    import tfdist

# %%
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ log noise, here and in children
STEPS = int(os.environ.get("TFDIST_NOTEBOOK_STEPS", "100"))  # the test suite runs a handful

import json
import pathlib
import shlex
import subprocess
import sys
import tempfile

TIMEOUT = 600  # seconds per command: a stuck worker must not hang the notebook
# From a source checkout, run from its root; otherwise the installed `experiments` package is used.
ROOT = pathlib.Path(tfdist.__file__).resolve().parent.parent
CWD = ROOT if (ROOT / "experiments" / "train.py").is_file() else None
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
OUT = pathlib.Path(tempfile.mkdtemp(prefix="tfdist-notebook-"))
TFDIST = [sys.executable, "-m", "tfdist.cli"]        # the `tfdist` command
TRAIN = [sys.executable, "-m", "experiments.train"]  # `python -m experiments.train`


def run(cmd):
    """Runs `cmd` and returns its output (stdout and stderr together).

    On a timeout or an interrupted cell the process gets SIGTERM first, which
    `tfdist launch` forwards to every worker, so no worker is left behind."""
    print("$", shlex.join("python" if part == sys.executable else part for part in cmd))
    with subprocess.Popen(cmd, cwd=CWD, env=ENV, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        try:
            output, _ = proc.communicate(timeout=TIMEOUT)
        except BaseException:
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if proc.returncode:
        raise RuntimeError(f"exit status {proc.returncode}; the output ended with:\n{output[-3000:]}")
    return output


def tfdist_lines(output):
    """tfdist's own lines, without TensorFlow's C++ log lines."""
    return "\n".join(line for line in output.splitlines() if "tfdist" in line)


def count_gpus():
    """GPUs on this runtime, without importing TensorFlow into the notebook."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listing.splitlines())


# %% [markdown]
# ## Workers and devices
#
# On a CPU-only runtime each worker is one process on the CPU. With at least one GPU per worker,
# worker R sees only GPU R (two processes on one GPU would fight over its memory, so with fewer GPUs
# the workers use the CPU). The single-process reference run sees the same devices.

# %%
WORKERS = 2
GPUS = count_gpus()
if GPUS >= WORKERS:  # worker R sees only GPU R (`tfdist launch` sets TFDIST_RANK=R)
    WORKER = ["sh", "-c", 'CUDA_VISIBLE_DEVICES="$TFDIST_RANK" exec "$@"', "worker"] + TRAIN
else:
    ENV["CUDA_VISIBLE_DEVICES"] = ""
    WORKER = TRAIN
FLAGS = ["--model=mlp", "--dataset=digits", "--optimizer=adam", "--global_batch_size=64",
         f"--train_steps={STEPS}", "--seed=0"]
print(f"{GPUS} GPU(s); {WORKERS} workers on {'one GPU each' if GPUS >= WORKERS else 'the CPU'}")


# %% [markdown]
# ## The `TF_CONFIG` each worker gets
#
# `tfdist launch --dry_run` prints each worker's environment and starts nothing. (The notebook
# runs `tfdist` as `python -m tfdist.cli`, the same program, so that its own Python is used.) All tasks are
# `worker`s and worker 0 is the chief (TensorFlow's rule when the cluster has no `chief` task):
# the one that writes checkpoints and the results JSON.

# %%
def launch(*launch_flags):
    """`tfdist launch --workers 2 [launch_flags] -- python -m experiments.train ...`"""
    return (TFDIST + ["launch", f"--workers={WORKERS}", *launch_flags, "--"] + WORKER
            + ["--strategy=multi_worker_mirrored"] + FLAGS)


for line in run(launch("--dry_run")).splitlines():
    if line.startswith("{"):
        worker = json.loads(line)
        print(f"worker {worker['rank']}: TF_CONFIG={json.dumps(worker['TF_CONFIG'])}")

# %% [markdown]
# On a real cluster every machine sets its own `TF_CONFIG`; `tfdist tf-config` builds it from the
# host list and the machine's rank (or from Slurm's variables with `--slurm`):

# %%
for index in range(WORKERS):
    print(run(TFDIST + ["tf-config", "--hosts", "node-a:2222,node-b:2222", "--index", str(index)]).strip())

# %% [markdown]
# ## Launch 2 workers
#
# `tfdist launch` picks free loopback ports, starts the workers with their `TF_CONFIG`, prefixes
# their lines with `[worker R]`, and ends every worker if one fails. (`--devices_per_worker 2` would
# give each worker 2 simulated CPUs: 4 replicas.)

# %%
MULTI_WORKER_JSON = OUT / "multi_worker.json"
output = run(launch() + ["--collective_timeout=120", f"--results_json={MULTI_WORKER_JSON}"])
print(tfdist_lines(output))
multi_worker = json.loads(MULTI_WORKER_JSON.read_text())  # written by the chief only
print(f"\nchief's results: strategy {multi_worker['strategy']}, "
      f"{multi_worker['num_replicas']} replicas, {len(multi_worker['losses'])} losses")

# %% [markdown]
# ## The same run in one process

# %%
DEFAULT_JSON = OUT / "default.json"
print(tfdist_lines(run(TRAIN + ["--strategy=default", f"--results_json={DEFAULT_JSON}"] + FLAGS)))
default = json.loads(DEFAULT_JSON.read_text())

# %% [markdown]
# ## Two workers, one device: the same losses
#
# Same seed, same global batch: each global step sees the same 64 examples (worker p keeps elements
# p, p+2, ... of the same permutation), and the summed worker gradients are the one-device gradient.

# %%
import numpy as np


def relative_differences(losses, reference):
    losses, reference = np.asarray(losses), np.asarray(reference)
    return np.abs(losses - reference) / np.abs(reference)


def plot_against_one_device(losses, differences):
    """Left: each run's per-step loss, the first being the one-device reference (drawn wide).
    Right: each other run's relative difference from it, against the 1e-5 guarantee."""
    import matplotlib.pyplot as plt
    steps = np.arange(1, len(next(iter(losses.values()))) + 1)
    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(13, 4.5))
    for index, (name, values) in enumerate(losses.items()):
        style = (dict(linewidth=4, alpha=0.35) if index == 0
                 else dict(linestyle="--", marker=".", markersize=4))
        ax_loss.plot(steps, values, label=name, **style)
    ax_loss.set(xlabel="step", ylabel="training loss", title="Per-step loss: the curves coincide")
    for name, difference in differences.items():
        ax_diff.plot(steps, np.maximum(difference, 1e-10), marker=".", label=name)
    ax_diff.axhline(1e-5, color="red", linestyle=":", label="the guarantee: 1e-5")
    ax_diff.set(yscale="log", ylim=(1e-10, 1e-3), xlabel="step",
                ylabel="|loss - one device| / one device",
                title="Relative difference from one device (0 drawn at 1e-10)")
    for ax in (ax_loss, ax_diff):
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.legend()
    plt.tight_layout()
    plt.show()

from IPython.display import Markdown, display


def show_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    display(Markdown("\n".join(lines)))


def shown_steps(count, at_most=8):
    """Indices of up to `at_most` evenly spaced steps, first and last included."""
    if count <= at_most:
        return list(range(count))
    return sorted({round(i * (count - 1) / (at_most - 1)) for i in range(at_most)})

difference = relative_differences(multi_worker["losses"], default["losses"])
print(f"largest relative loss difference over {len(difference)} steps: {difference.max():.1e}")
if GPUS < WORKERS:  # the float32 CPU guarantee
    assert difference.max() <= 1e-5, difference

show_table(["step", "default (1 process)", f"multi_worker_mirrored ({WORKERS} workers)", "relative difference"],
           [[i + 1, f"{default['losses'][i]:.6f}", f"{multi_worker['losses'][i]:.6f}",
             f"{difference[i]:.1e}"] for i in shown_steps(len(difference))])

workers = f"{WORKERS} workers (chief's JSON)"
plot_against_one_device({"default (1 process)": default["losses"], workers: multi_worker["losses"]},
                        {workers: difference})
