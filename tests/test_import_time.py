"""benchmarks.import_time at its smallest: both rows, positive times, what each imported."""

import subprocess
import sys

from helpers import REPO


def _run(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks.import_time", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_one_trial_prints_both_contenders_and_what_they_imported():
    result = _run("--trials", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines()
            if line.startswith("| deferred") or line.startswith("| eager")]
    assert [r[0].split()[0] for r in rows] == ["deferred", "eager"], result.stdout
    for name, wall, cpu, _, imported in rows:
        assert float(wall) > 0 and float(cpu) > 0, result.stdout
    deferred, eager = (set(r[4].split()) for r in rows)
    assert not deferred & {"sklearn", "matplotlib.pyplot"}, result.stdout
    assert {"sklearn", "matplotlib.pyplot"} <= eager, result.stdout


def test_zero_trials_is_a_usage_error():
    result = _run("--trials", "0")
    assert result.returncode == 2 and "--trials must be at least 1, got 0" in result.stderr
