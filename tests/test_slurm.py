"""Real Slurm: sbatch of examples/slurm/train-one-node.sbatch on a single-node cluster.

No mocks: munged, slurmctld and slurmd run for the session (tests/slurm_cluster.py),
jobs go through sbatch, srun starts the two workers, scancel signals them. Proven:
- the 2-task multi_worker_mirrored job trains like one device (per-step losses and
  the final checkpoint's tensors within 1e-5 relative of --strategy=default);
- `scancel --signal=TERM` makes both tasks save one checkpoint and exit 4, and a
  resubmitted job resumes from it exactly (its losses = the uninterrupted job's);
- a second cluster runs beside the first and leaves no process behind.
Skips, saying what to install, without Slurm's binaries or root (.ci/run installs them).
"""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import REPO
from slurm_cluster import SlurmCluster, free_port_pair, slurm, unavailable_reason  # noqa: F401 (fixture)
from tfdist.errors import EXIT_PREEMPTED

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

SCRIPT = os.path.join("examples", "slurm", "train-one-node.sbatch")
FLAGS = ["--model=mlp", "--dataset=synthetic", "--global_batch_size=32", "--optimizer=adam",
         "--seed=3", "--log_every=10"]
STEPS = 400          # at least this many; more when the TERM lands late (steps_to_compare)
RTOL = 1e-5
JOB_TIMEOUT = 300    # seconds; the machine is shared, TensorFlow's import alone is ~4 s a task


def submit(slurm, out_dir, name, *flags, model_dir=None):
    """sbatch of the one-node variant (2 tasks, 1 CPU each here); returns (job id, paths)."""
    paths = {key: os.path.join(out_dir, f"{name}.{key}") for key in ("out", "json")}
    paths["model_dir"] = model_dir or os.path.join(out_dir, name)
    env = dict(PYTHON=sys.executable, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
               TFDIST_PORT=str(free_port_pair()))
    job_id = slurm.sbatch(["--cpus-per-task=1", SCRIPT, *FLAGS, *flags,
                           f"--model_dir={paths['model_dir']}", f"--results_json={paths['json']}"],
                          output=paths["out"], cwd=REPO, env=env)
    return job_id, paths


def finish(slurm, job_id, paths, timeout=JOB_TIMEOUT):
    job = slurm.wait(job_id, timeout)
    output = read(paths["out"])
    results = json.load(open(paths["json"])) if os.path.exists(paths["json"]) else None
    return job, output, results


def read(path):
    return open(path, errors="replace").read() if os.path.exists(path) else ""


def task_exit_codes(output):
    """{task: exit code} from srun's own report lines ("task 1: Exited with exit code 4",
    "tasks 0-1: ..."); a task that exited 0 is not reported by srun."""
    codes = {}
    for tasks, code in re.findall(r"srun: error: \S+: tasks? ([\d,-]+): Exited with exit code (\d+)", output):
        for part in tasks.split(","):
            first, _, last = part.partition("-")
            for task in range(int(first), int(last or first) + 1):
                codes[task] = int(code)
    return codes


def final_tensors(model_dir):
    import tensorflow as tf
    with open(os.path.join(model_dir, "checkpoints.json")) as f:
        newest = os.path.join(model_dir, json.load(f)["checkpoints"][-1])
    reader = tf.train.load_checkpoint(newest)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(newest)
            if "OPTIMIZER_SLOT" in name or "/.ATTRIBUTES" in name}   # weights, slots, counters


def relative_difference(reference, value):
    reference, value = np.asarray(reference, np.float64), np.asarray(value, np.float64)
    return float(np.linalg.norm(value - reference) / max(np.linalg.norm(reference), 1e-12))


def term_after_step_10(slurm, job_id, paths):
    """scancel --signal=TERM once training runs. No --batch/--full: the signal goes to the
    job's steps (the python tasks) and the batch shell stays to report srun's exit code."""
    slurm.wait(job_id, JOB_TIMEOUT, until=lambda job: "step 10/" in read(paths["out"])
               or job["JobState"] not in ("PENDING", "RUNNING"))
    assert "step 10/" in read(paths["out"]), read(paths["out"])[-3000:]
    slurm.command(["scancel", "--signal=TERM", job_id])


def steps_to_compare(preempted_output):
    """--train_steps for the runs the preempted job is compared with: STEPS, or 100 past
    its checkpoint when the TERM landed later than STEPS. The signal travels scancel ->
    slurmctld -> slurmd -> the tasks while the test polls scontrol; on CI's loaded machine
    it once arrived 753 steps after step 10 (2026-12-06), past a fixed STEPS=400."""
    saved = [int(step) for step in re.findall(r"saved a checkpoint at step (\d+)", preempted_output)]
    return max([STEPS] + [step + 100 for step in saved])


