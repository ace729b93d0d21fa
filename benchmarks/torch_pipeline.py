"""tfdist's pipeline and tensor parallelism against PyTorch's, 2 processes x 1 thread on CPU.

    python -m benchmarks.torch_pipeline [--steps 30] [--trials 3]
        -> a markdown table; benchmarks/results/torch_pipeline.{csv,md}

Pipeline: the MLP 2048-2048x4-10 (pipeline_overlap's former default), global batch 512,
SGD, S=2 stages in 2 processes, M=8 micro-batches; tfdist's gpipe and 1f1b (`tfdist launch
--workers 2 -- python -m experiments.train --strategy=pipeline ...`) against
torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B over gloo, cut where
tfdist's balancer cuts (torch_pipeline_worker.py).
Tensor parallelism: Megatron's MLP block 4096-16384-4096 (then the 10 logits,
replicated), global batch 64, SGD, 2 processes, every weight pair split column then
row: tfdist's `--strategy=dtensor --mesh=batch=1,model=2 --layout=megatron` under
`tfdist launch --workers 2 --dtensor` against torch.distributed.tensor.parallel's
ColwiseParallel + RowwiseParallel on a 2-process CPU DeviceMesh (gloo).
Contenders alternate trial by trial in one run; medians are reported, with each
tfdist median's ratio to PyTorch's. torch is optional: without it the PyTorch rows
are skipped with a message. The PyTorch scripts train on one fixed random batch per
process; tfdist runs its real input pipeline on `synthetic` data.
"""

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
from typing import Dict, List, Sequence

from benchmarks import pipeline_overlap as overlap

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_pipeline_worker.py")
TP_INPUT, TP_FFN, TP_BATCH = 4096, 16384, 64
# The pipeline comparison's MLP and batch; the tfdist / PyTorch figures of docs/benchmarks.md are for these.
PIPELINE_INPUT, PIPELINE_HIDDEN, PIPELINE_BATCH = 2048, (2048,) * 4, 512
SCHEDULES = ("gpipe", "1f1b")


def torch_missing():
    """None when torch is importable, else why its rows are skipped."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch): PyTorch rows skipped"
    return None


def torch_rate(args: Sequence[str], timeout: float = 1800, attempts: int = 3) -> float:
    """examples/s printed by torch_pipeline_worker.py; retried because gloo now and then
    aborts a rank at teardown in this torch build (as torch_ddp.py's runs are)."""
    for attempt in range(1, attempts + 1):
        result = subprocess.run([sys.executable, WORKER, *args], env=overlap.env(),
                                capture_output=True, text=True, timeout=timeout)
        if result.returncode == 0:
            return float(result.stdout.strip().splitlines()[-1])
        overlap.FAILURES.append(f"torch_pipeline_worker.py {' '.join(args)}: exit "
                                f"{result.returncode} (attempt {attempt}/{attempts}): "
                                f"{result.stderr.strip().splitlines()[-1:]}")
    raise overlap.ContenderFailed(f"torch_pipeline_worker.py {' '.join(args)} failed "
                                  f"{attempts} times:\n{result.stderr[-2000:]}")


def tp_flags(input_dim: int, ffn: int, batch: int) -> List[str]:
    return overlap.mlp_flags(input_dim, (ffn, input_dim), batch) + [
        "--strategy=dtensor", "--simulate_devices=1", "--mesh=batch=1,model=2",
        "--layout=megatron"]


def contenders(steps: int, input_dim: int, hidden: Sequence[int], batch: int, microbatches: int,
               tp: Sequence[int], notes: List[str], schedules: Sequence[str] = SCHEDULES,
               tensor_parallel: bool = True):
    """name -> (benchmark, framework, run() -> examples/s)."""
    base = overlap.mlp_flags(input_dim, hidden, batch)
    missing = torch_missing()
    if missing:
        notes.append(missing)
    runs = {}
    for schedule in schedules:
        bench = f"pipeline {schedule}, S=2, M={microbatches}"
        flags = base + overlap.pipeline_flags(schedule, microbatches)
        runs[f"tfdist {schedule}, 2 worker processes"] = (
            bench, "tfdist", lambda flags=flags: overlap.tfdist_rate(2, steps, flags))
        if not missing:
            args = ["pipeline", schedule, "2", str(steps), str(input_dim),
                    ",".join(map(str, hidden)), str(batch), str(microbatches)]
            name = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}[schedule]
            runs[f"pytorch {name}, 2 processes (gloo)"] = (
                bench, "pytorch", lambda args=args: torch_rate(args))
    if not tensor_parallel:
        return runs
    tp_input, tp_ffn, tp_batch = tp
    bench = f"tensor parallel MLP {tp_input}-{tp_ffn}-{tp_input}-10, batch {tp_batch}"
    flags = tp_flags(tp_input, tp_ffn, tp_batch)
    runs["tfdist dtensor megatron, mesh batch=1,model=2, 2 processes"] = (
        bench, "tfdist", lambda: overlap.tfdist_rate(2, steps, flags, ["--dtensor"]))
    if not missing:
        args = ["tp", "2", str(steps), str(tp_input), str(tp_ffn), str(tp_batch)]
        runs["pytorch ColwiseParallel + RowwiseParallel, 2 processes (gloo)"] = (
            bench, "pytorch", lambda: torch_rate(args))
    return runs


