"""Who may join tfdist's ring (--collective=tcp / shm): a per-job secret and a handshake.

The ring's ports are logged and reachable by anyone who can reach the host, so
every ring connection starts with a mutual challenge-response (the shape of
SSH's and TLS-PSK's key confirmation, without the encryption):

  connector -> acceptor   HELLO(connector): magic, version, role, world, rank, job, challenge
  acceptor  -> connector  HELLO(acceptor) + HMAC(secret, "A" | both hellos)
  connector -> acceptor   HMAC(secret, "C" | both hellos)
  acceptor  -> connector  OK

Each side's proof covers the other side's fresh random challenge, so a recorded
handshake cannot be replayed, and the roles differ, so one side's proof cannot be
reflected back as the other's. The secret itself never crosses the wire. The job
id (a hash of TF_CONFIG's worker list) and the ranks are in the proven hellos, so
two jobs on one host, or a worker of the right job in the wrong place, never pair
up. The data that follows is framed and checked (tcp_ring), not encrypted: tfdist
trusts the network path between authenticated workers, as gloo and NCCL do.

The secret comes from $TFDIST_JOB_SECRET (`tfdist launch` sets a fresh one per
launch; Slurm and Kubernetes jobs export one). Without it, workers that are all
on this host share a per-user secret file (0600): other users cannot read it, and
processes of the same user could read this process's memory anyway, so a per-user
secret protects what can be protected there. Across hosts there is no such shared
place, so the ring refuses to start.
"""

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import struct
from typing import NamedTuple, Optional, Sequence

from tfdist import cluster
from tfdist.errors import UsageError

log = logging.getLogger("tfdist")
SECRET_ENV = "TFDIST_JOB_SECRET"
MIN_SECRET_BYTES = 16
PROTOCOL_VERSION = 1
HELLO = struct.Struct("<4sHHII16s32s")   # magic, version, role, world, rank, job, challenge
HELLO_MAGIC = b"TFDR"
CONNECTOR, ACCEPTOR = 1, 2
PROOF_BYTES = 32                         # HMAC-SHA256
OK = b"\x01"
HOW_TO_SET = (f"export {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') "
              f"once, and give every worker that same value (a Kubernetes Secret, see "
              f"examples/kubernetes/indexed-job.yaml; an export in the sbatch script, see "
              f"examples/slurm/train.sbatch); `tfdist launch` sets it for its workers itself")


class RingAuth(NamedTuple):
    """What a worker proves on every ring connection: it holds `secret` and belongs to `job`."""
    secret: bytes
    job: bytes   # 16 bytes, job_id()


class Hello(NamedTuple):
    role: int
    world: int
    rank: int
    job: bytes
    challenge: bytes


def job_id(worker_addresses: Sequence[str]) -> bytes:
    """16 bytes naming the job: a hash of its workers' addresses in rank order."""
    text = json.dumps([a.strip().lower() for a in worker_addresses])
    return hashlib.sha256(b"tfdist-job\0" + text.encode()).digest()[:16]


def parse_secret(text: str, where: str = f"${SECRET_ENV}") -> bytes:
    """The secret's bytes, or a UsageError. The message gives the length and the first
    bad position, never the value: it would end up in logs."""
    text = text.strip()
    bad = next((i for i, ch in enumerate(text) if ch not in "0123456789abcdefABCDEF"), None)
    if bad is not None or len(text) % 2 or len(text) < 2 * MIN_SECRET_BYTES:
        problem = (f"has a non-hex character at position {bad}" if bad is not None else
                   f"has {len(text)} hex digits")
        raise UsageError(f"{where} must be at least {2 * MIN_SECRET_BYTES} hex digits (an even "
                         f"number, {MIN_SECRET_BYTES}+ random bytes), but it {problem}. Make one "
                         f"with: {HOW_TO_SET}.")
    return bytes.fromhex(text)


