"""The planner's transient estimate against TensorFlow's allocator, on one device.

A training step's transient memory (peak during the step minus what was live
before it: the weights, slots and input buffers) is what the planner calls
gradients + activations. TF 2.21 reports allocator statistics for CPU devices
too (`tf.config.experimental.get_memory_info`), so this runs here; the error is
(estimate - measured) / measured.

Only some CPU allocators keep those statistics: oneDNN's (TensorFlow's default
where oneDNN is on, on AVX512 CPUs) and the BFC allocator that
TF_CPU_ALLOCATOR_USE_BFC=true selects. TensorFlow's plain CPU allocator, the
default on an AVX2-only CPU, keeps none. The measurement prefers the default
allocator where it keeps them, since its peak moved less from process to process
(it reports in steps of 64 KiB, so it also rounds; how it rounds is not read
here); BFC counts whole chunks, and hands out a free chunk up to twice the
request without splitting it, so its peak moves with the allocation history (on one AVX512
machine the mlp's BFC peak ranged 8.5-17.6 MB from process to process, its
oneDNN peak 12.5-13.6 MB). A probe process finds out which it is before
TensorFlow creates its devices here; if they already exist, it says how to start.

What is measured is the step as autodiff writes it: TensorFlow's graph rewrites
(grappler) are off while it is traced, and nothing runs beside the measured
steps: one executor thread and one kernel thread, and one global batch repeated
from memory. Each of the three moved the peak from process to process. Grappler's
rewrites put the mlp's peak (oneDNN's allocator, worst of five steps) at 11.5-12.5
MB in most processes and at 7.3 MB in about one in ten (1 of 10 idle, 1 of 8
under two busy loops here) and in both full-suite second streams on record,
loaded and niced (CI's at 519e7b7, this machine's at a59fc74, already on one
thread): a different rewritten graph, its peak set per process. With more
threads, timing decides the order of independent ops, and the order how many
gradients and activations are alive at once (12.5-13.6 MB idle); an input
pipeline's threads allocate on the same device in between. Measured as now:
9.5 MB in 18 of 22 runs and 10.5 MB in 4, idle and loaded. The rewritten
graph's peak, which a plan also has to leave room for, is in docs/planner.md.

    python -m benchmarks --suite=memory     # the CONFIGS below, one row each
"""

import contextlib
import os
import shlex
import subprocess
import sys
from typing import Dict, List

from tfdist import config as cfg
from benchmarks import harness
from tfdist.plan import command
from tfdist.plan.memory import Candidate, per_device


CONFIGS = (  # `tfdist plan` flags: one per registry model, big enough to dwarf allocator rounding
    ("--model=mlp", "--hidden_sizes=1024,1024", "--dataset=synthetic", "--synthetic_shape=784",
     "--global_batch_size=256", "--optimizer=sgd"),
    ("--model=cnn", "--dataset=digits", "--global_batch_size=256"),
    ("--model=transformer", "--dataset=text", "--global_batch_size=32"),
    ("--model=transformer", "--dataset=text", "--global_batch_size=32", "--num_layers=8",
     "--remat=full"),
    ("--model=resnet", "--dataset=synthetic", "--synthetic_shape=32,32,3", "--filters=16,32",
     "--global_batch_size=64"),
)


MEASURED_STEPS = 5
ALLOCATOR_STATS_ENV = "TF_CPU_ALLOCATOR_USE_BFC"  # read once, when TensorFlow creates its devices
PROBE_TIMEOUT_S = 120  # one `import tensorflow` and one op; a few seconds on an idle machine
THREAD_ENVS = ("TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS")


def default_allocator_keeps_stats() -> bool:
    """Whether TensorFlow's default CPU allocator keeps peak statistics here (a fresh process)."""
    probe = "import tensorflow as tf; tf.config.experimental.get_memory_info('CPU:0')"
    env = {**os.environ, ALLOCATOR_STATS_ENV: "false"}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                            timeout=PROBE_TIMEOUT_S)
    return result.returncode == 0


def allocator_name() -> str:
    """Which allocator measures in this process: 'bfc' or the platform's 'default'."""
    return "bfc" if os.environ.get(ALLOCATOR_STATS_ENV, "").lower() in ("true", "1") else "default"


