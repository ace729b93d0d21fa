"""The micro-batch cost benchmark: its three ways compute the same stage, and it reports a
row per row count (run in subprocesses: the module sets one-thread variables at import)."""

import subprocess
import sys

SAME_WORK = """
from benchmarks import microbatch_cost
steps = microbatch_cost.stage_steps(width=48, layers=3, rows=64, microbatches=4)
sums = {way: float(step()) for way, step in steps.items()}
whole = sums["whole"]
assert all(abs(v - whole) <= 1e-4 * max(1.0, abs(whole)) for v in sums.values()), sums
print("same", sums)
"""


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180)


def test_the_three_ways_compute_the_same_stage():
    ran = run("-c", SAME_WORK)
    assert ran.returncode == 0 and "same" in ran.stdout, ran.stderr[-2000:]


def test_reports_a_row_per_row_count():
    ran = run("-m", "benchmarks.microbatch_cost", "--width", "32", "--rows", "32,64",
              "--microbatches", "4", "--repeats", "2")
    assert ran.returncode == 0, ran.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in ran.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [int(r[0]) for r in rows] == [32, 64], ran.stdout
    assert all(float(value) > 0 for r in rows for value in r[1:]), ran.stdout


def test_rows_that_do_not_split_into_the_micro_batches_are_a_usage_error():
    ran = run("-m", "benchmarks.microbatch_cost", "--rows", "100", "--microbatches", "8")
    assert ran.returncode == 2 and "--rows 100 not divisible by --microbatches 8" in ran.stderr, \
        ran.stderr[-2000:]