def compare(steps: int = 30, trials: int = 3, input_dim: int = PIPELINE_INPUT,
            hidden: Sequence[int] = PIPELINE_HIDDEN, batch: int = PIPELINE_BATCH,
            microbatches: int = overlap.MICROBATCHES,
            tp: Sequence[int] = (TP_INPUT, TP_FFN, TP_BATCH), schedules: Sequence[str] = SCHEDULES,
            tensor_parallel: bool = True):
    """(rows, notes): per contender the median examples/s; tfdist rows carry tfdist / pytorch."""
    notes: List[str] = []
    runs = contenders(steps, input_dim, hidden, batch, microbatches, tp, notes, schedules,
                      tensor_parallel)
    before, ticks = os.getloadavg(), overlap.cpu_ticks()
    rates = overlap.alternate({name: run for name, (_, _, run) in runs.items()}, trials, notes)
    notes += [f"failed attempt, retried: {line}" for line in overlap.FAILURES]
    notes.append(overlap.load_note(before, os.getloadavg(), ticks, overlap.cpu_ticks()))
    medians = {name: statistics.median(r) for name, r in rates.items() if r}
    torch_median: Dict[str, float] = {runs[n][0]: m for n, m in medians.items()
                                      if runs[n][1] == "pytorch"}
    rows = []
    for name, (bench, framework, _) in runs.items():
        if name not in medians:
            continue
        reference = torch_median.get(bench)
        ratio = medians[name] / reference if framework == "tfdist" and reference else ""
        rows.append({"benchmark": bench, "contender": name,
                     "examples_per_sec_median": round(medians[name], 1),
                     "trials": " ".join(f"{x:.1f}" for x in rates[name]),
                     "tfdist_over_pytorch": round(ratio, 3) if ratio != "" else ""})
    return rows, notes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per trial (first untimed)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--input_dim", type=int, default=PIPELINE_INPUT)
    parser.add_argument("--hidden_sizes", default=",".join(map(str, PIPELINE_HIDDEN)))
    parser.add_argument("--global_batch_size", type=int, default=PIPELINE_BATCH)
    parser.add_argument("--microbatches", type=int, default=overlap.MICROBATCHES)
    parser.add_argument("--tp", default=f"{TP_INPUT},{TP_FFN},{TP_BATCH}",
                        help="tensor parallel: INPUT,FFN,BATCH")
    parser.add_argument("--out_dir", default=os.path.join(overlap.REPO, "benchmarks", "results"))
    args = parser.parse_args(argv)
    hidden = [int(h) for h in args.hidden_sizes.split(",")]
    tp = [int(x) for x in args.tp.split(",")]
    rows, notes = compare(args.steps, args.trials, args.input_dim, hidden,
                          args.global_batch_size, args.microbatches, tp)
    title = (f"2 processes x 1 thread, SGD, {args.steps} steps per trial (the first untimed), "
             f"{args.trials} alternating trials. Pipeline: MLP {args.input_dim}-"
             f"{args.hidden_sizes.replace(',', '-')}-10, global batch {args.global_batch_size}, "
             f"M={args.microbatches}. Tensor parallel: {tp[0]}-{tp[1]}-{tp[0]}-10, batch {tp[2]}.")
    print(overlap.write(rows, notes, args.out_dir, "torch_pipeline", title))


if __name__ == "__main__":
    main()
