"""The one-thread matrix-multiply benchmark runs and reports a row per (width, rows)."""

import subprocess
import sys

import pytest

from benchmarks import matmul_rows
from benchmarks.torch_pipeline import torch_missing


def tiny_run(*flags):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.matmul_rows", "--seconds", "0.1",
         "--widths", "64,72", "--rows", "32,64", *flags],
        capture_output=True, text=True, timeout=120)


def assert_every_row(out):
    rows = [line.split("|")[1:-1] for line in out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(64, 32), (64, 64), (72, 32), (72, 64)]
    # every rate printed positive: a loaded machine slows a tiny size, it does not zero it
    assert all(float(value) > 0 for r in rows for value in r[2:]), out


def test_reports_every_width_and_row_count():
    ran = tiny_run()
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert_every_row(ran.stdout)


def test_torch_reports_the_same_rows_or_says_how_to_install_it():
    ran = tiny_run("--framework", "torch")
    if torch_missing():
        assert ran.returncode == 2 and "pip install torch" in ran.stderr, ran.stderr[-2000:]
    else:
        assert ran.returncode == 0, ran.stderr[-2000:]
        assert_every_row(ran.stdout)


def test_a_slow_rate_is_not_printed_as_zero():
    assert matmul_rows.shown(2512.34) == "2512.3"
    assert matmul_rows.shown(0.00262) == "0.00262"


@pytest.mark.parametrize("text", ["", "0", "256,x", "-1"])
def test_bad_list_is_refused_with_the_received_text(text, capsys):
    with pytest.raises(SystemExit) as ended:
        matmul_rows.main(["--rows", text])
    assert ended.value.code == 2
    assert f"got {text!r}" in capsys.readouterr().err
