"""The planner's transient estimate against TensorFlow's allocator, on one device.

A training step's transient memory (peak during the step minus what was live
before it: the weights, slots and input buffers) is what the planner calls
gradients + activations. TF 2.21 reports allocator statistics for CPU devices
too (`tf.config.experimental.get_memory_info`), so this runs here; the error is
(estimate - measured) / measured.

    python -m experiments.benchmark --suite=memory     # the CONFIGS below, one row each
"""

import shlex
from typing import Dict, List

from tfdist import config as cfg
from tfdist.benchmarks import harness
from tfdist.plan import command
from tfdist.plan.memory import Candidate, per_device


CONFIGS = (  # `tfdist plan` flags: one per registry model, big enough to dwarf allocator rounding
    ("--model=mlp", "--hidden_sizes=1024,1024", "--dataset=synthetic", "--synthetic_shape=784",
     "--global_batch_size=256", "--optimizer=sgd"),
    ("--model=cnn", "--dataset=digits", "--global_batch_size=256"),
    ("--model=transformer", "--dataset=text", "--global_batch_size=32"),
    ("--model=resnet", "--dataset=synthetic", "--synthetic_shape=32,32,3", "--filters=16,32",
     "--global_batch_size=64"),
)


MEASURED_STEPS = 5


def measured_transient_bytes(config: cfg.RunConfig, device: str = "CPU:0",
                             steps: int = MEASURED_STEPS) -> int:
    """Peak minus live bytes on `device`, the worst of `steps` (already traced) training steps.

    The worst, not one step: TF's executor runs independent ops in whatever order
    its inter-op threads reach them, so one step's peak depends on the order (on a
    busy machine one step of the mlp peaked 27% below the others). Memory has to
    fit the worst step, and the planner estimates that one.
    """
    import tensorflow as tf
    step, iterator = harness.train_step_and_iterator(config)
    float(step(iterator))  # trace and warm up: first-step allocations are not the steady state
    float(step(iterator))
    worst = 0
    for _ in range(steps):
        tf.config.experimental.reset_memory_stats(device)
        before = tf.config.experimental.get_memory_info(device)["current"]
        float(step(iterator))
        worst = max(worst, tf.config.experimental.get_memory_info(device)["peak"] - before)
    return worst


def compare(plan_flags: List[str]) -> Dict:
    """One row: the planner's gradients + activations for one device, and the measurement."""
    args, work, _ = command.parse(["--devices=1", "--memory_per_device=1TiB", *plan_flags])
    estimate = per_device(Candidate("default", 1, replicas=1), work)[0]
    config = cfg.RunConfig(strategy="default", simulate_devices=0, model=command.model_config(args),
                           data=command.data_config(args), optimizer=args.optimizer,
                           global_batch_size=args.global_batch_size, train_steps=3)
    measured = measured_transient_bytes(config)
    predicted = estimate.gradients + estimate.activations
    return {"config": shlex.join(plan_flags), "gradients": estimate.gradients,
            "activations": estimate.activations, "estimate": predicted, "measured": measured,
            "error": round((predicted - measured) / measured, 3)}


def compare_all(configs=CONFIGS) -> List[Dict]:
    return [compare(list(flags)) for flags in configs]
