"""`--collective=shm`: the all-reduce of workers on one host, through shared memory.

Why: on one host, TCP over loopback copies every byte into the kernel and out
again, and those copies take the same cores that compute the gradients (the ring
was a fifth of a step in the throughput benchmark). NCCL and MPI switch to a
shared-memory transport inside a node; this is that transport for tfdist's CPU
workers. The data moves through memory-mapped files in /dev/shm; only small
signals go over the TCP ring's sockets, which keep their timeouts and notice a
dead peer at once.

One all-reduce of a buffer of L elements (float32, or float64 for a float64 model)
over n workers:
  1. each worker copies its buffer into its own input region;
  2. barrier;
  3. worker r sums chunk r of every input region, in worker order 0..n-1, into
     chunk r of the one shared result region (each chunk is summed once, by one
     worker, so every worker reads bitwise the same sums);
  4. barrier;
  5. each worker returns views of the result region: nothing is copied out.
Memory traffic is therefore one copy in and one pass of sums (a copy out cost
about 7% of the throughput benchmark's step: 2.5 of 5 ms in the all-reduce). The price is the contract: the
returned arrays are valid until this worker's next call, which is how a
training step uses them (the optimizer consumes the sums within the step).
Why two barriers suffice: the next call's step 1 writes only this worker's
input region, which nobody reads after barrier 4; its step 3 writes the result
region only after the next barrier 2, which a worker reaches only once it has
finished with this call's results.

A peer announces its region's path over the (authenticated) ring; this worker
maps only a path that tfdist itself would have made for that rank: directly in
shared_memory_dir(), named tfdist-shm-<rank>-<random>, a regular file of this
uid (opened with O_NOFOLLOW) of exactly the expected size. Anything else is a
TcpRingError naming the path and the peer. The first barrier of every call
carries the buffer layout's digest, so workers with different models fail there.
"""

import errno
import logging
import mmap
import os
import re
import stat
import tempfile
from typing import List

import numpy as np

from tfdist.parallel.tcp_ring import BufferLayout, TcpRing, TcpRingError
from tfdist.plan.recommend import gib   # the one bytes formatter (TF-free)

log = logging.getLogger("tfdist")
PATH_BYTES = 256   # one worker's region path, sent to the others in a fixed-size slot


def shared_memory_dir() -> str:
    """$TFDIST_SHM_DIR, else tmpfs when the OS has it (no disk behind the pages),
    else the temp dir."""
    if os.environ.get("TFDIST_SHM_DIR"):
        return os.environ["TFDIST_SHM_DIR"]
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedMemoryUnavailable(TcpRingError):
    """This worker cannot create its region (a full or missing directory)."""


