"""Chaos: SIGKILLs of random workers under `tfdist launch --max_restarts`, and what survives.

    from benchmarks import chaos
    rows = chaos.run_suite(kills=10, steps=640, checkpoint_every=20, seed=0,
                           collective="auto", timeout=900)

Two runs of one 2-worker training command (soak's mlp on synthetic data, with
--model_dir, --checkpoint_every C, --log_every=1):
  1. uninterrupted, under `tfdist launch --workers 2`;
  2. under `tfdist launch --workers 2 --max_restarts KILLS`, where the suite
     SIGKILLs one worker KILLS times in a row. Which worker, and at which step,
     come from random.Random(seed). A kill waits until the attempt has resumed
     and committed a checkpoint of its own (the chief's checkpoints.json names
     a step past the one it resumed from), so every attempt gets somewhere; the
     target step is uniform in (R + C, R + 3C] for an attempt resumed at R.

Then, from the chief's log and files:
  - kills delivered and restarts the launcher reported;
  - the final weights (every variable of the chief's newest checkpoint,
    optimizer slots included) against the uninterrupted run's: the largest
    ||chaos - reference|| / ||reference|| over variables (goal: <= 1e-6);
  - examples trained twice, counted: the data stream is deterministic given the
    seed and the step a job starts at (pipeline.train_dataset_fn(..., start_step)),
    so for every epoch a restart fell in, the examples of the steps each attempt
    kept (resumed at R_i, superseded at R_i+1) are generated again and compared,
    as a multiset, with the training split (the whole epoch trained exactly once);
  - steps recomputed: steps an attempt trained past its last checkpoint before
    the kill, trained again by the next attempt (wasted work, not double training:
    those updates died with the attempt).
"""

import collections
import dataclasses
import json
import logging
import os
import random
import re
import signal
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from benchmarks import soak
from benchmarks.scaling import ContenderFailed
from tfdist.errors import require

log = logging.getLogger("tfdist")

RESTART_LINE = re.compile(r"^\[tfdist launch\] .*\brestart (\d+)/(\d+)\b")
WEIGHTS_GOAL = 1e-6
BATCH = 64             # soak.TRAIN_FLAGS' --global_batch_size
SEED = 0               # soak.TRAIN_FLAGS' --seed
SYNTHETIC_EXAMPLES = 2048  # 32 steps per epoch: restarts fall in many epochs, counting is quick


def default_steps(kills: int, checkpoint_every: int) -> int:
    """Room for every attempt's kill (at most 3C steps past its resume point) and a last stretch."""
    return (3 * kills + 2) * checkpoint_every


def default_timeout(kills: int, steps: int) -> float:
    """Seconds for one job: every restart starts TensorFlow in two fresh processes
    (about 30 s each on this loaded 2-core machine, 10 s when quiet)."""
    return 300 + 0.1 * steps + 120 * kills


def train_flags(model_dir: str, steps: int, checkpoint_every: int, collective: str) -> List[str]:
    return [f"--collective={collective}", f"--train_steps={steps}", f"--model_dir={model_dir}",
            f"--checkpoint_every={checkpoint_every}", "--log_every=1",
            f"--synthetic_examples={SYNTHETIC_EXAMPLES}",
            f"--results_json={os.path.join(model_dir, 'results.json')}"]


def newest_checkpoint_step(model_dir: str) -> int:
    """The step of the newest checkpoint the chief has committed (0: none yet)."""
    try:
        with open(os.path.join(model_dir, "checkpoints.json")) as f:
            names = json.load(f)["checkpoints"]
    except (OSError, ValueError, KeyError):   # not written yet, or being replaced right now
        return 0
    return max((int(name.rsplit("-", 1)[1]) for name in names), default=0)


# --------------------------------------------------------------------------- the runs

@dataclasses.dataclass
class Kill:
    attempt: int
    rank: int
    target_step: int
    step_seen: int       # the chief's newest logged step when the signal went out


