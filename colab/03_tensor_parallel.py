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
# # Tensor parallelism with DTensor layouts
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tfdist/tfdist/blob/main/colab/03_tensor_parallel.ipynb)
#
# `--strategy=dtensor` shards a Keras 3 model's variables over a device mesh with named axes.
# On a `batch=2,model=2` mesh with the `megatron` layout (Shoeybi et al. 2019), each pair of dense
# layers is split column-parallel then row-parallel (and, in a transformer, each attention block),
# so every device holds about half of the weights and optimizer state while the batch is split over
# the other axis. Training still gives the one-device losses.
#
# This notebook trains an MLP on the offline `digits` data three ways (one device; all weights
# replicated on a `batch=4` mesh; `megatron` on `batch=2,model=2`), then shows the bytes each device
# holds and the per-step losses. The same layout shards a transformer:
# `--model=transformer --dataset=text` (the README's *Model parallelism* section).
#
# DTensor's collectives and `tf.distribute`'s cannot share one process, so every run here is its
# own `python -m experiments.train` subprocess and the notebook itself never starts TensorFlow.

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
# ## Devices
#
# The mesh needs 4 devices: 4 GPUs when the runtime has them, else 4 simulated CPU devices.

# %%
GPUS = count_gpus()
if GPUS >= 4:
    DEVICE_FLAGS = ["--num_gpus=4"]
else:
    DEVICE_FLAGS = ["--simulate_devices=4"]
    ENV["CUDA_VISIBLE_DEVICES"] = ""  # every run on the same kind of device
FLAGS = DEVICE_FLAGS + ["--model=mlp", "--hidden_sizes=256,256", "--dataset=digits",
                        "--optimizer=adam", "--global_batch_size=64", f"--train_steps={STEPS}",
                        "--seed=0"]
print(f"{GPUS} GPU(s); flags: {' '.join(FLAGS)}")

# %% [markdown]
# ## The `megatron` layout
#
# A layout map is keras.distribution's mental model: a regex matched against each variable's path,
# and per dimension a mesh axis (split over it) or `unsharded`; unmatched variables are replicated.
# For the MLP, `dense_0` is column-parallel (its output units split over `model`) and `dense_1`
# row-parallel (its input units split), so the hidden activation between them stays split and one
# all-reduce joins `dense_1`'s output.

# %%
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

from tfdist.parallel.dtensor import presets  # plain Python: no TensorFlow in this process

show_table(["variable path (regex)", "layout per dimension"],
           [[f"`{regex}`", "replicated" if spec is None else ", ".join(spec)]
            for regex, spec in presets.MEGATRON["mlp"].items()])

# %% [markdown]
# ## Three runs

# %%
RUNS = {
    "default (1 device)": ["--strategy=default"],
    "replicated (mesh batch=4)": ["--strategy=dtensor", "--mesh=batch=4", "--layout=data"],
    "megatron (mesh batch=2,model=2)": ["--strategy=dtensor", "--mesh=batch=2,model=2",
                                        "--layout=megatron"],
}
results = {}
for name, mode_flags in RUNS.items():
    path = OUT / f"run{len(results)}.json"
    print(tfdist_lines(run(TRAIN + mode_flags + FLAGS + [f"--results_json={path}"])).splitlines()[-1])
    results[name] = json.loads(path.read_text())

# %% [markdown]
# ## Same losses, half the bytes per device

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

reference = results["default (1 device)"]["losses"]
differences = {name: relative_differences(r["losses"], reference)
               for name, r in results.items() if r["strategy"] != "default"}
for name, difference in differences.items():
    print(f"{name}: largest relative loss difference over {len(difference)} steps: "
          f"{difference.max():.1e}")
if GPUS < 4:  # the float32 CPU guarantee
    assert all(difference.max() <= 1e-5 for difference in differences.values()), differences


def short(device):  # '/job:localhost/replica:0/task:0/device:CPU:0' -> 'CPU:0'
    return device.split("device:")[-1]


bytes_per_device = {name: {short(d): b for d, b in sorted(r["param_bytes_per_device"].items())}
                    for name, r in results.items()}
show_table(["run", "devices", "parameters + optimizer state per device", "all devices"],
           [[name, len(per_device), f"{max(per_device.values()) / 1e6:.2f} MB",
             f"{sum(per_device.values()) / 1e6:.2f} MB"] for name, per_device in bytes_per_device.items()])

# %% [markdown]
# Not half exactly: the output layer and the biases of row-parallel layers stay replicated. The
# README's *Model parallelism* section has the multi-client form (`tfdist launch --dtensor`) and the
# layout-file format.

# %%
import matplotlib.pyplot as plt

fig, (ax_bytes, ax_loss) = plt.subplots(1, 2, figsize=(13, 4.5))
device_names = sorted({d for per_device in bytes_per_device.values() for d in per_device})
width = 0.8 / len(results)
for i, (name, per_device) in enumerate(bytes_per_device.items()):
    positions = [device_names.index(d) + (i - (len(results) - 1) / 2) * width for d in per_device]
    ax_bytes.bar(positions, [b / 1e6 for b in per_device.values()], width, label=name)
ax_bytes.set_xticks(range(len(device_names)), device_names)
ax_bytes.set(ylabel="MB of parameters + optimizer state", ylim=(0, 1.45 * max(
    max(per_device.values()) for per_device in bytes_per_device.values()) / 1e6),
    title="Bytes per device: megatron holds about half")
ax_bytes.legend(fontsize=8)
steps = np.arange(1, len(reference) + 1)
for name, r in results.items():
    style = (dict(linewidth=4, alpha=0.35) if r["strategy"] == "default"
             else dict(linestyle="--", marker=".", markersize=4))
    ax_loss.plot(steps, r["losses"], label=name, **style)
ax_loss.set(xlabel="step", ylabel="training loss", title="Per-step loss: the curves coincide")
ax_loss.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
ax_loss.legend(fontsize=8)
plt.tight_layout()
plt.show()
