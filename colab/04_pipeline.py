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
# # Pipeline parallelism: stages, micro-batches, GPipe and 1F1B
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tfdist/tfdist/blob/main/colab/04_pipeline.ipynb)
#
# `--strategy=pipeline` cuts a Keras 3 model into stages, places each stage's variables and
# optimizer state on its own device, and runs each step as micro-batches flowing through the stages,
# with the GPipe or the 1F1B schedule. Each micro-batch's loss is divided by the global batch, so the
# gradients accumulated over micro-batches are the full-batch gradient: the losses are those of one
# device.
#
# This notebook shows where the model is cut, runs 2 stages with 1 to 8 micro-batches under both
# schedules, checks the losses against a `default` run, and shows the bytes on each stage's device
# and the step times.
#
# Runtime: 2 simulated CPU devices (one per stage) on a CPU-only runtime; all GPUs when there are 2
# or more (with 4 GPUs, 2 pipeline replicas of 2 stages).

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

# %%
from tfdist import devices

STAGES = 2
gpus = devices.physical_gpus()
ON_GPUS = len(gpus) >= STAGES and len(gpus) % STAGES == 0  # devices = stages x replicas
if not ON_GPUS:
    devices.select_gpus(0)  # one GPU cannot hold two stages: hide it, all runs use the CPU
SIMULATE = devices.AUTO if ON_GPUS else 2  # all GPUs, else 2 simulated CPUs: one per stage
print(f"{len(gpus)} GPU(s); devices: {', '.join(devices.configure(SIMULATE))}")

# %% [markdown]
# ## Where the model is cut
#
# A cut is valid where exactly one tensor crosses it; with no `--pipeline_split`, the partitioner
# picks the valid cuts that minimise the most expensive stage (cost = parameters). This is the
# function `--strategy=pipeline` calls.

# %%
import dataclasses

from tfdist import data, models
from tfdist.parallel.pipeline.partition import partition_model

BASE = tfdist.RunConfig(
    strategy="default", model=tfdist.ModelConfig(name="mlp", hidden_sizes=(256, 256, 256)),
    data=tfdist.DataConfig(name="digits"), optimizer="adam", global_batch_size=64,
    train_steps=STEPS, seed=0, simulate_devices=SIMULATE)
info = data.get_source(BASE.data).info
print(partition_model(models.build_model(info, BASE.model), STAGES).describe())

# %% [markdown]
# ## The schedules
#
# Per stage, the order of forward (F) and backward (B) passes over 4 micro-batches, from the
# schedule functions the pipeline runs. GPipe runs every forward first, so a stage holds the
# activations of all M micro-batches; 1F1B starts backwards as early as it can, so stage k holds at
# most S - k. Both run the backwards in micro-batch order, so both give the same numbers.

# %%
from tfdist.parallel.pipeline import schedule


def peak_activations(order):
    held = peak = 0
    for op, _ in order:
        held += 1 if op == schedule.FORWARD else -1
        peak = max(peak, held)
    return peak


for name, order_of in schedule.SCHEDULES.items():
    for stage in range(STAGES):
        order = order_of(STAGES, 4, stage)
        ops = " ".join(("F" if op == schedule.FORWARD else "B") + str(m) for op, m in order)
        print(f"{name:5} stage {stage}: {ops:24} peak activations held: {peak_activations(order)}")

# %% [markdown]
# ## Train: one device, then 2 stages with 1 to 8 micro-batches, GPipe and 1F1B
#
# The GPipe run with 4 micro-batches is
# `python -m experiments.train --strategy=pipeline --pipeline_stages=2 --microbatches=4 --pipeline_schedule=gpipe --model=mlp --hidden_sizes=256,256,256 ...`.

# %%
import logging

from experiments.train import summary  # the line `python -m experiments.train` prints
from tfdist.train import progress

