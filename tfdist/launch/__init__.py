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
  TMPDIR                 a directory of this launch (tfdist-job-*, 0700, under your
                         TMPDIR), removed when the launch ends: what workers leave
                         in the temp dir goes with it. A multi-process worker ends
                         with os._exit (TensorFlow's teardown waits for its peers),
                         which skips the atexit handlers that delete TensorFlow's
                         autograph files, and a killed worker runs none: per run,
                         dozens of files stayed in /tmp, and Open MPI's session dirs
                         under --mpi.

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
race, see tfdist.launch.workers.MpirunTeardownGuard): the launcher kills it and exits with the failed
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

Modules: options.py (the flags), group.py (each attempt's ports and environments),
mpirun.py (--mpi), output.py (prefixed whole lines), workers.py (start, watch, end);
this file runs the attempts.
"""

import os
import shutil
import sys
import tempfile
from typing import List, Optional, Sequence, Set, Tuple

from tfdist import netns
from tfdist.errors import EXIT_USAGE_ERROR, require, run_command
from tfdist.launch.group import job_secret, plan_group, print_dry_run
from tfdist.launch.mpirun import resolve_mpirun
from tfdist.launch.options import HOST, PRIVATE, LaunchOptions, is_loopback, parse_args, resolve_command
from tfdist.launch.output import log
from tfdist.launch.workers import Outcome, SignalForwarder, WorkerGroup


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
        temp_dir = tempfile.mkdtemp(prefix="tfdist-job-")
        try:
            outcome, interrupted = run_attempts(options, command, network, temp_dir)
        finally:
            shutil.rmtree(temp_dir, ignore_errors=True)
    finally:
        if network:
            network.close()
    if not (outcome.ok or interrupted):
        log(failure_advice(outcome, options.max_restarts, private=network is not None))
    return outcome.exit_code


def run_attempts(options: LaunchOptions, command: List[str], network,
                 temp_dir: Optional[str] = None) -> Tuple["Outcome", bool]:
    """The last attempt's outcome, and whether a signal of the user's ended it."""
    used_ports: Set[int] = set()
    secret = job_secret(os.environ)   # one per launch: restarted workers are the same job
    with SignalForwarder() as signals:
        for attempt in range(options.max_restarts + 1):
            plan = plan_group(options, attempt, exclude=used_ports,   # fresh ports: old ones may linger
                              secret=secret, temp_dir=temp_dir)
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
    """`python -m tfdist.launch ...`, as `tfdist launch ...`: a usage error is one paragraph, exit 2."""
    return run_command("launch", launch, list(sys.argv[1:] if argv is None else argv))
