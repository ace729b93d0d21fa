"""A stranger on the network against a running job, in every mode (tfdist.testing.stranger).

While a real job trains, an unrelated process (the prober, in this host's network) finds
every TCP port the job's processes listen on and tries to run `tf.io.write_file` through
each, as TensorFlow's gRPC server allows anyone who reaches it. What must hold:
- under `tfdist launch` (a private network by default), every port is in the job's own
  network namespace, nothing reaches it from here, no file appears, and the job trains
  to one device's losses;
- mirrored (one process) listens on nothing;
- under `tfdist launch --network=host` the door is open (the probe's op runs: this also
  proves the probe can succeed) and the launcher said so before the workers started.

The docs' table (docs/security.md) comes from these runs:

    TFDIST_STRANGER_RECORDS=/tmp/stranger python -m pytest tests/test_stranger.py
    python -m tfdist.testing.stranger --table /tmp/stranger
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO
from test_mpi import mpi_unavailable
from tfdist.testing import equivalence

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

STEPS = 40
TRAIN = ["-m", "experiments.train", "--model=mlp", "--dataset=digits", "--optimizer=adam",
         "--global_batch_size=32", f"--train_steps={STEPS}", "--seed=7", f"--log_every={STEPS}"]
# mode: (tfdist launch flags, or None for one process; the mode's training flags)
MODES = {
    "mirrored": (None, ["--strategy=mirrored", "--simulate_devices=2"]),
    "multi_worker_mirrored auto": (["--workers", "2"], ["--strategy=multi_worker_mirrored",
                                                        "--collective=auto"]),
    "multi_worker_mirrored tcp": (["--workers", "2"], ["--strategy=multi_worker_mirrored",
                                                       "--collective=tcp"]),
    "multi_worker_mirrored shm": (["--workers", "2"], ["--strategy=multi_worker_mirrored",
                                                       "--collective=shm"]),
    "multi_worker_mirrored mpi": (["--mpi", "--workers", "2"],
                                  ["--strategy=multi_worker_mirrored", "--collective=mpi"]),
    "dtensor 2 clients": (["--workers", "2", "--devices_per_worker", "2", "--dtensor"],
                          ["--strategy=dtensor", "--mesh=batch=2,model=2", "--layout=megatron"]),
    "pipeline across workers": (["--workers", "2"], ["--strategy=pipeline",
                                                     "--pipeline_stages=2", "--microbatches=4"]),
}
_reference = []


def one_device_losses(tmp_path):
    if not _reference:
        results = tmp_path / "default.json"
        done = subprocess.run([sys.executable, *TRAIN, "--strategy=default",
                               f"--results_json={results}"], cwd=REPO, env=environment(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        _reference.append(json.loads(results.read_text())["losses"])
    return _reference[0]


def environment():
    return dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")


def job_command(mode, results, network_flags=(), steps=STEPS):
    launch_flags, flags = MODES[mode]
    command = [sys.executable, *TRAIN, *flags, f"--results_json={results}",
               f"--train_steps={steps}"]
    if launch_flags is None:
        return command
    return [sys.executable, "-m", "tfdist.launch", *launch_flags, *network_flags, "--", *command]


def start_job_and_prober(command, tmp_path, *prober_flags):
    evidence, records = tmp_path / "evidence", tmp_path / "probe.json"
    evidence.mkdir()
    prober_log = open(tmp_path / "prober.log", "w")
    job = subprocess.Popen(command, cwd=REPO, env=environment(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    prober = subprocess.Popen([sys.executable, "-m", "tfdist.testing.stranger",
                               f"--pid={job.pid}", f"--out={records}",
                               f"--evidence_dir={evidence}", *prober_flags], cwd=REPO,
                              env=environment(), stderr=prober_log)
    prober_log.close()   # the prober holds its own copy
    return job, prober, records, evidence


def run_with_stranger(mode, tmp_path):
    """Runs the mode's job with a prober watching it; (job, probe records, results)."""
    results = tmp_path / "results.json"
    job, prober, records, evidence = start_job_and_prober(job_command(mode, results), tmp_path)
    try:
        out, err = job.communicate(timeout=600)
        # The prober ends once the job has and its last probes answered (at most
        # stranger.PROBE_SECONDS later).
        prober.wait(timeout=120)
    finally:
        for process in (job, prober):
            if process.poll() is None:
                process.kill()
    assert job.returncode == 0, out[-3000:] + err[-3000:]
    assert prober.returncode == 0
    save_records(mode, records.read_text())
    return (out + err + (tmp_path / "prober.log").read_text(), json.loads(records.read_text()),
            json.loads(results.read_text()), sorted(os.listdir(evidence)))


