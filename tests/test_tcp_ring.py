"""tfdist's TCP ring all-reduce (--collective=tcp) and its shared-memory sibling
(--collective=shm), on real loopback sockets and real /dev/shm mappings.

Ranks run as threads of this process (the sockets are real); the multi-process
equivalence run is in tests/test_multi_worker.py.
"""

import os
import socket
import threading
import time

import numpy as np
import pytest

from tfdist.errors import UsageError
from tfdist.parallel import ring_auth, shm_ring, tcp_ring

AUTH = ring_auth.RingAuth(secret=bytes(range(32)), job=ring_auth.job_id(["test"]))


def connect_rings(size, timeout=10.0):
    servers = [tcp_ring.listen("127.0.0.1") for _ in range(size)]
    ports = [s.getsockname()[1] for s in servers]
    rings = [None] * size

    def join(rank):
        rings[rank] = tcp_ring.TcpRing.connect(rank, ["127.0.0.1"] * size, ports,
                                               servers[rank], timeout, AUTH)

    run_all(join, size)
    return rings


def run_all(fn, size):
    errors = []

    def guarded(rank):
        try:
            fn(rank)
        except BaseException as error:  # reported below, with the rank
            errors.append((rank, error))

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


@pytest.mark.parametrize("size,length", [(2, 1_000_003), (3, 10), (4, 7), (3, 2), (2, 1)])
def test_ring_sums_and_every_rank_gets_the_same_bits(size, length):
    rings = connect_rings(size)
    rng = np.random.default_rng(size)
    inputs = [rng.standard_normal(length).astype(np.float32) for _ in range(size)]
    outputs = [None] * size

    def reduce(rank):
        outputs[rank] = rings[rank].all_reduce(inputs[rank])

    run_all(reduce, size)
    np.testing.assert_allclose(outputs[0], np.sum(inputs, axis=0), rtol=1e-6, atol=1e-6)
    for out in outputs[1:]:
        assert out.tobytes() == outputs[0].tobytes()  # replicas cannot drift apart
    if size == 2:  # a + b == b + a exactly: the sum is the float32 sum
        assert outputs[0].tobytes() == (inputs[0] + inputs[1]).tobytes()
    for ring in rings:
        ring.close()


def test_a_peer_that_dies_ends_the_reduce_at_once():
    rings = connect_rings(2)
    rings[1].close()  # what the OS does when worker 1's process dies
    start = time.monotonic()
    with pytest.raises(tcp_ring.TcpRingError, match="closed its connection|failed"):
        rings[0].all_reduce(np.ones(1000, np.float32))
    assert time.monotonic() - start < 5
    rings[0].close()


def test_a_silent_peer_times_out():
    rings = connect_rings(2, timeout=1.0)
    start = time.monotonic()
    with pytest.raises(tcp_ring.TcpRingError, match="within the collective timeout"):
        rings[0].all_reduce(np.ones(10, np.float32))  # worker 1 never takes part
    assert time.monotonic() - start < 5
    for ring in rings:
        ring.close()


def test_a_worker_that_never_connects_is_named():
    server = tcp_ring.listen("127.0.0.1")
    with socket.socket() as unused:  # a port nobody listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(tcp_ring.TcpRingError, match="could not connect to worker 1"):
        tcp_ring.TcpRing.connect(0, ["127.0.0.1"] * 2, [server.getsockname()[1], port],
                                 server, timeout=0.5, auth=AUTH)


def test_tcp_with_two_devices_per_worker_is_refused():
    from tfdist.config import RunConfig
    from tfdist.parallel import multi_worker
    config = RunConfig(strategy="multi_worker_mirrored", collective="tcp")
    with pytest.raises(UsageError, match="one CPU device per worker"):
        multi_worker.check_tcp_ring_config(config, ["/device:CPU:0", "/device:CPU:1"])
    with pytest.raises(UsageError, match="--trainer=fit"):
        multi_worker.check_tcp_ring_config(RunConfig(strategy="multi_worker_mirrored",
                                                     collective="tcp", trainer="fit"),
                                           ["/device:CPU:0"])


def test_arrays_are_summed_as_one_buffer_and_keep_their_shapes():
    rings = connect_rings(2)
    shapes = [(3, 4), (5,), ()]
    inputs = [[np.full(shape, rank + i, np.float32) for i, shape in enumerate(shapes)]
              for rank in range(2)]
    outputs = [None, None]

    def reduce(rank):
        outputs[rank] = rings[rank].all_reduce_arrays(*inputs[rank])

    run_all(reduce, 2)
    for rank in range(2):
        assert [o.shape for o in outputs[rank]] == shapes
        for i, out in enumerate(outputs[rank]):
            assert np.all(out == inputs[0][i] + inputs[1][i])
        assert inputs[rank][0][0, 0] == rank  # the inputs are not written to
    for ring in rings:
        ring.close()


