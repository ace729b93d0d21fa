"""Pipeline overlap across worker processes, one thread each, against the schedule's formula.

    python -m benchmarks.pipeline_overlap [--steps 6] [--trials 3]
        [--schedules gpipe,1f1b] [--no_ceiling] [--no_in_process] [--out_dir DIR]
        -> a markdown table; benchmarks/results/pipeline_overlap.{csv,md}

The same compute-bound MLP and global batch run (a) in one process on one thread
(`--strategy=default`), (b) as a 2-stage pipeline inside that one process (both
stages share its one thread: no overlap is possible, so this row measures what
cutting the batch into M micro-batches and the pipeline's bookkeeping cost), and
(c) as S=2 stages in 2 worker processes (`tfdist launch --workers 2`, worker 0
drives and runs stage 0 and the input pipeline, worker 1 serves stage 1) with M=8
micro-batches, for every schedule tfdist.config.PIPELINE_SCHEDULES lists, and (d) as 2
independent copies of (a) at once, one per core: what the two cores deliver when both
compute (the ceiling any 2-process run can reach; the formula assumes 2x).

With balanced stages and free communication, a schedule's step takes the ideal
T1/S times (1 + bubble), so its speedup over one process is:
  gpipe, 1f1b            S*M / (M + S - 1)                  (bubble (S-1)/M)
  interleaved_1f1b (V)   S*V*M / (V*M + S - 1)              (bubble (S-1)/(V*M))
  zero_bubble (ZB-H1)    3*S*M / (3*M + S - 1)              (bubble (S-1)/(3M), F = B = W)
Rows: examples/s median over alternating trials, speedup against the 1-process
run, the formula and the ratio of the two (1.0: the schedule's ideal reached), and
ratio_to_ceiling: that ratio with the formula scaled by (d)'s speedup / 2.

Every process is pinned to a core of its own (benchmarks.pinned): the one-process
contenders to the first core, worker R to the R-th. A stage process computes on one thread
but needs a second inter-op thread to hand its tensors over while it computes
(tfdist/parallel/pipeline/cluster.py raises TF_NUM_INTEROP_THREADS=1 to 2); pinned, that
thread cannot turn into a second core of compute, so the comparison stays one core per process.

Why the default model is 128-2048x5-10 at a global batch of 16384 (micro-batches of 2048
rows): the formula assumes what this configuration gives and most models do not, and the
suite measures whether the processes overlap, not how well a model happens to cut.
- Stages balanced in BOTH phases. gpipe runs every forward, then every backward, so each
  phase goes at its slowest stage's pace. Stage 0 never computes its first layer's input
  gradient, so with equal layers it has less backward work than the last stage; an input
  wide enough to even the totals (3072 against 2048) makes its forwards slower instead. A
  narrow input (128) makes the first layer nearly free, and the parameter-balanced cut of
  the four 2048x2048 products then gives each stage 2 of them in both phases (forward 2.06
  against 2 units, backward 4.06 against 4): gpipe's ideal is 0.99 of the formula. With the
  former 2048-2048x4-10 (stage 0: 2 forward and 3 backward units, stage 1: 2 and 4) it is
  0.93, with a 3072 input 0.94 (tests/test_pipeline_benchmarks.py checks the default's cut
  and the former default's).
- Micro-batches large enough to be free. Each micro-batch's weight gradients are added into
  the step's sums (every weight gradient read and written M times), and a one-thread matrix
  multiply is slower on fewer rows. Two stages in one process ran at 0.73x of one process
  at micro-batches of 64 rows, 0.83-0.90x at 256, 0.90-0.99x at 1024, 0.98x at 2048
  (the "Pipeline overlap" section of docs/benchmarks.md, measured on a 2-core Xeon).
The former default (`--input_dim 2048 --hidden_sizes 2048,2048,2048,2048
--global_batch_size 2048`) still runs, and docs/benchmarks.md keeps its figures. 784-4096x4-10
cannot come near the formula: tfdist balances stages by parameter count and its best cut
puts 33.6M of 53.7M parameters (63%) on one stage, a cap of 1.42x with M=8's bubble.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import json
from typing import Callable, Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_THREAD = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
              "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
STAGES = 2
MICROBATCHES = 8
VIRTUAL_STAGES = 2
DEFAULT_INPUT = 128          # the module docstring says why these three
DEFAULT_HIDDEN = (2048,) * 5
OVERLAP_GLOBAL_BATCH = 16384  # micro-batches of 2048 rows
DEFAULT_STEPS = 6            # about 10 s a step for one process at this batch
DEFAULT_TRIALS = 3
BASELINE = "tfdist 1 process"
SERIAL_PIPELINE = "tfdist gpipe, 2 stages in 1 process"
CEILING = "tfdist 1 process x2 at once, independent (the cores' ceiling)"
INDEPENDENT = "independent"   # the ceiling's "schedule": S copies, nothing shared


class ContenderFailed(RuntimeError):
    pass


def mlp_flags(input_dim: int, hidden: Sequence[int], batch: int) -> List[str]:
    return ["--model=mlp", f"--hidden_sizes={','.join(map(str, hidden))}",
            "--dataset=synthetic", f"--synthetic_shape={input_dim}",
            f"--synthetic_examples={max(4096, 4 * batch)}", f"--global_batch_size={batch}",
            "--optimizer=sgd", "--log_every=100000"]


def pipeline_flags(schedule: str, microbatches: int = MICROBATCHES,
                   stages: int = STAGES) -> List[str]:
    flags = ["--strategy=pipeline", f"--pipeline_stages={stages}",
             f"--microbatches={microbatches}", f"--pipeline_schedule={schedule}"]
    if schedule == "interleaved_1f1b":
        flags.append(f"--virtual_stages={VIRTUAL_STAGES}")
    return flags


def env() -> Dict[str, str]:
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **ONE_THREAD)


FAILURES: List[str] = []   # one line per failed attempt (retried), for the report's notes


def run_rate(command: Sequence[str], results: str, timeout: float, attempts: int = 3) -> float:
    """Runs one training command (one process or a launch) and returns its examples/s.

    A failed attempt is retried (3 attempts) and recorded in FAILURES with its log kept in a
    file: a worker group now and then ends with exit 3 after its last step (issue noted
    in the report), and one such run must not cost a whole benchmark."""
    for attempt in range(1, attempts + 1):
        try:
            result = subprocess.run(list(command), env=env(), cwd=REPO, capture_output=True,
                                    text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ContenderFailed(f"timed out after {timeout:.0f} s: {' '.join(command)}")
        if result.returncode == 0:
            with open(results) as f:
                return json.load(f)["examples_per_sec"]
        fd, log = tempfile.mkstemp(prefix="tfdist-bench-failed-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(" ".join(command) + "\n" + result.stdout + result.stderr)
        FAILURES.append(f"exit {result.returncode} (attempt {attempt}/{attempts}), log {log}: "
                        f"{' '.join(command[-4:])}")
        print(f"attempt {attempt} failed with exit {result.returncode}; log in {log}",
              file=sys.stderr, flush=True)
    raise ContenderFailed(f"exit {result.returncode} {attempts} times: {' '.join(command)}")


def train_command(steps: int, results: str, flags: Sequence[str], pin: bool) -> List[str]:
    """`python -m experiments.train`, writing `results`; pin: on a core of its own."""
    pinned = [sys.executable, "-m", "benchmarks.pinned"] if pin else []
    return [*pinned, sys.executable, "-m", "experiments.train", f"--train_steps={steps}",
            f"--results_json={results}", *flags]


def tfdist_rate(workers: int, steps: int, flags: Sequence[str], launch_flags=(),
                timeout: float = 1800, pin: bool = False) -> float:
    """examples/s of `python -m experiments.train FLAGS`, in one process or `workers` launched;
    pin: each process on a core of its own (benchmarks.pinned)."""
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "r.json")
        train = train_command(steps, results, flags, pin)
        if workers > 1:
            train = [sys.executable, "-m", "tfdist.launch", "--workers", str(workers),
                     *launch_flags, "--", *train]
        return run_rate(train, results, timeout)


def independent_rate(copies: int, steps: int, flags: Sequence[str], timeout: float = 1800) -> float:
    """Summed examples/s of `copies` independent one-process trainings started together, each
    pinned to a core of its own (TFDIST_RANK picks it, as under tfdist launch): what the
    machine's cores deliver when all compute at once, the most any S-process run can reach.
    A pipeline's formula assumes S cores that do not slow each other (shared caches, memory
    bandwidth, hyper-threads of one physical core, a hypervisor's neighbours); this row
    measures that assumption instead of making it. Each rate is over that process's own timed
    steps; the windows overlap but for start-up skew (well under a second against the steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        processes = []
        for rank in range(copies):
            results, log = os.path.join(tmp, f"r{rank}.json"), os.path.join(tmp, f"r{rank}.log")
            command = train_command(steps, results, flags, pin=True)
            with open(log, "w") as stderr:   # a file, not a pipe: nothing blocks on a full pipe
                process = subprocess.Popen(command, env=dict(env(), TFDIST_RANK=str(rank)),
                                           cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr)
            processes.append((process, results, log))
        deadline = time.monotonic() + timeout
        failures = []
        for process, _, log in processes:
            try:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                failures.append(f"timed out after {timeout:.0f} s")
                continue
            if process.returncode != 0:
                with open(log) as f:
                    last = f.read().strip().splitlines()[-1:]
                failures.append(f"exit {process.returncode}: {last}")
        if failures:
            raise ContenderFailed(f"{copies} independent processes: {'; '.join(failures)}")
        rates = []
        for _, results, _ in processes:
            with open(results) as f:
                rates.append(json.load(f)["examples_per_sec"])
        return sum(rates)


def formula(schedule: Optional[str], stages: int, microbatches: int) -> float:
    """The schedule's speedup over one process with balanced stages and free transfers."""
    s, m = stages, microbatches
    if schedule is None:
        return 1.0
    if schedule == INDEPENDENT:
        return float(s)
    if schedule in ("gpipe", "1f1b"):
        return s * m / (m + s - 1)
    if schedule == "interleaved_1f1b":
        v = VIRTUAL_STAGES
        return s * v * m / (v * m + s - 1)
    if schedule == "zero_bubble":
        return 3 * s * m / (3 * m + s - 1)
    raise ValueError(f"no formula for schedule {schedule!r}")


def listed_schedules() -> Sequence[str]:
    from tfdist import config   # TF-free
    return config.PIPELINE_SCHEDULES


def contenders(steps: int, input_dim: int, hidden: Sequence[int], batch: int,
               microbatches: int, schedules: Sequence[str], notes: List[str],
               in_process: bool = True, ceiling: bool = True):
    """name -> (run() -> examples/s, schedule or None, processes)."""
    base = mlp_flags(input_dim, hidden, batch)
    listed = listed_schedules()
    one_process = base + ["--strategy=default", "--simulate_devices=0"]
    runs = {BASELINE: (lambda: tfdist_rate(1, steps, one_process, pin=True), None, 1)}
    if ceiling:
        runs[CEILING] = (lambda: independent_rate(STAGES, steps, one_process), INDEPENDENT, STAGES)
    if in_process:
        runs[SERIAL_PIPELINE] = (lambda: tfdist_rate(
            1, steps, base + pipeline_flags("gpipe", microbatches) + ["--simulate_devices=2"],
            pin=True), None, 1)
    for schedule in schedules:
        if schedule not in listed:
            notes.append(f"{schedule}: skipped, not in tfdist.config.PIPELINE_SCHEDULES "
                         f"({', '.join(listed)}) in this tree")
            continue
        label = schedule + (f" V={VIRTUAL_STAGES}" if schedule == "interleaved_1f1b" else "")
        flags = base + pipeline_flags(schedule, microbatches)
        runs[f"tfdist {label}, 2 worker processes"] = (
            lambda flags=flags: tfdist_rate(STAGES, steps, flags, pin=True), schedule, STAGES)
    return runs


def alternate(runs: Dict[str, Callable[[], float]], trials: int,
              notes: List[str]) -> Dict[str, List[float]]:
    """Trial by trial, every contender once per trial; a contender that fails is dropped."""
    rates = {name: [] for name in runs}
    failed = set()
    for trial in range(trials):
        for name, run in runs.items():
            if name in failed:
                continue
            try:
                rates[name].append(run())
            except ContenderFailed as error:
                failed.add(name)
                notes.append(f"{name}: failed in trial {trial + 1}: {error}")
            print(f"trial {trial + 1}/{trials} {name}: {rates[name][-1:]} "
                  f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    return rates


def cpu_ticks() -> Optional[List[int]]:
    """The machine's CPU time counters (/proc/stat's first line: user, nice, system, idle,
    iowait, irq, softirq, steal, ...), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def steal_note(before: Optional[List[int]], after: Optional[List[int]]) -> str:
    """The share of CPU time the hypervisor gave other guests during the run: noise this
    machine cannot see in its own load (a shared VM's neighbours)."""
    if not before or not after or len(before) < 8 or len(after) < 8:
        return ""
    spent = [b - a for a, b in zip(before, after)]
    total = sum(spent[:8])
    return f"; hypervisor steal {100 * spent[7] / total:.1f}% of CPU time" if total else ""


def load_note(before, after, ticks_before=None, ticks_after=None) -> str:
    return (f"load average (1 min) {before[0]:.1f} at the start, {after[0]:.1f} at the end "
            f"(5 min: {after[1]:.1f}) on {os.cpu_count()} cores"
            + steal_note(ticks_before, ticks_after))


def compare(steps: int = DEFAULT_STEPS, trials: int = DEFAULT_TRIALS,
            input_dim: int = DEFAULT_INPUT,
            hidden: Sequence[int] = DEFAULT_HIDDEN, batch: int = OVERLAP_GLOBAL_BATCH,
            microbatches: int = MICROBATCHES,
            schedules: Sequence[str] = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"),
            in_process: bool = True, ceiling: bool = True):
    """(rows, notes): one row per contender, medians of alternating trials."""
    notes: List[str] = []
    runs = contenders(steps, input_dim, hidden, batch, microbatches, schedules, notes,
                      in_process, ceiling)
    before, ticks = os.getloadavg(), cpu_ticks()
    rates = alternate({name: run for name, (run, _, _) in runs.items()}, trials, notes)
    notes += [f"failed attempt, retried: {line}" for line in FAILURES]
    notes.append(load_note(before, os.getloadavg(), ticks, cpu_ticks()))
    return rows_from(rates, {name: (schedule, processes)
                             for name, (_, schedule, processes) in runs.items()},
                     microbatches), notes


def rows_from(rates: Dict[str, List[float]], meta: Dict[str, tuple],
              microbatches: int) -> List[Dict]:
    """Rows from each contender's trials; meta: name -> (schedule or None, processes).

    speedup is against one process on the whole batch (the issue's figure); overlap_speedup
    against the 2-stage pipeline in one process, which runs the same micro-batch ops on one
    thread, so it isolates what running the stages in two processes buys.
    ratio_to_ceiling: a pipeline's speedup against its formula scaled by what S cores
    measurably deliver together (the CEILING row's speedup over S): 1.0 is the schedule's
    ideal on these cores."""
    def median_of(name):
        return statistics.median(rates[name]) if rates.get(name) else None
    baseline, serial = median_of(BASELINE), median_of(SERIAL_PIPELINE)
    together = median_of(CEILING)
    per_core = together / baseline / STAGES if together and baseline else None
    rows = []
    for name, (schedule, processes) in meta.items():
        median = median_of(name)
        if median is None:
            continue
        ideal = formula(schedule, STAGES, microbatches)
        row = {"contender": name, "processes": processes,
               "examples_per_sec_median": round(median, 1),
               "trials": " ".join(f"{x:.1f}" for x in rates[name]),
               "speedup": round(median / baseline, 3) if baseline else "",
               "formula": round(ideal, 3),
               "ratio_to_formula": round(median / baseline / ideal, 3) if baseline else ""}
        pipeline = processes > 1 and schedule != INDEPENDENT
        if serial and pipeline:
            row.update(overlap_speedup=round(median / serial, 3),
                       overlap_ratio_to_formula=round(median / serial / ideal, 3))
        else:
            row.update(overlap_speedup="", overlap_ratio_to_formula="")
        row["ratio_to_ceiling"] = (round(median / baseline / ideal / per_core, 3)
                                   if pipeline and per_core else "")
        rows.append(row)
    return rows


def write(rows: List[Dict], notes: Sequence[str], out_dir: str, name: str, title: str) -> str:
    from benchmarks import report
    os.makedirs(out_dir, exist_ok=True)
    report.write_csv(rows, os.path.join(out_dir, f"{name}.csv"))
    text = f"{title}\n\n{report.markdown_table(rows)}"
    if notes:
        text += "\n" + "".join(f"- {note}\n" for note in notes)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text)
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help="steps per trial (first untimed)")
    parser.add_argument("--trials", type=int, default=DEFAULT_TRIALS)
    parser.add_argument("--input_dim", type=int, default=DEFAULT_INPUT)
    parser.add_argument("--hidden_sizes", default=",".join(map(str, DEFAULT_HIDDEN)))
    parser.add_argument("--global_batch_size", type=int, default=OVERLAP_GLOBAL_BATCH)
    parser.add_argument("--microbatches", type=int, default=MICROBATCHES)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b,zero_bubble")
    parser.add_argument("--no_ceiling", dest="ceiling", action="store_false",
                        help="leave out the two independent processes (the cores' ceiling row)")
    parser.add_argument("--no_in_process", dest="in_process", action="store_false",
                        help="leave out the 2 stages in one process row")
    parser.add_argument("--out_dir", default=os.path.join(REPO, "benchmarks", "results"),
                        help="where pipeline_overlap.{csv,md} go (a run replaces them)")
    return parser.parse_args(argv)


def title(args) -> str:
    return (f"MLP {args.input_dim}-{args.hidden_sizes.replace(',', '-')}-10, global batch "
            f"{args.global_batch_size}, SGD, synthetic data, {args.steps} steps per trial (the "
            f"first untimed), {args.trials} alternating trials, every process on a core of its "
            f"own (TF_NUM_INTRAOP_THREADS=1, TF_NUM_INTEROP_THREADS=1; a stage process raises "
            f"its inter-op pool to 2 for its transfers); "
            f"pipelines: {STAGES} stages, M={args.microbatches}.")


def main(argv=None) -> None:
    args = parse_args(argv)
    hidden = [int(h) for h in args.hidden_sizes.split(",")]
    rows, notes = compare(args.steps, args.trials, args.input_dim, hidden,
                          args.global_batch_size, args.microbatches, args.schedules.split(","),
                          args.in_process, args.ceiling)
    print(write(rows, notes, args.out_dir, "pipeline_overlap", title(args)))


if __name__ == "__main__":
    main()
