"""Activation recomputation (--remat) measured: a step's transient memory and its time,
with and without, on a transformer of 8 blocks on one device.

Each measurement runs in a fresh process (one executor and one kernel thread, the
allocator keeping statistics: benchmarks/memory.py's method, which needs both before
TensorFlow starts), and the modes alternate trial by trial, so the machine's load
falls on each alike. A step's transient bytes are its peak minus what was live
before it; the activations are that minus the gradients (one float32 per trainable
value, what the step holds at its end). Graph rewrites are measured both off
(memory.py's setting: the step as autodiff and recompute_grad write it) and on
(TensorFlow's default, what users run).

    python -m benchmarks --suite=remat            # writes remat.{csv,md} under --out_dir
    python -m benchmarks.remat --measure=full --rewrites=on   # one process, one JSON line
"""

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

from absl import app, flags

# contender -> (--remat, graph rewrites): "on" is TensorFlow's default with tfdist's one
# change under recomputation (grappler's dependency optimizer off, remat.py says why);
# "keep" leaves that optimizer on, "off" runs every rewrite off (memory.py's setting).
CONTENDERS = {
    "none": ("none", "on"),
    "full": ("full", "on"),
    "full, dependency optimizer kept on": ("full", "keep"),
    "none, graph rewrites off": ("none", "off"),
    "full, graph rewrites off": ("full", "off"),
}
BASELINES = {"on": "none", "keep": "none", "off": "none, graph rewrites off"}
MODEL_FLAGS = dict(num_layers=8, d_model=128, num_heads=4, d_ff=512)
SEQ_LEN, BATCH = 128, 32
TIMED_STEPS = 10
TRIAL_TIMEOUT_S = 600   # one process: import, build, trace, 2 + 5 + 10 steps


def run_config(mode: str):
    from tfdist import config as cfg
    return cfg.RunConfig(strategy="default", simulate_devices=0,
                         model=cfg.ModelConfig(name="transformer", **MODEL_FLAGS),
                         data=cfg.DataConfig(name="text", seq_len=SEQ_LEN),
                         global_batch_size=BATCH, optimizer="adam", train_steps=3,
                         remat=None if mode == "none" else mode)


def measure(mode: str, rewrites: str) -> Dict:
    """In this (fresh) process: transient bytes (worst of memory.py's steps) and the
    median time of TIMED_STEPS further steps."""
    from benchmarks import harness, memory
    config = run_config(mode)
    memory.require_one_thread_executor()
    memory.require_allocator_stats()
    import tensorflow as tf
    if rewrites == "keep":   # set before remat.apply, which then leaves it as it is
        tf.config.optimizer.set_experimental_options({"dependency_optimization": True})
    rewriting = (memory._without_graph_rewrites() if rewrites == "off"
                 else contextlib.nullcontext())
    with rewriting:
        step, iterator, model, recomputed = harness.train_step_iterator_and_model(
            config, one_batch=True)
        worst = memory.worst_transient_bytes(step, iterator)
        times = []
        for _ in range(TIMED_STEPS):
            start = time.perf_counter()
            float(step(iterator))
            times.append(time.perf_counter() - start)
    gradients = 4 * sum(int(tf.size(v)) for v in model.trainable_variables)
    return {"transient": worst, "gradients": gradients, "step_s": statistics.median(times),
            "recomputed": len(recomputed)}


def trial(mode: str, rewrites: str) -> Dict:
    """One measurement in a fresh process."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.remat", f"--measure={mode}", f"--rewrites={rewrites}"],
        capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"remat measurement {mode}/{rewrites} failed (exit "
                           f"{result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])


def compare(trials: int = 3) -> List[Dict]:
    """One row per contender: medians over trials, the contenders alternating."""
    found = {name: [] for name in CONTENDERS}
    for _ in range(trials):
        for name, (mode, rewrites) in CONTENDERS.items():
            found[name].append(trial(mode, rewrites))
    rows = []
    for name, (mode, rewrites) in CONTENDERS.items():
        got, base = _medians(found[name]), _medians(found[BASELINES[rewrites]])
        rows.append({
            "model": "transformer " + " ".join(f"{k}={v}" for k, v in MODEL_FLAGS.items())
                     + f" seq_len={SEQ_LEN} batch={BATCH}",
            "contender": name, "recomputed_layers": got["recomputed"],
            "transient_mb": round(got["transient"] / 2**20, 1),
            "activations_mb": round(got["activations"] / 2**20, 1),
            "activations_vs_none": round(got["activations"] / base["activations"], 3),
            "step_ms": round(1000 * got["step_s"], 1),
            "time_vs_none": round(got["step_s"] / base["step_s"], 3), "trials": trials})
    return rows


def _medians(results: List[Dict]) -> Dict:
    return {"transient": statistics.median(r["transient"] for r in results),
            "activations": statistics.median(r["transient"] - r["gradients"] for r in results),
            "step_s": statistics.median(r["step_s"] for r in results),
            "recomputed": results[0]["recomputed"]}


flags.DEFINE_enum("measure", None, ["none", "full"], "Measure this --remat in this process.")
flags.DEFINE_enum("rewrites", "on", ["on", "keep", "off"],
                  "Graph rewrites (CONTENDERS: on, dependency optimizer kept on, all off).")


def main(argv: Optional[list] = None) -> None:
    del argv
    print(json.dumps(measure(flags.FLAGS.measure, flags.FLAGS.rewrites)), flush=True)


if __name__ == "__main__":
    app.run(main)