def preempt_after_step_10(slurm, job_id, paths):
    """TERM once step 10 runs, then the job's end: {"preempted": finish(...), "seconds_to_end",
    "checkpoints": checkpoints.json's text, "steps": steps_to_compare(its output)}."""
    term_after_step_10(slurm, job_id, paths)
    signalled = time.monotonic()
    ended = finish(slurm, job_id, paths)
    return dict(preempted=ended, seconds_to_end=time.monotonic() - signalled,
                checkpoints=read(os.path.join(paths["model_dir"], "checkpoints.json")),
                steps=steps_to_compare(ended[1]))


@pytest.fixture(scope="module")
def runs(slurm, tmp_path_factory):
    """Every job of this file: a job preempted with scancel --signal=TERM, then, overlapped
    (the node takes two 2-task jobs at once), its resubmission, the uninterrupted 2-task
    job and a one-device run of the same flags, all to the same step, chosen once the
    preempted job's checkpoint step is known (steps_to_compare)."""
    out_dir = str(tmp_path_factory.mktemp("slurm"))
    # Far more steps than STEPS: only the TERM ends this job.
    preempted = submit(slurm, out_dir, "preempted", "--train_steps=1000000")
    result = preempt_after_step_10(slurm, *preempted)
    steps = result["steps"]
    # The resubmission: same script and flags, the same --model_dir, a --train_steps to stop at.
    resumed = submit(slurm, out_dir, "resumed", f"--train_steps={steps}",
                     model_dir=preempted[1]["model_dir"])
    uninterrupted = submit(slurm, out_dir, "mwms", f"--train_steps={steps}")
    default_dir = os.path.join(out_dir, "default")
    one_device = subprocess.Popen(
        [sys.executable, "-m", "experiments.train", "--strategy=default", "--simulate_devices=0", *FLAGS,
         f"--train_steps={steps}", f"--model_dir={default_dir}", f"--results_json={default_dir}.json"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"),
        stdout=subprocess.DEVNULL, stderr=open(f"{default_dir}.log", "w"))
    try:
        assert one_device.wait(JOB_TIMEOUT) == 0, read(f"{default_dir}.log")[-3000:]
    finally:
        one_device.kill()
    result.update(uninterrupted=(*finish(slurm, *uninterrupted), uninterrupted[1]["model_dir"]),
                  resumed=finish(slurm, *resumed),
                  default=(json.load(open(f"{default_dir}.json")), default_dir))
    return result


def test_sbatch_two_tasks_on_one_node_train_like_one_device(runs):
    (job, output, results, model_dir), (reference, reference_dir) = runs["uninterrupted"], runs["default"]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, output[-3000:])
    assert results["strategy"] == "multi_worker_mirrored" and results["num_replicas"] == 2
    assert len(results["losses"]) == len(reference["losses"]) == runs["steps"] >= STEPS
    np.testing.assert_allclose(results["losses"], reference["losses"], rtol=RTOL, atol=0)
    expected, got = final_tensors(reference_dir), final_tensors(model_dir)
    assert expected.keys() == got.keys() and expected
    worst = max(relative_difference(expected[name], got[name]) for name in expected)
    assert worst <= RTOL, worst


def test_scancel_term_saves_exit_4_and_a_resubmitted_job_resumes_exactly(runs):
    job, output, _ = runs["preempted"]
    assert task_exit_codes(output) == {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, output[-3000:]
    assert job["ExitCode"] == f"{EXIT_PREEMPTED}:0", job
    saved = re.findall(r"saved a checkpoint at step (\d+)", output)
    assert len(saved) == 2 and saved[0] == saved[1], saved        # both tasks, one step
    step = int(saved[0])
    assert 10 <= step < runs["steps"], f"TERM landed at step {step}; {runs['steps']} leaves nothing to resume"
    assert json.loads(runs["checkpoints"])["checkpoints"][-1] == f"ckpt-{step}", runs["checkpoints"]
    print(f"TERM to job end: {runs['seconds_to_end']:.1f} s; checkpoint at step {step}")

    job, output, resumed = runs["resumed"]
    assert job["ExitCode"] == "0:0", (job, output[-3000:])
    assert resumed["start_step"] == step and len(resumed["losses"]) == runs["steps"] - step
    uninterrupted = runs["uninterrupted"][2]
    np.testing.assert_allclose(resumed["losses"], uninterrupted["losses"][step:], rtol=RTOL, atol=0)


def test_a_second_cluster_runs_beside_the_first_and_leaves_nothing_behind(slurm):
    with SlurmCluster.started() as other:
        assert other.conf != slurm.conf
        ranks = other.command(["srun", "-n", "2", "bash", "-c", "echo $SLURM_PROCID"]).stdout.split()
        assert sorted(ranks) == ["0", "1"]
        daemons = [process.pid for process in other.daemons.values()]
    assert other.processes() == [] and not any(os.path.exists(f"/proc/{pid}") for pid in daemons)
    assert not os.path.exists(other.root)
    assert slurm.node_state() == "idle"      # the session's cluster did not notice
