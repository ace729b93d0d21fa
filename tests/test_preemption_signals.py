"""A preempted process is not cut short by the next SIGTERM (tfdist/train/preemption.py).

Slurm sends a preempted job more than one SIGTERM: to the tasks when the preemption starts,
and to the whole job when it ends the job (at the end of GraceTime, or at once without one),
which examples/slurm/preemptible.sh's batch shell forwards to the tasks again. The first one
asks the run to save and stop; once it has, the rest must not kill the process while it
saves and closes its cluster. Without a request, the previous handler comes back. Real
signals to this process; no TensorFlow.
"""

import os
import signal
import time

from tfdist.train.preemption import PreemptionWatcher


def send_sigterm_to_self():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)   # Python runs the handler at the next bytecode boundary of the main thread


def test_after_a_stop_request_later_sigterms_are_ignored():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with PreemptionWatcher() as watcher:
            send_sigterm_to_self()
            assert watcher.requested
            send_sigterm_to_self()            # a second one inside: the same request
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        send_sigterm_to_self()                # after: would end pytest if it were not ignored
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_without_a_request_the_previous_handler_comes_back():
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        with PreemptionWatcher() as watcher:
            pass
        assert not watcher.requested
        send_sigterm_to_self()
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
