"""The GPipe bubble: measured pipeline step time against the ideal and the formula.

With S balanced stages, M micro-batches and free communication, a GPipe step
takes (M + S - 1) / M times the ideal time T1 / S (T1: the same global batch on
one device), because each stage idles for S - 1 of the M + S - 1 slots: the
bubble fraction (S - 1) / (M + S - 1). Each row reports the measured step time,
its ratio to T1 / S, the formula's ratio, and both bubble fractions.

    from benchmarks.bubble import bubble_rows
    rows = bubble_rows(stages=(2, 4), microbatches=(1, 2, 4, 8))

Caveat for simulated CPU devices: they share the host's cores, so stages do not
really run in parallel and a measured ratio near S (not the formula) is expected
there; the comparison is meaningful on real accelerators.
"""

import statistics
import time
from typing import Dict, List, Sequence

from tfdist import devices
from benchmarks import harness
from tfdist.config import ModelConfig, RunConfig

# Five equal 512-wide layers: stages of nearly equal cost for S = 2 and 4.
DEFAULT_MODEL = ModelConfig(name="mlp", hidden_sizes=(512,) * 5)


def step_seconds(config: RunConfig, steps: int) -> float:
    """Median wall time of one training step, after two untimed (tracing) steps."""
    train_step, iterator = harness.train_step_and_iterator(config)
    for _ in range(2):
        float(train_step(iterator))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        float(train_step(iterator))  # float() waits for the step to finish
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bubble_rows(stages: Sequence[int] = (2, 4), microbatches: Sequence[int] = (1, 2, 4, 8),
                steps: int = 10, global_batch_size: int = 512,
                model: ModelConfig = DEFAULT_MODEL) -> List[Dict]:
    """One row per (S, M): step time, ratio to the ideal T1 / S, GPipe formula, bubble."""
    devices.configure(max(stages))  # before TensorFlow initialises: the most ever needed
    base = dict(model=model, global_batch_size=global_batch_size, optimizer="sgd", seed=0,
                train_steps=steps)
    one_device = step_seconds(RunConfig(strategy="default", simulate_devices=max(stages),
                                        **base), steps)
    rows = []
    for num_stages in stages:
        for m in microbatches:
            config = RunConfig(strategy="pipeline", simulate_devices=num_stages,
                               pipeline_stages=num_stages, microbatches=m, **base)
            measured = step_seconds(config, steps)
            ideal = one_device / num_stages
            rows.append({
                "stages": num_stages, "microbatches": m,
                "step_seconds": round(measured, 5),
                "one_device_seconds": round(one_device, 5),
                "ratio_to_ideal": round(measured / ideal, 3),
                "formula_ratio": round((m + num_stages - 1) / m, 3),
                "bubble_formula": round((num_stages - 1) / (m + num_stages - 1), 3),
                "bubble_measured": round(1 - ideal / measured, 3),
            })
    return rows