def test_buffer_layout_aligns_every_array_and_zeroes_the_gaps():
    arrays = [np.full((3, 5), 1.0, np.float32), np.full(7, 2.0, np.float32), np.float32(3.0)]
    layout = tcp_ring.BufferLayout.of(arrays)
    assert layout.starts == [0, 16, 32] and layout.length == 48
    buffer = layout.empty()
    layout.pack(arrays, buffer)
    assert buffer.ctypes.data % 64 == 0
    assert np.count_nonzero(buffer) == 15 + 7 + 1  # the gaps are zero, so sums stay finite
    views = layout.unpack(buffer)
    assert all(v.ctypes.data % 64 == 0 for v in views)
    assert [v.shape for v in views] == [(3, 5), (7,), ()]
    assert all(np.array_equal(v, a) for v, a in zip(views, arrays))


def test_barrier_and_all_gather_of_bytes():
    rings = connect_rings(3)
    gathered, arrived = [None] * 3, []

    def gather(rank):
        time.sleep(0.1 * rank)      # a late worker holds the others at the barrier
        arrived.append(rank)
        rings[rank].barrier()
        assert len(arrived) == 3
        gathered[rank] = rings[rank].all_gather_bytes(f"worker-{rank}".encode() * rank, 32)

    run_all(gather, 3)
    assert gathered == [[b"", b"worker-1", b"worker-2worker-2"]] * 3
    for ring in rings:
        ring.close()


def shared_memory_files():
    directory = shm_ring.shared_memory_dir()
    return {name for name in os.listdir(directory) if name.startswith("tfdist-shm-")}


@pytest.mark.parametrize("size", [1, 2, 3])
def test_shared_memory_sums_in_worker_order_with_the_same_bits_everywhere(size):
    before = shared_memory_files()
    rings = connect_rings(size)
    reducers = [shm_ring.SharedMemoryAllReduce(ring) for ring in rings]
    rng = np.random.default_rng(size)
    for _ in range(3):   # the regions are reused step after step
        inputs = [[rng.standard_normal((33, 17)).astype(np.float32),
                   rng.standard_normal(5).astype(np.float32), np.float32(rank)]
                  for rank in range(size)]
        outputs = [None] * size

        def reduce(rank):
            outputs[rank] = reducers[rank].all_reduce_arrays(*inputs[rank])

        run_all(reduce, size)
        for i in range(3):
            expected = inputs[0][i]
            for rank in range(1, size):
                expected = expected + inputs[rank][i]     # worker order, as documented
            for rank in range(size):
                assert outputs[rank][i].tobytes() == np.asarray(expected).tobytes()
                assert outputs[rank][i].ctypes.data % 64 == 0
    assert shared_memory_files() == before  # unlinked once mapped: nothing to leak
    for reducer, ring in zip(reducers, rings):
        reducer.close()
        ring.close()


def test_shared_memory_with_a_dead_peer_fails_fast():
    rings = connect_rings(2, timeout=5.0)
    reducers = [shm_ring.SharedMemoryAllReduce(ring) for ring in rings]
    run_all(lambda rank: reducers[rank].all_reduce_arrays(np.ones(10, np.float32)), 2)
    rings[1].close()  # what the OS does when worker 1's process dies
    start = time.monotonic()
    with pytest.raises(tcp_ring.TcpRingError, match="closed its connection|failed"):
        reducers[0].all_reduce_arrays(np.ones(10, np.float32))
    assert time.monotonic() - start < 2
    # Another buffer (another model) would need new regions, which need the peer: the
    # broken ring says so at once.
    with pytest.raises(tcp_ring.TcpRingError, match="ring broke earlier"):
        reducers[0].all_reduce_arrays(np.ones(17, np.float32))  # 32 floats once aligned
    for reducer in reducers:
        reducer.close()
    rings[0].close()


def test_shared_memory_takes_another_models_buffer():
    """A second model in the same processes sums a buffer of another length: every
    worker maps new regions (each traces the new step at the same point)."""
    rings = connect_rings(2, timeout=5.0)
    reducers = [shm_ring.SharedMemoryAllReduce(ring) for ring in rings]
    for length in (10, 40, 10):
        outputs = [None, None]

        def reduce(rank):
            outputs[rank] = reducers[rank].all_reduce_arrays(
                np.full(length, rank + 1, np.float32))[0].copy()

        run_all(reduce, 2)
        assert all(np.array_equal(out, np.full(length, 3, np.float32)) for out in outputs)
    for reducer, ring in zip(reducers, rings):
        reducer.close()
        ring.close()


