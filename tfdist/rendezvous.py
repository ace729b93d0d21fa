"""A bounded rendezvous before TensorFlow joins a cluster.

TensorFlow waits for missing peers inside C++ while holding the GIL, so no
Python timeout, signal handler or thread can end that wait (measured: a worker
whose peer never starts hangs past SIGTERM). So tfdist first makes sure every
peer is up, in Python, with a deadline: each worker listens on its own TF_CONFIG
port and polls the others' ports until all answer. Nobody waits for a port that
nobody will open, because every worker listens before it polls. Then the
listener is closed and TensorFlow binds the same port.

tfdist's listeners (this one and the tcp ring's) bind the worker's own TF_CONFIG
address, not every interface. TensorFlow's own gRPC server binds all interfaces
on the same port once this listener is closed: that is TF's choice, not ours.
"""

import errno
import ipaddress
import logging
import socket
import time
from typing import Iterable, List, Tuple

from tfdist import cluster
from tfdist.errors import ClusterError, UsageError

log = logging.getLogger("tfdist")
POLL_SECONDS = 0.2
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


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


def bind_host(host: str, spans_hosts: bool = False) -> Tuple[int, str]:
    """(family, address) for a listener of the worker whose TF_CONFIG host is `host`:
    that host resolved here, preferring a non-loopback address; loopback stays loopback.

    One exception, with a warning: a host name that resolves to loopback only here
    (Debian's "127.0.1.1 <hostname>" line in /etc/hosts) while workers on other hosts
    must reach it would be unreachable, so such a listener binds every interface;
    the ring's handshake still refuses whoever is not this job's worker.
    """
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise UsageError(f"this worker's TF_CONFIG host {host!r} does not resolve here "
                         f"({error.strerror}). Give each task a host name or IP address "
                         f"of its own machine.") from None
    # IPv4 first, as connecting clients usually try it, so both pick the same one.
    found = sorted({(family, info[0]) for family, _, _, _, info in infos
                    if family in (socket.AF_INET, socket.AF_INET6)},
                   key=lambda pair: (pair[0] != socket.AF_INET, pair[1]))
    if not found:
        raise UsageError(f"this worker's TF_CONFIG host {host!r} has no IPv4/IPv6 address.")
    outward = [(f, a) for f, a in found if not ipaddress.ip_address(a).is_loopback]
    family, address = (outward or found)[0]
    if not outward and spans_hosts and host.lower() not in LOOPBACK_NAMES:
        log.warning("TF_CONFIG host %r resolves to %s here, which the other hosts cannot "
                    "reach: listening on every interface instead (fix /etc/hosts to bind one)",
                    host, address)
        return family, "::" if family == socket.AF_INET6 else "0.0.0.0"
    return family, address


def listen_on(address: str, label: str, spans_hosts: bool = False) -> socket.socket:
    """Listens on this task's own TF_CONFIG address and port."""
    host, port = cluster.split_address(address)
    family, own = bind_host(host, spans_hosts)
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((own, port))
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRNOTAVAIL:
            raise UsageError(
                f"task {label}'s TF_CONFIG address {address!r} is not this machine's: "
                f"{host!r} resolves to {own}, which no interface here has. Run each task "
                f"on the host TF_CONFIG gives it.") from None
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
    spans_hosts = any(not cluster.is_local_host(cluster.split_address(a)[0]) for a in peers)
    listener = listen_on(tf_config.address, label, spans_hosts)
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
