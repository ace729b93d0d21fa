"""Real Slurm preemption: preempt-and-requeue, every way Slurm stops a job, automatic resume.

No mocks: the jobs are examples/slurm/train-one-node.sbatch (2 tasks, multi_worker_mirrored)
on real single-node Slurms, signalled by Slurm itself or by scancel. Proven:
- preempt-and-requeue: on a cluster whose high partition preempts its low ones
  (PreemptType=preempt/partition_prio, PreemptMode=REQUEUE, KillWait=30, Slurm's default), a
  job in a low partition is preempted by one that needs the node; both tasks save and exit 4,
  the job is requeued, runs again after the other job with nothing done by the test in
  between, resumes from its checkpoint and ends with the weights and Adam slots of an
  uninterrupted 2-task job (within 1e-6 relative; bitwise here), after at least one requeue.
  Twice: with GraceTime=30 (SIGTERM to the tasks, 30 s for the job) and without (Slurm ends
  the whole job at once: SIGTERM to the batch shell and the tasks, SIGKILL after KillWait);
- `scancel --signal=TERM`, `--signal=TERM --batch`, `--signal=TERM --full`, and the time
  limit's signal (`--signal=B:USR1@15`): each makes both tasks save one checkpoint (same step)
  and exit 4, and the job exit 4; the time limit also requeues the job. The scancels stop
  three jobs of one --model_dir in turn, each a resubmission of the same command resuming
  from the previous job's checkpoint; then one more resubmission trains on and ends with an
  uninterrupted job's per-step losses and weights (a resume that was not exact anywhere
  would show there). The same for the job stopped by its time limit.
Four flows run at once (each has idle waits): the two preemptions on a cluster each, the
scancels and the time limit on the session's. Skips, saying what to install, without
Slurm's binaries or root, as test_slurm.py.
"""

import contextlib
import json
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import numpy as np
import pytest

from helpers import REPO
from slurm_cluster import (FINAL_STATES, SlurmCluster, free_port_pair, preemptible_conf,  # noqa: F401
                           slurm, unavailable_reason)
from test_slurm import final_tensors, read, relative_difference, task_exit_codes
from tfdist.errors import EXIT_PREEMPTED

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

SCRIPT = os.path.join("examples", "slurm", "train-one-node.sbatch")
FLAGS = ["--model=mlp", "--dataset=synthetic", "--global_batch_size=32", "--optimizer=adam",
         "--seed=3", "--log_every=10"]
UNTIL_STOPPED = "--train_steps=1000000"   # only a signal ends such a job
# The preempted jobs' length, and the least any resumed job trains to (so that they share one
# uninterrupted reference): still training when the high-priority job arrives (a second or two
# after step 10; 25-50 steps/s here), and cheap to replay.
STEPS = 400
GRACE_TIME = 30      # the preemption grace clusters give,
KILL_WAIT = 30       # and Slurm's default KillWait (SIGTERM to SIGKILL when it ends a job)
REQUEUE_DELAY = 10   # a requeued job may start 11 s later (Slurm's default: 121 s)
# slurmctld checks time limits every 30 s and sends the warning signal at the first check
# within 30 s of its time: USR1 75-105 s after the start, when training runs (the first step
# came 45 s after the submission with this file's first jobs all starting at once on a
# machine loaded 10 deep). The tasks save and exit 4 seconds later, before the limit.
TIME_LIMIT = ["--time=2", "--signal=B:USR1@15"]
RTOL = 1e-6
JOB_TIMEOUT = 300    # seconds, per wait; the machine is shared


# ---------------------------------------------------------------------------- jobs

