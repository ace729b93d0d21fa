"""multi_worker_mirrored failures end fast, with a message naming the problem.

Bad TF_CONFIG and taken ports are caught before TensorFlow starts a server; a
peer that never starts is caught by the rendezvous; a peer that dies mid-run is
caught by TensorFlow's heartbeat and reported as a cluster error (exit 3); under
`tfdist launch` the launcher ends the group at once.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import REPO, run_cli
from tfdist import rendezvous
from tfdist.cluster import parse_tf_config
from tfdist.errors import EXIT_CLUSTER_ERROR, UsageError
from tfdist.parallel import multi_worker

TRAIN = ["--strategy=multi_worker_mirrored", "--model=mlp", "--global_batch_size=32"]


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def tf_config(ports, index):
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


@pytest.mark.parametrize("value,expected", [
    ('{"cluster": {"worker": ["127.0.0.1:1"]', "not valid JSON"),
    ('{"task": {"type": "worker", "index": 0}}', "cluster"),
    ('{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 3}}',
     "valid range is 0..0"),
])
def test_bad_tf_config_is_a_usage_error(value, expected, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", value)
    with pytest.raises(UsageError, match=expected):
        multi_worker.cluster_from_environment()


def test_no_cluster_at_all_explains_how_to_get_one(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    with pytest.raises(UsageError, match="tfdist launch --workers N"):
        multi_worker.cluster_from_environment()


def test_taken_port_is_named():
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        config = parse_tf_config(tf_config([port, free_ports(1)[0]], 0))
        with pytest.raises(UsageError, match=f"port {port} of task worker:0 is already taken"):
            rendezvous.wait_for_peers(config, timeout_seconds=5)
    finally:
        taken.close()


def test_malformed_tf_config_from_the_cli(tmp_path):
    start = time.monotonic()
    result = run_cli([*TRAIN, "--train_steps=5"], env={"TF_CONFIG": "{not json"}, timeout=60)
    assert result.returncode == 2 and "TF_CONFIG" in result.stderr
    assert "Traceback" not in result.stderr and time.monotonic() - start < 60


def test_worker_that_never_starts(tmp_path):
    ports = free_ports(2)
    start = time.monotonic()
    result = run_cli([*TRAIN, "--train_steps=5", "--collective_timeout=5"],
                     env={"TF_CONFIG": tf_config(ports, 0)}, timeout=60)
    assert result.returncode == EXIT_CLUSTER_ERROR, result.stderr[-2000:]
    assert f"nothing answered at 127.0.0.1:{ports[1]}" in result.stderr
    assert "Traceback" not in result.stderr and time.monotonic() - start < 60


def start_worker(ports, index, log_path, collective="auto"):
    env = dict(os.environ, TF_CONFIG=tf_config(ports, index), PYTHONPATH=REPO,
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "experiments.train", *TRAIN, "--train_steps=1000000",
            "--log_every=100", "--collective_timeout=20", f"--collective={collective}"]
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT)


def wait_for_text(path, text, timeout, process=None):
    """Until `text` is in the file at `path`; fails at once, with the log, if `process`
    (the one writing it) ends first, instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in open(path).read():
            return
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{text!r} not in {path}: its process ended with exit "
                                 f"{process.returncode} first:\n{open(path).read()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s:\n{open(path).read()[-2000:]}")


