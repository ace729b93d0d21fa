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


def pytest_collection_modifyitems(session, config, items):
    """DTensor tests run last. DTensor's collectives claim collective group keys
    for the whole process; a later tf.distribute collective over other devices
    with the same key fails ("joining a group that is already full", seen with
    the synchronized BatchNorm test). Every user process runs one mode, so the
    order only matters inside this shared test process."""
    items.sort(key=lambda item: "test_dtensor" in item.nodeid)
