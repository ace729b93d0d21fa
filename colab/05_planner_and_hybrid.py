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
# # Which mode fits? The planner, then a 2-D hybrid run
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tfdist/tfdist/blob/main/colab/05_planner_and_hybrid.ipynb)
#
# `tfdist plan` estimates the memory each device needs (parameters, gradients, optimizer state,
# activations) for data parallelism, sharded data parallelism (ZeRO stages 1-3), DTensor tensor
# parallelism over a model axis of size k, pipelines of s stages, and their 2-D hybrids, and
# recommends **the simplest plan that fits**, with the exact `python -m experiments.train` flags
# that run it. It never imports TensorFlow, so planning a billion-parameter model takes
# milliseconds.
#
# This notebook (1) asks the planner about a 1.2-billion-parameter transformer on 8 GPUs of
# various sizes, (2) plans a small MLP for this runtime's 4 devices with a memory budget that
# forces a 2-D hybrid (batch x model), runs the printed command, and checks that the bytes per
# device the run reports are exactly the planner's, and that its losses equal one device's.

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


# %% [markdown]
# ## 1. Planning a model too big for one device
#
# The planner takes a model as `experiments/train.py` does (registry name and its flags), or just
# `--params N`. In Python, `tfdist.plan.command.parse` takes the same flags as `tfdist plan`.

# %%
from tfdist.plan import command, recommend

BIG = ["--model=transformer", "--num_layers=24", "--d_model=2048", "--num_heads=16",
       "--d_ff=8192", "--dataset=text", "--seq_len=1024", "--global_batch_size=64",
       "--devices=8"]


def plan_for(flags):
    args, work, hardware = command.parse(flags)
    return args, work, hardware, recommend.recommend(work, hardware)


rows = []
for memory in ("80GiB", "40GiB", "24GiB", "16GiB", "8GiB"):
    _, work, hardware, plan = plan_for(BIG + [f"--memory_per_device={memory}"])
    chosen = plan.chosen
    rows.append([memory, chosen.candidate.describe() if chosen else "**does not fit**",
                 recommend.gib(chosen.peak) if chosen else "-", plan.reason])
print(recommend.summarize(work.inventory))
show_table(["memory per device", "recommended", "peak per device", "why"], rows)

# %% [markdown]
# Every plan the planner considered for 16 GiB devices, split into what each device holds (the
# worst device of each plan), against the usable memory. In float32 none fits, so the planner
# tried them all and says by how much the best one misses:

# %%
import matplotlib.pyplot as plt
import numpy as np

_, work, hardware, plan = plan_for(BIG + ["--memory_per_device=16GiB"])
considered = [e for e in plan.evaluated if e.problem is None]
worst = [max(e.devices, key=lambda d: d.total) for e in considered]


def label(c):  # two short lines per plan
    if c.strategy == "dtensor":
        zero_part = f" zero {c.zero_stage}" if c.zero_stage else ""
        return f"dtensor{zero_part}\nbatch={c.replicas},model={c.model_ways}"
    if c.strategy == "pipeline":
        return f"pipeline {c.stages} stages x{c.replicas}\nM={c.microbatches} {c.schedule}"
    return f"{c.strategy}\nx {c.devices}"


labels = [label(e.candidate) for e in considered]
parts = {"parameters + optimizer": [d.state for d in worst],
         "gradients": [d.gradients for d in worst], "activations": [d.activations for d in worst]}
fig, ax = plt.subplots(figsize=(13, 4.5))
bottom = np.zeros(len(worst))
for name, values in parts.items():
    values = np.asarray(values) / 2**30
    ax.bar(labels, values, bottom=bottom, label=name)
    bottom += values
ax.axhline(hardware.usable / 2**30, color="black", linestyle="--", label="usable per device")
ax.set(ylabel="GiB on the worst device", title="8 x 16 GiB: what each plan needs per device")
ax.tick_params(axis="x", labelsize=8)
ax.legend()
plt.tight_layout()
plt.show()
print(plan.reason)