def test_shm_with_workers_on_other_hosts_is_refused():
    from tfdist import cluster
    from tfdist.parallel import multi_worker
    tf_config = cluster.parse_tf_config(
        '{"cluster": {"worker": ["10.1.2.3:2222", "10.1.2.4:2222"]}, '
        '"task": {"type": "worker", "index": 0}}')
    with pytest.raises(UsageError, match="every worker on this host.*10.1.2.3, 10.1.2.4"):
        multi_worker.check_one_host(tf_config)
    local = cluster.parse_tf_config(
        '{"cluster": {"worker": ["localhost:2222", "127.0.0.1:2223"]}, '
        '"task": {"type": "worker", "index": 1}}')
    multi_worker.check_one_host(local)


def test_shared_memory_that_cannot_be_reserved_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("TFDIST_SHM_DIR", str(tmp_path / "missing"))
    rings = connect_rings(2)
    errors = [None, None]

    def prepare(rank):
        try:
            shm_ring.SharedMemoryAllReduce(rings[rank]).prepare([(1000,), ()])
        except shm_ring.SharedMemoryUnavailable as error:
            errors[rank] = str(error)

    run_all(prepare, 2)
    for rank, error in enumerate(errors):
        size = "8.00 KiB" if rank == 0 else "4.00 KiB"   # worker 0 also holds the results
        assert f"worker {rank} cannot reserve {size} of shared memory in {tmp_path}/missing" \
            in error and "--collective=tcp" in error
    for ring in rings:
        ring.close()


def exchange(reducers, inputs_of_rank):
    outputs = [None] * len(reducers)

    def reduce(rank):
        outputs[rank] = [np.array(o, copy=True)
                         for o in reducers[rank].all_reduce_arrays(*inputs_of_rank(rank))]

    run_all(reduce, len(reducers))
    return outputs


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_float64_model_is_summed_in_float64(transport):
    """A float64 gradient beside float32 ones (the loss): the buffer is float64, the
    float32 arrays widen exactly, and the sums are float64's."""
    rings = connect_rings(2, timeout=10.0)
    reducers = (rings if transport == "tcp"
                else [shm_ring.SharedMemoryAllReduce(ring) for ring in rings])
    rng = np.random.default_rng(64)
    grads = [rng.standard_normal((9, 7)) for _ in range(2)]          # float64
    losses = [np.float32(1.0 + 2 ** -20 * rank) for rank in range(2)]
    outputs = exchange(reducers, lambda rank: [grads[rank], losses[rank]])
    for summed_grad, summed_loss in outputs:
        assert summed_grad.dtype == np.float64
        assert summed_grad.tobytes() == (grads[0] + grads[1]).tobytes()
        assert summed_loss == np.float64(losses[0]) + np.float64(losses[1])
    # Then a float32 model in the same processes: float32 sums again (shm: new regions).
    outputs = exchange(reducers, lambda rank: [grads[rank].astype(np.float32)])
    assert all(out.dtype == np.float32 for out, in outputs)
    assert outputs[0][0].tobytes() == (grads[0].astype(np.float32)
                                       + grads[1].astype(np.float32)).tobytes()
    if transport == "shm":
        for reducer in reducers:
            reducer.close()
    for ring in rings:
        ring.close()


def test_workers_that_sum_other_dtypes_fail_at_their_first_exchange():
    rings = connect_rings(2, timeout=5.0)
    errors = []

    def reduce(rank):
        dtype = np.float64 if rank else np.float32
        try:
            rings[rank].all_reduce_arrays(np.ones(10, dtype))
        except tcp_ring.TcpRingError as error:
            errors.append(str(error))

    run_all(reduce, 2)
    assert len(errors) == 2
    for ring in rings:
        ring.close()


def test_buffer_layout_aligns_float64_arrays_too():
    arrays = [np.full(9, 1.0), np.float32(3.0)]
    layout = tcp_ring.BufferLayout.of(arrays)
    assert layout.dtype == np.float64 and layout.starts == [0, 16] and layout.length == 24
    buffer = layout.empty()
    assert buffer.dtype == np.float64 and buffer.ctypes.data % 64 == 0
    layout.pack(arrays, buffer)
    assert np.count_nonzero(buffer) == 10
    assert layout.digest != tcp_ring.BufferLayout([(9,), ()]).digest
