"""--collective=fastest (the default): which collective a worker picks for its layout, and
that any explicit --collective is kept. The rule's reasons are in
tfdist.parallel.multi_worker.choose_collective; the end-to-end runs (2 launched workers on
shm by default, equal to one device) are tests/test_multi_worker.py's and the throughput
benchmark's."""

import importlib.util
import json

import pytest

from tfdist import config as cfg
from tfdist.parallel import multi_worker

LOCAL = {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
         "task": {"type": "worker", "index": 0}}
TWO_HOSTS = {"cluster": {"worker": ["127.0.0.1:2222", "10.9.8.7:2222"]},
             "task": {"type": "worker", "index": 0}}
MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS",
                 "SLURM_PROCID")
HAS_MPI4PY = importlib.util.find_spec("mpi4py") is not None


@pytest.fixture
def worker_env(monkeypatch):
    for name in MPI_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def set_env(tf_config=LOCAL, **variables):
        monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
    return set_env


def chosen(**options):
    config = cfg.RunConfig(**{"strategy": "multi_worker_mirrored", "simulate_devices": 0,
                              **options})
    return multi_worker.choose_collective(config).collective


@pytest.mark.parametrize("options, env, expected", [
    ({}, {}, "shm"),                                              # one host, one CPU each
    ({}, {"tf_config": TWO_HOSTS}, "auto"),                       # across hosts: TF's own
    ({"simulate_devices": 2}, {}, "auto"),                        # several devices a worker
    ({"trainer": "fit"}, {}, "auto"),                             # Keras' own fit
    ({"mixed_precision": "mixed_float16"}, {}, "auto"),           # loss scaling
    ({}, {"OMPI_COMM_WORLD_SIZE": "2"}, "mpi" if HAS_MPI4PY else "auto"),   # mpirun
    # srun sets PMIx variables under the cluster's default plugin, MPI chosen or not
    ({}, {"PMIX_RANK": "0", "SLURM_PROCID": "0"}, "shm"),
    ({"collective": "auto"}, {}, "auto"),                         # asked for: kept
    ({"collective": "tcp"}, {"OMPI_COMM_WORLD_SIZE": "2"}, "tcp"),
], ids=["one-host", "two-hosts", "two-devices", "keras-fit", "float16", "mpirun",
        "srun-default-pmix", "explicit-auto", "explicit-tcp"])
def test_the_default_picks_the_fastest_exact_collective_for_the_layout(
        worker_env, options, env, expected):
    worker_env(**env)
    assert chosen(**options) == expected


def test_the_choice_is_logged_with_its_reason(worker_env, caplog):
    worker_env()
    with caplog.at_level("INFO", logger="tfdist"):
        chosen()
    assert "collective shm: CPU workers on this host, one device each" in caplog.text
    assert "auto is TensorFlow's own" in caplog.text
