"""A bounded rendezvous before TensorFlow joins a cluster.

TensorFlow waits for missing peers inside C++ while holding the GIL, so no
Python timeout, signal handler or thread can end that wait (measured: a worker
whose peer never starts hangs past SIGTERM). So tfdist first makes sure every
peer is up, in Python, with a deadline: each worker listens on its own TF_CONFIG
port and polls the others' ports until all answer. Nobody waits for a port that
nobody will open, because every worker listens before it polls. Then the
listener is closed and TensorFlow binds the same port.
"""

import socket
import time
from typing import Iterable, List

from tfdist import cluster
from tfdist.errors import ClusterError, UsageError

POLL_SECONDS = 0.2


def unreachable(addresses: Iterable[str], timeout: float = 0.5) -> List[str]:
    """The "host:port" addresses that refuse or time out a TCP connection now."""
    missing = []
    for address in addresses:
        host, port = cluster.split_address(address)
        try:
            with socket.create_connection((host, port), timeout=timeout):
                pass
        except OSError:
            missing.append(address)
    return missing


def listen_on(address: str, label: str) -> socket.socket:
    """Listens on this task's own port (all interfaces, as TF's server will)."""
    host, port = cluster.split_address(address)
    family, anywhere = (socket.AF_INET6, "::") if ":" in host else (socket.AF_INET, "0.0.0.0")
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((anywhere, port))
    except OSError as error:
        listener.close()
        raise UsageError(
            f"port {port} of task {label} is already taken by another process "
            f"(address {address!r}: {error.strerror}). Stop that process, or give this task "
            f"another port in TF_CONFIG (tfdist launch picks free ports itself).") from None
    listener.listen(64)
    return listener


def wait_for_peers(tf_config: cluster.TFConfig, timeout_seconds: float) -> None:
    """Returns once every other training task answers on its port; else ClusterError."""
    label = f"{tf_config.task_type}:{tf_config.task_index}"
    peers = [a for a in tf_config.worker_addresses if a != tf_config.address]
    listener = listen_on(tf_config.address, label)
    try:
        deadline = time.monotonic() + timeout_seconds
        missing = unreachable(peers)
        while missing and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
            missing = unreachable(missing)
    finally:
        listener.close()
    if missing:
        raise ClusterError(
            f"task {label} (rank {tf_config.rank} of {tf_config.num_workers}): nothing answered "
            f"at {', '.join(missing)} within --collective_timeout={timeout_seconds:g} s, so those "
            f"workers never started (or died, or are unreachable from here). Start every task "
            f"of TF_CONFIG (`tfdist launch --workers N` starts them all) and run `tfdist doctor`.")