class Job:
    """One sbatch of the example script: its id, cluster, output file and model_dir."""

    def __init__(self, cluster, out_dir, name, *flags, model_dir=None, sbatch_options=()):
        self.cluster, self.name = cluster, name
        self.out, self.json = (os.path.join(out_dir, f"{name}.{key}") for key in ("out", "json"))
        self.model_dir = model_dir or os.path.join(out_dir, name)
        env = dict(PYTHON=sys.executable, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
                   TFDIST_PORT=str(free_port_pair()))
        self.id = cluster.sbatch([*sbatch_options, "--cpus-per-task=1", SCRIPT, *FLAGS, *flags,
                                  f"--model_dir={self.model_dir}", f"--results_json={self.json}"],
                                 output=self.out, cwd=REPO, env=env)

    def output(self):
        return read(self.out)

    def wait_for_step(self, step):
        """Until the chief logs `step` (a multiple of --log_every), or the job ends."""
        self.cluster.wait(self.id, JOB_TIMEOUT, until=lambda job: f"step {step}/" in self.output()
                          or job["JobState"] not in ("PENDING", "RUNNING"))
        assert f"step {step}/" in self.output(), f"{self.name}: no step {step}\n{self.output()[-3000:]}"

    def finish(self):
        """Waits for the end; (scontrol's view, results JSON or None, self)."""
        job = self.cluster.wait(self.id, JOB_TIMEOUT)
        results = json.load(open(self.json)) if os.path.exists(self.json) else None
        return job, results, self


class References:
    """Uninterrupted 2-task jobs on the session's cluster, one per --train_steps, started when
    first asked for and shared by every comparison that needs that length."""

    def __init__(self, cluster, out_dir):
        self.cluster, self.out_dir, self.jobs, self.lock = cluster, out_dir, {}, threading.Lock()

    def start(self, steps):
        with self.lock:
            if steps not in self.jobs:
                self.jobs[steps] = Job(self.cluster, self.out_dir, f"reference-{steps}",
                                       f"--train_steps={steps}")

    def finished(self):
        return {steps: job.finish() for steps, job in self.jobs.items()}


def saved_steps(output):
    return [int(step) for step in re.findall(r"saved a checkpoint at step (\d+)", output)]


def resumed_steps(output):
    return [int(step) for step in re.findall(r"resumed from \S+ at step (\d+)", output)]


