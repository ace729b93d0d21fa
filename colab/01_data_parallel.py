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
# # Data parallelism with `mirrored`, equal to one device
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/tfdist/tfdist/blob/main/colab/01_data_parallel.ipynb)
#
# tfdist moves a Keras 3 training run from one device (`--strategy=default`) to data parallelism
# over every local device (`--strategy=mirrored`, TensorFlow's `MirroredStrategy`) with one flag,
# and guarantees that **the per-step losses agree to 1e-5 relative** (float32). This notebook trains
# the README's default experiment, a small CNN on the offline `digits` data, on one device and on 2
# and 4 replicas, and compares them step by step.
#
# Why they agree: with the same seed and global batch, every global step sees the same examples,
# whatever the number of replicas (the input pipeline permutes each epoch *before* it shards), and
# each replica divides its summed per-example loss by the *global* batch, so the all-reduced
# gradient is exactly the one-device gradient.
#
# Runtime: on a CPU-only runtime the CPU is split into 4 simulated devices; with 2 or more GPUs
# the GPUs are used.

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

# %% [markdown]
# ## Devices
#
# TensorFlow fixes its devices when it initialises (at its first op), so they are set up first.
# `tfdist.devices` is what `--simulate_devices` and `--num_gpus` use.

# %%
from tfdist import devices

gpus = devices.physical_gpus()
ON_GPUS = len(gpus) >= 2 and 64 % len(gpus) == 0  # the global batch of 64 splits over them
if ON_GPUS:
    local_devices = devices.configure(devices.AUTO)  # every GPU
else:
    devices.select_gpus(0)  # one GPU cannot show data parallelism: hide it, all runs use the CPU
    local_devices = devices.configure(4)  # 4 logical CPU devices
REPLICAS = [len(local_devices)] if ON_GPUS else [2, 4]
print(f"{len(gpus)} GPU(s); devices: {', '.join(local_devices)}")

# %% [markdown]
# ## Train on one device, then on 2 and 4 replicas
#
# `tfdist.run(config)` is what `python -m experiments.train` calls; the mirrored run below is
#
# ```
# python -m experiments.train --strategy=mirrored --simulate_devices=4 --model=cnn --dataset=digits \
#     --optimizer=adam --global_batch_size=64 --train_steps=100 --seed=0
# ```

# %%
import dataclasses

from experiments.train import summary  # the line `python -m experiments.train` prints
from tfdist.train import progress

progress.configure_logging()  # as the CLI: tfdist's progress lines, TensorFlow's only from WARNING up
BASE = tfdist.RunConfig(
    strategy="default", model=tfdist.ModelConfig(name="cnn"), data=tfdist.DataConfig(name="digits"),
    optimizer="adam", global_batch_size=64, train_steps=STEPS, seed=0,
    simulate_devices=devices.AUTO if ON_GPUS else 4)


def mirrored(replicas):
    return dataclasses.replace(BASE, strategy="mirrored",
                               simulate_devices=devices.AUTO if ON_GPUS else replicas)


results = {"default": tfdist.run(BASE)}
print(summary(results["default"]))
for replicas in REPLICAS:
    result = tfdist.run(mirrored(replicas))
    results[f"mirrored x{result['num_replicas']}"] = result
    print(summary(result))

# %% [markdown]
# ## The equivalence guarantee, step by step

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


reference = results["default"]["losses"]
differences = {name: relative_differences(result["losses"], reference)
               for name, result in results.items() if name != "default"}
for name, difference in differences.items():
    print(f"{name}: largest relative loss difference over {len(difference)} steps: "
          f"{difference.max():.1e}")
if not ON_GPUS:  # the float32 CPU guarantee (GPU kernels may round differently per batch size)
    assert all(difference.max() <= 1e-5 for difference in differences.values()), differences

names = list(results)
show_table(["step"] + names + ["largest relative difference"],
           [[i + 1] + [f"{results[name]['losses'][i]:.6f}" for name in names]
            + [f"{max(d[i] for d in differences.values()):.1e}"] for i in shown_steps(len(reference))])
show_table(["run", "replicas", "final loss", "eval accuracy", "examples/s"],
           [[name, r["num_replicas"], f"{r['final_loss']:.4f}", f"{r['eval_accuracy']:.2%}",
             f"{r['examples_per_sec']:.0f}"] for name, r in results.items()])

# %% [markdown]
# Simulated CPU devices share the host's cores, so `mirrored` is not faster here; on GPUs each
# replica has its own device. The point on a CPU runtime is that the numbers are the same.

# %%
plot_against_one_device({name: result["losses"] for name, result in results.items()}, differences)
