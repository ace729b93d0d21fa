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


DTENSOR_PROCESS = "TFDIST_DTENSOR_PROCESS"


def uses_dtensor(item) -> bool:
    return "test_dtensor" in item.nodeid or "[dtensor]" in item.nodeid


def pytest_collection_modifyitems(session, config, items):
    """DTensor tests run in a process of their own (tests/test_isolated_dtensor.py).

    DTensor's collectives and tf.distribute's share process-wide collective group
    keys: after one, the other fails ("joining a group that is already full",
    CancelledError in the sharded step), whichever runs first. A user process runs
    one mode, so this only concerns the shared test process.
    """
    import pytest
    in_dtensor_process = bool(os.environ.get(DTENSOR_PROCESS))
    for item in items:
        if uses_dtensor(item) != in_dtensor_process:
            where = "the main test process" if in_dtensor_process else "its own process"
            item.add_marker(pytest.mark.skip(reason=f"runs in {where} "
                                                    f"(see tests/test_isolated_dtensor.py)"))