@dataclasses.dataclass
class Attempt:
    first_step: int = 0  # the chief's first logged step: resumed at first_step - 1
    last_step: int = 0

    @property
    def resumed_at(self) -> Optional[int]:
        """None when the attempt never logged a step (it died or was ended before one)."""
        return self.first_step - 1 if self.first_step else None


@dataclasses.dataclass
class ChaosRun:
    exit_code: Optional[int]   # None: ended by the suite at its timeout
    wall_seconds: float
    kills: List[Kill]
    attempts: List[Attempt]
    restarts_seen: int
    log_tail: str


class KillPlanner:
    """Follows the launcher's log and decides when to kill whom: one kill per attempt."""

    def __init__(self, kills: int, checkpoint_every: int, seed: int, model_dir: str):
        self.remaining, self.c, self.model_dir = kills, checkpoint_every, model_dir
        self.rng = random.Random(seed)
        self.attempts = [Attempt()]
        self.restarts_seen = 0
        self.target: Optional[Tuple[int, int]] = None   # (step, rank) for this attempt
        self.killed_this_attempt = False

    def read(self, lines: List[str]) -> None:
        for line in lines:
            if RESTART_LINE.search(line):
                self.restarts_seen += 1
                self.attempts.append(Attempt())
                self.target, self.killed_this_attempt = None, False
                continue
            match = soak.STEP_LINE.search(line)
            if match:
                attempt = self.attempts[-1]
                step = int(match.group(1))
                attempt.first_step = attempt.first_step or step
                attempt.last_step = max(attempt.last_step, step)

    def due(self) -> Optional[Tuple[int, int]]:
        """(rank, target) to kill now, or None."""
        attempt = self.attempts[-1]
        if self.remaining == 0 or self.killed_this_attempt or not attempt.first_step:
            return None
        if self.target is None:   # drawn once per attempt, in a fixed order: seeded runs repeat
            step = attempt.resumed_at + self.c + self.rng.randint(1, 2 * self.c)
            self.target = (step, self.rng.randrange(soak.WORKERS))
        step, rank = self.target
        if attempt.last_step >= step and newest_checkpoint_step(self.model_dir) > attempt.resumed_at:
            return rank, step
        return None

    def killed(self) -> None:
        self.remaining -= 1
        self.killed_this_attempt = True


def run_with_kills(command: List[str], log_path: str, model_dir: str, kills: int,
                   checkpoint_every: int, seed: int, timeout: float) -> ChaosRun:
    started = time.monotonic()
    launcher = soak.start_launcher(command, log_path)
    follower = soak.LogFollower(log_path)
    planner = KillPlanner(kills, checkpoint_every, seed, model_dir)
    delivered, timed_out = [], False
    try:
        while launcher.poll() is None:
            if time.monotonic() - started > timeout:
                timed_out = True
                break
            planner.read(follower.new_lines())
            due = planner.due()
            if due and _kill(launcher.pid, *due):
                delivered.append(Kill(len(planner.attempts) - 1, due[0], due[1],
                                      planner.attempts[-1].last_step))
                planner.killed()
            time.sleep(soak.POLL_SECONDS)
    finally:
        if launcher.poll() is None:
            soak.end_launcher(launcher, list(soak.worker_pids(launcher.pid).values()))
    planner.read(follower.new_lines())
    with open(log_path, errors="replace") as f:
        tail = f.read()[-3000:]
    return ChaosRun(None if timed_out else launcher.returncode, time.monotonic() - started,
                    delivered, planner.attempts, planner.restarts_seen, tail)


def _kill(launcher_pid: int, rank: int, step: int) -> bool:
    pid = soak.worker_pids(launcher_pid).get(rank)
    if pid is None:   # between attempts: try again at the next poll
        return False
    os.kill(pid, signal.SIGKILL)
    log.info("chaos: SIGKILL to worker %d (pid %d) at step >= %d", rank, pid, step)
    return True