def job_secret(worker_hosts: Sequence[str], env=None) -> bytes:
    """$TFDIST_JOB_SECRET; else, when every worker is on this host, the per-user secret
    file; else a UsageError saying how to set one."""
    env = os.environ if env is None else env
    if SECRET_ENV in env:
        return parse_secret(env[SECRET_ENV])
    elsewhere = sorted({h for h in worker_hosts if not cluster.is_local_host(h)})
    if elsewhere:
        raise UsageError(
            f"--collective=tcp/shm across hosts needs a shared job secret, so that only this "
            f"job's workers can join its ring, but ${SECRET_ENV} is not set (workers on "
            f"{', '.join(elsewhere)}). Run {HOW_TO_SET}.")
    return user_secret(secret_file_path(env))


def secret_file_path(env) -> str:
    """$XDG_RUNTIME_DIR (a per-user 0700 tmpfs, gone at logout) when the OS has one,
    else ~/.cache/tfdist."""
    runtime = env.get("XDG_RUNTIME_DIR")
    base = (os.path.join(runtime, "tfdist") if runtime and os.path.isdir(runtime)
            else os.path.join(os.path.expanduser("~"), ".cache", "tfdist"))
    return os.path.join(base, "job-secret")


def user_secret(path: str) -> bytes:
    """This user's secret in `path`, created (0600) by the first worker that needs it.
    Workers that start together race here: each writes a complete file under a
    temporary name and links it into place, which only one link can win."""
    if not os.path.lexists(path):
        try:
            _create_secret_file(path)
        except OSError as error:   # e.g. a read-only home in a container
            raise UsageError(f"cannot create the ring's secret file {path} ({error.strerror}). "
                             f"Set ${SECRET_ENV} instead: {HOW_TO_SET}.") from None
    return parse_secret(_read_private_file(path), where=f"the secret file {path}")


def _create_secret_file(path: str) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    try:
        os.link(temporary, path)
    except FileExistsError:
        pass   # another worker won the race: use its secret
    finally:
        os.unlink(temporary)


def _read_private_file(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as error:
        raise UsageError(f"cannot read the ring's secret file {path} ({error.strerror}). "
                         f"Remove it, or set ${SECRET_ENV}: {HOW_TO_SET}.") from None
    try:
        info = os.fstat(fd)
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid()
                or info.st_mode & 0o077):
            raise UsageError(
                f"the ring's secret file {path} must be a regular file owned by uid "
                f"{os.getuid()} with mode 0600, but it has uid {info.st_uid} and mode "
                f"{stat.filemode(info.st_mode)}. Remove it (tfdist makes a new one), or set "
                f"${SECRET_ENV}: {HOW_TO_SET}.")
        return os.read(fd, 4096).decode("ascii", "replace")
    finally:
        os.close(fd)


# ------------------------------------------------------------------------- handshake

def hello(role: int, world: int, rank: int, auth: RingAuth) -> bytes:
    return HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, role, world, rank, auth.job,
                      secrets.token_bytes(32))


def parse_hello(data: bytes) -> Optional[Hello]:
    """The hello's fields, or None if these bytes are not a tfdist hello of this version."""
    magic, version, role, world, rank, job, challenge = HELLO.unpack(data)
    if magic != HELLO_MAGIC or version != PROTOCOL_VERSION:
        return None
    return Hello(role, world, rank, job, challenge)


def hello_mismatch(data: bytes, role: int, world: int, rank: int, auth: RingAuth) -> str:
    """Why this hello is not the one expected ("" if it is)."""
    got = parse_hello(data)
    if got is None:
        return f"not a tfdist ring hello of protocol version {PROTOCOL_VERSION}"
    if got.role != role:
        return f"role {got.role}, expected {role}"
    if got.job != auth.job:
        return "a different job (another TF_CONFIG worker list)"
    if got.world != world:
        return f"world size {got.world}, expected {world}"
    if got.rank != rank:
        return f"rank {got.rank}, expected {rank}"
    return ""


def proof(auth: RingAuth, role: int, connector_hello: bytes, acceptor_hello: bytes) -> bytes:
    label = b"A" if role == ACCEPTOR else b"C"
    return hmac.new(auth.secret, b"tfdist-ring\0" + label + connector_hello + acceptor_hello,
                    hashlib.sha256).digest()


def proof_holds(auth: RingAuth, role: int, connector_hello: bytes, acceptor_hello: bytes,
                received: bytes) -> bool:
    return hmac.compare_digest(proof(auth, role, connector_hello, acceptor_hello), received)
