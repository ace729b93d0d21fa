"""Test set-up: TensorFlow gets 4 simulated CPU devices once, before anything runs.

Logical devices cannot change after TensorFlow initialises, so every in-process
test shares these 4; tests needing another layout run a subprocess.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
SIMULATED_CPUS = 4


def pytest_configure(config):
    from tfdist import devices
    devices.simulate_cpus(SIMULATED_CPUS)
    import tensorflow as tf
    # Initialise now, so later requests for 2 or 4 devices use these instead of
    # silently re-splitting the CPU before the first op.
    assert len(tf.config.list_logical_devices("CPU")) == SIMULATED_CPUS
