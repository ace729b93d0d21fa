"""`--collective=tcp`: tfdist's own ring all-reduce over plain TCP sockets (CPU workers).

Why: TensorFlow's CPU collectives move tensors through gRPC, measured here at
0.3-0.6 GB/s bus bandwidth on loopback, so two CPU workers trained slower than
one; PyTorch's gloo, over raw TCP, is several times faster. This is the
gloo-style path for TF: each step's gradients and loss, flattened into one
float32 buffer, are summed by a ring reduce-scatter then all-gather
(Patarasuk & Yuan 2009, as in gloo and NCCL), over sockets opened once.

Exact by construction: each chunk's sum is computed once, by one worker, and
then copied to the others, so every worker applies bitwise the same gradients
(replicas never drift apart); with two workers a + b == b + a bit for bit.

No wait is unbounded: every socket has the collective timeout, and a peer that
dies closes its sockets, which ends the step at once with a TcpRingError.
"""

import socket
import threading
import time
from typing import List, Sequence

import numpy as np

SOCKET_BUFFER_BYTES = 4 << 20
CONNECT_RETRY_SECONDS = 0.05


class TcpRingError(RuntimeError):
    """A peer closed its connection, or did not answer within the timeout."""


def bind_address(host: str) -> str:
    """Loopback stays loopback (tfdist launch's default); anything else listens everywhere."""
    return "127.0.0.1" if host in ("localhost", "127.0.0.1") else "0.0.0.0"


def listen(host: str) -> socket.socket:
    """A listener on an ephemeral port of this worker (its number is then exchanged)."""
    server = socket.create_server((bind_address(host), 0))
    server.listen(4)
    return server


