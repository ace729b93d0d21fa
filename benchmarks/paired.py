"""Two multi-worker contenders of the throughput suite, in many alternating pairs.

    python -m benchmarks.paired [--contenders shm,mpi] [--pairs 10] [--steps 300]
        [--workload throughput|latency]
        -> a markdown table of every pair and its ratio; benchmarks/results/paired.{csv,md}
           (--workload=latency: paired_latency.{csv,md})

Why: the throughput suite's 3 trials per contender cannot tell two collectives apart
when they differ by less than this shared 2-core machine's noise (5-20% between runs
minutes apart). Here each pair runs A and B back to back, in the order A B, then B A
in the next pair (so a machine that drifts slower hits both alike), and the report
gives each pair's ratio B/A, their median, and how many pairs B won. A gain of a few
percent shows as most pairs above 1.0 even when single runs scatter more than that.

Contenders are one workload, 2 workers, one thread per process, with these
collectives: tf (TensorFlow's own), tcp, shm, mpi (under `tfdist launch --mpi`).
Workloads (WORKLOADS): `throughput`, the throughput suite's (throughput.TRAIN_FLAGS:
MLP 784-1024-1024-10, global batch 512, SGD; 7.1 MiB of gradients, compute-bound),
and `latency`, the soak suite's (MLP 784-100-50-10, global batch 64, Adam; 0.3 MiB of
gradients, so a step is mostly the all-reduce's latency).
"""

import argparse
import os
import statistics
import sys
from typing import Callable, Dict, List, Sequence

from benchmarks import allreduce, throughput
from tfdist.errors import UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIVES = ("tf", "tcp", "shm", "mpi")
# Flags on top of throughput.TRAIN_FLAGS (later flags win).
WORKLOADS = {
    "throughput": (),
    "latency": ("--hidden_sizes=100,50", "--synthetic_shape=28,28,1", "--synthetic_examples=8192",
                "--global_batch_size=64", "--optimizer=adam"),
}


def runner(name: str, steps: int, workers: int = 2,
           workload: str = "throughput") -> Callable[[], float]:
    """() -> examples/s of `workload` on `workers` workers over the collective `name`."""
    flags = list(WORKLOADS[workload])
    if name == "tf":
        return lambda: throughput._tfdist_rate(workers, steps, flags)
    if name == "mpi":
        return lambda: throughput._tfdist_rate(workers, steps, flags + ["--collective=mpi"],
                                               ["--mpi"])
    return lambda: throughput._tfdist_rate(workers, steps, flags + [f"--collective={name}"])


def parse_contenders(text: str) -> Sequence[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if len(names) != 2 or names[0] == names[1]:
        raise UsageError(f"--contenders takes two different collectives, A,B; got {text!r}. "
                         f"Valid names: {', '.join(COLLECTIVES)}.")
    for name in names:
        if name not in COLLECTIVES:
            raise UsageError(f"Unknown collective {name!r} in --contenders={text!r}. "
                             f"Valid names: {', '.join(COLLECTIVES)}.")
    if "mpi" in names and allreduce.mpi_missing():
        raise UsageError(f"--contenders={text!r} needs MPI: {allreduce.mpi_missing()} "
                         f"(pip install -e \".[mpi]\").")
    return names


def run_pairs(runs: Dict[str, Callable[[], float]], pairs: int) -> List[Dict]:
    """One row per pair: both rates and B/A; the order flips every pair."""
    a, b = runs
    rows = []
    for pair in range(pairs):
        order = (a, b) if pair % 2 == 0 else (b, a)
        rates = {}
        for name in order:
            rates[name] = runs[name]()
            print(f"pair {pair + 1}/{pairs} {name}: {rates[name]:.0f} examples/s "
                  f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
        rows.append({"pair": pair + 1, "order": " then ".join(order),
                     a: round(rates[a], 1), b: round(rates[b], 1),
                     f"{b}/{a}": round(rates[b] / rates[a], 4)})
    return rows


def summary(rows: List[Dict], a: str, b: str) -> Dict:
    ratios = [row[f"{b}/{a}"] for row in rows]
    return {"pair": "median", "order": f"{b} at or above {a} in {sum(r >= 1 for r in ratios)} "
                                       f"of {len(ratios)} pairs",
            a: round(statistics.median(row[a] for row in rows), 1),
            b: round(statistics.median(row[b] for row in rows), 1),
            f"{b}/{a}": round(statistics.median(ratios), 4)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default="shm,mpi", help="A,B: B/A is reported")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workload", default="throughput",
                        help=f"one of {', '.join(WORKLOADS)} (see the module's docstring)")
    parser.add_argument("--out_dir", default=os.path.join(REPO, "benchmarks", "results"))
    args = parser.parse_args(argv)
    try:
        a, b = parse_contenders(args.contenders)
        if args.pairs < 1 or args.steps < 2:
            raise UsageError(f"--pairs must be >= 1 and --steps >= 2; got --pairs={args.pairs} "
                             f"--steps={args.steps}.")
        if args.workload not in WORKLOADS:
            raise UsageError(f"Unknown --workload={args.workload!r}. Valid: "
                             f"{', '.join(WORKLOADS)}.")
    except UsageError as error:
        print(f"tfdist: error: {error}", file=sys.stderr)
        return 2
    rows = run_pairs({name: runner(name, args.steps, workload=args.workload) for name in (a, b)},
                     args.pairs)
    rows.append(summary(rows, a, b))
    from benchmarks import report
    name = "paired" if args.workload == "throughput" else f"paired_{args.workload}"
    print(report.write_all(rows, args.out_dir, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