def test_waiting_for_a_log_line_ends_when_its_process_does(tmp_path):
    """A launch that fails at start (Open MPI once ended mpirun with 'The PMIx server's
    listener thread failed to start', exit 213) fails the test at once, not after 180 s."""
    log_path = tmp_path / "log"
    process = subprocess.Popen([sys.executable, "-c", "print('no steps here'); raise SystemExit(5)"],
                               stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    started = time.monotonic()
    with pytest.raises(AssertionError, match="ended with exit 5 first:\n.*no steps here"):
        wait_for_text(log_path, "step 100/", timeout=180, process=process)
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("collective", ["auto", "tcp", "shm"])
def test_peer_killed_mid_run_ends_the_survivor_with_a_cluster_error(collective, tmp_path):
    ports = free_ports(2)
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    workers = [start_worker(ports, i, logs[i], collective) for i in range(2)]
    try:
        wait_for_text(logs[0], "step 100/", timeout=90)
        workers[1].kill()
        killed = time.monotonic()
        assert workers[0].wait(timeout=60) == EXIT_CLUSTER_ERROR
        assert time.monotonic() - killed < 20 + 5  # within --collective_timeout
        assert "a peer died or stopped answering" in logs[0].read_text()
    finally:
        for worker in workers:
            worker.kill()


SILENT_TCP_DEFECT = pytest.mark.xfail(
    strict=False, reason="known defect, cause not found: under --collective=tcp a SIGSTOPped "
    "peer ended the survivor at 40 s (two timeouts) instead of 20 s in 1 of 4 runs on a 2-core "
    "AVX2 EPYC; 0 of 26 hand runs were late on the AVX512 EPYC (2026-12-04)")


WATCHED_STEP = """
import sys, time
from tfdist.parallel import watchdog
step = watchdog.Watchdog(0.5, "worker 0 of 2").guard_each_call(time.sleep, "a training step")
step(1.5)              # the first call traces on every worker: it gets FIRST_CALL_SECONDS
print("first call survived", flush=True)
step(1.5)              # any later call gets --collective_timeout
print("second call survived", flush=True)
"""


def test_a_steps_first_call_may_trace_longer_than_the_collective_timeout():
    """A CI run's 2-worker job (--collective_timeout=10, loaded machine) was ended in its
    first step, which traces the step on every worker, with no peer lost. The first call of
    each guarded step now gets at least watchdog.FIRST_CALL_SECONDS; later calls keep the
    timeout, and its message names it."""
    done = subprocess.run([sys.executable, "-c", WATCHED_STEP], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode == EXIT_CLUSTER_ERROR, done.stdout + done.stderr
    assert done.stdout == "first call survived\n", done.stdout
    assert done.stderr == ("tfdist: cluster error: worker 0 of 2: a training step made no progress "
                           "for --collective_timeout=0.5 s: a peer died or stopped answering. Check "
                           "the other workers' logs; `tfdist launch --max_restarts R` restarts the "
                           "group.\n"), done.stderr


@pytest.mark.parametrize("collective", ["auto", pytest.param("tcp", marks=SILENT_TCP_DEFECT)])
def test_silent_peer_ends_the_survivor_within_the_timeout(collective, tmp_path):
    """A peer that stops answering without dying (SIGSTOP: no closed socket, no failed
    heartbeat RPC yet) is caught by the per-process watchdog, which replaced TF's
    per-collective timeout (a thread per collective, tfdist.parallel.watchdog)."""
    ports = free_ports(2)
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    workers = [start_worker(ports, i, logs[i], collective) for i in range(2)]
    try:
        wait_for_text(logs[0], "step 100/", timeout=90)
        workers[1].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert workers[0].wait(timeout=60) == EXIT_CLUSTER_ERROR
        assert time.monotonic() - stopped < 20 + 5  # within --collective_timeout
        log = logs[0].read_text()
        assert "a peer died or stopped answering" in log and "Traceback" not in log, log[-2000:]
    finally:
        for worker in workers:
            worker.kill()


def test_ring_across_hosts_without_a_secret_is_refused_before_any_socket(monkeypatch):
    """build_multi_worker asks for the secret before the rendezvous opens a socket;
    in-process, so no traffic goes to the (documentation-only) other host."""
    monkeypatch.delenv("TFDIST_JOB_SECRET", raising=False)
    config = parse_tf_config({"cluster": {"worker": ["127.0.0.1:2222", "trainer-1.example:2222"]},
                              "task": {"type": "worker", "index": 0}})
    with pytest.raises(UsageError, match=r"TFDIST_JOB_SECRET is not set \(workers on "
                                         r"trainer-1\.example\)"):
        multi_worker.ring_secret(config)


def rank_pids(launcher_pid):
    """pid of each worker the launcher started, by the TFDIST_RANK in its environment."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            status = open(f"/proc/{entry}/status").read()
        except OSError:
            continue
        parent = int(status.split("PPid:")[1].split()[0])
        ranks = [e for e in environ if e.startswith(b"TFDIST_RANK=")]
        if parent == launcher_pid and ranks:
            found[int(ranks[0].split(b"=")[1])] = int(entry)
    return found


def test_launcher_ends_the_group_when_a_worker_is_killed(tmp_path):
    log_path = tmp_path / "launch.log"
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--", sys.executable, "-m",
         "experiments.train", *TRAIN, "--train_steps=1000000", "--log_every=100"],
        cwd=REPO, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    try:
        wait_for_text(log_path, "step 100/", timeout=90)
        pids = rank_pids(launcher.pid)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        assert launcher.wait(timeout=60) != 0
        assert time.monotonic() - killed < 30
        time.sleep(0.5)
        assert not os.path.exists(f"/proc/{pids[0]}") or "zombie" in open(
            f"/proc/{pids[0]}/status").read()
    finally:
        launcher.kill()


def test_shared_memory_that_cannot_be_reserved_is_a_usage_error(tmp_path):
    """Before the first step, on every worker, with the directory named (exit 2)."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
               TFDIST_SHM_DIR=str(tmp_path / "missing"))
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--", sys.executable, "-m",
         "experiments.train", *TRAIN, "--train_steps=5", "--collective=shm",
         "--collective_timeout=20"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert f"of shared memory in {tmp_path}/missing" in output
    assert "Traceback" not in output and time.monotonic() - start < 60


def test_sigterm_to_one_worker_stops_every_worker_at_the_same_step(tmp_path):
    """The preemption flag is agreed at every step; with --collective=shm (and tcp)
    it travels over tfdist's ring, not TF's gRPC collectives."""
    from tfdist.errors import EXIT_PREEMPTED
    log_path = tmp_path / "launch.log"
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--", sys.executable, "-m",
         "experiments.train", *TRAIN, "--train_steps=1000000", "--log_every=10",
         "--collective=shm", "--collective_timeout=20", f"--model_dir={tmp_path / 'run'}"],
        cwd=REPO, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    try:
        wait_for_text(log_path, "step 20/", timeout=90)
        os.kill(rank_pids(launcher.pid)[1], signal.SIGTERM)   # worker 1 only
        assert launcher.wait(timeout=60) == EXIT_PREEMPTED, log_path.read_text()[-3000:]
    finally:
        launcher.kill()
    saved = [line.split("saved a checkpoint at step ")[1].split()[0]
             for line in log_path.read_text().splitlines() if "saved a checkpoint at step" in line]
    assert len(saved) == 2 and saved[0] == saved[1], saved   # both workers, one step


