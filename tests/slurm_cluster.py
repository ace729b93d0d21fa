"""A real single-node Slurm for tests: munged, slurmctld and slurmd in a temp dir.

    with SlurmCluster.started() as slurm:
        job = slurm.sbatch(["examples/slurm/train-one-node.sbatch", "--train_steps=10"], output=path)
        slurm.wait(job)["ExitCode"]      # "0:0"

Everything the daemons need lives in one directory: slurm.conf (used through
SLURM_CONF by every daemon and command), the munge key and munge's own socket,
state, spool, pid and log files, on ports picked free at start. So it never
touches /etc/slurm, /etc/munge or a Slurm already running system-wide, and two
of these can run side by side. The node is called `localhost` (NodeAddr
127.0.0.1): tfdist turns the node list into TF_CONFIG, so every worker address
is loopback. Daemons run in the foreground as children of the test process;
`stop()` ends them and then every process that still carries this cluster's
SLURM_CONF in its environment (job steps, slurmstepd), so nothing is left behind.

Needs root (slurmd starts jobs as their user, munged runs as user munge) and
Debian's slurm-wlm + munge; `unavailable_reason()` says why not, for a skip.
"""

import contextlib
import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

import pytest

NODE = "localhost"
DAEMON_BINARIES = ("munged", "slurmctld", "slurmd")
CLIENT_BINARIES = ("sbatch", "srun", "scontrol", "scancel", "sinfo")
# Terminal job states (`scontrol show job`); a job in one of these is over.
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"}
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")


def which(name: str) -> Optional[str]:
    """Finds a binary also in sbin directories, which a non-root PATH often lacks."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN_DIRS))


def unavailable_reason() -> Optional[str]:
    """Why a real Slurm cannot run here (a skip reason), or None if it can."""
    missing = [name for name in DAEMON_BINARIES + CLIENT_BINARIES if which(name) is None]
    if missing:
        return f"Slurm not installed: apt-get install slurm-wlm munge (missing: {', '.join(missing)})"
    if os.geteuid() != 0:
        return ("Slurm tests need root: they start munged, slurmctld and slurmd "
                "(run as root, as CI does; apt-get install slurm-wlm munge)")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "Slurm tests need the 'munge' user: apt-get install munge"
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Ports handed to jobs this session: two jobs given the same pair before either binds it
# would collide.
_handed_out = set()


def free_port_pair() -> int:
    """A port P with P+1 free too (`tfdist tf-config --slurm` gives task i port P+i), below
    the kernel's ephemeral range and never handed out twice in this session. A port the
    kernel finds free (bind to 0) lies in that range, where, until the job binds it (after
    the queue and TensorFlow's import: seconds to minutes on a loaded machine), any
    outgoing connection may take it: a CI run's job ended "port 36420 of task worker:1 is
    already taken by another process", which tfdist reports rightly."""
    first_ephemeral = ephemeral_ports()[0]
    choices = random.Random()
    for _ in range(1000):
        port = choices.randrange(max(1024, first_ephemeral - 8000), first_ephemeral - 1)
        pair = {port, port + 1}
        if pair & _handed_out or not all(bindable(p) for p in pair):
            continue
        _handed_out.update(pair)
        return port
    raise RuntimeError(f"found no two consecutive free ports below {first_ephemeral} on 127.0.0.1")


def ephemeral_ports() -> tuple:
    """The kernel's range for ports it picks itself (Linux' default 32768-60999)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(part) for part in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture(scope="session")
def slurm():
    """One real single-node Slurm for the whole session (skips where none can run)."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with SlurmCluster.started() as cluster:
        yield cluster
    leftovers = cluster.processes()
    assert not leftovers, f"the Slurm test cluster left processes behind: {leftovers}"


def node_hardware() -> Dict[str, str]:
    """This machine as slurmd sees it (`slurmd -C`), so the node is never drained
    for claiming more CPUs or memory than it has."""
    text = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True,
                          timeout=30, check=True).stdout
    fields = dict(re.findall(r"(\w+)=(\S+)", text.splitlines()[0]))
    keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
    return {key: fields[key] for key in keys if key in fields}


# The session's partition. FORCE:2: two jobs may share a CPU, so a test can run two 2-task
# jobs at once on a 2-core machine.
SHARED_PARTITION = (f"PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP "
                    f"OverSubscribe=FORCE:2")


