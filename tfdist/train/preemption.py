"""Preemption: SIGTERM asks the run to save at the next step boundary and stop.

Schedulers (Slurm, Kubernetes, spot VMs) send SIGTERM some seconds before they
kill. The handler only sets a flag; the loop sees it after the step in flight,
agrees on it with every worker (so all save the same step), saves a checkpoint
and raises `Preempted`, which entry points turn into exit code EXIT_PREEMPTED.
Rerunning the same command resumes from that checkpoint.
"""

import signal
import threading


class PreemptionWatcher:
    """Context manager that turns SIGTERM into a flag (main thread only)."""

    def __init__(self, signals=(signal.SIGTERM,)):
        self.signals = signals
        self.requested = False
        self._previous = {}

    def _handle(self, signum, frame):
        del frame
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            # After a stop was asked for, the process is on its way out (saving, closing its
            # cluster, exit 4), and a second TERM must not cut that short: Slurm sends one to
            # the tasks and another to the whole job (a batch script forwarding it, the end of
            # a preemption's GraceTime), and each is the same request.
            signal.signal(signum, signal.SIG_IGN if self.requested else handler)
        return False
