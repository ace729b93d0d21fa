"""Soak: does a long 2-worker run hold its threads, memory and open files flat?

    from benchmarks import soak
    rows = soak.run_suite(["auto", "tcp"], steps=20000, checkpoint_every=200, timeout=2400)

For each collective choice, one `tfdist launch --workers 2 -- python -m
experiments.train --strategy=multi_worker_mirrored --model=mlp --dataset=synthetic
--collective=C --model_dir=... --checkpoint_every=... --eval_every=100` job, as a long real job runs
(for mpi, `tfdist launch --mpi`: Open MPI's mpirun starts the ranks). The choice
"pipeline" runs `--strategy=pipeline --pipeline_stages=2 --microbatches=4` instead: a
stage in each worker process. Each worker
process (found among the launcher's descendants by its rank variable: TFDIST_RANK
for the launcher's own children, OMPI_COMM_WORLD_RANK for mpirun's) is sampled
from outside through /proc/PID: threads ("Threads" in status), resident memory
("VmRSS") and open files (entries of fd/). The first sample is taken as soon as
the chief logs its first step line (--log_every=10: step 10, a few steps later
under load; the row says which), then one every POLL_SECONDS until
the process is gone, so the last sample is the last one before it exited.

Pass (issue 12): exit 0, every step trained, threads at the end <= 2x those after
the first step, RSS at the end <= 1.5x, and, over runs of at least
MIN_STEPS_FOR_GROWTH steps sampled after WARMUP_STEPS, RSS growth of at most
MAX_RSS_KB_PER_STEP a step from the first sample past WARMUP_STEPS (pace_from_step)
to the last, as the least-squares slope of RSS over step through every sample in
between (the ratio alone let a 3 KB-a-step leak pass at 20,000 steps; two end points
alone read a warm-up that ran a little past WARMUP_STEPS as a pace). A failing or
timed-out run is a row, not an exception: the suite exists to show leaks, so it
must survive them.
"""

import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from tfdist.config import COLLECTIVES
from tfdist.errors import require

log = logging.getLogger("tfdist")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = 2
POLL_SECONDS = 0.1          # /proc sampling and log reading; ~0.2 ms of work per poll
STOP_GRACE_SECONDS = 30     # a timed-out launcher gets this long to end its workers
MAX_THREADS_RATIO = 2.0
MAX_RSS_RATIO = 1.5
# A leak of a few KB a step stays under the ratio for tens of thousands of steps: Keras'
# loss tracker read every step (two TensorFlow all-reduces, leaking in TensorFlow) grew
# shm runs 3 KB a step, 1.06x at 20,000. The run's own per-step loss list is 0.03 KB.
MAX_RSS_KB_PER_STEP = 0.5
# The pace is taken from the first sample at or after WARMUP_STEPS: before it a process is
# still allocating for good (traces, buffers, the first checkpoints). The pipeline's
# driver grew 926 -> 948 MB by step 2,580, then 0.25 KB a step to step 38,610.
WARMUP_STEPS = 2000
MIN_STEPS_FOR_GROWTH = 5000   # sampled after warm-up; shorter runs are reported, not judged
# The chief's progress line, as the launcher prefixes it: "[worker 0] tfdist 12:00:00 step 7/500 ..."
STEP_LINE = re.compile(r"\[worker 0\] .*?\bstep (\d+)/(\d+)\b")
FAILURE_LINE = re.compile(r"worker (\d+) (exited with code -?\d+|was killed by \w+ \(\d+\))")
# With a validation every EVAL_EVERY steps (synthetic's test split: 16 batches of 64), as a
# job would validate. Evaluation grew each of 2 workers by 41 KB at 4 eval batches and 120 KB
# at 40 (TensorFlow all-reduces per eval batch, the dataset distributed anew each time), so
# about 70 KB here, 0.7 KB a step at this pace; a soak without evaluations never saw it.
# After 9947d71's fixes this suite still measured 70-115 KB an evaluation: a new iterator per
# evaluation, and the pipeline's eval loss left on its stage worker (both fixed; docs/benchmarks.md, Soak).
EVAL_EVERY = 100
TRAIN_FLAGS = ("--strategy=multi_worker_mirrored", "--model=mlp", "--dataset=synthetic",
               "--optimizer=adam", "--global_batch_size=64", "--seed=0",
               f"--eval_every={EVAL_EVERY}")