def preemptible_conf(grace_time: int, kill_wait: int, requeue_delay: int) -> dict:
    """SlurmCluster.started(**preemptible_conf(...)): a cluster with a preemptible queue.

    Partitions on the one node: a job in `high` that needs the node preempts the jobs of
    `low` and `nograce` (PriorityTier). Slurm signals a `low` job's tasks (SIGTERM), gives it
    `grace_time` seconds (GraceTime), then ends it as it ends any job (SIGCONT and SIGTERM
    to the tasks and the batch shell, SIGKILL `kill_wait` seconds later: KillWait) and
    requeues it (PreemptMode=REQUEUE); a `nograce` job is ended and requeued at once. No
    oversubscription: the node is either a low job's or the high job's. Process tracking
    by cgroups where this machine lets slurmd make them (what clusters run), else by the
    process tree. A random first job id keeps two such clusters' cgroups (named after job
    ids) apart; scheduling every 2 s starts a requeued job soon after its `requeue_delay`
    (a passing begin time is no event: Slurm's default is a pass every 60 s)."""
    partitions = f"""PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SchedulerParameters=sched_interval=2,bf_interval=2
PartitionName=low Nodes={NODE} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={grace_time}
PartitionName=nograce Nodes={NODE} MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=0
PartitionName=high Nodes={NODE} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF"""
    return dict(partitions=partitions, kill_wait=kill_wait, requeue_delay=requeue_delay,
                proctrack="cgroup" if cgroup_v1_usable() else "linuxproc",
                first_job_id=random.randrange(10 ** 6, 6 * 10 ** 7))


