"""Device set-up: simulated CPU devices and GPU selection.

Both must happen before TensorFlow initialises its devices (the first op, or
the first strategy, does that). Asking too late is a UsageError, never a no-op.
"""

import logging
from typing import List

from tfdist.errors import UsageError

AUTO = -1
AUTO_SIMULATED_CPUS = 2  # a CPU-only host still rehearses data parallelism

log = logging.getLogger(__name__)


def physical_gpus():
    import tensorflow as tf
    return tf.config.list_physical_devices("GPU")


def simulate_cpus(count: int) -> List[str]:
    """Splits the host CPU into `count` logical devices and returns their names.

    After TensorFlow initialised its devices this still works when at least
    `count` logical CPUs exist (the first `count` are used: how one test process
    runs 2- and 4-device modes); with fewer it is a UsageError.
    """
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    config = [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
    try:
        tf.config.set_logical_device_configuration(cpu, config)
    except RuntimeError:
        existing = len(tf.config.list_logical_devices("CPU"))
        if existing < count:
            raise UsageError(
                f"Cannot simulate {count} CPU devices: TensorFlow already initialised "
                f"its devices with {existing} CPU device(s). Ask for simulated devices "
                f"(--simulate_devices / tfdist.devices.simulate_cpus) before any "
                f"TensorFlow op runs, or start a new process.") from None
    return [f"/cpu:{i}" for i in range(count)]


def select_gpus(num_gpus: int) -> int:
    """Makes the first `num_gpus` GPUs visible (AUTO: all); returns how many are used."""
    import tensorflow as tf
    gpus = physical_gpus()
    if num_gpus == AUTO or num_gpus == len(gpus):
        return len(gpus)
    if num_gpus > len(gpus):
        raise UsageError(f"--num_gpus={num_gpus} but only {len(gpus)} GPU(s) are visible.")
    try:
        tf.config.set_visible_devices(gpus[:num_gpus], "GPU")
    except RuntimeError:
        raise UsageError("Cannot change visible GPUs after TensorFlow initialised its "
                         "devices; set --num_gpus before any TensorFlow op runs.") from None
    return num_gpus


def configure(simulate_devices: int = AUTO, num_gpus: int = AUTO) -> List[str]:
    """Sets up devices for a run and returns the local compute devices to use.

    simulate_devices > 0 always means simulated CPUs (a rehearsal, even on a GPU
    host); AUTO means GPUs when there are any, else AUTO_SIMULATED_CPUS CPUs.
    """
    used_gpus = 0 if simulate_devices > 0 else select_gpus(num_gpus)
    if used_gpus:
        return [f"/gpu:{i}" for i in range(used_gpus)]
    count = AUTO_SIMULATED_CPUS if simulate_devices == AUTO else simulate_devices
    return simulate_cpus(count) if count > 0 else ["/cpu:0"]
