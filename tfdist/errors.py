"""User-facing errors.

A `UsageError` is a mistake the user can fix (a bad flag, a missing dataset, a
batch that does not divide). Entry points print its message as one paragraph and
exit with status 2 instead of showing a TensorFlow stack trace.
"""

import argparse
import sys
from typing import Callable, List


class UsageError(ValueError):
    """A problem with the user's input, explained in the message."""


def require(condition: bool, message: str) -> None:
    """Raises UsageError(message) unless condition holds."""
    if not condition:
        raise UsageError(message)


class ClusterError(RuntimeError):
    """The cluster failed around this process: a peer never joined or stopped answering.

    Entry points print the message and exit with EXIT_CLUSTER_ERROR, so a launcher
    or scheduler can tell it from a crash (1) and a usage error (2).
    """


class Preempted(Exception):
    """SIGTERM arrived; a checkpoint of `step` was saved. Rerun to resume."""

    def __init__(self, step: int, directory: str):
        super().__init__(f"preempted (SIGTERM): saved a checkpoint at step {step} in "
                         f"{directory}; rerun the same command to resume from it.")
        self.step = step


EXIT_USAGE_ERROR = 2
EXIT_CLUSTER_ERROR = 3
EXIT_PREEMPTED = 4


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises UsageError, so flag mistakes read like every other user error."""

    def error(self, message):
        raise UsageError(f"{message}. Usage: {' '.join(self.format_usage().split())}")


def run_command(name: str, handler: Callable[[List[str]], int], argv: List[str]) -> int:
    """`tfdist NAME ARGV...`: handler's exit status; a UsageError is printed as one
    paragraph on stderr and is exit status 2."""
    try:
        return handler(argv)
    except UsageError as error:
        print(f"tfdist {name}: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        return EXIT_USAGE_ERROR