def logged_step_after(step, log_every=10):
    """The first step the chief logs at least 10 steps past `step`."""
    return (step // log_every + 2) * log_every


def timestamp(value):
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S")


# ---------------------------------------------------------------------------- preemption

PARTITIONS = ("low", "nograce")   # preemptible_conf's: GraceTime=GRACE_TIME, and none


@pytest.fixture(scope="module")
def preemptible_slurms():
    """{partition: a single-node Slurm whose high partition preempts its low ones}: one per
    preemption, so that both run at once (each needs its node to itself)."""
    with contextlib.ExitStack() as stack:
        clusters = {partition: stack.enter_context(SlurmCluster.started(
            **preemptible_conf(GRACE_TIME, KILL_WAIT, REQUEUE_DELAY))) for partition in PARTITIONS}
        yield clusters
    for cluster in clusters.values():
        assert not cluster.processes(), "a preemptible cluster left processes behind"


def preempt(cluster, out_dir, partition):
    """The tfdist job to `partition`; once it trains, a job that needs the whole node to the
    high partition. Slurm does the rest: from there on the test only watches, until the tfdist
    job has ended. Returns the Job, its end (scontrol's view, results) and the high job's view."""
    job = Job(cluster, out_dir, f"preempted-{partition}", f"--train_steps={STEPS}",
              sbatch_options=[f"--partition={partition}"])
    job.wait_for_step(10)
    high = cluster.sbatch(["--partition=high", "--nodes=1", "--exclusive", f"--job-name=high-{partition}",
                           "--wrap", "sleep 3"], output=os.path.join(out_dir, f"high-{partition}.out"),
                          cwd=REPO)
    return dict(job=job, end=job.finish(), high=cluster.job(high))


# ---------------------------------------------------------------------------- stops and resumes

def scancel_after_10_more_steps(*options):
    def stop(job, checkpoint):
        job.wait_for_step(logged_step_after(checkpoint))
        job.cluster.command(["scancel", "--signal=TERM", *options, job.id])
    return stop


def out_of_time(job, checkpoint):
    """Nothing from the test: the time limit's USR1 stops the job, which requeues itself. Its
    requeued run is then cancelled while it waits (121 s on this cluster): the next job is a
    resubmission, as after the other stops."""
    job.cluster.wait(job.id, JOB_TIMEOUT, until=lambda state: state["JobState"] in FINAL_STATES
                     or state["Restarts"] != "0" and state["JobState"] == "PENDING")
    job.cluster.command(["scancel", job.id])


SCANCELS = [("scancel --signal=TERM", scancel_after_10_more_steps(), []),
            ("scancel --signal=TERM --batch", scancel_after_10_more_steps("--batch"), []),
            ("scancel --signal=TERM --full", scancel_after_10_more_steps("--full"), [])]
TIME_LIMITS = [("time limit", out_of_time, TIME_LIMIT)]


def stop_and_resume(cluster, out_dir, name, stops, references):
    """Jobs of one --model_dir, each stopped by its `stops` entry and the next a resubmission
    of the same command; then one that trains on to 100 steps past the last checkpoint (at
    least STEPS). Returns the stopped jobs (what each left), the last job's end, its steps."""
    model_dir, links, checkpoint = os.path.join(out_dir, name), [], 0
    for number, (how, stop, sbatch_options) in enumerate(stops):
        job = Job(cluster, out_dir, f"{name}{number}", UNTIL_STOPPED, model_dir=model_dir,
                  sbatch_options=sbatch_options)
        stop(job, checkpoint)
        state, _, _ = job.finish()
        output = job.output()
        links.append(dict(how=how, job=state, output=output, saved=saved_steps(output),
                          resumed=resumed_steps(output), exits=task_exit_codes(output)))
        checkpoint = max(links[-1]["saved"] or [checkpoint])
    steps = max(STEPS, checkpoint + 100)
    references.start(steps)
    last = Job(cluster, out_dir, f"{name}-last", f"--train_steps={steps}", model_dir=model_dir)
    return dict(links=links, last=last.finish(), steps=steps)


@pytest.fixture(scope="module")
def runs(slurm, preemptible_slurms, tmp_path_factory):
    """Every job of this file, in four flows at once: the two preemptions and the time limit
    in threads, the scancels here. The references start with the resubmissions that need them."""
    out_dir = str(tmp_path_factory.mktemp("slurm-preempt"))
    references = References(slurm, out_dir)
    with ThreadPoolExecutor(max_workers=3) as beside:
        preemptions = {partition: beside.submit(preempt, cluster, out_dir, partition)
                       for partition, cluster in preemptible_slurms.items()}
        time_limit = beside.submit(stop_and_resume, slurm, out_dir, "time-limit", TIME_LIMITS, references)
        scancels = stop_and_resume(slurm, out_dir, "scancel", SCANCELS, references)
        references.start(STEPS)   # the preemptions' (already started, unless TERMs came late)
        return dict(preemptions={partition: flow.result() for partition, flow in preemptions.items()},
                    time_limit=time_limit.result(), scancels=scancels, references=references.finished())


# ---------------------------------------------------------------------------- checks

def assert_like_the_uninterrupted_job(runs, results, model_dir, what):
    """Per-step losses from results' start_step, and the final checkpoint's tensors (weights,
    Adam slots, counters), against the uninterrupted job of as many steps; returns how many
    tensors are bitwise equal, and how many there are."""
    state, reference, reference_job = runs["references"][results["steps"]]
    assert state["ExitCode"] == "0:0", reference_job.output()[-3000:]
    start = results["start_step"]
    np.testing.assert_allclose(results["losses"], reference["losses"][start:], rtol=RTOL, atol=0,
                               err_msg=what)
    expected, got = final_tensors(reference_job.model_dir), final_tensors(model_dir)
    assert expected.keys() == got.keys() and expected, what
    worst = max(relative_difference(expected[name], got[name]) for name in expected)
    assert worst <= RTOL, f"{what}: tensors {worst:.2e} relative off the uninterrupted job's"
    return sum(np.array_equal(expected[name], got[name]) for name in expected), len(expected)


# How the batch shell saw each preemption: with a grace time the tasks alone got SIGTERM and
# the shell requeued the job itself once they had saved (Slurm 22.05 would not: the job ended
# inside its grace time); without one Slurm ended the whole job, shell included, and requeued it.
BATCH_SHELL_SAW = {"low": "preempted (tasks exited 4): requeueing job",
                   "nograce": "SIGTERM: asking the tasks to save and exit"}


@pytest.mark.parametrize("partition", PARTITIONS, ids=["grace_time_30s", "kill_wait_30s"])
def test_a_preempted_job_is_requeued_and_ends_like_an_uninterrupted_one(runs, partition):
    preemption = runs["preemptions"][partition]
    (job, results, tfdist_job), high = preemption["end"], preemption["high"]
    output = tfdist_job.output()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, output[-3000:])
    restarts = int(job["Restarts"])
    print(f"preempted job {job['JobId']} ({partition}): requeued {restarts} time(s) (scontrol's "
          f"Restarts); the high-priority job ran {high['StartTime']} to {high['EndTime']}, the "
          f"tfdist job's last run {job['StartTime']} to {job['EndTime']}")
    assert restarts >= 1, job
    # The first run: both tasks saved the same step and exited 4 (srun reports only non-zero).
    assert task_exit_codes(output) == {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, output[-3000:]
    saved = saved_steps(output)
    assert len(saved) == 2 and saved[0] == saved[1] < STEPS, saved
    assert BATCH_SHELL_SAW[partition] in output, output[-3000:]
    # The next run began after the high-priority job had ended, and resumed from that step.
    assert high["JobState"] == "COMPLETED", high
    assert timestamp(high["EndTime"]) <= timestamp(job["StartTime"]), (high, job)
    assert resumed_steps(output) == [saved[0]] * 2, output[-3000:]
    bitwise, count = assert_like_the_uninterrupted_job(runs, results, tfdist_job.model_dir,
                                                       f"job preempted in {partition}")
    print(f"checkpoint at step {saved[0]}; final tensors bitwise equal to the uninterrupted "
          f"job's: {bitwise}/{count}")


def assert_saved_and_exited_4(link):
    """Both tasks exited 4 after saving one checkpoint at the same step."""
    assert link["exits"] == {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, (link["how"], link["output"][-3000:])
    assert len(link["saved"]) == 2 and link["saved"][0] == link["saved"][1], (link["how"], link["saved"])


def assert_resumed_from_the_previous_link(links, link):
    """A resubmitted job started from the checkpoint the job before it saved."""
    previous = links[link - 1]["saved"][:1] if link else []
    assert links[link]["resumed"] == previous * 2, (links[link]["how"], links[link]["output"][-3000:])
    assert not link or links[link]["saved"][0] > previous[0], links[link]["saved"]


@pytest.mark.parametrize("link", range(3), ids=["plain", "batch", "full"])
def test_scancel_term_makes_both_tasks_save_and_exit_4(runs, link):
    stop = runs["scancels"]["links"][link]
    assert stop["job"]["ExitCode"] == f"{EXIT_PREEMPTED}:0" and stop["job"]["Restarts"] == "0", stop
    assert_saved_and_exited_4(stop)
    assert_resumed_from_the_previous_link(runs["scancels"]["links"], link)


def test_the_time_limit_signal_makes_both_tasks_save_exit_4_and_requeue(runs):
    stop = runs["time_limit"]["links"][0]
    assert stop["job"]["Restarts"] == "1", stop["job"]   # requeued once, cancelled while pending
    assert_saved_and_exited_4(stop)
    assert "time limit (USR1)" in stop["output"], stop["output"][-3000:]
    assert "out of time (tasks exited 4): requeueing job" in stop["output"], stop["output"][-3000:]


@pytest.mark.parametrize("flow", ["scancels", "time_limit"])
def test_the_resubmitted_job_ends_like_an_uninterrupted_one(runs, flow):
    (job, results, last), links = runs[flow]["last"], runs[flow]["links"]
    assert job["ExitCode"] == "0:0", (job, last.output()[-3000:])
    assert results["start_step"] == links[-1]["saved"][0] and results["steps"] == runs[flow]["steps"]
    bitwise, count = assert_like_the_uninterrupted_job(runs, results, last.model_dir, f"{flow}' last job")
    print(f"{flow}: " + ", ".join(f"{link['how']}: checkpoint at step {link['saved'][0]}" for link in links)
          + f"; resumed and trained to {runs[flow]['steps']}: final tensors bitwise equal to the "
          f"uninterrupted job's: {bitwise}/{count}")
