"""One run per --model_dir: a lock file that names its holder.

Two runs on one --model_dir would both write ckpt-N and checkpoints.json, and
each would resume from the other's state. The run that writes --model_dir (the
only process, or the chief of a multi-worker job; the others write scratch dirs)
holds `<model_dir>/.tfdist-lock` for the whole run.

Why fcntl.flock and not an O_CREAT|O_EXCL file: the kernel drops a flock when its
process dies, however it dies (SIGKILL, the OOM killer, a power cut on the host),
so a lock is stale exactly when nobody holds it. An O_EXCL file outlives a killed
process, and telling a dead holder from a live one then means probing its pid,
which cannot be done from another host and is wrong after pid reuse. The file's
content (host, pid, start time) only serves the messages: who holds the lock, or
whose stale lock a new run takes over. On NFS, Linux implements flock with the
server's byte-range locks (since 2.6.12), which hold across clients.

The file is never deleted: a run that unlinked it on exit could race a starting
run that had just opened the old inode, and two runs would then each hold a lock
on a different file. A clean release empties the file instead, so only a lock
left by a process that died shows a holder to the next run.
"""

import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
from typing import Dict, Optional

from tfdist import parallel
from tfdist.errors import UsageError

LOCK_FILE = ".tfdist-lock"
log = logging.getLogger("tfdist")

# realpath -> [file descriptor, holds]: the CLI takes the lock before importing
# TensorFlow and tfdist.run takes it again; a second flock from this same process
# on a new descriptor would conflict with the first, so nested holds share one.
_held: Dict[str, list] = {}


def describe_holder(text: str) -> str:
    """"pid 123 on host h since 2026-01-01 12:00:00 UTC" from the lock file's content."""
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on host {holder['host']} since {holder['since']}"
    except (ValueError, TypeError, KeyError):
        return "a process that has not written its name yet (it is starting)"


def _holder_record() -> str:
    since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": since})


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode("utf-8", "replace").strip()


def _acquire(path: str, model_dir: str) -> Optional[int]:
    """The locked file's descriptor; None where the file system has no locks."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)   # not inherited by children (PEP 446)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = describe_holder(_read(fd))
        os.close(fd)
        raise UsageError(
            f"--model_dir {model_dir!r} is in use by another run: {holder} (lock file {path}). "
            f"Two runs on one --model_dir would overwrite each other's checkpoints. Wait for "
            f"that run to finish, stop it, or give this run another --model_dir.") from None
    except OSError as error:   # ENOLCK, EOPNOTSUPP: e.g. an NFS mount without its lock daemon
        os.close(fd)
        # Refusing to train there would punish the common case (one run) for the rare one.
        log.warning("--model_dir %s: cannot lock %s (%s), so a second run there would not be "
                    "stopped", model_dir, path, error.strerror or error)
        return None
    except BaseException:
        os.close(fd)
        raise
    left = _read(fd)
    if left:   # a holder that released cleanly empties the file: this one died holding it
        log.info("--model_dir %s: taking over the stale lock of %s, which ended without "
                 "releasing it", model_dir, describe_holder(left))
    os.ftruncate(fd, 0)
    os.pwrite(fd, _holder_record().encode(), 0)
    return fd


def _release(fd: Optional[int]) -> None:
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)   # a clean end: the next run has no stale holder to report
    finally:
        os.close(fd)          # closing the last descriptor drops the flock


@contextlib.contextmanager
def hold(model_dir: Optional[str]):
    """Holds --model_dir's lock inside the block (nothing when model_dir is None).

    Raises UsageError naming the holder when another live process holds it; a
    lock left by a dead process is taken over, with a log line naming it.
    """
    if not model_dir:
        yield
        return
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.realpath(os.path.join(model_dir, LOCK_FILE))
    entry = _held.get(path)
    if entry is None:
        entry = _held[path] = [_acquire(path, model_dir), 0]
    entry[1] += 1
    try:
        yield
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            del _held[path]
            _release(entry[0])


def hold_for(config):
    """hold(--model_dir) in the process that writes it (see parallel.writes_model_dir),
    nothing in the others."""
    writes = parallel.writes_model_dir(config.strategy)
    return hold(config.model_dir if writes else None)