# %% [markdown]
# ## 2. Plan for this runtime, run the plan, compare
#
# An MLP (64-256-256-10 on `digits`, Adam, global batch 32) on 4 devices with 900 KiB each: a
# full copy does not fit, megatron tensor parallelism over 2 devices does, and the other 2 ways
# replicate it, a 2-D hybrid `batch=2,model=2`. On a CPU runtime the devices are 4 simulated CPUs
# (`--device_type cpu` makes the planner print `--simulate_devices=4`). `--zero_stage=0` leaves
# out sharded data parallelism (ZeRO, which the planner tries before splitting the model, and
# which fits here too) so that the plan is the hybrid.

# %%
DEVICE_TYPE = "gpu" if count_gpus() >= 4 else "cpu"
if DEVICE_TYPE == "cpu":
    ENV["CUDA_VISIBLE_DEVICES"] = ""  # fewer than 4 GPUs: the 4 devices are simulated CPUs
SMALL = ["--model=mlp", "--hidden_sizes=256,256", "--dataset=digits", "--optimizer=adam",
         "--global_batch_size=32", "--devices=4", "--memory_per_device=900KiB",
         "--zero_stage=0", f"--device_type={DEVICE_TYPE}"]
print(run(TFDIST + ["plan", *SMALL]))
planned = json.loads(run(TFDIST + ["plan", *SMALL, "--json"]))

# %% [markdown]
# Run exactly the printed command (plus a step count and a results file), and the same model on one
# device:

# %%
python, module, *train_flags = planned["command"]
extra = [f"--train_steps={STEPS}", "--seed=0"]
results = {}
for name, flags in (("plan", train_flags[1:]),
                    ("default", ["--strategy=default", "--model=mlp", "--hidden_sizes=256,256",
                                 "--dataset=digits", "--optimizer=adam", "--global_batch_size=32"])):
    path = OUT / f"{name}.json"
    print(tfdist_lines(run(TRAIN + flags + extra + [f"--results_json={path}"])).splitlines()[-1])
    results[name] = json.loads(path.read_text())


# %%
def short(device):  # '/job:localhost/replica:0/task:0/device:CPU:0' -> 'CPU:0'
    return device.split("device:")[-1]


expected = planned["recommended"]["param_bytes_per_device"]
reported = results["plan"]["param_bytes_per_device"]
show_table(["device", "planned bytes", "reported by the run", "equal"],
           [[short(d), f"{expected[d]:,}", f"{reported.get(d, 0):,}",
             "yes" if expected[d] == reported.get(d) else "**no**"] for d in sorted(expected)])
assert expected == reported, "the planner's parameter + optimizer bytes must be exact"

reference = np.asarray(results["default"]["losses"])
losses = np.asarray(results["plan"]["losses"])
difference = np.max(np.abs(losses - reference) / np.abs(reference))
print(f"largest relative loss difference against one device: {difference:.1e}")
if DEVICE_TYPE == "cpu":
    assert difference < 1e-5

# %%
fig, (ax_bytes, ax_loss) = plt.subplots(1, 2, figsize=(13, 4.2))
one_device = sum(results["default"]["param_bytes_per_device"].values())
ax_bytes.bar(["one device"] + [short(d) for d in sorted(reported)],
             [one_device / 1e3] + [reported[d] / 1e3 for d in sorted(reported)],
             color=["gray"] + ["C0"] * len(reported))
ax_bytes.set(ylabel="KB of parameters + optimizer state",
             title=f"{planned['recommended']['plan']}: bytes per device")
steps = np.arange(1, len(reference) + 1)
ax_loss.plot(steps, reference, linewidth=4, alpha=0.35, label="default (1 device)")
ax_loss.plot(steps, losses, "--.", label=planned["recommended"]["plan"])
ax_loss.set(xlabel="step", ylabel="training loss", title="Per-step loss: the curves coincide")
ax_loss.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
ax_loss.legend()
plt.tight_layout()
plt.show()
