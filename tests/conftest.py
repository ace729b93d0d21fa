"""Test set-up: TensorFlow gets 4 simulated CPU devices once, before anything runs;
tests/suite_guard.py decides which tests run in which pytest process and fails
the session if a test is skipped everywhere.

Logical devices cannot change after TensorFlow initialises, so every in-process
test shares these 4; tests needing another layout run a subprocess.
"""

import os

import pytest

import cpu_report
import suite_guard

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
SIMULATED_CPUS = 4

# DTensor tests run in a pytest process of their own (tests/test_isolated_dtensor.py):
# DTensor's collectives and tf.distribute's share process-wide collective group
# keys, and after one the other fails ("joining a group that is already full",
# CancelledError in the sharded step), whichever runs first. A user process runs
# one mode, so this only concerns the shared test process.
# The one list of what runs there: these files, and any test marked `dtensor`.
# tests/test_docs_examples.py runs there too, for balance: every example is a process of
# its own, so it shares no state with the DTensor tests, and the DTensor process ended 20
# minutes before the main one in the CI run of 7dc3bbf (tests/cpu_report.py), with the
# examples' 6 minutes on the main process's critical path.
DTENSOR_PROCESS = "TFDIST_DTENSOR_PROCESS"
DTENSOR = suite_guard.Process(
    env_var=DTENSOR_PROCESS, runner="tests/test_isolated_dtensor.py", marker="dtensor",
    files=("tests/test_dtensor.py", "tests/test_dtensor_multiclient.py",
           "tests/test_dtensor_plan.py", "tests/test_zero.py"),
    balance_files=("tests/test_docs_examples.py",))


# A second stream of the main suite's tests, in a pytest process started beside the main
# one (suite_guard: early start). The main process mostly keeps one of this machine's two
# cores busy (one training process, or `import tensorflow` in a launch: 49% idle, sampled
# in a one-stream run); these files use the other. They are equivalence runs, notebooks,
# data and the planner: none waits on a timeout, starts Slurm or a runner of its own, so
# sharing the cores changes no verdict. The fault tests (watchdogs, collective timeouts)
# stay in the main process, which this one and the DTensor process yield to (nice 19,
# suite_guard's docstring). Its one earlier failure, unnamed in that run's output, was most
# likely test_plan's allocator test, which failed on this AVX2-only machine in any process
# until 83ca1af.
SECOND_STREAM_FILES = tuple(f"tests/{name}.py" for name in (
    "test_multi_worker", "test_keras_api", "test_keras_api_multi_worker", "test_notebooks",
    "test_plan", "test_keras_io_guide", "test_pipeline_keras_hub", "test_user_code",
    "test_user_data", "test_models", "test_training", "test_equivalence_mirrored",
    "test_mpi", "test_data_sources", "test_one_process_modes", "test_keras_io_equivalence",
    "test_guarantee", "test_stranger", "test_remat"))
SECOND_STREAM_PROCESS = "TFDIST_SECOND_STREAM"
SECOND_STREAM = suite_guard.Process(
    env_var=SECOND_STREAM_PROCESS, runner="tests/test_second_stream.py",
    files=SECOND_STREAM_FILES, main_without_runner=True)


# Tests whose verdicts depend on time (a dead or stopped peer must end the others within
# --collective_timeout, start-up deadlines, Slurm jobs, restarts) run last of the main
# process's own tests, at nice 0, beside the two processes above at nice 19, which then get
# little more than the cores these tests leave idle. Sharing the cores at nice 5 and 10, a
# 2-worker run once took over 90 s to reach step 100 and a fault test failed; run after the
# other processes had ended, these files kept a core idle for 12 of the suite's 34 minutes.
TIME_SENSITIVE_FILES = tuple(f"tests/{name}.py" for name in (
    "test_mpi_errors", "test_mpi_faults", "test_multi_worker_failures",
    "test_pipeline_cross_worker_faults", "test_restart", "test_fault_tolerance", "test_launch",
    "test_slurm", "test_slurm_mpi", "test_slurm_preempt", "test_benchmark_suites",
    "test_model_dir_lock",
    "test_tcp_ring", "test_ring_security"))


def pytest_configure(config):
    suite_guard.install(config, [DTENSOR, SECOND_STREAM],
                        time_sensitive_files=TIME_SENSITIVE_FILES)
    stream = ("dtensor" if os.environ.get(DTENSOR_PROCESS) else
              "second" if os.environ.get(SECOND_STREAM_PROCESS) else "main")
    cpu_report.install(config, stream)
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
