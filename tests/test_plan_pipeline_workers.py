"""`tfdist plan` and pipelines whose stages live in different workers.

The planner offers a k-stage pipeline across W workers when k divides W (the
stages live in different workers, each worker's devices are in-node replicas of
its stage), lists the others with the reason, names every device by its task as
the run does, and the command it prints runs: its param_bytes_per_device equal
the plan's, byte for byte, device for device.
"""

import json
import os
import subprocess
import sys

from helpers import REPO

PLAN = ["--devices", "4", "--workers", "2", "--device_type", "cpu", "--model", "cnn"]


def plan(*extra):
    result = subprocess.run([sys.executable, "-m", "tfdist.cli", "plan", *PLAN, *extra, "--json"],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode in (0, 1), result.stderr[-2000:]
    return json.loads(result.stdout)


def test_stages_that_do_not_divide_the_workers_are_listed_with_the_reason():
    found = plan("--memory_per_device", "150KB")
    four = [c for c in found["candidates"] if c["strategy"] == "pipeline" and c["stages"] == 4]
    assert four and all("4 stages do not divide the 2 workers" in c["problem"] for c in four)


def test_the_printed_cross_worker_pipeline_runs_with_the_planned_bytes(tmp_path):
    found = plan("--memory_per_device", "600KB")
    chosen = found["recommended"]
    assert chosen["strategy"] == "pipeline" and chosen["stages"] == 2 and chosen["replicas"] == 2
    command = found["command"]
    assert command[:6] == ["tfdist", "launch", "--workers", "2", "--devices_per_worker", "2"]
    results = tmp_path / "results.json"
    launched = [sys.executable, "-m", "tfdist.launch", *command[2:command.index("--")], "--",
                sys.executable, *command[command.index("--") + 2:], "--train_steps=2",
                f"--results_json={results}"]
    run = subprocess.run(launched, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO,
                                                      TF_CPP_MIN_LOG_LEVEL="2"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    measured = json.loads(results.read_text())["param_bytes_per_device"]
    assert measured == chosen["param_bytes_per_device"]
    # stage 0 on both devices of worker 0, stage 1 on both of worker 1
    assert measured["/job:worker/replica:0/task:0/device:CPU:0"] == \
        measured["/job:worker/replica:0/task:0/device:CPU:1"]
