"""The launcher's workers: start them, watch them, forward signals, end them all."""

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Set

from tfdist import netns
from tfdist.errors import UsageError
from tfdist.launch.mpirun import (MpirunOutput, all_ended, mpirun_command, mpirun_ranks,
                                  resolve_mpirun, session_members)
from tfdist.launch.group import GroupPlan
from tfdist.launch.options import HOST, NETWORK_ENV, PRIVATE, LaunchOptions
from tfdist.launch.output import FinalTextOnly, log, pump, terminal

POLL_SECONDS = 0.05          # how often the launcher looks at its workers
PORT_PROBE_SECONDS = 0.5     # how often --start_timeout probes worker ports
REAP_TIMEOUT_SECONDS = 5.0   # after SIGKILL, and for the output pipes to drain
START_TIMEOUT_EXIT_CODE = 124  # the code `timeout` uses
MPIRUN_HANG_SECONDS = 15.0   # mpirun still up this long after its last rank ended: hung (MpirunTeardownGuard)
MPIRUN_CHECK_SECONDS = 1.0   # how often the guard reads /proc
CHIEF_RANK = 0               # worker 0 is the chief (see tfdist.launch's docstring)


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
            threading.Thread(target=pump, daemon=True, args=(pipe, terminal(stream), rank, prefix, keep))
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
                             f"tfdist.launch.workers.MpirunTeardownGuard); {who}", report.failed_rank)
