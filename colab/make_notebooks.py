"""Writes the Colab notebooks 01-05 in this directory (outputs cleared).

    python colab/make_notebooks.py           # rewrite them
    python colab/make_notebooks.py --check   # exit 1 if a committed notebook differs

Edit the cells here, not in the .ipynb files: tests/test_notebooks.py checks that
the committed notebooks are what this script writes, and runs them headless.
Cells shared by several notebooks (install, subprocess helpers) are written once
here, so each notebook stays self-contained for Colab.
"""

import os
import sys

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_URL = "https://github.com/tfdist/tfdist"   # our placeholder for the public repository
COLAB_URL = "https://colab.research.google.com/github/tfdist/tfdist/blob/main/colab/{name}"
BADGE = ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
         "(" + COLAB_URL + ")")


def md(text):
    return ("markdown", text.strip("\n"))


def code(text):
    return ("code", text.strip("\n"))


def title(name, heading, intro):
    return md(f"# {heading}\n\n{BADGE.format(name=name)}\n\n{intro.strip()}")


INSTALL = code(r'''
try:
    import tfdist
except ImportError:  # a fresh Colab runtime: install tfdist (with TensorFlow 2.21 and Keras 3)
    %pip install -q "tfdist @ git+''' + REPO_URL + r'''"
    import tfdist
''')

STEPS_AND_LOGS = r'''
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ log noise, here and in children
STEPS = int(os.environ.get("TFDIST_NOTEBOOK_STEPS", "100"))  # the test suite runs a handful
'''

# Notebooks 2 and 3 train in subprocesses: `python -m experiments.train`, as on a cluster.
SUBPROCESS_HELPERS = code(STEPS_AND_LOGS + r'''
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
''')

TABLE_HELPER = r'''
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
'''

LOSS_COMPARISON = r'''
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
'''


# --------------------------------------------------------------------------- 01

NB1 = "01_data_parallel.ipynb"
NOTEBOOK_1 = [
    title(NB1, "Data parallelism with `mirrored`, equal to one device", r'''
tfdist moves a Keras 3 training run from one device (`--strategy=default`) to data parallelism
over every local device (`--strategy=mirrored`, TensorFlow's `MirroredStrategy`) with one flag,
and guarantees that **the per-step losses agree to 1e-5 relative** (float32). This notebook trains
the README's default experiment, a small CNN on the offline `digits` data, on one device and on 2
and 4 replicas, and compares them step by step.

Why they agree: with the same seed and global batch, every global step sees the same examples,
whatever the number of replicas (the input pipeline permutes each epoch *before* it shards), and
each replica divides its summed per-example loss by the *global* batch, so the all-reduced
gradient is exactly the one-device gradient.

Runtime: on a CPU-only runtime the CPU is split into 4 simulated devices; with 2 or more GPUs
the GPUs are used.
'''),
    INSTALL,
    code(STEPS_AND_LOGS),
    md(r'''
## Devices

TensorFlow fixes its devices when it initialises (at its first op), so they are set up first.
`tfdist.devices` is what `--simulate_devices` and `--num_gpus` use.
'''),
    code(r'''
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
'''),
    md(r'''
## Train on one device, then on 2 and 4 replicas

`tfdist.run(config)` is what `python -m experiments.train` calls; the mirrored run below is

```
python -m experiments.train --strategy=mirrored --simulate_devices=4 --model=cnn --dataset=digits \
    --optimizer=adam --global_batch_size=64 --train_steps=100 --seed=0
```
'''),
    code(r'''
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
'''),
    md(r'''
## The equivalence guarantee, step by step
'''),
    code(LOSS_COMPARISON + TABLE_HELPER + r'''

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
'''),
    md(r'''
Simulated CPU devices share the host's cores, so `mirrored` is not faster here; on GPUs each
replica has its own device. The point on a CPU runtime is that the numbers are the same.
'''),
    code(r'''
plot_against_one_device({name: result["losses"] for name, result in results.items()}, differences)
'''),
]


# --------------------------------------------------------------------------- 02

