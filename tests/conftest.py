"""Test set-up: TensorFlow gets 4 simulated CPU devices once, before anything runs;
tests/suite_guard.py decides which tests run in which pytest process and fails
the session if a test is skipped everywhere.

Logical devices cannot change after TensorFlow initialises, so every in-process
test shares these 4; tests needing another layout run a subprocess.
"""

import os

import pytest

import suite_guard

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
SIMULATED_CPUS = 4

# DTensor tests run in a pytest process of their own (tests/test_isolated_dtensor.py):
# DTensor's collectives and tf.distribute's share process-wide collective group
# keys, and after one the other fails ("joining a group that is already full",
# CancelledError in the sharded step), whichever runs first. A user process runs
# one mode, so this only concerns the shared test process.
# The one list of what runs there: these files, and any test marked `dtensor`.
DTENSOR_PROCESS = "TFDIST_DTENSOR_PROCESS"
DTENSOR = suite_guard.Process(
    env_var=DTENSOR_PROCESS, runner="tests/test_isolated_dtensor.py", marker="dtensor",
    files=("tests/test_dtensor.py", "tests/test_dtensor_multiclient.py",
           "tests/test_dtensor_plan.py"))


# Tests whose verdicts depend on time (a dead or stopped peer must end the others within
# --collective_timeout, start-up deadlines, Slurm jobs, restarts) run last in the main
# process, after the DTensor process has ended, alone on the cores: sharing them with two
# other pytest processes, a 2-worker fault test and an MPI fault test failed.
ALONE_FILES = tuple(f"tests/{name}.py" for name in (
    "test_mpi_errors", "test_mpi_faults", "test_multi_worker_failures",
    "test_pipeline_cross_worker_faults", "test_restart", "test_fault_tolerance", "test_launch",
    "test_slurm", "test_slurm_mpi", "test_benchmark_suites", "test_model_dir_lock",
    "test_tcp_ring", "test_ring_security"))


def pytest_configure(config):
    suite_guard.install(config, [DTENSOR], alone_files=ALONE_FILES)
    from tfdist import devices
    devices.simulate_cpus(SIMULATED_CPUS)
    import tensorflow as tf
    # Initialise now, so later requests for 2 or 4 devices use these instead of
    # silently re-splitting the CPU before the first op.
    assert len(tf.config.list_logical_devices("CPU")) == SIMULATED_CPUS


@pytest.fixture
def run_own_process(request, tmp_path):
    """run(env_var, fallback_args, timeout) -> (result, requested ids, passed ids): runs this
    session's tests for that process in a fresh pytest (see tests/suite_guard.py)."""
    def run(env_var, fallback_args, timeout):
        return suite_guard.run_own_process(request.config, env_var, tmp_path, fallback_args,
                                           timeout)
    return run
