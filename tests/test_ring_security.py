"""The tcp/shm ring against strangers and broken peers, over real loopback sockets.

Ranks run as threads of this process (no TensorFlow). What every test checks:
no sum ever changes. The honest workers either get the exact sum (a stranger
was refused and ignored) or a TcpRingError naming the offender's address,
within the collective timeout; never a hang, never a different number.
"""

import logging
import os
import socket
import stat
import threading
import time

import numpy as np
import pytest

from tfdist import rendezvous
from tfdist.errors import UsageError
from tfdist.parallel import ring_auth, shm_ring, tcp_ring
from tfdist.parallel.ring_auth import RingAuth

AUTH = RingAuth(secret=bytes(range(32)), job=ring_auth.job_id(["127.0.0.1:1", "127.0.0.1:2"]))
LOOPBACK = "127.0.0.1"


def listeners(size):
    servers = [tcp_ring.listen(LOOPBACK) for _ in range(size)]
    return servers, [s.getsockname()[1] for s in servers]


def run_ranks(fn, size):
    """fn(rank) in one thread per rank; {rank: result or the exception it raised}."""
    results = {}

    def guarded(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as error:   # the test looks at it
            results[rank] = error

    threads = [threading.Thread(target=guarded, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def connect_rings(size, timeout=10.0, auths=None, servers=None, ports=None):
    if servers is None:
        servers, ports = listeners(size)
    auths = auths or [AUTH] * size
    return run_ranks(lambda r: tcp_ring.TcpRing.connect(r, [LOOPBACK] * size, ports, servers[r],
                                                        timeout, auths[r]), size)


def close_all(results):
    for value in results.values():
        if isinstance(value, tcp_ring.TcpRing):
            value.close()


# ------------------------------------------------------------------ strangers at the door

def stranger_talks(sock, kind):
    """What a stranger says after connecting; returns once the acceptor hangs up."""
    try:
        if kind == "random bytes":
            sock.sendall(os.urandom(ring_auth.HELLO.size))
        elif kind != "silent":
            auth, world, rank = {
                "wrong secret": (RingAuth(b"\x07" * 32, AUTH.job), 2, 1),
                "wrong rank": (AUTH, 2, 0),
                "wrong world": (AUTH, 3, 1),
                "wrong job": (RingAuth(AUTH.secret, ring_auth.job_id(["other:1"])), 2, 1),
            }[kind]
            mine = ring_auth.hello(ring_auth.CONNECTOR, world, rank, auth)
            sock.sendall(mine)
            reply = sock.recv(ring_auth.HELLO.size + ring_auth.PROOF_BYTES, socket.MSG_WAITALL)
            if reply:   # its proof, with whatever secret it has
                sock.sendall(ring_auth.proof(auth, ring_auth.CONNECTOR, mine,
                                             reply[:ring_auth.HELLO.size]))
        sock.recv(1)   # b"" once refused
    except OSError:
        pass


def start_stranger(port, kind):
    """Connects now (so it is first in the accept queue), then talks in a thread."""
    sock = socket.create_connection((LOOPBACK, port), timeout=10)
    thread = threading.Thread(target=stranger_talks, args=(sock, kind), daemon=True)
    thread.start()
    return sock, f"{LOOPBACK}:{sock.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["wrong secret", "wrong rank", "wrong world", "wrong job",
                                  "random bytes", "silent"])
def test_a_stranger_is_refused_logged_and_ignored_and_the_sum_stays_exact(
        kind, caplog, monkeypatch):
    monkeypatch.setattr(tcp_ring, "HANDSHAKE_SECONDS", 0.5)   # the silent one holds it this long
    servers, ports = listeners(2)
    sock, address = start_stranger(ports[0], kind)   # before worker 1 connects to worker 0
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        rings = connect_rings(2, servers=servers, ports=ports)
    assert all(isinstance(r, tcp_ring.TcpRing) for r in rings.values()), rings
    inputs = [np.random.default_rng(r).standard_normal(1001).astype(np.float32) for r in (0, 1)]
    sums = run_ranks(lambda r: rings[r].all_reduce(inputs[r]), 2)
    exact = (inputs[0] + inputs[1]).tobytes()
    assert sums[0].tobytes() == exact and sums[1].tobytes() == exact
    assert f"worker 0 refused a connection from {address}" in caplog.text
    assert sock.recv(1) == b""   # the stranger was hung up on
    sock.close()
    close_all(rings)


def test_a_door_that_only_strangers_knock_on_ends_naming_them():
    server = tcp_ring.listen(LOOPBACK)
    acceptor = tcp_ring._Acceptor(server, AUTH, 0, 2, time.monotonic() + 1.5)
    acceptor.start()
    sock, address = start_stranger(server.getsockname()[1], "wrong secret")
    start = time.monotonic()
    with pytest.raises(tcp_ring.TcpRingError,
                       match=f"worker 1 did not connect and authenticate.*{address} "
                             r"\(a wrong proof"):
        acceptor.result()
    assert time.monotonic() - start < 4
    acceptor.stop()
    server.close()
    sock.close()


def test_workers_with_different_secrets_never_pair_and_name_each_other():
    auths = [AUTH, RingAuth(b"\x42" * 32, AUTH.job)]
    servers, ports = listeners(2)
    start = time.monotonic()
    results = connect_rings(2, timeout=2.0, auths=auths, servers=servers, ports=ports)
    assert time.monotonic() - start < 6
    for rank in (0, 1):
        error = results[rank]
        assert isinstance(error, tcp_ring.TcpRingError), results
        peer = 1 - rank
        assert f"worker {peer} ({LOOPBACK}:{ports[peer]})" in str(error) \
            or f"worker {peer} did not connect and authenticate" in str(error)
    assert "could not prove it holds this job's secret" in " ".join(map(str, results.values()))


# ------------------------------------------------------------------ broken frames

def frame(length, sequence=0, part=1, magic=tcp_ring.FRAME_MAGIC, elements=10):
    """A reduce-scatter frame header as worker 1 of 2 would send it for a 10-float buffer."""
    return tcp_ring.FRAME.pack(magic, sequence, tcp_ring.flat_digest(elements),
                               tcp_ring.REDUCE_SCATTER, part, length)


CHUNK = 20   # bytes: half of 10 float32
BAD_STREAMS = {
    "short frame": (frame(12) + b"\0" * 12, "12 bytes, expected 20 \\(short\\)"),
    "oversized frame": (frame(4096) + b"\0" * 4096, "4096 bytes, expected 20 \\(oversized\\)"),
    "random bytes": (None, "not a tfdist ring frame"),
    "wrong sequence": (frame(CHUNK, sequence=7) + b"\0" * CHUNK, "exchange #7 .* expects #0"),
    "wrong part": (frame(CHUNK, part=0) + b"\0" * CHUNK, "part 0, expected .* part 1"),
    "payload cut, then closed": (frame(CHUNK) + b"\0" * 8, "closed its connection"),
    "payload cut, then silence": (frame(CHUNK) + b"\0" * 8, "within the collective timeout"),
    "extra bytes after a frame": (frame(CHUNK) + b"\0" * CHUNK + os.urandom(64),
                                  "not a tfdist ring frame"),
}


@pytest.mark.parametrize("case", sorted(BAD_STREAMS))
def test_a_bad_frame_from_an_authenticated_peer_is_an_error_naming_it_never_a_sum(case):
    rings = connect_rings(2, timeout=1.5)
    stream, message = BAD_STREAMS[case]
    # Worker 1 writes raw bytes on its authenticated link instead of running the ring.
    rings[1].to_next.sendall(stream if stream is not None else os.urandom(256))
    if case == "payload cut, then closed":
        rings[1].close()
    mine = np.arange(10, dtype=np.float32)
    start = time.monotonic()
    with pytest.raises(tcp_ring.TcpRingError, match=message) as raised:
        rings[0].all_reduce(mine)
    assert time.monotonic() - start < 1.5 + 2   # within the timeout (and a loaded machine's slack)
    if case != "payload cut, then closed":
        assert f"worker 1 ({LOOPBACK}:" in str(raised.value)
    assert np.array_equal(mine, np.arange(10, dtype=np.float32))   # nothing was summed into it
    with pytest.raises(tcp_ring.TcpRingError, match="broke earlier"):
        rings[0].all_reduce(mine)   # a stream out of step is never trusted again
    close_all(rings)


def test_a_peer_trickling_bytes_cannot_stretch_the_deadline():
    rings = connect_rings(2, timeout=1.0)
    stop = threading.Event()

    def trickle():   # a valid header, then one byte every 0.3 s: 6 s for the payload
        rings[1].to_next.sendall(frame(CHUNK))
        for _ in range(CHUNK):
            if stop.wait(0.3):
                return
            rings[1].to_next.sendall(b"\0")

    threading.Thread(target=trickle, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(tcp_ring.TcpRingError, match=f"worker 1 \\({LOOPBACK}:.*timeout"):
        rings[0].all_reduce(np.ones(10, np.float32))
    assert time.monotonic() - start < 3   # the 1 s deadline, not the 6 s trickle
    stop.set()
    close_all(rings)


@pytest.mark.parametrize("collective", ["tcp", "shm"])
def test_workers_with_different_layouts_fail_at_the_first_exchange(collective):
    rings = connect_rings(2, timeout=3.0)
    reducers = ([shm_ring.SharedMemoryAllReduce(rings[r]) for r in (0, 1)]
                if collective == "shm" else [rings[0], rings[1]])
    shapes = [[(4, 4), ()], [(16,), ()]]   # the same 32 floats, laid out differently
    results = run_ranks(lambda r: reducers[r].all_reduce_arrays(
        *[np.ones(s, np.float32) for s in shapes[r]]), 2)
    for rank in (0, 1):
        assert isinstance(results[rank], tcp_ring.TcpRingError), results
        assert "different buffer layout" in str(results[rank])
        assert f"worker {1 - rank} ({LOOPBACK}:" in str(results[rank])
    if collective == "shm":
        for reducer in reducers:
            reducer.close()
    close_all(rings)


# ------------------------------------------------------------------ addresses

def test_listeners_bind_the_workers_own_address_not_every_interface():
    ring_listener = tcp_ring.listen("localhost")
    assert ring_listener.getsockname()[0] == LOOPBACK
    ring_listener.close()
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port = probe.getsockname()[1]
    rendezvous_listener = rendezvous.listen_on(f"{LOOPBACK}:{port}", "worker:0")
    assert rendezvous_listener.getsockname()[:2] == (LOOPBACK, port)
    rendezvous_listener.close()


def test_a_tf_config_address_that_is_not_this_machine_is_a_usage_error():
    with pytest.raises(UsageError, match="'192.0.2.1:2222' is not this machine's"):
        rendezvous.listen_on("192.0.2.1:2222", "worker:1")   # TEST-NET-1: bind only, no traffic


# ------------------------------------------------------------------ the secret

def test_across_hosts_the_ring_refuses_to_start_without_a_secret():
    with pytest.raises(UsageError) as raised:
        ring_auth.job_secret(["127.0.0.1", "10.1.2.3"], env={})
    message = str(raised.value)
    assert "$TFDIST_JOB_SECRET is not set (workers on 10.1.2.3)" in message
    assert "export TFDIST_JOB_SECRET=$(python -c 'import secrets; " \
           "print(secrets.token_hex(32))')" in message
    assert "Kubernetes Secret" in message and "sbatch" in message
    secret = "ab" * 32
    assert ring_auth.job_secret(["10.1.2.3"], env={"TFDIST_JOB_SECRET": secret}) \
        == bytes.fromhex(secret)


@pytest.mark.parametrize("value,problem", [("", "has 0 hex digits"),
                                           ("ab" * 15, "has 30 hex digits"),
                                           ("a" * 33, "has 33 hex digits"),
                                           ("ab" * 20 + "zz", "non-hex character at position 40")])
def test_a_malformed_secret_is_named_without_showing_it(value, problem):
    with pytest.raises(UsageError, match=f"at least 32 hex digits.*{problem}") as raised:
        ring_auth.job_secret(["localhost"], env={"TFDIST_JOB_SECRET": value})
    assert not value or value not in str(raised.value)


def test_on_one_host_workers_share_a_private_per_user_secret(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    secrets_seen = run_ranks(lambda r: ring_auth.job_secret(["localhost", "127.0.0.1"], env), 4)
    assert len(set(secrets_seen.values())) == 1                   # the racing workers agree
    assert len(secrets_seen[0]) == 32
    path = tmp_path / "tfdist" / "job-secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(os.listdir(tmp_path / "tfdist")) == ["job-secret"]   # no temporaries left
    path.chmod(0o644)
    with pytest.raises(UsageError, match="must be a regular file .* mode 0600.*-rw-r--r--"):
        ring_auth.job_secret(["localhost"], env)


# ------------------------------------------------------------------ shared memory paths

def test_shm_maps_only_its_own_region_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDIST_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    outside = tmp_path / "tfdist-shm-1-abcdefgh"
    outside.write_bytes(b"\0" * 64)
    cases = {
        str(outside): "not a tfdist-shm-1-\\* file in",
        str(tmp_path / "shm" / "notes.txt"): "not a tfdist-shm-1-\\* file in",
        str(tmp_path / "shm" / "tfdist-shm-0-abcdefgh"): "not a tfdist-shm-1-\\* file in",
        str(tmp_path / "shm" / ".." / "tfdist-shm-1-abcdefgh"): "not a tfdist-shm-1-\\* file",
    }
    link = tmp_path / "shm" / "tfdist-shm-1-linklink"
    link.symlink_to(outside)
    cases[str(link)] = "symbolic link"
    wrong_size = tmp_path / "shm" / "tfdist-shm-1-smallfil"
    wrong_size.write_bytes(b"\0" * 8)
    cases[str(wrong_size)] = "with 64 bytes .* 8 bytes"
    for path, message in cases.items():
        with pytest.raises(tcp_ring.TcpRingError, match=f"worker 1 \\(10.0.0.9:1\\).*{message}"):
            shm_ring.map_region(path, 1, 64, "worker 1 (10.0.0.9:1)")
    right = tmp_path / "shm" / "tfdist-shm-1-right_ok"
    right.write_bytes(b"\0" * 64)
    shm_ring.map_region(str(right), 1, 64, "worker 1").close()


def test_a_peer_announcing_a_region_outside_the_shm_dir_is_refused(tmp_path):
    rings = connect_rings(2, timeout=3.0)
    reducers = [shm_ring.SharedMemoryAllReduce(rings[r]) for r in (0, 1)]
    planted = tmp_path / "tfdist-shm-1-abcdefgh"   # the right name in the wrong place

    def plant(floats):
        planted.write_bytes(b"\0" * 4 * floats)
        return str(planted)

    reducers[1]._create_region = plant   # worker 1 lies about where its region is

    def reduce(rank):
        try:
            return reducers[rank].all_reduce_arrays(np.ones(16, np.float32))
        finally:
            rings[rank].close()   # a failed worker's sockets close, as when its process exits

    results = run_ranks(reduce, 2)
    assert isinstance(results[0], tcp_ring.TcpRingError)
    assert f"worker 1 ({LOOPBACK}:{rings[1].addresses[1].split(':')[1]})" in str(results[0])
    assert f"region '{planted}', which is not a tfdist-shm-1-* file" in str(results[0])
    assert isinstance(results[1], tcp_ring.TcpRingError)   # and worker 1 is not left waiting
