"""The one-thread matrix-multiply benchmark runs and reports a row per (width, rows)."""

import subprocess
import sys

import pytest

from tfdist.benchmarks import matmul_rows


def test_reports_every_width_and_row_count():
    out = subprocess.run(
        [sys.executable, "-m", "tfdist.benchmarks.matmul_rows", "--seconds", "0.1",
         "--widths", "64,72", "--rows", "32,64"],
        capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(64, 32), (64, 64), (72, 32), (72, 64)]
    # sizes big enough that no rate rounds to 0.0 at one decimal
    assert all(float(value) > 0 for r in rows for value in r[2:]), out


@pytest.mark.parametrize("text", ["", "0", "256,x", "-1"])
def test_bad_list_is_refused_with_the_received_text(text, capsys):
    with pytest.raises(SystemExit) as ended:
        matmul_rows.main(["--rows", text])
    assert ended.value.code == 2
    assert f"got {text!r}" in capsys.readouterr().err
