"""What one attempt of `tfdist launch` starts: each worker's ports and environment."""

import dataclasses
import json
import os
import secrets
import socket
from typing import Dict, List, Mapping, Optional, Set

from tfdist import cluster
from tfdist.errors import UsageError, require
from tfdist.launch import mpirun
from tfdist.launch.options import LaunchOptions
from tfdist.parallel import ring_auth

SECRET_SHOWN = "<set>"       # --dry_run shows this instead of $TFDIST_JOB_SECRET


def pick_free_ports(host: str, count: int, exclude: Set[int] = frozenset()) -> List[int]:
    """`count` distinct ports that are free on every interface, none of them in `exclude`.

    All probe sockets stay open until the end so the kernel cannot hand out one
    port twice; they are closed before the workers start (never connected, so
    no TIME_WAIT), which leaves a small race with other programs, as in torchrun.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    _check_bindable(host, family)
    probes, ports = [], []
    try:
        while len(ports) < count:
            require(len(probes) < count + len(exclude) + 1000, f"Could not find {count} free ports on {host}.")
            probe = socket.socket(family, socket.SOCK_STREAM)
            probes.append(probe)
            probe.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
            port = probe.getsockname()[1]
            if port not in exclude:
                ports.append(port)
    finally:
        for probe in probes:
            probe.close()
    return ports


def _check_bindable(host: str, family: int) -> None:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
    except OSError as error:
        raise UsageError(f"--host {host!r} is not an address of this machine: {error.strerror or error}. "
                         f"Use 127.0.0.1 (the default) or one of this machine's addresses.") from None


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """What one attempt starts: per-rank extra environment and the ports each rank should open."""
    environments: List[Dict[str, str]]
    ports: List[List[int]]

    @property
    def all_ports(self) -> Set[int]:
        return {port for ports in self.ports for port in ports}


def job_secret(env: Mapping[str, str]) -> str:
    """The user's $TFDIST_JOB_SECRET (checked now, not in N workers later), else a fresh one:
    the key tfdist's ring proves membership with (tfdist.parallel.ring_auth)."""
    if env.get(ring_auth.SECRET_ENV):
        ring_auth.parse_secret(env[ring_auth.SECRET_ENV])
        return env[ring_auth.SECRET_ENV]
    return secrets.token_hex(32)


def plan_group(options: LaunchOptions, restart_count: int = 0, exclude: Set[int] = frozenset(),
               secret: Optional[str] = None, temp_dir: Optional[str] = None) -> GroupPlan:
    """temp_dir, if given, is every worker's TMPDIR (see tfdist.launch.run)."""
    n = options.workers
    secret = secret or job_secret(os.environ)
    if options.mpi:
        return with_temp_dir(plan_mpi_group(options, restart_count, secret), temp_dir)
    ports = pick_free_ports(options.host, 2 * n if options.dtensor else n, exclude)
    tf_addresses = [cluster.join_address(options.host, port) for port in ports[:n]]
    dtensor_addresses = [cluster.join_address(options.host, port) for port in ports[n:]]
    environments = []
    for rank in range(n):
        env = {"TF_CONFIG": json.dumps(cluster.build_tf_config(tf_addresses, rank)),
               "TFDIST_RANK": str(rank),
               "TFDIST_NUM_WORKERS": str(n),
               "TFDIST_RESTART_COUNT": str(restart_count),
               ring_auth.SECRET_ENV: secret}
        if options.devices_per_worker is not None:
            env["TFDIST_SIMULATE_DEVICES"] = str(options.devices_per_worker)
        if options.dtensor:
            env.update(cluster.dtensor_env(dtensor_addresses, rank))
            env.update(cluster.keras_distribution_env(dtensor_addresses, rank))
        environments.append(env)
    rank_ports = [[ports[rank]] + ([ports[n + rank]] if options.dtensor else []) for rank in range(n)]
    return with_temp_dir(GroupPlan(environments, rank_ports), temp_dir)


def with_temp_dir(plan: GroupPlan, temp_dir: Optional[str]) -> GroupPlan:
    if temp_dir is not None:
        for env in plan.environments:
            env["TMPDIR"] = temp_dir
    return plan


def plan_mpi_group(options: LaunchOptions, restart_count: int, secret: str) -> GroupPlan:
    """One process, mpirun, whose ranks share one environment (MPI gives each its rank)."""
    env = {"TFDIST_NUM_WORKERS": str(options.workers),
           "TFDIST_RESTART_COUNT": str(restart_count),
           ring_auth.SECRET_ENV: secret}
    if options.devices_per_worker is not None:
        env["TFDIST_SIMULATE_DEVICES"] = str(options.devices_per_worker)
    return GroupPlan([env], [[]])


def print_dry_run(options: LaunchOptions, plan: GroupPlan, out) -> None:
    if options.mpi:
        shown = {"mpirun": mpirun.mpirun_command(options, mpirun.resolve_mpirun(), list(options.command),
                                          plan.environments[0])}
        shown.update(plan.environments[0], **{ring_auth.SECRET_ENV: SECRET_SHOWN})
        out.write(json.dumps(shown) + "\n")
        out.flush()
        return
    for rank, env in enumerate(plan.environments):
        shown = {"rank": rank, "command": list(options.command)}
        shown.update(env)
        shown["TF_CONFIG"] = json.loads(env["TF_CONFIG"])   # an object reads better than an escaped string
        shown[ring_auth.SECRET_ENV] = SECRET_SHOWN   # a secret printed is a secret in every log
        out.write(json.dumps(shown) + "\n")
    out.flush()
