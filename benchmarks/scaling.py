"""Scaling: step time, examples/s and efficiency per parallel mode and device count.

    from benchmarks import scaling
    rows = scaling.run_suite("default:1,mirrored:2,pipeline:4", steps=30, trials=3)
    scaling.write_report(rows, "benchmarks/results")   # scaling.csv, .md, .png

A contender is MODE:N (N devices; the baseline `default:1` always runs). Each
run is a fresh `python -m experiments.train` process, because simulated devices
must be set before TensorFlow initialises and DTensor and tf.distribute
collectives cannot share one process. Every contender trains the same MLP on
`synthetic` data with the same global batch and SGD; contenders alternate trial
by trial so machine noise hits all alike, and medians are reported.
speedup = examples/s over the baseline's; efficiency = speedup / devices.

Caveat for simulated CPU devices: they share the host's cores, and the one-device
baseline already uses all of them, so speedup <= 1 is expected there; the suite
checks the harness, real numbers need accelerators.
"""

import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence, Tuple

from benchmarks import report
from tfdist.errors import UsageError, require

log = logging.getLogger("tfdist")

BASELINE = "default:1"
DEFAULT_CONTENDERS = ("default:1,mirrored:2,mirrored:4,dtensor:2,dtensor:4,dtensor_megatron:4,"
                      "pipeline:2,pipeline:4")
# Four equal hidden layers: pipeline stages of nearly equal cost for S = 2 and 4, and
# an even layer count, so megatron pairs every column-parallel layer with a row-parallel one.
HIDDEN_SIZES = (1024, 1024, 1024, 1024)
GLOBAL_BATCH_SIZE = 512
MICROBATCHES = 4
TAIL_CHARS = 3000


class ContenderFailed(RuntimeError):
    """A contender's training process failed or timed out; the message has its output's tail."""


@dataclasses.dataclass(frozen=True)
class Contender:
    mode: str
    devices: int
    layout: str               # human description: mesh, stages, replicas
    flags: Tuple[str, ...]    # experiments.train flags selecting the mode

    @property
    def name(self) -> str:
        return f"{self.mode}:{self.devices}"


def _default(n):
    require(n == 1, f"default runs on 1 device, got default:{n}.")
    # Not split: the baseline is one device with all the host's cores.
    return "1 device", ("--strategy=default", "--simulate_devices=0")


def _mirrored(n):
    return f"{n} replicas", ("--strategy=mirrored", f"--simulate_devices={n}")


def _dtensor(n):
    return f"mesh batch={n}, layout data", ("--strategy=dtensor", f"--simulate_devices={n}",
                                            f"--mesh=batch={n}", "--layout=data")


def _dtensor_megatron(n):
    require(n % 2 == 0, f"dtensor_megatron needs an even device count (mesh batch=N/2,model=2), "
                        f"got dtensor_megatron:{n}.")
    mesh = f"batch={n // 2},model=2"
    return f"mesh {mesh}, layout megatron", ("--strategy=dtensor", f"--simulate_devices={n}",
                                             f"--mesh={mesh}", "--layout=megatron")


def _pipeline(n):
    require(n >= 2, f"pipeline needs at least 2 stages, got pipeline:{n}.")
    return (f"{n} stages, {MICROBATCHES} microbatches",
            ("--strategy=pipeline", f"--simulate_devices={n}", f"--pipeline_stages={n}",
             f"--microbatches={MICROBATCHES}"))


MODES = {"default": _default, "mirrored": _mirrored, "dtensor": _dtensor,
         "dtensor_megatron": _dtensor_megatron, "pipeline": _pipeline}


def parse_contenders(spec: str) -> List[Contender]:
    """"MODE:N,..." -> contenders, the baseline first (added when missing), no duplicates."""
    names = [item.strip() for item in spec.split(",") if item.strip()]
    contenders = {}
    for name in [BASELINE] + names:
        mode, _, count = name.partition(":")
        require(mode in MODES, f"Unknown scaling mode {mode!r} in {name!r}. "
                               f"Valid modes: {', '.join(MODES)} (as MODE:DEVICES).")
        require(count.isascii() and count.isdigit() and int(count) >= 1,
                f"Scaling contender {name!r} needs a device count >= 1, as {mode}:2.")
        layout, flags = MODES[mode](int(count))
        contender = Contender(mode, int(count), layout, flags)
        contenders.setdefault(contender.name, contender)
    return list(contenders.values())


def train_command(contender: Contender, steps: int, results_json: str,
                  hidden_sizes: Sequence[int], global_batch_size: int) -> List[str]:
    return [sys.executable, "-m", "experiments.train", *contender.flags,
            "--model=mlp", f"--hidden_sizes={','.join(map(str, hidden_sizes))}",
            "--dataset=synthetic", "--synthetic_shape=784",
            # 4096 training examples: the final evaluation is one batch of 512, not a minute.
            "--synthetic_examples=4096", f"--global_batch_size={global_batch_size}",
            "--optimizer=sgd", "--seed=0", f"--train_steps={steps}", "--log_every=1000000",
            f"--results_json={results_json}"]