def cgroup_v1_usable() -> bool:
    """Whether slurmd's proctrack/cgroup (cgroup v1, freezer) can work here: the freezer
    hierarchy is mounted and root may make a cgroup in it."""
    probe = os.path.join(CGROUP_FREEZER, f"tfdist-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
        return True
    except OSError:
        return False


CGROUP_FREEZER = "/sys/fs/cgroup/freezer"
# Process tracking only (no limits); the daemons read cgroup.conf beside slurm.conf.
CGROUP_CONF = """CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
"""


def slurm_conf(root: str, munge_socket: str, ctld_port: int, slurmd_port: int,
               partitions: str = SHARED_PARTITION, kill_wait: int = 10, proctrack: str = "linuxproc",
               requeue_delay: Optional[int] = None, first_job_id: int = 1) -> str:
    """slurm.conf of a throwaway single-node cluster. `proctrack`: "linuxproc" (the session's)
    or "cgroup" (Slurm's default where cgroups exist, so what clusters run). `requeue_delay`:
    seconds a requeued job waits before it may start again (Slurm takes it from AuthInfo's
    cred_expire, also the lifetime of a step's credential: 120 by default)."""
    hardware = " ".join(f"{key}={value}" for key, value in node_hardware().items())
    # slurmctld only runs where SlurmctldHost names this host; the address forces loopback.
    controller = socket.gethostname().split(".")[0]
    return f"""# Written by tests/slurm_cluster.py: a throwaway single-node cluster.
ClusterName=tfdisttest
SlurmctldHost={controller}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}{f",cred_expire={requeue_delay}" if requeue_delay else ""}
FirstJobId={first_job_id}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/{proctrack}
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Keep finished jobs visible to `scontrol show job` (no accounting here) for 10 minutes.
MinJobAge=600
KillWait={kill_wait}
NodeName={NODE} NodeAddr=127.0.0.1 {hardware} State=UNKNOWN
{partitions}
"""


class SlurmCluster:
    """One single-node Slurm; start() brings it up, stop() ends every process of it."""

    def __init__(self, root: Optional[str] = None, **conf):
        # Not pytest's tmp_path: its parents are 0700 root, and munged (user munge) must
        # reach its own directory.
        self.root = root or tempfile.mkdtemp(prefix="tfdist-slurm-")
        os.chmod(self.root, 0o755)
        self.conf = os.path.join(self.root, "slurm.conf")
        self.munge_dir = os.path.join(self.root, "munge")
        self.munge_socket = os.path.join(self.munge_dir, "munge.socket")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        for name in list(self.env):   # an enclosing job's variables would leak into ours
            if name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and name != "SLURM_CONF":
                del self.env[name]
        self.daemons: Dict[str, subprocess.Popen] = {}
        self.conf_options = conf   # slurm_conf's keywords

    @classmethod
    @contextlib.contextmanager
    def started(cls, timeout: float = 90, **conf):
        """A running cluster; on leaving, every process of it ends and, unless something
        failed (then its logs stay for a look), its directory goes. `conf`: slurm_conf's
        keywords (partitions=..., kill_wait=...)."""
        cluster = cls(**conf)
        try:
            cluster.start(timeout)
            yield cluster
        finally:
            cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)

    # ------------------------------------------------------------------ start

    def start(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        for name in ("state", "spool"):
            os.makedirs(os.path.join(self.root, name), exist_ok=True)
        self._start_munged(deadline)
        with open(self.conf, "w") as f:
            f.write(slurm_conf(self.root, self.munge_socket, free_port(), free_port(), **self.conf_options))
        if self.conf_options.get("proctrack") == "cgroup":
            with open(os.path.join(self.root, "cgroup.conf"), "w") as f:   # read beside slurm.conf
                f.write(CGROUP_CONF)
        self._spawn("slurmctld", [which("slurmctld"), "-D", "-i", "-f", self.conf])
        self._await(deadline, "slurmctld to answer `scontrol ping`",
                    lambda: "UP" in self.command(["scontrol", "ping"], check=False).stdout)
        self._spawn("slurmd", [which("slurmd"), "-D", "-N", NODE, "-f", self.conf])
        self._await(deadline, f"node {NODE} to be idle", lambda: self.node_state() == "idle")

    def _start_munged(self, deadline: float) -> None:
        munge = pwd.getpwnam("munge")
        # munged wants its socket's directory executable by all (clients must reach it),
        # writable only by munge.
        os.makedirs(self.munge_dir)
        os.chmod(self.munge_dir, 0o755)
        key = os.path.join(self.munge_dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))   # what `mungekey` makes: 1 KiB of random bytes
        os.chmod(key, 0o400)
        for path in (self.munge_dir, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        files = {flag: os.path.join(self.munge_dir, name) for flag, name in
                 (("--pid-file", "munged.pid"), ("--log-file", "munged.log"), ("--seed-file", "munged.seed"))}
        command = [which("munged"), "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
                   "--origin=127.0.0.1", *(f"{flag}={path}" for flag, path in files.items())]
        self._spawn("munged", command, user=munge.pw_uid, group=munge.pw_gid, extra_groups=[])
        self._await(deadline, "munged's socket", lambda: os.path.exists(self.munge_socket))

    def _spawn(self, name: str, command: List[str], **kwargs) -> None:
        log = open(os.path.join(self.root, f"{name}.out"), "w")
        self.daemons[name] = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)
        log.close()

    def _await(self, deadline: float, what: str, ready) -> None:
        while not ready():
            dead = {name: p.returncode for name, p in self.daemons.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                problem = f"exited {dead}" if dead else "timed out"
                raise RuntimeError(f"Slurm test cluster in {self.root}: waiting for {what}: {problem}.\n"
                                   f"{self.logs_tail()}")
            time.sleep(0.2)

    def logs_tail(self, lines: int = 15) -> str:
        parts = []
        for name in ("munge/munged.log", "slurmctld.log", "slurmd.log",
                     "munged.out", "slurmctld.out", "slurmd.out"):
            path = os.path.join(self.root, name)
            if os.path.exists(path):
                tail = open(path, errors="replace").read().splitlines()[-lines:]
                parts.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # ------------------------------------------------------------------ use

    def command(self, args: List[str], timeout: float = 60, check: bool = True, **kwargs):
        """Runs a Slurm client command against this cluster (SLURM_CONF set)."""
        result = subprocess.run([which(args[0]), *args[1:]], env=kwargs.pop("env", self.env),
                                capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def node_state(self) -> str:
        return self.command(["sinfo", "-h", "-n", NODE, "-o", "%T"], check=False).stdout.strip()

    def sbatch(self, args: List[str], output: str, cwd: str, env: Optional[dict] = None) -> str:
        """Submits a batch job; returns its id. `output` gets the job's stdout and stderr."""
        result = self.command(["sbatch", "--parsable", f"--output={output}", f"--chdir={cwd}", *args],
                              cwd=cwd, env=dict(self.env, **(env or {})))
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> Dict[str, str]:
        """`scontrol show job` as a dict: JobState, ExitCode ("4:0" = exit 4, no signal), ..."""
        text = self.command(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, timeout: float, until=lambda job: job["JobState"] in FINAL_STATES):
        """Polls the job until `until(job)` (by default: it ended); cancels it on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if until(job):
                return job
            if time.monotonic() > deadline:
                self.command(["scancel", job_id], check=False)
                raise TimeoutError(f"Slurm job {job_id} still {job['JobState']} after {timeout:.0f} s")
            time.sleep(0.25)

    # ------------------------------------------------------------------ stop

    def processes(self) -> List[int]:
        """Pids of every process started for this cluster: they carry its SLURM_CONF
        (daemons, slurmstepd and job tasks inherit it), whoever their parent is now."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:   # gone meanwhile, or a zombie
                continue
        return found

    def stop(self, timeout: float = 30) -> None:
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            self.command(["scancel", "--user=root", "--full"], check=False, timeout=15)
        for name in ("slurmd", "slurmctld", "munged"):
            if name in self.daemons:
                self._end(self.daemons[name], timeout)
        # Job tasks and slurmstepd outlive slurmd; they are ours by their SLURM_CONF.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.processes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + timeout / 2
            while self.processes() and time.monotonic() < deadline:
                time.sleep(0.2)

    @staticmethod
    def _end(process: subprocess.Popen, timeout: float) -> None:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout)