NB2 = "02_multi_worker.ipynb"
NOTEBOOK_2 = [
    title(NB2, "Multi-worker data parallelism over `TF_CONFIG`", r'''
`--strategy=multi_worker_mirrored` trains one Keras 3 model data-parallel across processes and
machines with TensorFlow's `MultiWorkerMirroredStrategy` (Keras 3's own `fit` is broken under it
upstream: keras-team/keras#20585; tfdist trains with its own loop and repairs `fit`). Each process
learns its place in the cluster from the `TF_CONFIG` environment variable.

This notebook starts 2 worker processes on this machine with `tfdist launch`, shows the
`TF_CONFIG` each one got, reads the chief's results JSON, and checks its per-step losses against a
single-process `default` run with the same seed and global batch.
'''),
    INSTALL,
    SUBPROCESS_HELPERS,
    md(r'''
## Workers and devices

On a CPU-only runtime each worker is one process on the CPU. With at least one GPU per worker,
worker R sees only GPU R (two processes on one GPU would fight over its memory, so with fewer GPUs
the workers use the CPU). The single-process reference run sees the same devices.
'''),
    code(r'''
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
'''),
    md(r'''
## The `TF_CONFIG` each worker gets

`tfdist launch --dry_run` prints each worker's environment and starts nothing. (The notebook
runs `tfdist` as `python -m tfdist.cli`, the same program, so that its own Python is used.) All tasks are
`worker`s and worker 0 is the chief (TensorFlow's rule when the cluster has no `chief` task):
the one that writes checkpoints and the results JSON.
'''),
    code(r'''
def launch(*launch_flags):
    """`tfdist launch --workers 2 [launch_flags] -- python -m experiments.train ...`"""
    return (TFDIST + ["launch", f"--workers={WORKERS}", *launch_flags, "--"] + WORKER
            + ["--strategy=multi_worker_mirrored"] + FLAGS)


for line in run(launch("--dry_run")).splitlines():
    if line.startswith("{"):
        worker = json.loads(line)
        print(f"worker {worker['rank']}: TF_CONFIG={json.dumps(worker['TF_CONFIG'])}")
'''),
    md(r'''
On a real cluster every machine sets its own `TF_CONFIG`; `tfdist tf-config` builds it from the
host list and the machine's rank (or from Slurm's variables with `--slurm`):
'''),
    code(r'''
for index in range(WORKERS):
    print(run(TFDIST + ["tf-config", "--hosts", "node-a:2222,node-b:2222", "--index", str(index)]).strip())
'''),
    md(r'''
## Launch 2 workers

`tfdist launch` picks free loopback ports, starts the workers with their `TF_CONFIG`, prefixes
their lines with `[worker R]`, and ends every worker if one fails. (`--devices_per_worker 2` would
give each worker 2 simulated CPUs: 4 replicas.)
'''),
    code(r'''
MULTI_WORKER_JSON = OUT / "multi_worker.json"
output = run(launch() + ["--collective_timeout=120", f"--results_json={MULTI_WORKER_JSON}"])
print(tfdist_lines(output))
multi_worker = json.loads(MULTI_WORKER_JSON.read_text())  # written by the chief only
print(f"\nchief's results: strategy {multi_worker['strategy']}, "
      f"{multi_worker['num_replicas']} replicas, {len(multi_worker['losses'])} losses")
'''),
    md(r'''
## The same run in one process
'''),
    code(r'''
DEFAULT_JSON = OUT / "default.json"
print(tfdist_lines(run(TRAIN + ["--strategy=default", f"--results_json={DEFAULT_JSON}"] + FLAGS)))
default = json.loads(DEFAULT_JSON.read_text())
'''),
    md(r'''
## Two workers, one device: the same losses

Same seed, same global batch: each global step sees the same 64 examples (worker p keeps elements
p, p+2, ... of the same permutation), and the summed worker gradients are the one-device gradient.
'''),
    code(LOSS_COMPARISON + TABLE_HELPER + r'''
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
'''),
]


# --------------------------------------------------------------------------- 03

NB3 = "03_tensor_parallel.ipynb"
NOTEBOOK_3 = [
    title(NB3, "Tensor parallelism with DTensor layouts", r'''
`--strategy=dtensor` shards a Keras 3 model's variables over a device mesh with named axes.
On a `batch=2,model=2` mesh with the `megatron` layout (Shoeybi et al. 2019), each pair of dense
layers is split column-parallel then row-parallel (and, in a transformer, each attention block),
so every device holds about half of the weights and optimizer state while the batch is split over
the other axis. Training still gives the one-device losses.

This notebook trains an MLP on the offline `digits` data three ways (one device; all weights
replicated on a `batch=4` mesh; `megatron` on `batch=2,model=2`), then shows the bytes each device
holds and the per-step losses. The same layout shards a transformer:
`--model=transformer --dataset=text` (the README's *Model parallelism* section).

DTensor's collectives and `tf.distribute`'s cannot share one process, so every run here is its
own `python -m experiments.train` subprocess and the notebook itself never starts TensorFlow.
'''),
    INSTALL,
    SUBPROCESS_HELPERS,
    md(r'''
## Devices

The mesh needs 4 devices: 4 GPUs when the runtime has them, else 4 simulated CPU devices.
'''),
    code(r'''
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
'''),
    md(r'''
## The `megatron` layout

A layout map is keras.distribution's mental model: a regex matched against each variable's path,
and per dimension a mesh axis (split over it) or `unsharded`; unmatched variables are replicated.
For the MLP, `dense_0` is column-parallel (its output units split over `model`) and `dense_1`
row-parallel (its input units split), so the hidden activation between them stays split and one
all-reduce joins `dense_1`'s output.
'''),
    code(TABLE_HELPER + r'''
from tfdist.parallel.dtensor import presets  # plain Python: no TensorFlow in this process

show_table(["variable path (regex)", "layout per dimension"],
           [[f"`{regex}`", "replicated" if spec is None else ", ".join(spec)]
            for regex, spec in presets.MEGATRON["mlp"].items()])
'''),
    md(r'''
## Three runs
'''),
    code(r'''
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
'''),
    md(r'''
## Same losses, half the bytes per device
'''),
    code(LOSS_COMPARISON + r'''
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
'''),
    md(r'''
Not half exactly: the output layer and the biases of row-parallel layers stay replicated. The
README's *Model parallelism* section has the multi-client form (`tfdist launch --dtensor`) and the
layout-file format.
'''),
    code(r'''
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
'''),
]