def save_records(name, text):
    """Keeps a copy for the docs' table when TFDIST_STRANGER_RECORDS names a directory."""
    directory = os.environ.get("TFDIST_STRANGER_RECORDS")
    if directory:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, name.replace(" ", "+") + ".json"), "w") as f:
            f.write(text)


def mode_params() -> list:
    params = []
    for mode in MODES:
        marks = ([pytest.mark.skipif(mpi_unavailable() is not None,
                                     reason=str(mpi_unavailable()))] if "mpi" in mode else [])
        params.append(pytest.param(mode, marks=marks, id=mode.replace(" ", "_")))
    return params


@pytest.mark.slow
@pytest.mark.parametrize("mode", mode_params())
def test_a_stranger_can_neither_reach_nor_change_a_job(mode, tmp_path):
    output, records, results, evidence = run_with_stranger(mode, tmp_path)
    assert evidence == [], f"the stranger's op ran in {mode}: {records}"
    assert all(r["probe"] != "op ran" for r in records), records
    if MODES[mode][0] is None:
        assert records == [], f"one process should listen on nothing: {records}"
    else:
        # Every listening port of a launched job lives in the job's private network:
        # TensorFlow's servers (bound 0.0.0.0 there), tfdist's rings and rendezvous, and
        # Open MPI's runtime. None is reachable from this network.
        assert records, f"the probe saw no door to try: {output[-4000:]}"
        assert all(r["network"] == "private" and r["probe"] == "refused"
                   and r["interfaces"] == ["lo"] for r in records), records
        assert "workers share a private network" in output
    reference = one_device_losses(tmp_path)
    assert len(results["losses"]) == len(reference) == STEPS
    error = equivalence.max_relative_loss_error(equivalence.Record("one device", reference, None),
                                                equivalence.Record(mode, results["losses"], None))
    assert error <= equivalence.RTOL, (mode, error)


@pytest.mark.slow
def test_on_the_hosts_network_the_door_is_open_and_the_launcher_says_so(tmp_path):
    """The same probe does get in when the job shares this host's network: what
    --network=host costs, and the proof that the probe above can succeed. The job trains
    until the probe's op has run (--until_op_runs), then is stopped: however slow the
    machine, the server is up while the probe tries it."""
    mode, network = "multi_worker_mirrored tcp", "--network=host"
    command = job_command(mode, tmp_path / "results.json", (network,), steps=10**6)
    job, prober, records, evidence = start_job_and_prober(command, tmp_path, "--until_op_runs",
                                                          "--timeout=300")
    try:
        prober.wait(timeout=360)
    finally:
        job.terminate()   # the launcher stops its workers (a preemption, no checkpoint)
        try:
            out, err = job.communicate(timeout=120)
        finally:
            for process in (job, prober):
                if process.poll() is None:
                    process.kill()
    assert prober.returncode == 0
    save_records(f"{mode} {network}", records.read_text())
    records = json.loads(records.read_text())
    assert "listens on every interface" in out + err and "firewall" in out + err
    opened = {r["port"] for r in records if r["probe"] == "op ran"}
    servers = {r["port"] for r in records if r["what"] == "TensorFlow gRPC server"}
    assert opened and os.listdir(evidence) and opened <= servers, records


def test_a_worker_outside_tfdist_launch_announces_its_open_server_once(caplog, monkeypatch):
    from tfdist import cluster
    monkeypatch.setattr(cluster, "_servers_announced", [])
    monkeypatch.delenv(cluster.NETWORK_ENV, raising=False)
    with caplog.at_level("WARNING", logger="tfdist"):
        cluster.announce_grpc_server("10.1.2.3:2222", "multi_worker_mirrored")
        cluster.announce_grpc_server("10.1.2.3:2222", "multi_worker_mirrored")
    assert caplog.text.count("every interface") == 1
    assert "port 2222" in caplog.text and "10.1.2.3:2222" in caplog.text
    caplog.clear()
    monkeypatch.setattr(cluster, "_servers_announced", [])
    monkeypatch.setenv(cluster.NETWORK_ENV, "private")   # tfdist launch's workers
    with caplog.at_level("WARNING", logger="tfdist"):
        cluster.announce_grpc_server("127.0.0.1:2222", "dtensor")
    assert caplog.text == ""