def require_allocator_stats(device: str = "CPU:0") -> None:
    """Makes `device`'s allocator keep peak statistics, or raises saying how to."""
    if ALLOCATOR_STATS_ENV not in os.environ:  # in time only if no device exists yet
        os.environ[ALLOCATOR_STATS_ENV] = "false" if default_allocator_keeps_stats() else "true"
    import tensorflow as tf
    try:
        tf.config.experimental.get_memory_info(device)
    except ValueError as error:
        raise RuntimeError(
            f"TensorFlow keeps no allocator statistics for {device!r} in this process "
            f"({error}; {ALLOCATOR_STATS_ENV}={os.environ.get(ALLOCATOR_STATS_ENV)!r}). "
            f"Start the measurement in a fresh process with {ALLOCATOR_STATS_ENV}=true, before "
            f"anything runs a TensorFlow op: python -m benchmarks --suite=memory") from None


def require_one_thread_executor() -> None:
    """Runs TensorFlow's ops on one executor and one kernel thread, or raises saying how to.

    Only possible before TensorFlow's context exists; a context already started on
    one thread of each (the API or THREAD_ENVS) is accepted as it is.
    """
    import tensorflow as tf
    threading = tf.config.threading
    try:
        threading.set_inter_op_parallelism_threads(1)
        threading.set_intra_op_parallelism_threads(1)
        return
    except RuntimeError:  # the context exists: accept it only if it already runs on one thread
        pass
    from_api = (threading.get_inter_op_parallelism_threads(),
                threading.get_intra_op_parallelism_threads()) == (1, 1)
    from_env = all(os.environ.get(name) == "1" for name in THREAD_ENVS)
    if not (from_api or from_env):
        raise RuntimeError(
            "TensorFlow already runs on more than one thread in this process, so a step's op "
            "order (and its memory peak) changes from run to run. Start the measurement in a "
            "fresh process, or with " + " ".join(f"{name}=1" for name in THREAD_ENVS) +
            ": python -m benchmarks --suite=memory")


def measured_transient_bytes(config: cfg.RunConfig, device: str = "CPU:0",
                             steps: int = MEASURED_STEPS) -> int:
    """Peak minus live bytes on `device`, the worst of `steps` (already traced) training steps.

    Without graph rewrites, on one thread (module docstring), so the graph and the
    op order do not change with the machine's load; the worst of several steps
    still, since the allocator's reuse can differ from one step to the next.
    """
    require_one_thread_executor()  # first: reading the allocator's statistics starts the context
    require_allocator_stats(device)
    with _without_graph_rewrites():  # around the measured steps too: a changed setting re-optimizes
        step, iterator = harness.train_step_and_iterator(config, one_batch=True)
        return worst_transient_bytes(step, iterator, device, steps)


def worst_transient_bytes(step, iterator, device: str = "CPU:0",
                          steps: int = MEASURED_STEPS) -> int:
    """Peak minus live bytes on `device`, the worst of `steps` steps after two warm-up
    steps (first-step allocations are not the steady state)."""
    import tensorflow as tf
    float(step(iterator))
    float(step(iterator))
    worst = 0
    for _ in range(steps):
        tf.config.experimental.reset_memory_stats(device)
        before = tf.config.experimental.get_memory_info(device)["current"]
        float(step(iterator))
        worst = max(worst, tf.config.experimental.get_memory_info(device)["peak"] - before)
    return worst


@contextlib.contextmanager
def _without_graph_rewrites():
    """Functions run inside run as traced (grappler off); outside, with the caller's setting."""
    import tensorflow as tf
    before = tf.config.optimizer.get_experimental_options().get("disable_meta_optimizer", False)
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": before})


def compare(plan_flags: List[str]) -> Dict:
    """One row: the planner's gradients + activations for one device, and the measurement."""
    args, work, _ = command.parse(["--devices=1", "--memory_per_device=1TiB", *plan_flags])
    estimate = per_device(Candidate("default", 1, replicas=1), work)[0]
    config = cfg.RunConfig(strategy="default", simulate_devices=0, model=command.model_config(args),
                           data=command.data_config(args), optimizer=args.optimizer,
                           global_batch_size=args.global_batch_size, train_steps=3,
                           remat=args.remat)
    measured = measured_transient_bytes(config)
    predicted = estimate.gradients + estimate.activations
    return {"config": shlex.join(plan_flags), "allocator": allocator_name(),
            "gradients": estimate.gradients,
            "activations": estimate.activations, "estimate": predicted, "measured": measured,
            "error": round((predicted - measured) / measured, 3)}


def compare_all(configs=CONFIGS) -> List[Dict]:
    return [compare(list(flags)) for flags in configs]