# Every 10 steps, as a job would log (each log line also writes TensorBoard scalars):
# the first sample lands within a few steps of the first; its step is in the row.
LOG_EVERY = 10
# How a worker's environment names its rank: tfdist launch's own workers, then Open MPI's ranks.
RANK_VARIABLES = (b"TFDIST_RANK", b"OMPI_COMM_WORLD_RANK")


# --------------------------------------------------------------------------- settings

# Besides the collectives: "pipeline", 2 stages in the 2 worker processes (worker 0 drives,
# worker 1 serves its stage; tfdist/parallel/pipeline/cluster.py), whose boundary tensors
# cross TensorFlow's runtime every micro-batch. Later flags override TRAIN_FLAGS' strategy.
PIPELINE_JOB = "pipeline"
PIPELINE_FLAGS = ("--strategy=pipeline", "--pipeline_stages=2", "--microbatches=4")
JOBS = tuple(COLLECTIVES) + (PIPELINE_JOB,)


def parse_collectives(text: str) -> Tuple[str, ...]:
    """"auto,tcp" -> ("auto", "tcp"); an unknown name is a UsageError naming the valid ones."""
    names = tuple(name.strip() for name in str(text).split(",") if name.strip())
    require(names, f"--collectives names none, got {text!r}. Valid choices: {', '.join(JOBS)}.")
    for name in names:
        require(name in JOBS,
                f"Unknown collective {name!r} in --collectives={text!r}. "
                f"Valid choices: {', '.join(JOBS)}.")
    twice = sorted({name for name in names if names.count(name) > 1})
    # Each job gets a run directory by name; to repeat one, run the suite again.
    require(not twice, f"--collectives={text!r} names {', '.join(twice)} more than once; "
                       f"name each job once.")
    return names


def job_flags(job: str) -> List[str]:
    """The training flags that make a soak job of `job` (a collective, or the pipeline)."""
    return list(PIPELINE_FLAGS) if job == PIPELINE_JOB else [f"--collective={job}"]


def check_job_settings(steps: int, checkpoint_every: int, timeout: float) -> None:
    require(steps >= 1, f"--steps must be >= 1, got {steps}.")
    require(checkpoint_every >= 1, f"--checkpoint_every must be >= 1, got {checkpoint_every}.")
    require(timeout > 0, f"--run_timeout must be > 0 seconds, got {timeout}.")


# --------------------------------------------------------------------------- processes

def children_of() -> Dict[int, List[int]]:
    """ppid -> pids of its children, for every process now in /proc."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                ppid = int(f.read().split("PPid:")[1].split()[0])
        except (OSError, IndexError, ValueError):   # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def rank_of(pid: int) -> Optional[int]:
    """The worker rank in the process's environment (RANK_VARIABLES), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:   # gone, or not ours to read
        return None
    for name in RANK_VARIABLES:
        for entry in environ:
            if entry.startswith(name + b"="):
                value = entry.split(b"=", 1)[1]
                return int(value) if value.isdigit() else None
    return None


def worker_pids(launcher_pid: int) -> Dict[int, int]:
    """rank -> pid of each worker among the launcher's descendants: the nearest ones
    with a rank variable (tfdist launch's children carry TFDIST_RANK; under --mpi the
    ranks are mpirun's children, the launcher's grandchildren, with OMPI_COMM_WORLD_RANK).
    A worker's own children inherit its variable and are not looked at."""
    children, found = children_of(), {}
    pending = list(children.get(launcher_pid, ()))
    while pending:
        pid = pending.pop()
        rank = rank_of(pid)
        if rank is None:
            pending.extend(children.get(pid, ()))
        else:
            found.setdefault(rank, pid)
    return found


@dataclasses.dataclass(frozen=True)
class Sample:
    threads: int
    rss_kb: int
    fds: int
    step: int        # the chief's newest logged step when the sample was taken