progress.configure_logging(logging.WARNING)  # as the CLI, but quiet: 8 short runs
MICROBATCHES = {"gpipe": (1, 2, 4, 8), "1f1b": (2, 4, 8)}  # with M = 1 both are F0 B0
results = {"default": tfdist.run(BASE)}
print(summary(results["default"]))
for schedule_name in schedule.SCHEDULES:
    for microbatches in MICROBATCHES[schedule_name]:
        results[schedule_name, microbatches] = tfdist.run(dataclasses.replace(
            BASE, strategy="pipeline", pipeline_stages=STAGES, microbatches=microbatches,
            pipeline_schedule=schedule_name))
        print(f"{schedule_name:5} M={microbatches}:", summary(results[schedule_name, microbatches]))

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

import numpy as np

reference = np.asarray(results["default"]["losses"])


def largest_difference(result):
    return float(np.max(np.abs(np.asarray(result["losses"]) - reference) / np.abs(reference)))


def ms_per_step(result):
    return 1000 * result["global_batch_size"] / result["examples_per_sec"]


def short(device):  # '/job:localhost/replica:0/task:0/device:CPU:1' -> 'CPU:1'
    return device.split("device:")[-1]


worst = max(largest_difference(r) for key, r in results.items() if key != "default")
print(f"largest relative loss difference from one device, over every pipeline run: {worst:.1e}")
if not ON_GPUS:  # the float32 CPU guarantee
    assert worst <= 1e-5, worst

def bytes_text(result):
    return ", ".join(f"{short(d)}: {b / 1e3:.0f} KB" for d, b in sorted(result["param_bytes_per_device"].items()))


show_table(["run", "micro-batches", "ms / step", "largest relative loss difference", "parameters + optimizer state"],
           [["default", "-", f"{ms_per_step(results['default']):.1f}", "-", bytes_text(results["default"])]]
           + [[key[0], key[1], f"{ms_per_step(r):.1f}", f"{largest_difference(r):.1e}", bytes_text(r)]
              for key, r in results.items() if key != "default"])

# %% [markdown]
# On simulated CPU devices the stages share the host's cores, so they do not run at the same time
# and more micro-batches only add per-micro-batch overhead; on accelerators GPipe's idle fraction
# (the bubble) is (S - 1) / (M + S - 1), which more micro-batches shrink. What a CPU runtime does
# show: the losses equal one device's, and each device holds only its stage's bytes.

# %%
import matplotlib.pyplot as plt

fig, (ax_loss, ax_bytes, ax_time) = plt.subplots(1, 3, figsize=(16, 4.5))
steps = np.arange(1, len(reference) + 1)
ax_loss.plot(steps, reference, linewidth=4, alpha=0.35, label="default (1 device)")
for key in (("gpipe", 4), ("1f1b", 4)):
    ax_loss.plot(steps, results[key]["losses"], "--.", markersize=4, label=f"{key[0]}, M={key[1]}")
ax_loss.set(xlabel="step", ylabel="training loss", title="Per-step loss: the curves coincide")
ax_loss.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
ax_loss.legend()

stage_bytes = {short(d): b for d, b in sorted(results["gpipe", 4]["param_bytes_per_device"].items())}
ax_bytes.bar(["default\n(1 device)"] + [f"pipeline\n{d}" for d in stage_bytes],
             [sum(results["default"]["param_bytes_per_device"].values()) / 1e3]
             + [b / 1e3 for b in stage_bytes.values()], color=["gray"] + ["C0"] * len(stage_bytes))
ax_bytes.set(ylabel="KB of parameters + optimizer state", title="Bytes per device")

for schedule_name, counts in MICROBATCHES.items():
    ax_time.plot(counts, [ms_per_step(results[schedule_name, m]) for m in counts],
                 marker="o", label=schedule_name)
ax_time.set(xticks=MICROBATCHES["gpipe"], xlabel="micro-batches M",
            ylabel="ms per step", title="Step time (simulated devices share the CPU)")
ax_time.set_ylim(bottom=0)
ax_time.legend()
plt.tight_layout()
plt.show()
