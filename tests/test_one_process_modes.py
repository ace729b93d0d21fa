"""A one-process mode started where a cluster of several workers is described would
train one independent copy per worker: it is exit 2 before TensorFlow starts."""

import json
import re
import subprocess
import sys

import pytest

from helpers import REPO
from test_launch import clean_env
from tfdist import parallel
from tfdist.errors import UsageError

ONE_PROCESS_MODES = [name for name in parallel.MODES.names() if name not in parallel.SPANS_WORKERS]


def tf_config(workers: int, index: int = 0) -> str:
    hosts = [f"127.0.0.1:{2000 + i}" for i in range(workers)]
    return json.dumps({"cluster": {"worker": hosts}, "task": {"type": "worker", "index": index}})


DTENSOR_TWO_CLIENTS = {"DTENSOR_CLIENT_ID": "1", "DTENSOR_NUM_CLIENTS": "2", "DTENSOR_JOB_NAME": "worker",
                       "DTENSOR_JOBS": "127.0.0.1:3000,127.0.0.1:3001"}
SRUN_TWO_TASKS = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2"}


def test_the_modes_that_span_workers_are_modes():
    assert set(parallel.SPANS_WORKERS) <= set(parallel.MODES.names())
    assert sorted(ONE_PROCESS_MODES) == ["default", "mirrored", "one_device"]


@pytest.mark.parametrize("strategy", ONE_PROCESS_MODES + ["dtensor"])
@pytest.mark.parametrize("env, variable", [
    ({"TF_CONFIG": tf_config(3, 1)}, "TF_CONFIG describes a cluster of 3 workers (this process is rank 1)"),
    (SRUN_TWO_TASKS, "SLURM_STEP_NUM_TASKS describes a cluster of 2 workers"),
])
def test_one_process_mode_under_a_cluster_is_refused_naming_the_variable(strategy, env, variable):
    with pytest.raises(UsageError) as raised:
        parallel.spanned_cluster(strategy, env)
    message = str(raised.value)
    assert f"--strategy={strategy}" in message and variable in message
    assert "independent full copy" in message
    assert "multi_worker_mirrored" in message and "tfdist launch --workers N --dtensor" in message


def test_several_dtensor_clients_refuse_the_other_modes():
    with pytest.raises(UsageError, match=re.escape("DTENSOR_JOBS describes a cluster of 2 workers")):
        parallel.spanned_cluster("mirrored", DTENSOR_TWO_CLIENTS)


@pytest.mark.parametrize("strategy, env", [
    ("mirrored", {}),
    ("pipeline", {"TF_CONFIG": tf_config(1)}),                              # a one-worker cluster
    ("default", {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"}),
    ("mirrored", {"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}),               # an sbatch script: one process
    ("multi_worker_mirrored", {"TF_CONFIG": tf_config(2, 1)}),
    ("multi_worker_mirrored", SRUN_TWO_TASKS),
    ("pipeline", {"TF_CONFIG": tf_config(2, 1)}),        # stages in different workers
    ("pipeline", SRUN_TWO_TASKS),
    ("dtensor", dict(DTENSOR_TWO_CLIENTS, TF_CONFIG=tf_config(2, 1))),   # `tfdist launch --dtensor` sets both
])
def test_what_may_run_there(strategy, env):
    parallel.spanned_cluster(strategy, env)


def test_only_the_chief_writes_the_model_dir():
    assert parallel.writes_model_dir("mirrored", {})
    assert parallel.writes_model_dir("multi_worker_mirrored", {"TF_CONFIG": tf_config(2, 0)})
    assert not parallel.writes_model_dir("multi_worker_mirrored", {"TF_CONFIG": tf_config(2, 1)})
    assert not parallel.writes_model_dir("multi_worker_mirrored", SRUN_TWO_TASKS)
    assert not parallel.writes_model_dir("dtensor", DTENSOR_TWO_CLIENTS)


def test_one_process_mode_under_tfdist_launch_exits_2_before_tensorflow_is_imported():
    # -X importtime lists every module the worker imports on its stderr: TensorFlow must not be one.
    command = [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--",
               sys.executable, "-X", "importtime", "-m", "experiments.train", "--strategy=mirrored",
               "--model=mlp", "--train_steps=5"]
    result = subprocess.run(command, cwd=REPO, env=clean_env(TF_CPP_MIN_LOG_LEVEL="2"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    # The first worker to fail ends the other, which may not get to say it too.
    assert re.search(r"^\[worker [01]\] tfdist: error: --strategy=mirrored runs in one process, but "
                     r"TF_CONFIG describes a cluster of 2 workers \(this process is rank [01]\)",
                     result.stderr, re.M), result.stderr[-3000:]
    imported = re.findall(r"\|\s+(\S+)$", result.stderr, re.M)
    assert "tfdist.parallel" in imported and "absl.flags" in imported   # it did import, and ran
    assert not [name for name in imported if name.split(".")[0] in ("tensorflow", "keras")]
    assert "Traceback" not in result.stderr