def sample(pid: int, step: int) -> Optional[Sample]:
    """The process's threads, RSS and open files now; None once it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    if "VmRSS" not in fields:   # a zombie has no memory left to report
        return None
    return Sample(int(fields["Threads"]), int(fields["VmRSS"].split()[0]), fds, step)


def end_launcher(launcher: subprocess.Popen, pids: Sequence[int]) -> None:
    """SIGTERM (the launcher forwards it and ends its workers), then SIGKILL to all."""
    launcher.send_signal(signal.SIGTERM)
    try:
        launcher.wait(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait(timeout=STOP_GRACE_SECONDS)
    for pid in pids:   # tfdist launch's workers lead their own process groups; mpirun's ranks may not
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
                break
            except (ProcessLookupError, PermissionError):
                continue


class LogFollower:
    """Reads the lines appended to a file since the last call (a `tail -f` without a thread)."""

    def __init__(self, path: str):
        self.path = path
        self._offset = 0
        self._partial = ""

    def new_lines(self) -> List[str]:
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        # \r too: a progress bar redraws in place, and each redraw is a line to us.
        *lines, self._partial = re.split(r"[\r\n]", self._partial + data.decode("utf-8", "replace"))
        return lines


def launch_command(train_flags: Sequence[str], max_restarts: int = 0, mpi: bool = False) -> List[str]:
    """tfdist launch of the soak's training command (with --mpi: under Open MPI's mpirun);
    later flags override earlier ones."""
    return [sys.executable, "-m", "tfdist.launch", "--workers", str(WORKERS),
            "--max_restarts", str(max_restarts), *(["--mpi"] if mpi else []), "--",
            sys.executable, "-m", "experiments.train", *TRAIN_FLAGS, *train_flags]


def start_launcher(command: Sequence[str], log_path: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    with open(log_path, "wb") as out:   # the child keeps its own copy of the descriptor
        return subprocess.Popen(list(command), cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT)


# --------------------------------------------------------------------------- one soak run

@dataclasses.dataclass
class WorkerTrace:
    first: Optional[Sample] = None
    last: Optional[Sample] = None
    peak_threads: int = 0
    settled: Optional[Sample] = None   # the first at or after WARMUP_STEPS
    # From `settled` on, the newest sample of each logged step: at most steps / --log_every.
    paced: Dict[int, Sample] = dataclasses.field(default_factory=dict)

    def add(self, s: Sample) -> None:
        self.first = self.first or s
        self.settled = self.settled or (s if s.step >= WARMUP_STEPS else None)
        if self.settled:
            self.paced[s.step] = s
        self.last = s
        self.peak_threads = max(self.peak_threads, s.threads)


@dataclasses.dataclass
class RunOutcome:
    exit_code: Optional[int]     # the launcher's; None when the suite ended it at the timeout
    wall_seconds: float
    steps: int                   # the chief's last logged step
    failures: Dict[int, str]     # rank -> how it failed, from the launcher's log
    traces: Dict[int, WorkerTrace]
    log_tail: str


def watch(launcher: subprocess.Popen, log_path: str, timeout: float) -> RunOutcome:
    """Samples both workers from the first step until they exit (or the timeout ends them)."""
    started = time.monotonic()
    follower, traces = LogFollower(log_path), {r: WorkerTrace() for r in range(WORKERS)}
    pids, step, failures, timed_out = {}, 0, {}, False
    while True:
        step, failures = _read_log(follower.new_lines(), step, failures)
        if len(pids) < WORKERS:
            pids.update(worker_pids(launcher.pid))
        if step >= 1:
            for rank, pid in pids.items():
                s = sample(pid, step)
                if s:
                    traces[rank].add(s)
        if launcher.poll() is not None:
            break
        if time.monotonic() - started > timeout:
            timed_out = True
            end_launcher(launcher, list(pids.values()))
            break
        time.sleep(POLL_SECONDS)
    step, failures = _read_log(follower.new_lines(), step, failures)
    with open(log_path, errors="replace") as f:
        tail = f.read()[-3000:]
    return RunOutcome(None if timed_out else launcher.returncode, time.monotonic() - started,
                      step, failures, traces, tail)


def _read_log(lines, step, failures):
    for line in lines:
        match = STEP_LINE.search(line)
        if match:
            step = max(step, int(match.group(1)))
        failed = FAILURE_LINE.search(line) if line.startswith("[tfdist launch]") else None
        if failed:
            failures.setdefault(int(failed.group(1)), failed.group(2))
    return step, failures


def soak_once(collective: str, steps: int, checkpoint_every: int, timeout: float,
              work_dir: str) -> RunOutcome:
    run_dir = os.path.join(work_dir, collective)
    os.makedirs(run_dir)
    command = launch_command([*job_flags(collective), f"--train_steps={steps}",
                              f"--model_dir={run_dir}/model", f"--checkpoint_every={checkpoint_every}",
                              f"--log_every={LOG_EVERY}"], mpi=collective == "mpi")
    launcher = start_launcher(command, os.path.join(run_dir, "launch.log"))
    try:
        return watch(launcher, os.path.join(run_dir, "launch.log"), timeout)
    finally:
        if launcher.poll() is None:   # an exception in watch: never leave a job behind
            end_launcher(launcher, [])


# --------------------------------------------------------------------------- rows

def _ratio(last: Optional[int], first: Optional[int]) -> str:
    return f"{last / first:.2f}" if first and last is not None else ""


def rss_kb_per_step(samples: Sequence[Sample]) -> Optional[float]:
    """The least-squares slope of RSS over step: a leak's pace, which one late sample at
    either end (a warm-up still finishing, the allocator giving memory back) cannot set
    alone. None without two distinct steps."""
    if len({s.step for s in samples}) < 2:
        return None
    mean_step = sum(s.step for s in samples) / len(samples)
    mean_rss = sum(s.rss_kb for s in samples) / len(samples)
    covariance = sum((s.step - mean_step) * (s.rss_kb - mean_rss) for s in samples)
    return covariance / sum((s.step - mean_step) ** 2 for s in samples)


def growth_ok(samples: Sequence[Sample]) -> bool:
    """Judged only from samples past warm-up that span MIN_STEPS_FOR_GROWTH steps or more
    (see MAX_RSS_KB_PER_STEP and WARMUP_STEPS)."""
    if not samples or samples[-1].step - samples[0].step < MIN_STEPS_FOR_GROWTH:
        return True
    return rss_kb_per_step(samples) <= MAX_RSS_KB_PER_STEP


def worker_exit(outcome: RunOutcome, rank: int) -> str:
    if outcome.exit_code is None:
        return "ended at timeout"
    if rank in outcome.failures:
        return outcome.failures[rank]
    return "0" if outcome.exit_code == 0 else "ended by launcher"


def rows_of(collective: str, steps: int, outcome: RunOutcome) -> List[Dict]:
    rows = []
    for rank, trace in sorted(outcome.traces.items()):
        first, last = trace.first or Sample(0, 0, 0, 0), trace.last or Sample(0, 0, 0, 0)
        threads_ratio, rss_ratio = _ratio(last.threads, first.threads), _ratio(last.rss_kb, first.rss_kb)
        passed = (outcome.exit_code == 0 and outcome.steps == steps and trace.first is not None
                  and last.threads <= MAX_THREADS_RATIO * first.threads
                  and last.rss_kb <= MAX_RSS_RATIO * first.rss_kb
                  and growth_ok(list(trace.paced.values())))
        per_step = rss_kb_per_step(list(trace.paced.values()))
        rows.append({
            "collective": collective, "worker": rank, "steps": f"{outcome.steps}/{steps}",
            "exit": worker_exit(outcome, rank), "wall_s": round(outcome.wall_seconds),
            "threads_first": first.threads, "threads_last": last.threads,
            "threads_ratio": threads_ratio, "threads_peak": trace.peak_threads,
            "rss_first_mb": round(first.rss_kb / 1024), "rss_last_mb": round(last.rss_kb / 1024),
            "rss_ratio": rss_ratio,
            "rss_kb_per_step": "" if per_step is None else f"{per_step:.2f}",
            "pace_from_step": trace.settled.step if trace.settled else "",
            "fds_first": first.fds, "fds_last": last.fds,
            "first_sample_step": first.step, "last_sample_step": last.step,
            "pass": "yes" if passed else "NO",
        })
    return rows


def run_suite(collectives: Sequence[str], steps: int, checkpoint_every: int,
              timeout: float) -> List[Dict]:
    """One 2-worker soak run per collective choice, one row per worker."""
    check_job_settings(steps, checkpoint_every, timeout)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tfdist-soak-") as work_dir:
        for collective in collectives:
            log.info("soak %s: 2 workers, %d steps, checkpoint every %d (timeout %.0f s)",
                     collective, steps, checkpoint_every, timeout)
            outcome = soak_once(collective, steps, checkpoint_every, timeout, work_dir)
            new = rows_of(collective, steps, outcome)
            for row in new:
                log.info("soak %s worker %s: steps %s, exit %s, threads %s -> %s, RSS %s -> %s MB, "
                         "fds %s -> %s, %s s", collective, row["worker"], row["steps"], row["exit"],
                         row["threads_first"], row["threads_last"], row["rss_first_mb"],
                         row["rss_last_mb"], row["fds_first"], row["fds_last"], row["wall_s"])
            if outcome.exit_code != 0:
                log.info("soak %s failed (exit %s); the launcher's log ends:\n%s", collective,
                         outcome.exit_code, outcome.log_tail)
            rows += new
    return rows
