"""A private network for one host's workers: loopback only, unreachable from outside the job.

Why: every worker of a multi-worker job runs TensorFlow's gRPC server (MultiWorkerMirrored,
DTensor multi-client, the cross-worker pipeline), and TensorFlow binds it to every
interface whatever address TF_CONFIG names (grpc_server_lib.cc: AddListeningPort(
"0.0.0.0:" + port), no bind option, insecure credentials). Whoever reaches that port can
run any op in the worker: read or write files, assign the model's variables. For a job
on one host nothing outside needs to reach it, so `tfdist launch` starts its workers in
a network namespace of their own, where the only interface is a loopback the host's
loopback does not share: the servers bind 0.0.0.0 there, which is that loopback alone.

How: a holder process (`python -m tfdist.netns`) unshares a new network namespace (and,
when not root, a user namespace mapping only the user's own uid and gid, which is what
lets an unprivileged user create one), brings its loopback up, and stays until the
launcher closes its stdin. Each worker enters the holder's namespaces between fork and
exec (`enter`, a Popen preexec_fn calling setns), so the workers share one loopback and
nothing else. The workers keep the user's uid; after exec they hold no capability.
The holder also answers the launcher's port probes (--start_timeout), which must be made
from inside.

What it costs: the workers cannot reach other hosts (no downloads from a worker); the
launcher says so once at start. `tfdist launch --network=host` gives them this host's
network instead (and TensorFlow's servers are then on every interface, also announced).
Linux only; where namespaces are not allowed (a container's seccomp profile, user
namespaces disabled) `available()` says why and the launcher falls back to the host's
network with that announcement.
"""

import ctypes
import ctypes.util
import fcntl
import os
import socket
import struct
import subprocess
import sys
from typing import Optional

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
READY = "ready"
START_TIMEOUT_SECONDS = 30.0

_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _needs_user_namespace() -> bool:
    return os.geteuid() != 0


# --------------------------------------------------------------------------- the holder

def make_private_network() -> None:
    """In this (single-threaded) process: a new network namespace with its loopback up."""
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWNET | (CLONE_NEWUSER if _needs_user_namespace() else 0)
    _check(libc().unshare(flags), "unshare")
    if flags & CLONE_NEWUSER:
        # Map only our own ids: files the workers write stay the user's.
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    bring_loopback_up()


def bring_loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def port_accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def hold() -> int:
    """The holder's main: make the namespace, say READY, answer "host port" probes with
    1 or 0 until stdin closes."""
    try:
        make_private_network()
    except OSError as error:
        print(f"error {error.strerror or error}", flush=True)
        return 1
    print(READY, flush=True)
    for line in sys.stdin:
        host, _, port = line.strip().rpartition(" ")
        print("1" if host and port.isdigit() and port_accepts(host, int(port)) else "0",
              flush=True)
    return 0


# --------------------------------------------------------------------------- the launcher's side

class PrivateNetwork:
    """The holder process and the namespace file descriptors workers enter."""

    def __init__(self):
        self.holder = subprocess.Popen(
            [sys.executable, "-m", "tfdist.netns"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True)
        first = self._read_line(START_TIMEOUT_SECONDS)
        if first != READY:
            detail = first.removeprefix("error ") if first else self._stderr_tail()
            self.close()
            raise OSError(f"cannot make a private network namespace ({detail})")
        pid = self.holder.pid
        self.user_fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY) \
            if _needs_user_namespace() else None
        self.net_fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        self._setns = libc().setns   # resolved now: the child between fork and exec only calls it

    def _read_line(self, timeout: float) -> Optional[str]:
        import selectors
        with selectors.DefaultSelector() as selector:
            selector.register(self.holder.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                return None
        line = self.holder.stdout.readline()
        return line.strip() if line else None

    def _stderr_tail(self) -> str:
        if self.holder.poll() is None:
            return "the holder process did not answer"
        lines = (self.holder.stderr.read() or "").strip().splitlines()
        return lines[-1] if lines else f"the holder exited with code {self.holder.returncode}"

    def enter(self) -> None:
        """Popen preexec_fn: this child joins the namespaces (user first: it grants the
        capability the network namespace asks for). Only setns, through a function resolved
        before any fork: no import or lock a thread of the launcher could hold at fork.
        A failed setns ends the child with 126 before it runs anything."""
        if self.user_fd is not None and self._setns(self.user_fd, CLONE_NEWUSER) != 0:
            os._exit(126)
        if self._setns(self.net_fd, CLONE_NEWNET) != 0:
            os._exit(126)

    def port_accepts(self, host: str, port: int) -> bool:
        """A connection test made from inside the namespace (by the holder)."""
        try:
            self.holder.stdin.write(f"{host} {port}\n")
            self.holder.stdin.flush()
        except (BrokenPipeError, ValueError):
            return False
        return self._read_line(5.0) == "1"

    def close(self) -> None:
        for name in ("user_fd", "net_fd"):
            fd = getattr(self, name, None)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
        if self.holder.stdin and not self.holder.stdin.closed:
            try:
                self.holder.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.holder.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.holder.kill()
            self.holder.wait()
        for stream in (self.holder.stdout, self.holder.stderr):
            if stream:
                stream.close()


def open_private_network() -> "tuple[Optional[PrivateNetwork], str]":
    """(the network, "") or (None, why not): Linux only, and namespaces must be allowed."""
    if not sys.platform.startswith("linux"):
        return None, f"network namespaces are Linux's; this is {sys.platform}"
    try:
        return PrivateNetwork(), ""
    except OSError as error:
        return None, str(error)


if __name__ == "__main__":
    sys.exit(hold())