# --------------------------------------------------------------------------- 04

NB4 = "04_pipeline.ipynb"
NOTEBOOK_4 = [
    title(NB4, "Pipeline parallelism: stages, micro-batches, GPipe and 1F1B", r'''
`--strategy=pipeline` cuts a Keras 3 model into stages, places each stage's variables and
optimizer state on its own device, and runs each step as micro-batches flowing through the stages,
with the GPipe or the 1F1B schedule. Each micro-batch's loss is divided by the global batch, so the
gradients accumulated over micro-batches are the full-batch gradient: the losses are those of one
device.

This notebook shows where the model is cut, runs 2 stages with 1 to 8 micro-batches under both
schedules, checks the losses against a `default` run, and shows the bytes on each stage's device
and the step times.

Runtime: 2 simulated CPU devices (one per stage) on a CPU-only runtime; all GPUs when there are 2
or more (with 4 GPUs, 2 pipeline replicas of 2 stages).
'''),
    INSTALL,
    code(STEPS_AND_LOGS),
    code(r'''
from tfdist import devices

STAGES = 2
gpus = devices.physical_gpus()
ON_GPUS = len(gpus) >= STAGES and len(gpus) % STAGES == 0  # devices = stages x replicas
if not ON_GPUS:
    devices.select_gpus(0)  # one GPU cannot hold two stages: hide it, all runs use the CPU
SIMULATE = devices.AUTO if ON_GPUS else 2  # all GPUs, else 2 simulated CPUs: one per stage
print(f"{len(gpus)} GPU(s); devices: {', '.join(devices.configure(SIMULATE))}")
'''),
    md(r'''
## Where the model is cut

A cut is valid where exactly one tensor crosses it; with no `--pipeline_split`, the partitioner
picks the valid cuts that minimise the most expensive stage (cost = parameters). This is the
function `--strategy=pipeline` calls.
'''),
    code(r'''
import dataclasses

from tfdist import data, models
from tfdist.parallel.pipeline.partition import partition_model

BASE = tfdist.RunConfig(
    strategy="default", model=tfdist.ModelConfig(name="mlp", hidden_sizes=(256, 256, 256)),
    data=tfdist.DataConfig(name="digits"), optimizer="adam", global_batch_size=64,
    train_steps=STEPS, seed=0, simulate_devices=SIMULATE)
info = data.get_source(BASE.data).info
print(partition_model(models.build_model(info, BASE.model), STAGES).describe())
'''),
    md(r'''
## The schedules

Per stage, the order of forward (F) and backward (B) passes over 4 micro-batches, from the
schedule functions the pipeline runs. GPipe runs every forward first, so a stage holds the
activations of all M micro-batches; 1F1B starts backwards as early as it can, so stage k holds at
most S - k. Both run the backwards in micro-batch order, so both give the same numbers.
'''),
    code(r'''
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
'''),
    md(r'''
## Train: one device, then 2 stages with 1 to 8 micro-batches, GPipe and 1F1B

The GPipe run with 4 micro-batches is
`python -m experiments.train --strategy=pipeline --pipeline_stages=2 --microbatches=4 --pipeline_schedule=gpipe --model=mlp --hidden_sizes=256,256,256 ...`.
'''),
    code(r'''
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
'''),
    code(TABLE_HELPER + r'''
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
'''),
    md(r'''
On simulated CPU devices the stages share the host's cores, so they do not run at the same time
and more micro-batches only add per-micro-batch overhead; on accelerators GPipe's idle fraction
(the bubble) is (S - 1) / (M + S - 1), which more micro-batches shrink. What a CPU runtime does
show: the losses equal one device's, and each device holds only its stage's bytes.
'''),
    code(r'''
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
'''),
]


# --------------------------------------------------------------------------- 05