def ring_closed():
    from tfdist.parallel.tcp_ring import TcpRingError
    return TcpRingError("worker 1 (127.0.0.1:48666) closed its connection (it stopped or died)")


def heartbeat_lost():
    import tensorflow as tf
    return tf.errors.UnavailableError(None, None, "Task /job:worker/replica:0/task:1 heartbeat "
                                                  "timed out")


@pytest.mark.parametrize("make_error", [ring_closed, heartbeat_lost])
def test_a_peer_lost_in_a_host_side_agreement_is_a_cluster_error(make_error):
    """The metrics' sums at an epoch's end and the preemption check run tfdist's ring in
    plain Python, outside a step, so a peer that dies there raises the ring's own error,
    not a TensorFlow one: the suite saw a survivor end with exit 1 and a traceback
    (test_peer_killed_mid_run_ends_the_survivor_with_a_cluster_error[shm], the kill landing
    at an epoch's end). Both kinds must come out as the ClusterError (exit 3); a full
    /dev/shm stays what it is."""
    import types
    from tfdist.errors import ClusterError
    from tfdist.parallel import multi_worker, shm_ring
    worker = types.SimpleNamespace(tf_config=types.SimpleNamespace(rank=0, num_workers=2))
    worker._peer_failure = types.MethodType(multi_worker.MultiWorkerParallelism._peer_failure,
                                            worker)
    translate = multi_worker.MultiWorkerParallelism.translate_failures
    with pytest.raises(ClusterError, match=r"worker 0 of 2: a peer died or stopped answering"):
        with translate(worker):
            raise make_error()
    with pytest.raises(shm_ring.SharedMemoryUnavailable):
        with translate(worker):
            raise shm_ring.SharedMemoryUnavailable("/dev/shm is full")