class BufferLayout:
    """Where each of several float32 arrays sits in one flat buffer: every array
    starts on a 64-byte boundary, because TensorFlow takes a numpy_function's
    64-byte-aligned outputs without copying them (a misaligned one costs a copy;
    tests/test_upstream_canaries.py watches this). The gaps are zeros."""

    ALIGN = 16   # float32 elements in 64 bytes (EIGEN_MAX_ALIGN_BYTES)
    _cache = {}

    def __init__(self, shapes):
        self.shapes = [tuple(shape) for shape in shapes]
        self.sizes = [int(np.prod(shape)) for shape in self.shapes]
        self.starts, end = [], 0
        for size in self.sizes:
            self.starts.append(end)
            end += -(-size // self.ALIGN) * self.ALIGN
        self.length = end

    @classmethod
    def of(cls, arrays) -> "BufferLayout":
        shapes = tuple(np.shape(a) for a in arrays)
        if shapes not in cls._cache:
            cls._cache[shapes] = cls(shapes)
        return cls._cache[shapes]

    def empty(self) -> np.ndarray:
        """A fresh, 64-byte-aligned buffer whose gaps are zero."""
        raw = np.empty(self.length + self.ALIGN, np.float32)
        skip = (-raw.ctypes.data % 64) // 4
        buffer = raw[skip:skip + self.length]
        for start, size in zip(self.starts, self.sizes):
            buffer[start + size:start + -(-size // self.ALIGN) * self.ALIGN] = 0.0
        return buffer

    def pack(self, arrays, buffer: np.ndarray) -> None:
        for start, size, array in zip(self.starts, self.sizes, arrays):
            buffer[start:start + size] = np.reshape(array, -1)

    def unpack(self, buffer: np.ndarray) -> List[np.ndarray]:
        return [buffer[start:start + size].reshape(shape)
                for start, size, shape in zip(self.starts, self.sizes, self.shapes)]


class TcpRing:
    """A ring over `size` workers; `reduce_in_place(buffer)` sums a float32 buffer over it
    (`all_reduce` and `all_reduce_arrays` wrap it for a copy, and for several arrays)."""

    def __init__(self, rank: int, size: int, to_next: socket.socket, from_prev: socket.socket,
                 timeout: float):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.to_next, self.from_prev = to_next, from_prev

    @classmethod
    def connect(cls, rank: int, hosts: Sequence[str], ports: Sequence[int],
                server: socket.socket, timeout: float) -> "TcpRing":
        """Connects to the next worker and accepts the previous one (both before `timeout`)."""
        size = len(hosts)
        following = (rank + 1) % size
        to_next = _connect(hosts[following], ports[following], timeout, following)
        server.settimeout(timeout)
        try:
            from_prev, _ = server.accept()
        except socket.timeout:
            raise TcpRingError(f"worker {(rank - 1) % size} did not connect to worker {rank} "
                               f"within {timeout:.0f} s") from None
        finally:
            server.close()
        for sock in (to_next, from_prev):
            _tune(sock, timeout)
        return cls(rank, size, to_next, from_prev, timeout)

    def all_reduce(self, buffer: np.ndarray) -> np.ndarray:
        """Sums `buffer` (1-D float32) over the ring; returns a new array with the sums."""
        out = np.array(buffer, dtype=np.float32, copy=True)
        self.reduce_in_place(out)
        return out

    def all_reduce_arrays(self, *arrays: np.ndarray) -> List[np.ndarray]:
        """Sums several float32 arrays as one buffer; returns arrays of the same shapes.

        One copy in (into a fresh buffer, so nothing TensorFlow still holds is ever
        written) and none out: the results are aligned views of that buffer.
        """
        layout = BufferLayout.of(arrays)
        buffer = layout.empty()
        layout.pack(arrays, buffer)
        self.reduce_in_place(buffer)
        return layout.unpack(buffer)

    def reduce_in_place(self, out: np.ndarray) -> None:
        """Replaces the 1-D float32 array `out` by its sum over the ring."""
        if self.size == 1:
            return
        chunks = np.array_split(out, self.size)
        scratch = np.empty(max(len(c) for c in chunks), np.float32)
        n, r = self.size, self.rank
        for step in range(n - 1):        # reduce-scatter: chunk (r+1) % n ends up summed here
            incoming = chunks[(r - step - 1) % n]
            self._exchange(chunks[(r - step) % n], scratch[:len(incoming)])
            np.add(incoming, scratch[:len(incoming)], out=incoming)
        for step in range(n - 1):        # all-gather: pass the summed chunks around
            self._exchange(chunks[(r + 1 - step) % n], chunks[(r - step) % n])

    def barrier(self) -> None:
        """Returns once every worker has called it: n-1 rounds of passing a byte on, so
        round k tells each worker that its k-th predecessor has arrived."""
        token, received = np.ones(1, np.uint8), np.empty(1, np.uint8)
        for _ in range(self.size - 1):
            self._exchange(token, received)

    def all_gather_bytes(self, data: bytes, slot: int) -> List[bytes]:
        """Every worker's `data` (at most `slot` bytes), in rank order."""
        if len(data) > slot:
            raise ValueError(f"{len(data)} bytes do not fit a {slot}-byte slot")
        slots = np.zeros((self.size, slot + 2), np.uint8)  # 2 length bytes, then the data
        slots[self.rank, :2] = divmod(len(data), 256)
        slots[self.rank, 2:2 + len(data)] = np.frombuffer(data, np.uint8)
        for step in range(self.size - 1):
            self._exchange(slots[(self.rank - step) % self.size],
                           slots[(self.rank - step - 1) % self.size])
        return [bytes(row[2:2 + 256 * int(row[0]) + int(row[1])]) for row in slots]

    def _exchange(self, send: np.ndarray, receive: np.ndarray) -> None:
        """Sends to the next worker while receiving from the previous (no deadlock on
        full socket buffers: the send runs in a thread)."""
        failure: List[BaseException] = []

        def sender():
            try:
                self.to_next.sendall(memoryview(send).cast("B"))
            except OSError as error:
                failure.append(error)

        thread = threading.Thread(target=sender, daemon=True)
        thread.start()
        try:
            _receive_exactly(self.from_prev, memoryview(receive).cast("B"))
        finally:
            thread.join(self.timeout)
        if failure or thread.is_alive():
            raise TcpRingError(f"worker {self.rank} could not send to worker "
                               f"{(self.rank + 1) % self.size}: "
                               f"{failure[0] if failure else 'timed out'}")

    def close(self) -> None:
        for sock in (self.to_next, self.from_prev):
            sock.close()


def _connect(host: str, port: int, timeout: float, peer: int) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, port), timeout=timeout)
        except OSError as error:
            if time.monotonic() > deadline:
                raise TcpRingError(f"could not connect to worker {peer} at {host}:{port} "
                                   f"within {timeout:.0f} s: {error}") from None
            time.sleep(CONNECT_RETRY_SECONDS)


def _tune(sock: socket.socket, timeout: float) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    sock.settimeout(timeout)


def _receive_exactly(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        try:
            count = sock.recv_into(view)
        except socket.timeout:
            raise TcpRingError("a peer sent nothing within the collective timeout") from None
        except OSError as error:
            raise TcpRingError(f"connection to a peer failed: {error}") from None
        if count == 0:
            raise TcpRingError("a peer closed its connection (it stopped or died)")
        view = view[count:]