def run_uninterrupted(command: List[str], log_path: str, timeout: float) -> Tuple[int, float]:
    started = time.monotonic()
    launcher = soak.start_launcher(command, log_path)
    try:
        code = launcher.wait(timeout=timeout)
    except Exception:   # TimeoutExpired, or ^C: never leave the job behind
        soak.end_launcher(launcher, list(soak.worker_pids(launcher.pid).values()))
        raise
    return code, time.monotonic() - started


# --------------------------------------------------------------------------- what survived

def weights_difference(model_dir: str, reference_dir: str) -> Tuple[float, str]:
    """max over variables of ||a - b|| / ||b|| between the two chiefs' newest checkpoints."""
    import numpy as np
    import tensorflow as tf   # only now: the jobs are over

    def tensors(directory):
        with open(os.path.join(directory, "checkpoints.json")) as f:
            path = os.path.join(directory, json.load(f)["checkpoints"][-1])
        reader = tf.train.load_checkpoint(path)
        return {name: np.asarray(reader.get_tensor(name), np.float64)
                for name, _ in tf.train.list_variables(path)
                if name.endswith(".ATTRIBUTES/VARIABLE_VALUE")}

    got, want = tensors(model_dir), tensors(reference_dir)
    if got.keys() != want.keys():
        raise ContenderFailed(f"the chaos and reference checkpoints hold different variables: "
                              f"{sorted(got.keys() ^ want.keys())}")
    worst, worst_name = 0.0, ""
    for name, reference in want.items():
        difference = np.linalg.norm(got[name] - reference) / max(np.linalg.norm(reference), 1e-12)
        if difference > worst or not worst_name:
            worst, worst_name = float(difference), name
    return worst, worst_name if worst > 0 else "(all equal)"


def kept_ranges(resume_steps: List[int], steps: int) -> List[Tuple[int, int, int]]:
    """(start_step, first, last) per attempt, in order: the steps first..last of the attempt
    resumed at start_step that the final model kept. Walks back from the last attempt, so an
    attempt that fell back to an older checkpoint supersedes everything past it."""
    kept, end = [], steps
    for start in reversed(resume_steps):
        if start < end:
            kept.append((start, start + 1, end))
            end = start
    return kept[::-1]