NB5 = "05_planner_and_hybrid.ipynb"
NOTEBOOK_5 = [
    title(NB5, "Which mode fits? The planner, then a 2-D hybrid run", r'''
`tfdist plan` estimates the memory each device needs (parameters, gradients, optimizer state,
activations) for data parallelism, DTensor tensor parallelism over a model axis of size k,
pipelines of s stages, and their 2-D hybrids, and recommends **the simplest plan that fits**,
with the exact `python -m experiments.train` flags that run it. It never imports TensorFlow, so
planning a billion-parameter model takes milliseconds.

This notebook (1) asks the planner about a 1.2-billion-parameter transformer on 8 GPUs of
various sizes, (2) plans a small MLP for this runtime's 4 devices with a memory budget that
forces a 2-D hybrid (batch x model), runs the printed command, and checks that the bytes per
device the run reports are exactly the planner's, and that its losses equal one device's.
'''),
    INSTALL,
    SUBPROCESS_HELPERS,
    code(TABLE_HELPER),
    md(r'''
## 1. Planning a model too big for one device

The planner takes a model as `experiments/train.py` does (registry name and its flags), or just
`--params N`. In Python, `tfdist.plan.command.parse` takes the same flags as `tfdist plan`.
'''),
    code(r'''
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
'''),
    md(r'''
Every plan the planner considered for 16 GiB devices, split into what each device holds (the
worst device of each plan), against the usable memory. In float32 none fits, so the planner
tried them all and says by how much the best one misses:
'''),
    code(r'''
import matplotlib.pyplot as plt
import numpy as np

_, work, hardware, plan = plan_for(BIG + ["--memory_per_device=16GiB"])
considered = [e for e in plan.evaluated if e.problem is None]
worst = [max(e.devices, key=lambda d: d.total) for e in considered]


def label(c):  # two short lines per plan
    if c.strategy == "dtensor":
        return f"dtensor\nbatch={c.replicas},model={c.model_ways}"
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
'''),
    md(r'''
## 2. Plan for this runtime, run the plan, compare

An MLP (64-256-256-10 on `digits`, Adam, global batch 32) on 4 devices with 900 KiB each: a
full copy does not fit, megatron tensor parallelism over 2 devices does, and the other 2 ways
replicate it, a 2-D hybrid `batch=2,model=2`. On a CPU runtime the devices are 4 simulated CPUs
(`--device_type cpu` makes the planner print `--simulate_devices=4`).
'''),
    code(r'''
DEVICE_TYPE = "gpu" if count_gpus() >= 4 else "cpu"
if DEVICE_TYPE == "cpu":
    ENV["CUDA_VISIBLE_DEVICES"] = ""  # fewer than 4 GPUs: the 4 devices are simulated CPUs
SMALL = ["--model=mlp", "--hidden_sizes=256,256", "--dataset=digits", "--optimizer=adam",
         "--global_batch_size=32", "--devices=4", "--memory_per_device=900KiB",
         f"--device_type={DEVICE_TYPE}"]
print(run(TFDIST + ["plan", *SMALL]))
planned = json.loads(run(TFDIST + ["plan", *SMALL, "--json"]))
'''),
    md(r'''
Run exactly the printed command (plus a step count and a results file), and the same model on one
device:
'''),
    code(r'''
python, module, *train_flags = planned["command"]
extra = [f"--train_steps={STEPS}", "--seed=0"]
results = {}
for name, flags in (("plan", train_flags[1:]),
                    ("default", ["--strategy=default", "--model=mlp", "--hidden_sizes=256,256",
                                 "--dataset=digits", "--optimizer=adam", "--global_batch_size=32"])):
    path = OUT / f"{name}.json"
    print(tfdist_lines(run(TRAIN + flags + extra + [f"--results_json={path}"])).splitlines()[-1])
    results[name] = json.loads(path.read_text())
'''),
    code(r'''
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
'''),
    code(r'''
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
'''),
]


NOTEBOOKS = {NB1: NOTEBOOK_1, NB2: NOTEBOOK_2, NB3: NOTEBOOK_3, NB4: NOTEBOOK_4,
             NB5: NOTEBOOK_5}


def build(cells) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "colab": {"provenance": []},
    }
    for index, (kind, source) in enumerate(cells):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        notebook.cells.append(make(source, id=f"cell-{index:02d}"))  # fixed ids: stable diffs
    nbformat.validate(notebook)
    return notebook


def main(argv) -> int:
    check = "--check" in argv[1:]
    stale = []
    for name, cells in NOTEBOOKS.items():
        path = os.path.join(HERE, name)
        text = nbformat.writes(build(cells)) + "\n"
        if check:
            current = open(path).read() if os.path.exists(path) else None
            if current != text:
                stale.append(name)
        else:
            with open(path, "w") as f:
                f.write(text)
            print(f"wrote {path}")
    if stale:
        print(f"not what colab/make_notebooks.py writes: {', '.join(stale)}; run it and commit.",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
