"""`tfdist launch`'s command line: LaunchOptions, validated before anything starts."""

import dataclasses
import os
import shlex
import shutil
from typing import List, Optional, Sequence

from tfdist import cluster
from tfdist.errors import ArgumentParser, require

DESCRIPTION = "Start N local workers with their TF_CONFIG, the torchrun of TensorFlow."
PRIVATE, HOST = "private", "host"
NETWORKS = (PRIVATE, HOST)
NETWORK_ENV = cluster.NETWORK_ENV   # what the workers read


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    workers: int
    command: tuple
    devices_per_worker: Optional[int] = None
    max_restarts: int = 0
    dtensor: bool = False
    dry_run: bool = False
    start_timeout: float = 0.0   # 0: do not wait for the workers' ports to open
    host: str = "127.0.0.1"
    grace_period: float = 5.0
    mpi: bool = False
    mpi_args: tuple = ()
    network: Optional[str] = None   # "private" or "host"; None: private on a loopback --host

    def __post_init__(self):
        require(self.workers >= 1, f"--workers must be >= 1, got {self.workers}.")
        require(self.devices_per_worker is None or self.devices_per_worker >= 0,
                f"--devices_per_worker must be >= 0, got {self.devices_per_worker}.")
        require(self.max_restarts >= 0, f"--max_restarts must be >= 0, got {self.max_restarts}.")
        require(self.start_timeout >= 0, f"--start_timeout must be >= 0 seconds, got {self.start_timeout}.")
        require(self.grace_period > 0, f"--grace_period must be > 0 seconds, got {self.grace_period}.")
        require(len(self.command) > 0,
                "Give the command each worker runs after --, e.g. "
                "tfdist launch --workers 2 -- python -m experiments.train --strategy=multi_worker_mirrored.")
        cluster.split_address(cluster.join_address(self.host, 1), "--host")
        require(self.mpi or not self.mpi_args,
                f"--mpi_args {' '.join(self.mpi_args)!r} needs --mpi (they are mpirun's options).")
        require(self.network in (None,) + NETWORKS,
                f"--network must be one of {', '.join(NETWORKS)}, got {self.network!r}.")
        require(self.network != PRIVATE or is_loopback(self.host),
                f"--network=private gives the workers a loopback of their own, where "
                f"--host={self.host} does not exist. Use --host=127.0.0.1, or --network=host.")
        if self.mpi:
            require(not self.dtensor, "--mpi and --dtensor cannot be combined: DTensor's "
                                      "clients take their addresses from the launcher, MPI's ranks "
                                      "from mpirun. Use --dtensor without --mpi.")
            require(not self.start_timeout, "--start_timeout probes the ports the launcher gives "
                                            "each worker; under --mpi the ranks pick their own. "
                                            "The training's --collective_timeout bounds the start.")


def parse_args(argv: Sequence[str]) -> LaunchOptions:
    argv = list(argv)
    flags, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = ArgumentParser(prog="tfdist launch", description=DESCRIPTION)
    parser.add_argument("--workers", type=int, required=True, help="number of worker processes (N >= 1)")
    parser.add_argument("--devices_per_worker", type=int, default=None,
                        help="sets TFDIST_SIMULATE_DEVICES=K: simulated CPU devices per worker")
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="restart the whole group with fresh ports up to R times after a failure")
    parser.add_argument("--dtensor", action="store_true", help="also set DTENSOR_* for multi-client DTensor")
    parser.add_argument("--dry_run", action="store_true",
                        help="print each worker's environment as JSON lines and start nothing")
    parser.add_argument("--start_timeout", type=float, default=0.0,
                        help="fail when a worker has not opened its TF_CONFIG/DTensor port after S seconds "
                             "(0: no check; the port opens when the worker creates its strategy)")
    parser.add_argument("--host", default="127.0.0.1", help="address the workers listen on (default 127.0.0.1)")
    parser.add_argument("--grace_period", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when ending workers")
    parser.add_argument("--network", choices=NETWORKS, default=None,
                        help="private: the workers share a network of their own, loopback only, "
                             "unreachable from outside the job (default with a loopback --host); "
                             "host: this host's network")
    parser.add_argument("--mpi", action="store_true",
                        help="start the workers with Open MPI's mpirun (for --collective=mpi)")
    parser.add_argument("--mpi_args", default="",
                        help='extra mpirun options, one string, e.g. "--mca btl tcp,self"')
    args, extra = parser.parse_known_args(flags)
    require(not extra, f"Unexpected arguments {' '.join(extra)!r}. Put the command the workers run after --, "
                       f"e.g. tfdist launch --workers 2 -- python train.py.")
    return LaunchOptions(workers=args.workers, command=tuple(command),
                         devices_per_worker=args.devices_per_worker, max_restarts=args.max_restarts,
                         dtensor=args.dtensor, dry_run=args.dry_run, start_timeout=args.start_timeout,
                         host=args.host, grace_period=args.grace_period, mpi=args.mpi,
                         mpi_args=tuple(shlex.split(args.mpi_args)), network=args.network)


def resolve_command(command: Sequence[str]) -> List[str]:
    """Finds the executable up front: a typo should fail in milliseconds, before any worker starts."""
    program = command[0]
    if os.sep in program:
        require(os.path.isfile(program) and os.access(program, os.X_OK),
                f"Cannot start worker command {program!r}: no such executable file.")
        return list(command)
    found = shutil.which(program)
    require(found is not None,
            f"Cannot start worker command {program!r}: not found on PATH. "
            f"Check the spelling, or give the full path.")
    return [found, *command[1:]]