def count_examples_twice(resume_steps: List[int], steps: int) -> Dict:
    """Examples trained more (and less) than once in every epoch a restart fell in, counted."""
    import numpy as np
    import tensorflow as tf
    from tfdist import data
    from tfdist.config import DataConfig
    from tfdist.data import pipeline
    config = DataConfig(name="synthetic", synthetic_examples=SYNTHETIC_EXAMPLES)
    source = data.get_source(config)
    steps_per_epoch = SYNTHETIC_EXAMPLES // BATCH
    epochs = sorted({r // steps_per_epoch for r in resume_steps if r > 0
                     and (r // steps_per_epoch + 1) * steps_per_epoch <= steps})  # whole epochs only
    checked = {s for e in epochs for s in range(e * steps_per_epoch + 1, (e + 1) * steps_per_epoch + 1)}
    seen = {e: collections.Counter() for e in epochs}
    for start, first, last in kept_ranges([0] + resume_steps, steps):
        if not checked & set(range(first, last + 1)):
            continue
        fn = pipeline.train_dataset_fn(source, BATCH, SEED, config, start_step=start)
        streams = [iter(fn(tf.distribute.InputContext(soak.WORKERS, w, soak.WORKERS)))
                   for w in range(soak.WORKERS)]
        for step in range(first, min(last, max(checked)) + 1):
            batches = [next(s) for s in streams]
            if step in checked:
                seen[(step - 1) // steps_per_epoch].update(_keys(batches))
    split = collections.Counter((np.asarray(x).tobytes(), int(y)) for x, y in source.examples("train"))
    twice = sum(sum((counter - split).values()) for counter in seen.values())
    missed = sum(sum((split - counter).values()) for counter in seen.values())
    return {"epochs_checked": len(epochs),
            "examples_checked": sum(sum(counter.values()) for counter in seen.values()),
            "examples_trained_twice": twice, "examples_missed": missed}


def _keys(batches):
    import numpy as np
    for xb, yb in batches:
        xs, ys = np.asarray(xb), np.asarray(yb)
        yield from ((x.tobytes(), int(y)) for x, y in zip(xs, ys))


# --------------------------------------------------------------------------- the suite

def run_suite(kills: int, steps: int, checkpoint_every: int, seed: int, collective: str,
              timeout: float) -> List[Dict]:
    require(kills >= 1, f"--kills must be >= 1, got {kills}.")
    soak.check_job_settings(steps, checkpoint_every, timeout)
    soak.parse_collectives(collective)
    with tempfile.TemporaryDirectory(prefix="tfdist-chaos-") as work:
        reference_dir, chaos_dir = os.path.join(work, "reference"), os.path.join(work, "chaos")
        log.info("chaos: the uninterrupted run, %d steps over %s", steps, collective)
        code, reference_seconds = run_uninterrupted(
            soak.launch_command(train_flags(reference_dir, steps, checkpoint_every, collective)),
            os.path.join(work, "reference.log"), timeout)
        if code != 0:
            with open(os.path.join(work, "reference.log"), errors="replace") as f:
                raise ContenderFailed(f"the uninterrupted chaos reference run failed (exit {code}):\n"
                                      f"{f.read()[-3000:]}")
        log.info("chaos: %d kills under --max_restarts %d (seed %d)", kills, kills, seed)
        run = run_with_kills(
            soak.launch_command(train_flags(chaos_dir, steps, checkpoint_every, collective), kills),
            os.path.join(work, "chaos.log"), chaos_dir, kills, checkpoint_every, seed, timeout)
        if run.exit_code != 0:
            log.info("chaos run failed (exit %s); its log ends:\n%s", run.exit_code, run.log_tail)
        return [summary_row(run, reference_dir, chaos_dir, kills, steps, checkpoint_every,
                            seed, collective, reference_seconds)]


def summary_row(run: ChaosRun, reference_dir: str, chaos_dir: str, kills: int, steps: int,
                checkpoint_every: int, seed: int, collective: str, reference_seconds: float) -> Dict:
    resumes = [a.resumed_at for a in run.attempts[1:]]
    recomputed = [a.last_step - nxt.resumed_at for a, nxt in zip(run.attempts, run.attempts[1:])
                  if nxt.resumed_at is not None]
    completed = run.exit_code == 0 and run.attempts[-1].last_step == steps
    row = {"collective": collective, "steps": steps, "checkpoint_every": checkpoint_every,
           "seed": seed, "kills_requested": kills, "kills_delivered": len(run.kills),
           "restarts_seen": run.restarts_seen, "exit": run.exit_code,
           "killed_ranks": " ".join(str(k.rank) for k in run.kills),
           "kill_steps": " ".join(str(k.step_seen) for k in run.kills),
           "resumed_at": " ".join("-" if r is None else str(r) for r in resumes),
           "steps_recomputed": sum(recomputed),
           "steps_recomputed_each": " ".join(map(str, recomputed)),
           "reference_wall_s": round(reference_seconds), "chaos_wall_s": round(run.wall_seconds)}
    if completed:
        difference, name = weights_difference(chaos_dir, reference_dir)
        row.update(max_rel_weight_diff=f"{difference:.2e}", worst_variable=name.split("/.ATTR")[0])
        row.update(count_examples_twice([r for r in resumes if r is not None], steps))
    else:   # nothing final to compare: say so in the row instead of failing the suite
        row.update(max_rel_weight_diff="n/a (did not finish)", worst_variable="",
                   epochs_checked=0, examples_checked=0, examples_trained_twice="n/a",
                   examples_missed="n/a")
    weights_ok = completed and float(row["max_rel_weight_diff"]) <= WEIGHTS_GOAL
    row["pass"] = "yes" if (weights_ok and len(run.kills) == kills and row["examples_trained_twice"] == 0
                            and row["examples_missed"] == 0) else "NO"
    log.info("chaos: %s", ", ".join(f"{k} {v}" for k, v in row.items()))
    return row
