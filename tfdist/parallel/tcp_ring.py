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

Only this job's workers get in: every connection starts with ring_auth's
mutual HMAC handshake (job, rank, world size, protocol version), and the
listener keeps refusing strangers until the expected peer has proven itself.
Every exchange is a frame whose header (magic, exchange number, a digest of the
buffer layout, part, length) is checked before any payload byte is used, so a
short, long or foreign frame, or two workers summing different models, is a
TcpRingError naming the peer, never a changed sum.

No wait is unbounded: each exchange has one deadline (--collective_timeout) that
a trickling peer cannot extend, and a peer that dies closes its sockets, which
ends the step at once with a TcpRingError.
"""

import functools
import hashlib
import logging
import socket
import struct
import threading
import time
from typing import List, Optional, Sequence

import numpy as np

from tfdist import cluster, rendezvous
from tfdist.parallel import ring_auth
from tfdist.parallel.ring_auth import RingAuth

log = logging.getLogger("tfdist")
SOCKET_BUFFER_BYTES = 4 << 20
CONNECT_RETRY_SECONDS = 0.05
HANDSHAKE_SECONDS = 5.0     # per connection: an honest peer answers in milliseconds, and a
                            # stranger that stalls must not hold the door for the whole timeout
ACCEPT_POLL_SECONDS = 0.2   # how often the acceptor looks up from accept() (to be stopped)
SENDER_GRACE_SECONDS = 0.5  # after a bad frame, how long our own frame may take to go out
FRAME = struct.Struct("<4sQ16sHHQ")   # magic, exchange number, layout digest, kind, part, bytes
FRAME_MAGIC = b"TFDF"
REDUCE_SCATTER, ALL_GATHER, BARRIER, GATHER_BYTES = 1, 2, 3, 4
KIND_NAMES = {REDUCE_SCATTER: "reduce-scatter", ALL_GATHER: "all-gather", BARRIER: "barrier",
              GATHER_BYTES: "byte gather"}


class TcpRingError(RuntimeError):
    """A peer closed its connection, did not answer in time, or broke the protocol."""


def listen(host: str, spans_hosts: bool = False) -> socket.socket:
    """A listener on an ephemeral port of this worker's own address (its TF_CONFIG host;
    the port number is then exchanged). Loopback stays loopback."""
    family, address = rendezvous.bind_host(host, spans_hosts)
    server = socket.create_server((address, 0), family=family)
    server.listen(16)
    return server


class BufferLayout:
    """Where each of several arrays sits in one flat buffer of one dtype: float32, or
    float64 when any array is float64 (a float64 model's sums keep its precision; the
    float32 arrays beside them widen exactly). Every array starts on a 64-byte
    boundary, because TensorFlow takes a numpy_function's 64-byte-aligned outputs
    without copying them (a misaligned one costs a copy; tests/test_upstream_canaries.py
    watches this). The gaps are zeros. `digest` names the dtype and shapes in every
    frame, so workers with different models fail at their first exchange instead of
    summing unrelated numbers."""

    ALIGN_BYTES = 64   # EIGEN_MAX_ALIGN_BYTES
    _cache = {}

    def __init__(self, shapes, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self.align = self.ALIGN_BYTES // self.dtype.itemsize   # elements per boundary
        self.shapes = [tuple(shape) for shape in shapes]
        self.sizes = [int(np.prod(shape)) for shape in self.shapes]
        self.starts, end = [], 0
        for size in self.sizes:
            self.starts.append(end)
            end += self._padded(size)
        self.length = end
        detail = self.shapes if self.dtype == np.float32 else (self.dtype.name, self.shapes)
        self.digest = layout_digest("arrays", detail)

    @classmethod
    def of(cls, arrays) -> "BufferLayout":
        shapes = tuple(np.shape(a) for a in arrays)
        dtype = buffer_dtype(np.asarray(a).dtype for a in arrays)
        if (shapes, dtype) not in cls._cache:
            cls._cache[shapes, dtype] = cls(shapes, dtype)
        return cls._cache[shapes, dtype]

    def _padded(self, size: int) -> int:
        return -(-size // self.align) * self.align

    def empty(self) -> np.ndarray:
        """A fresh, 64-byte-aligned buffer whose gaps are zero."""
        raw = np.empty(self.length + self.align, self.dtype)
        skip = (-raw.ctypes.data % self.ALIGN_BYTES) // self.dtype.itemsize
        buffer = raw[skip:skip + self.length]
        for start, size in zip(self.starts, self.sizes):
            buffer[start + size:start + self._padded(size)] = 0.0
        return buffer

    def pack(self, arrays, buffer: np.ndarray) -> None:
        for start, size, array in zip(self.starts, self.sizes, arrays):
            buffer[start:start + size] = np.reshape(array, -1)

    def unpack(self, buffer: np.ndarray) -> List[np.ndarray]:
        return [buffer[start:start + size].reshape(shape)
                for start, size, shape in zip(self.starts, self.sizes, self.shapes)]


def buffer_dtype(dtypes) -> np.dtype:
    """float64 if any of `dtypes` is, else float32: the one dtype a ring sums in."""
    return np.dtype(np.float64 if any(np.dtype(d) == np.float64 for d in dtypes)
                    else np.float32)


def layout_digest(purpose: str, detail) -> bytes:
    return hashlib.blake2b(f"{purpose}:{detail!r}".encode(), digest_size=16).digest()


@functools.lru_cache(maxsize=256)   # bounded: a run sums a handful of buffer lengths
def flat_digest(length: int, dtype: str = "float32") -> bytes:
    return layout_digest("flat", length if dtype == "float32" else (dtype, length))


class TcpRing:
    """A ring over `size` workers; `reduce_in_place(buffer)` sums a float32 (or float64)
    buffer over it
    (`all_reduce` and `all_reduce_arrays` wrap it for a copy, and for several arrays)."""

    def __init__(self, rank: int, size: int, to_next: socket.socket, from_prev: socket.socket,
                 timeout: float, addresses: Sequence[str] = ()):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.to_next, self.from_prev = to_next, from_prev
        self.addresses = list(addresses)   # every worker's ring address, in rank order
        self.prev_address = _peer_name(from_prev)
        self._sequence = 0                 # exchanges so far: the same count on every worker
        self._broken: Optional[str] = None

    @classmethod
    def connect(cls, rank: int, hosts: Sequence[str], ports: Sequence[int],
                server: socket.socket, timeout: float, auth: RingAuth) -> "TcpRing":
        """Connects to the next worker and accepts the previous one, each authenticated
        (both before `timeout`). The acceptor runs in a thread meanwhile: every worker
        connects first, and a handshake needs the other side to be accepting."""
        size = len(hosts)
        deadline = time.monotonic() + timeout
        acceptor = _Acceptor(server, auth, rank, size, deadline)
        acceptor.start()
        to_next = None
        try:
            following = (rank + 1) % size
            to_next = _connect_authenticated(hosts[following], ports[following], deadline,
                                             following, rank, size, auth)
            from_prev = acceptor.result()
        except BaseException:
            acceptor.stop()
            acceptor.discard()   # a peer it let in after all: nobody will read it
            if to_next is not None:
                to_next.close()
            raise
        finally:
            acceptor.stop()
            server.close()
        for sock in (to_next, from_prev):
            _tune(sock, timeout)
        addresses = [cluster.join_address(h, p) for h, p in zip(hosts, ports)]
        return cls(rank, size, to_next, from_prev, timeout, addresses)

    def all_reduce(self, buffer: np.ndarray) -> np.ndarray:
        """Sums `buffer` (1-D; float32, or float64 kept as float64) over the ring; returns a
        new array with the sums."""
        out = np.array(buffer, dtype=buffer_dtype([np.asarray(buffer).dtype]), copy=True)
        self.reduce_in_place(out)
        return out

    def all_reduce_arrays(self, *arrays: np.ndarray) -> List[np.ndarray]:
        """Sums several arrays as one buffer (BufferLayout: float32, or float64 if any is);
        returns arrays of the same shapes.

        One copy in (into a fresh buffer, so nothing TensorFlow still holds is ever
        written) and none out: the results are aligned views of that buffer.
        """
        layout = BufferLayout.of(arrays)
        buffer = layout.empty()
        layout.pack(arrays, buffer)
        self.reduce_in_place(buffer, layout.digest)
        return layout.unpack(buffer)

    def reduce_in_place(self, out: np.ndarray, digest: Optional[bytes] = None) -> None:
        """Replaces the 1-D array `out` (float32 or float64) by its sum over the ring.
        `digest` names its layout (default: its dtype and length); every worker must pass
        the same."""
        if self.size == 1:
            return
        digest = digest or flat_digest(len(out), out.dtype.name)
        chunks = np.array_split(out, self.size)
        scratch = np.empty(max(len(c) for c in chunks), out.dtype)
        n, r = self.size, self.rank
        for step in range(n - 1):        # reduce-scatter: chunk (r+1) % n ends up summed here
            sent, received = (r - step) % n, (r - step - 1) % n
            incoming = chunks[received]
            # Into scratch: the sum happens only once the whole checked frame arrived.
            self._exchange(chunks[sent], scratch[:len(incoming)], digest, REDUCE_SCATTER,
                           sent, received)
            np.add(incoming, scratch[:len(incoming)], out=incoming)
        for step in range(n - 1):        # all-gather: pass the summed chunks around
            sent, received = (r + 1 - step) % n, (r - step) % n
            # Straight into `out`: a frame that fails midway raises, and the caller
            # never sees this buffer (all_reduce's and all_reduce_arrays' own copy).
            self._exchange(chunks[sent], chunks[received], digest, ALL_GATHER, sent, received)

    def barrier(self, digest: bytes = b"\0" * 16) -> None:
        """Returns once every worker has called it: n-1 rounds of passing a byte on, so
        round k tells each worker that its k-th predecessor has arrived. Workers must
        pass the same `digest` (shm passes its buffer layout's)."""
        token, received = np.ones(1, np.uint8), np.empty(1, np.uint8)
        for _ in range(self.size - 1):
            self._exchange(token, received, digest, BARRIER, 0, 0)

    def all_gather_bytes(self, data: bytes, slot: int) -> List[bytes]:
        """Every worker's `data` (at most `slot` bytes), in rank order."""
        if len(data) > slot:
            raise ValueError(f"{len(data)} bytes do not fit a {slot}-byte slot")
        slots = np.zeros((self.size, slot + 2), np.uint8)  # 2 length bytes, then the data
        slots[self.rank, :2] = divmod(len(data), 256)
        slots[self.rank, 2:2 + len(data)] = np.frombuffer(data, np.uint8)
        digest = layout_digest("bytes", slot)
        for step in range(self.size - 1):
            sent, received = (self.rank - step) % self.size, (self.rank - step - 1) % self.size
            self._exchange(slots[sent], slots[received], digest, GATHER_BYTES, sent, received)
        return [bytes(row[2:2 + 256 * int(row[0]) + int(row[1])]) for row in slots]

    def _exchange(self, send: np.ndarray, receive: np.ndarray, digest: bytes, kind: int,
                  sent_part: int, received_part: int) -> None:
        """Sends a frame to the next worker while receiving one from the previous (no
        deadlock on full socket buffers: the send runs in a thread), both before one
        deadline. A failed exchange breaks the ring: the streams are out of step."""
        if self._broken:
            raise TcpRingError(f"the ring broke earlier ({self._broken})")
        deadline = time.monotonic() + self.timeout
        sequence, self._sequence = self._sequence, self._sequence + 1
        payload = memoryview(send).cast("B")
        header = FRAME.pack(FRAME_MAGIC, sequence, digest, kind, sent_part, payload.nbytes)
        failure: List[BaseException] = []

        def sender():
            try:
                _send_parts(self.to_next, [header, payload], deadline)
            except (OSError, TcpRingError) as error:
                failure.append(error)

        thread = threading.Thread(target=sender, daemon=True)
        thread.start()
        try:
            view = memoryview(receive).cast("B")
            expected = FRAME.pack(FRAME_MAGIC, sequence, digest, kind, received_part, view.nbytes)
            self._receive_frame(expected, view, deadline)
        except TcpRingError as error:
            # A moment for our own frame to go out (the neighbour then sees the same
            # mismatch, not just a closed socket); then the shutdown wakes our sender,
            # should the next worker have stopped reading.
            thread.join(min(SENDER_GRACE_SECONDS, max(0.0, deadline - time.monotonic())))
            self._break(str(error))
            raise
        finally:
            thread.join(max(0.0, deadline - time.monotonic()) + 0.1)
        if failure or thread.is_alive():
            self._break("a send failed")
            raise TcpRingError(f"worker {self.rank} could not send to worker "
                               f"{(self.rank + 1) % self.size}"
                               f"{self._address_of((self.rank + 1) % self.size)}: "
                               f"{failure[0] if failure else 'timed out'}")

    def _receive_frame(self, expected: bytes, view: memoryview, deadline: float) -> None:
        """The header, checked against `expected`, then exactly the payload. One call
        reads the header and whatever payload has arrived with it (a syscall saved per
        exchange); those bytes are only used once the header matched and all arrived."""
        header = bytearray(FRAME.size)
        peer = self._peer_label()
        got = _receive_into(self.from_prev, [memoryview(header), view], deadline, peer)
        if got < FRAME.size:
            _receive_exactly(self.from_prev, memoryview(header)[got:], deadline, peer)
            got = FRAME.size
        if header != expected:
            raise TcpRingError(f"{peer} {frame_mismatch(bytes(header), expected)}")
        _receive_exactly(self.from_prev, view[got - FRAME.size:], deadline, peer)

    def _break(self, reason: str) -> None:
        """No later exchange can trust these streams: refuse them from now on, and shut
        the sockets so that both neighbours see at once that this worker stopped."""
        self._broken = reason
        for sock in (self.to_next, self.from_prev):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _peer_label(self) -> str:
        return f"worker {(self.rank - 1) % self.size} ({self.prev_address})"

    def _address_of(self, rank: int) -> str:
        return f" ({self.addresses[rank]})" if self.addresses else ""

    def close(self) -> None:
        for sock in (self.to_next, self.from_prev):
            sock.close()


def frame_mismatch(got: bytes, expected: bytes) -> str:
    """What differs between a received frame header and the expected one, in words."""
    magic, sequence, digest, kind, part, length = FRAME.unpack(got)
    _, want_sequence, want_digest, want_kind, want_part, want_length = FRAME.unpack(expected)
    if magic != FRAME_MAGIC:
        return "sent bytes that are not a tfdist ring frame (a stranger, or a corrupt stream)"
    if sequence != want_sequence:
        return (f"sent exchange #{sequence} while this worker expects #{want_sequence}: the "
                f"workers are out of step")
    if digest != want_digest:
        return ("sums a different buffer layout than this worker (a different model, "
                "optimizer or code version on some worker?)")
    if (kind, part) != (want_kind, want_part):
        return (f"sent a {KIND_NAMES.get(kind, kind)} frame of part {part}, expected a "
                f"{KIND_NAMES[want_kind]} frame of part {want_part}")
    return (f"sent a frame of {length} bytes, expected {want_length} "
            f"({'oversized' if length > want_length else 'short'})")


# ------------------------------------------------------------------ connecting

class _Acceptor:
    """Accepts connections until one proves it is worker rank-1 of this job, or the
    deadline passes; strangers and wrong peers are logged, closed and ignored."""

    def __init__(self, server: socket.socket, auth: RingAuth, rank: int, size: int,
                 deadline: float):
        self.server, self.auth, self.rank, self.size = server, auth, rank, size
        self.deadline = deadline
        self.rejected: List[str] = []
        self._accepted: Optional[socket.socket] = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(ACCEPT_POLL_SECONDS * 5)

    def discard(self) -> None:
        if self._accepted is not None:
            self._accepted.close()
            self._accepted = None

    def result(self) -> socket.socket:
        self._thread.join(max(0.0, self.deadline - time.monotonic()) + HANDSHAKE_SECONDS)
        if self._accepted is not None:
            return self._accepted
        previous = (self.rank - 1) % self.size
        tried = (f"; refused {len(self.rejected)} connection(s): {'; '.join(self.rejected[:5])}"
                 if self.rejected else "")
        raise TcpRingError(f"worker {previous} did not connect and authenticate to worker "
                           f"{self.rank} within the timeout{tried}")

    def _run(self) -> None:
        while not self._stopping.is_set():
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                return
            self.server.settimeout(min(remaining, ACCEPT_POLL_SECONDS))
            try:
                conn, address = self.server.accept()
            except socket.timeout:
                continue
            except OSError:
                return   # the listener was closed: connect() gave up
            peer = cluster.join_address(*address[:2])
            reason = self._authenticate(conn, peer)
            if not reason:
                self._accepted = conn
                return
            conn.close()
            self.rejected.append(f"{peer} ({reason})")
            log.warning("tfdist ring: worker %d refused a connection from %s: %s", self.rank,
                        peer, reason)

    def _authenticate(self, conn: socket.socket, peer: str) -> str:
        """"" if `conn` is worker rank-1 of this job, else why not."""
        deadline = min(self.deadline, time.monotonic() + HANDSHAKE_SECONDS)
        previous = (self.rank - 1) % self.size
        try:
            theirs = _receive_bytes(conn, ring_auth.HELLO.size, deadline, peer)
            wrong = ring_auth.hello_mismatch(theirs, ring_auth.CONNECTOR, self.size, previous,
                                             self.auth)
            if wrong:
                return f"its hello has {wrong}"
            mine = ring_auth.hello(ring_auth.ACCEPTOR, self.size, self.rank, self.auth)
            _send_parts(conn, [mine + ring_auth.proof(self.auth, ring_auth.ACCEPTOR, theirs,
                                                      mine)], deadline)
            answer = _receive_bytes(conn, ring_auth.PROOF_BYTES, deadline, peer)
            if not ring_auth.proof_holds(self.auth, ring_auth.CONNECTOR, theirs, mine, answer):
                return "a wrong proof (it does not hold this job's secret)"
            _send_parts(conn, [ring_auth.OK], deadline)
            return ""
        except (TcpRingError, OSError) as error:
            return f"handshake failed: {error}"


def _connect_authenticated(host: str, port: int, deadline: float, peer: int, rank: int,
                           size: int, auth: RingAuth) -> socket.socket:
    """A connection to worker `peer` that has proven itself, and accepted our proof."""
    sock = _connect(host, port, deadline, peer)
    label = f"worker {peer} ({cluster.join_address(host, port)})"
    try:
        mine = ring_auth.hello(ring_auth.CONNECTOR, size, rank, auth)
        _send_parts(sock, [mine], deadline)
        reply = _receive_bytes(sock, ring_auth.HELLO.size + ring_auth.PROOF_BYTES, deadline,
                               label, closed=f"{label} refused this worker's handshake (a "
                               f"different ${ring_auth.SECRET_ENV} or job there?)")
        theirs, their_proof = reply[:ring_auth.HELLO.size], reply[ring_auth.HELLO.size:]
        wrong = ring_auth.hello_mismatch(theirs, ring_auth.ACCEPTOR, size, peer, auth)
        if wrong:
            raise TcpRingError(f"{label} is not the expected peer: its hello has {wrong}")
        if not ring_auth.proof_holds(auth, ring_auth.ACCEPTOR, mine, theirs, their_proof):
            raise TcpRingError(f"{label} could not prove it holds this job's secret (a "
                               f"different ${ring_auth.SECRET_ENV} there, or a stranger)")
        _send_parts(sock, [ring_auth.proof(auth, ring_auth.CONNECTOR, mine, theirs)], deadline)
        _receive_bytes(sock, 1, deadline, label, closed=f"{label} refused this worker's proof "
                       f"(a different ${ring_auth.SECRET_ENV} there?)")
        return sock
    except BaseException:
        sock.close()
        raise


def _connect(host: str, port: int, deadline: float, peer: int) -> socket.socket:
    while True:
        try:
            return socket.create_connection((host, port),
                                            timeout=max(0.01, deadline - time.monotonic()))
        except OSError as error:
            if time.monotonic() > deadline:
                raise TcpRingError(f"could not connect to worker {peer} at "
                                   f"{cluster.join_address(host, port)} within the timeout: "
                                   f"{error}") from None
            time.sleep(CONNECT_RETRY_SECONDS)


def _tune(sock: socket.socket, timeout: float) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    sock.settimeout(timeout)


def _peer_name(sock: socket.socket) -> str:
    try:
        return cluster.join_address(*sock.getpeername()[:2])
    except (OSError, TypeError):
        return "unknown address"


# ------------------------------------------------------------------ bytes with deadlines

def _send_parts(sock: socket.socket, parts, deadline: float) -> None:
    """Sends every byte of `parts` (one sendmsg for all, usually) before `deadline`."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TcpRingError("the send did not finish within the collective timeout")
        sock.settimeout(remaining)
        try:
            count = sock.sendmsg(views)
        except socket.timeout:
            raise TcpRingError("the send did not finish within the collective timeout") from None
        while views and count >= views[0].nbytes:
            count -= views[0].nbytes
            views.pop(0)
        if views:
            views[0] = views[0][count:]


def _receive_bytes(sock: socket.socket, count: int, deadline: float, peer: str,
                   closed: str = "") -> bytes:
    buffer = bytearray(count)
    _receive_exactly(sock, memoryview(buffer), deadline, peer, closed)
    return bytes(buffer)


def _receive_into(sock: socket.socket, views, deadline: float, peer: str) -> int:
    """One read into `views` in order (scatter), before `deadline`: the byte count."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TcpRingError(f"{peer} sent too little within the collective timeout")
    sock.settimeout(remaining)
    try:
        count = sock.recvmsg_into(views)[0]
    except socket.timeout:
        raise TcpRingError(f"{peer} sent nothing within the collective timeout") from None
    except OSError as error:
        raise TcpRingError(f"connection to {peer} failed: {error}") from None
    if count == 0:
        raise TcpRingError(f"{peer} closed its connection (it stopped or died)")
    return count


def _receive_exactly(sock: socket.socket, view: memoryview, deadline: float, peer: str,
                     closed: str = "") -> None:
    """Fills `view` from `sock` before `deadline` (one deadline for all the bytes, so a
    peer that trickles them cannot stretch it)."""
    while view.nbytes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TcpRingError(f"{peer} sent too little within the collective timeout")
        sock.settimeout(remaining)
        try:
            count = sock.recv_into(view)
        except socket.timeout:
            raise TcpRingError(f"{peer} sent nothing within the collective timeout") from None
        except OSError as error:
            raise TcpRingError(f"connection to {peer} failed: {error}") from None
        if count == 0:
            raise TcpRingError(closed or f"{peer} closed its connection (it stopped or died)")
        view = view[count:]
