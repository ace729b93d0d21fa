"""The README's first command: `python -m experiments.train` with no flags."""

import json

from helpers import run_cli


def test_default_experiment_reaches_95_percent_on_digits(tmp_path):
    path = tmp_path / "results.json"
    result = run_cli([f"--results_json={path}"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(path.read_text())
    assert results["strategy"] == "mirrored" and results["num_replicas"] == 2
    assert results["dataset"] == "digits"
    assert results["eval_accuracy"] >= 0.95, results["eval_accuracy"]
    assert "eval accuracy" in result.stdout  # the one-line summary
