"""What a tfdist process pays before its first step: `import tfdist, tensorflow, keras`.

    python -m benchmarks.import_time [--trials 7]

Fresh interpreters, alternating with and without tfdist.lazy_keras's deferral
(TFDIST_EAGER_KERAS_IMPORTS=1), so machine noise hits both alike; medians of wall
time and of the child's CPU time (user + system), and which of scikit-learn,
matplotlib.pyplot and IPython each left imported.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

from tfdist import lazy_keras

WATCHED = ("sklearn", "matplotlib.pyplot", "IPython")
# A module LazyLoader has not run yet is an instance of a ModuleType subclass of its own.
PROBE = ("import tfdist, tensorflow, keras, sys, types; print(' '.join(m for m in "
         f"{WATCHED!r} if type(sys.modules.get(m)) is types.ModuleType) or '-')")
CONTENDERS = {"deferred (default)": {}, f"eager ({lazy_keras.OPT_OUT}=1)": {lazy_keras.OPT_OUT: "1"}}


def one_import(extra_env: dict) -> tuple:
    """(wall seconds, CPU seconds, modules imported) of one fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != lazy_keras.OPT_OUT}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", **extra_env)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                            text=True, timeout=300, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, result.stdout.strip().splitlines()[-1]


def compare(trials: int) -> list:
    runs = {name: [] for name in CONTENDERS}
    for _ in range(trials):
        for name, env in CONTENDERS.items():
            runs[name].append(one_import(env))
    return [{"contender": name,
             "wall_s_median": round(statistics.median(r[0] for r in rs), 2),
             "cpu_s_median": round(statistics.median(r[1] for r in rs), 2),
             "cpu_s_trials": " ".join(f"{r[1]:.2f}" for r in rs),
             "imported": rs[-1][2]} for name, rs in runs.items()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=7, help="fresh interpreters per contender")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials must be at least 1, got {args.trials}")
    rows = compare(args.trials)
    print("| contender | wall s (median) | CPU s (median) | CPU s per trial | of "
          f"{', '.join(WATCHED)} imported |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['contender']} | {row['wall_s_median']} | {row['cpu_s_median']} | "
              f"{row['cpu_s_trials']} | {row['imported']} |")


if __name__ == "__main__":
    main()