def _tail(output) -> str:
    if isinstance(output, bytes):  # TimeoutExpired keeps undecoded bytes
        output = output.decode(errors="replace")
    return (output or "")[-TAIL_CHARS:]


def run_once(contender: Contender, steps: int, timeout: float,
             hidden_sizes: Sequence[int] = HIDDEN_SIZES,
             global_batch_size: int = GLOBAL_BATCH_SIZE) -> Dict:
    """Trains one contender in a fresh process; returns its results JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json")
        command = train_command(contender, steps, path, hidden_sizes, global_batch_size)
        try:
            done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            raise ContenderFailed(f"{contender.name} timed out after {timeout:.0f} s: "
                                  f"{' '.join(command)}\n{_tail(error.output)}") from None
        if done.returncode != 0 or not os.path.exists(path):
            raise ContenderFailed(f"{contender.name} failed (exit {done.returncode}): "
                                  f"{' '.join(command)}\n{_tail(done.stdout)}")
        with open(path) as f:
            results = json.load(f)
    if results["steps"] != steps:
        raise ContenderFailed(f"{contender.name} trained {results['steps']} steps, not {steps}.")
    return results


def measure(contenders: Sequence[Contender], steps: int, trials: int, timeout: float,
            **model) -> Dict[str, List[Dict]]:
    """Results per contender name, one per trial; contenders alternate within each trial."""
    results = {c.name: [] for c in contenders}
    for trial in range(1, trials + 1):
        for contender in contenders:
            start = time.perf_counter()
            r = run_once(contender, steps, timeout, **model)
            results[contender.name].append(r)
            log.info("scaling trial %d/%d %-20s %8.0f examples/s  (%.1f s wall)", trial, trials,
                     contender.name, r["examples_per_sec"], time.perf_counter() - start)
    return results


def summarise(contenders: Sequence[Contender], results: Dict[str, List[Dict]],
              global_batch_size: int = GLOBAL_BATCH_SIZE) -> List[Dict]:
    """One row per contender: medians over trials, speedup and efficiency vs the baseline."""
    def median_rate(name):
        return statistics.median(r["examples_per_sec"] for r in results[name])

    baseline = median_rate(BASELINE)
    rows = []
    for c in contenders:
        rate = median_rate(c.name)
        # The loop's rate excludes the first (tracing) step, so this is the mean timed step.
        step_ms = statistics.median(1000 * global_batch_size / r["examples_per_sec"]
                                    for r in results[c.name])
        speedup = rate / baseline
        rows.append({
            "mode": c.mode, "devices": c.devices, "layout": c.layout,
            "step_ms": round(step_ms, 1), "examples_per_sec": round(rate),
            "speedup": round(speedup, 2), "efficiency": round(speedup / c.devices, 2),
            # Whole loop incl. tracing and the final evaluation: startup cost per mode.
            "train_s": round(statistics.median(r["train_seconds"] for r in results[c.name]), 1),
            "trials_examples_per_sec": " ".join(f"{r['examples_per_sec']:.0f}"
                                                for r in results[c.name]),
        })
    return rows


def run_suite(spec: str = DEFAULT_CONTENDERS, steps: int = 30, trials: int = 3,
              timeout: float = 600, hidden_sizes: Sequence[int] = HIDDEN_SIZES,
              global_batch_size: int = GLOBAL_BATCH_SIZE) -> List[Dict]:
    require(steps >= 2, f"--steps must be >= 2 (the first step is not timed), got {steps}.")
    require(trials >= 1, f"--trials must be >= 1, got {trials}.")
    contenders = parse_contenders(spec)  # before any process starts: bad names fail fast
    results = measure(contenders, steps, trials, timeout, hidden_sizes=hidden_sizes,
                      global_batch_size=global_batch_size)
    return summarise(contenders, results, global_batch_size)


def plot(rows: Sequence[Dict], path: str) -> None:
    """Speedup against devices, one line per mode, next to ideal linear scaling."""
    lines = {}
    for row in rows:
        lines.setdefault(row["mode"], []).append((row["devices"], row["speedup"]))
    counts = sorted({row["devices"] for row in rows} | {1})
    report.write_plot(
        path, lines, reference=("ideal (linear)", [(n, n) for n in counts]),
        title=f"Scaling on simulated CPU devices sharing {os.cpu_count()} cores\n"
              f"(checks the harness; real scaling needs accelerators)",
        xlabel="devices", ylabel="speedup vs default on 1 device", xticks=counts)


def write_report(rows: Sequence[Dict], out_dir: str, name: str = "scaling") -> str:
    """Writes NAME.csv, NAME.md and NAME.png under out_dir; returns the markdown."""
    if not rows:
        raise UsageError("No scaling rows to write.")
    table = report.write_all(list(rows), out_dir, name)
    plot(rows, os.path.join(out_dir, f"{name}.png"))
    return table
