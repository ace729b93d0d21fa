"""The scaling suite: rows, efficiency math and its three files; one small real run.

The first tests need no TensorFlow (results dicts stand in for the results JSON
the training processes write). The real run starts 2 training processes
(default:1 and mirrored:2, 5 steps, 1 trial): about 15 s here.
"""

import csv
import os
import subprocess
import sys

import pytest

from helpers import REPO
from benchmarks import scaling
from tfdist.errors import UsageError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def results(*rates):
    """One results JSON (the keys the suite reads) per trial's examples/s."""
    return [{"examples_per_sec": rate, "train_seconds": 2.0, "steps": 10} for rate in rates]


def test_contenders_parse_with_the_baseline_first_and_no_duplicates():
    contenders = scaling.parse_contenders("pipeline:4, mirrored:2,default:1,mirrored:2")
    assert [c.name for c in contenders] == ["default:1", "pipeline:4", "mirrored:2"]
    megatron = scaling.parse_contenders("dtensor_megatron:4")[1]
    assert "--mesh=batch=2,model=2" in megatron.flags and "--layout=megatron" in megatron.flags
    assert megatron.layout == "mesh batch=2,model=2, layout megatron"


@pytest.mark.parametrize("spec, message", [
    ("mirrored:2,bogus:2", "Unknown scaling mode 'bogus' in 'bogus:2'. Valid modes: default, "
                           "mirrored, dtensor, dtensor_megatron, pipeline"),
    ("mirrored", "needs a device count >= 1"),
    ("default:2", "default runs on 1 device"),
    ("dtensor_megatron:3", "needs an even device count"),
    ("pipeline:1", "at least 2 stages"),
])
def test_bad_contenders_are_usage_errors_naming_the_valid_choices(spec, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        scaling.parse_contenders(spec)


def test_rows_csv_markdown_and_png(tmp_path):
    contenders = scaling.parse_contenders("mirrored:2,pipeline:4")
    rows = scaling.summarise(contenders, {
        "default:1": results(1000, 900, 1100),      # median 1000
        "mirrored:2": results(1500, 1600, 1400),    # median 1500: speedup 1.5, efficiency 0.75
        "pipeline:4": results(800, 2000, 700),      # median 800: speedup 0.8, efficiency 0.2
    }, global_batch_size=512)
    by_mode = {row["mode"]: row for row in rows}
    assert by_mode["default"]["speedup"] == 1.0 and by_mode["default"]["efficiency"] == 1.0
    assert by_mode["mirrored"]["speedup"] == 1.5 and by_mode["mirrored"]["efficiency"] == 0.75
    assert by_mode["pipeline"]["speedup"] == 0.8 and by_mode["pipeline"]["efficiency"] == 0.2
    assert by_mode["mirrored"]["step_ms"] == round(1000 * 512 / 1500, 1)
    assert by_mode["mirrored"]["trials_examples_per_sec"] == "1500 1600 1400"

    table = scaling.write_report(rows, str(tmp_path))
    with open(tmp_path / "scaling.csv") as f:
        written = list(csv.DictReader(f))
    assert [r["mode"] for r in written] == ["default", "mirrored", "pipeline"]
    assert written[2]["efficiency"] == "0.2" and written[2]["layout"] == "4 stages, 4 microbatches"
    assert (tmp_path / "scaling.md").read_text() == table
    assert "| pipeline | 4 | 4 stages, 4 microbatches | 640.0 | 800 | 0.8 | 0.2 |" in table
    assert (tmp_path / "scaling.png").read_bytes()[:8] == PNG_MAGIC


def test_a_failing_or_slow_contender_is_reported_with_its_output():
    indivisible = scaling.parse_contenders("mirrored:3")[1]  # 512 examples over 3 replicas
    with pytest.raises(scaling.ContenderFailed,
                       match=r"(?s)mirrored:3 failed \(exit 2\).*not divisible by the 3 replicas"):
        scaling.run_once(indivisible, steps=2, timeout=120)
    with pytest.raises(scaling.ContenderFailed, match="default:1 timed out after 1 s"):
        scaling.run_once(scaling.parse_contenders("")[0], steps=2, timeout=1)


@pytest.mark.slow
def test_the_suite_end_to_end(tmp_path):
    command = [sys.executable, "-m", "benchmarks", "--suite=scaling",
               "--scaling_modes=default:1,mirrored:2", "--steps=5", "--trials=1",
               "--run_timeout=120", f"--out_dir={tmp_path}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "scaling trial 1/1 mirrored:2" in done.stderr  # one progress line per run
    for name in ("scaling.csv", "scaling.md", "scaling.png"):
        assert (tmp_path / name).stat().st_size > 0
    with open(tmp_path / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["devices"]) for r in rows] == [("default", "1"), ("mirrored", "2")]
    for row in rows:
        rate, step_ms = float(row["examples_per_sec"]), float(row["step_ms"])
        assert rate > 0 and step_ms == pytest.approx(1000 * 512 / rate, rel=0.01)
        assert float(row["efficiency"]) == pytest.approx(float(row["speedup"]) / int(row["devices"]),
                                                         abs=0.01)
    assert float(rows[0]["speedup"]) == 1.0
    assert (tmp_path / "scaling.md").read_text() in done.stdout
