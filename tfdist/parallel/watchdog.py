"""One watchdog thread per process: a collective that makes no progress ends the job.

Why not TensorFlow's own timeout: `CommunicationOptions(timeout_seconds=T)` makes
every TF collective start a thread that sleeps T seconds (measured on TF 2.21: a
fast 2-worker loop gained ~4 threads per step and a long job died at step ~2,600
with `std::system_error: Resource temporarily unavailable`, pid_max 32768). So
tfdist builds its strategy without that timeout and guards each piece of work
that runs collectives (a training step, an eval step, a flag agreed between the
workers) with a deadline instead. Arming and disarming are two attribute writes;
the one thread polls, so the cost does not grow with the number of steps.

When a deadline passes, the peer that should have answered is dead or stuck, and
this process is itself stuck inside TensorFlow's C++ collective, where no Python
exception can reach it. So the watchdog prints the cluster error and ends the
process with EXIT_CLUSTER_ERROR (3), as a ClusterError raised in the main thread
would; `tfdist launch` then ends (or restarts) the group.
"""

import contextlib
import os
import sys
import threading
import time
from typing import Optional

from tfdist.errors import EXIT_CLUSTER_ERROR

POLL_SECONDS_MAX = 1.0
# The least a step's first call gets (the default --collective_timeout): it traces the step
# (and, under XLA, compiles it) on every worker before the first collective can complete,
# and a peer slow to trace is not a dead one. A CI run's 2-worker MLP with
# --collective_timeout=10 on a loaded machine was ended in its first step, no peer lost.
FIRST_CALL_SECONDS = 300.0


class Watchdog:
    """Ends the process when a guarded piece of work outlives `timeout_seconds`."""

    def __init__(self, timeout_seconds: float, who: str):
        self.timeout = float(timeout_seconds)
        self.who = who                        # "worker 1 of 2", for the message
        self._deadline: Optional[float] = None
        self._what = ""
        self._seconds = self.timeout
        self._poll = min(POLL_SECONDS_MAX, self.timeout / 10)
        self._thread = threading.Thread(target=self._watch, name="tfdist-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, what: str, seconds: Optional[float] = None):
        """Deadline now + timeout (or `seconds`) for the block; nested guards keep the outer
        one."""
        if self._deadline is not None:
            yield
            return
        self._what = what
        self._seconds = self.timeout if seconds is None else seconds
        self._deadline = time.monotonic() + self._seconds
        try:
            yield
        finally:
            self._deadline = None

    def guard_each_call(self, fn, what: str):
        """fn with each call guarded; the first gets at least FIRST_CALL_SECONDS (it traces)."""
        called = []

        def guarded(*args):
            if called:
                with self.guard(what):
                    return fn(*args)
            called.append(True)
            with self.guard(f"{what} (the first: traced on every worker)",
                            max(self.timeout, FIRST_CALL_SECONDS)):
                return fn(*args)
        return guarded

    def _watch(self) -> None:
        while True:
            time.sleep(self._poll)
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._fire()

    def _fire(self) -> None:
        limit = (f"--collective_timeout={self.timeout:g} s" if self._seconds == self.timeout
                 else f"{self._seconds:g} s")
        message = (f"tfdist: cluster error: {self.who}: {self._what} made no progress for "
                   f"{limit}: a peer died or stopped answering. "
                   f"Check the other workers' logs; `tfdist launch --max_restarts R` restarts "
                   f"the group.\n")
        try:
            sys.stderr.write(message)
            sys.stderr.flush()
        finally:
            os._exit(EXIT_CLUSTER_ERROR)   # the main thread is stuck in C++: nothing else ends it


_watchdogs = {}


def for_process(timeout_seconds: float, who: str) -> Watchdog:
    """The process's one watchdog for this timeout (a strategy lives as long as the process)."""
    key = (float(timeout_seconds), who)
    if key not in _watchdogs:
        _watchdogs[key] = Watchdog(timeout_seconds, who)
    return _watchdogs[key]