class SharedMemoryAllReduce:
    """Sums float32 (or float64) buffers over the workers of `ring`, who must share this
    host."""

    def __init__(self, ring: TcpRing):
        self.ring = ring
        self._layout_key = None           # (elements, dtype) of the mapped regions
        self._maps: List[mmap.mmap] = []
        self._inputs: List[np.ndarray] = []
        self._result: np.ndarray = None   # in worker 0's file, after its input region

    def all_reduce_arrays(self, *arrays: np.ndarray) -> List[np.ndarray]:
        """Sums several arrays as one buffer (tcp_ring.BufferLayout: float32, or float64 if
        any is); returns arrays of the same shapes (views of the shared result region:
        valid until the next call)."""
        if self.ring.size == 1:
            return self.ring.all_reduce_arrays(*arrays)   # a copy: nothing to share
        layout = BufferLayout.of(arrays)
        self._map_regions(layout.length, layout.dtype)
        rank = self.ring.rank
        layout.pack(arrays, self._inputs[rank])
        self.ring.barrier(layout.digest)   # every worker sums this layout, or nobody sums
        mine = self._chunk(rank)
        result = self._result[mine]
        np.add(self._inputs[0][mine], self._inputs[1][mine], out=result)
        for region in self._inputs[2:]:
            np.add(result, region[mine], out=result)
        self.ring.barrier()
        return layout.unpack(self._result)

    def prepare(self, shapes, dtype=np.float32) -> None:
        """Maps the regions for arrays of these shapes and this buffer dtype now (every
        worker at once), so a lack of shared memory is reported before training, not in
        a step."""
        if self.ring.size > 1:
            layout = BufferLayout(shapes, dtype)
            self._map_regions(layout.length, layout.dtype)

    def _chunk(self, worker: int) -> slice:
        """Worker `worker`'s share of [0, L): n nearly equal contiguous chunks."""
        n, length = self.ring.size, self._layout_key[0]
        bounds = [length * i // n for i in range(n + 1)]
        return slice(bounds[worker], bounds[worker + 1])

    def _map_regions(self, length: int, dtype: np.dtype) -> None:
        """Creates this worker's region (worker 0's also holds the result region), learns
        the others' and maps them (first call, and when another model's buffer comes)."""
        if self._layout_key == (length, dtype):
            return
        if self._layout_key is not None:
            # Another model in this process (every worker traces it at the same point of
            # the program, so every worker comes here): its own regions.
            log.info("collective shm: a buffer of %d %s replaces one of %d %s; new regions",
                     length, dtype.name, *self._layout_key)
            self.close()
        itemsize = dtype.itemsize
        elements_of = [2 * length] + [length] * (self.ring.size - 1)
        path = self._create_region(itemsize * elements_of[self.ring.rank])
        try:
            paths = self.ring.all_gather_bytes(path.encode(), PATH_BYTES)
            for peer, (peer_path, elements) in enumerate(zip(paths, elements_of)):
                self._maps.append(self._map_peer_region(peer, peer_path.decode(errors="replace"),
                                                        itemsize * elements))
            self.ring.barrier()   # every worker holds every mapping ...
        finally:
            os.unlink(path)       # ... so the file can go: the mappings keep the memory
        regions = [np.frombuffer(region, dtype) for region in self._maps]
        self._inputs = [region[:length] for region in regions]
        self._result = regions[0][length:]
        self._layout_key = (length, dtype)
        log.info("collective shm: %d workers sum %s of %s through shared memory in %s",
                 self.ring.size, gib(itemsize * length), dtype.name, shared_memory_dir())

    def _create_region(self, nbytes: int) -> str:
        directory = shared_memory_dir()
        fd = path = None
        try:
            fd, path = tempfile.mkstemp(prefix=region_prefix(self.ring.rank), dir=directory)
            os.posix_fallocate(fd, 0, nbytes)  # fails now (ENOSPC), not SIGBUS later
        except OSError as error:
            if path:
                os.unlink(path)
            raise SharedMemoryUnavailable(
                f"worker {self.ring.rank} cannot reserve {gib(nbytes)} of shared "
                f"memory in {directory} ({error.strerror}). Free space there (in Docker: "
                f"--shm-size), point $TFDIST_SHM_DIR at a larger tmpfs, or use "
                f"--collective=tcp.") from None
        finally:
            if fd is not None:
                os.close(fd)
        return path

    def _map_peer_region(self, peer: int, path: str, size: int) -> mmap.mmap:
        addresses = self.ring.addresses
        who = f"worker {peer}" + (f" ({addresses[peer]})" if addresses else "")
        return map_region(path, peer, size, who)

    def close(self) -> None:
        self._inputs, self._result = [], None
        for region in self._maps:
            try:
                region.close()
            except BufferError:   # an array still views it; the OS unmaps it at exit
                pass
        self._maps = []
        self._layout_key = None


def region_prefix(rank: int) -> str:
    return f"tfdist-shm-{rank}-"


def map_region(path: str, rank: int, size: int, who: str) -> mmap.mmap:
    """Maps the region `who` (worker `rank`) announced, if it is one tfdist made for that
    rank (see the module docstring); else a TcpRingError naming the path and the peer."""
    directory = os.path.abspath(shared_memory_dir())
    # mkstemp's random part: 8 of [a-z0-9_]
    name_ok = re.fullmatch(re.escape(region_prefix(rank)) + r"[a-z0-9_]{8}",
                           os.path.basename(path))
    if os.path.dirname(os.path.abspath(path)) != directory or not name_ok:
        raise TcpRingError(f"{who} announced the shared memory region {path!r}, which is not "
                           f"a tfdist-shm-{rank}-* file in {directory}: refusing to map it")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise TcpRingError(f"{who} announced the shared memory region {path}, which is a "
                               f"symbolic link: refusing to map it") from None
        raise TcpRingError(f"cannot open {who}'s shared memory {path} ({error.strerror}): are "
                           f"all workers on this host? Use --collective=tcp across hosts") from None
    try:
        info = os.fstat(fd)
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid()
                or info.st_size != size):
            raise TcpRingError(
                f"{who} announced the shared memory region {path}, but it is not a regular "
                f"file of uid {os.getuid()} with {size} bytes (uid {info.st_uid}, "
                f"{stat.filemode(info.st_mode)}, {info.st_size} bytes): refusing to map it")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
