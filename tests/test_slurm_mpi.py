"""Real Slurm + MPI: sbatch of examples/slurm/train-mpi.sbatch (srun --mpi=pmix, --collective=mpi).

No mocks: the session's single-node Slurm (tests/slurm_cluster.py) runs the jobs, srun
starts the two tasks as the ranks of one MPI world through Slurm's PMIx plugin, tfdist
forms the TensorFlow cluster from that world (no TF_CONFIG) and sums the gradients
with MPI_Allreduce. Proven:
- the 2-task job trains like one device: per-step losses within 1e-5 relative of
  --strategy=default with the same flags and seed, the chief's final checkpoint
  (weights, Adam slots, counters) within 1e-5, and both tasks' final weights bitwise
  equal to each other and within 1e-5 of the one-device weights;
- `scancel --signal=TERM` makes both ranks save one checkpoint (agreed over MPI) and
  exit 4, and the resubmitted job resumes from it exactly (its losses = the
  uninterrupted job's).
Skips, saying what to install, without Slurm or root (as tests/test_slurm.py), without
mpi4py and a loadable MPI library, or without the libpmix.so that Slurm's PMIx plugin
dlopens (Debian's slurm-wlm: libpmix-dev; .ci/run installs it).
"""

import glob
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import REPO
from slurm_cluster import slurm, unavailable_reason  # noqa: F401 (fixture)
from test_slurm import (final_tensors, preempt_after_step_10, read, relative_difference,
                        task_exit_codes)
from tfdist.errors import EXIT_PREEMPTED
from tfdist.testing import equivalence

SCRIPT = os.path.join("examples", "slurm", "train-mpi.sbatch")
FLAGS = ["--model=mlp", "--dataset=synthetic", "--global_batch_size=32", "--optimizer=adam",
         "--seed=3", "--log_every=10"]
STEPS = 400          # at least this many; more when the TERM lands late (steps_to_compare)
RTOL = equivalence.RTOL
JOB_TIMEOUT = 300    # seconds, per job: the machine is shared
# Where Debian, RPM and source builds of Slurm keep their plugins (slurm.conf's PluginDir
# default); mpi_pmix.so is the PMIx plugin srun --mpi=pmix loads (a link to mpi_pmix_vN.so).
SLURM_PLUGIN_DIRS = ("/usr/lib/*/slurm-wlm", "/usr/lib64/slurm", "/usr/lib/slurm",
                     "/usr/local/lib/slurm", "/usr/local/lib64/slurm")


def pmix_unavailable_reason():
    """Why `srun --mpi=pmix` cannot start MPI ranks here, or None.

    Slurm's PMIx plugin links no libpmix: at each job step it dlopens
    PMIXP_LIBPATH/libpmix.so, a directory compiled into the plugin (Debian:
    /usr/lib/x86_64-linux-gnu/pmix2/lib). That unversioned libpmix.so is a
    development file: Debian ships it in libpmix-dev only (libpmix2 has
    libpmix.so.2), and without it every srun --mpi=pmix step fails. So: find the
    plugin, read the directory out of it, and look for libpmix.so there."""
    plugins = [path for pattern in SLURM_PLUGIN_DIRS
               for path in glob.glob(os.path.join(pattern, "mpi_pmix.so"))]
    if not plugins:
        return (f"Slurm's PMIx plugin (mpi_pmix.so) is not installed in any of "
                f"{', '.join(SLURM_PLUGIN_DIRS)}: srun --mpi=pmix cannot start MPI ranks")
    with open(plugins[0], "rb") as f:
        strings = [s.decode() for s in re.findall(rb"\0(/[\x21-\x7e]+)\0", f.read()) if b"%" not in s]
    directories = [s for s in strings if "pmix" in s] or strings
    if any(os.path.exists(os.path.join(d, "libpmix.so")) for d in directories):
        return None
    wanted = os.path.join(directories[0], "libpmix.so") if directories else "libpmix.so"
    return (f"Slurm's PMIx plugin {plugins[0]} dlopens {wanted}, which is missing: "
            f"apt-get install libpmix-dev (libpmix2 alone has only libpmix.so.2)")


def mpi_unavailable_reason():
    """Why the job's Python cannot join an MPI world, or None (checked in a subprocess:
    loading libmpi into pytest's own process is not this test's business)."""
    check = ("import mpi4py; mpi4py.rc.initialize = False\n"
             "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return (f"--collective=mpi needs mpi4py and an MPI library ({last}): "
                f'pip install -e ".[mpi]"')
    return None


def unavailable():
    return unavailable_reason() or pmix_unavailable_reason() or mpi_unavailable_reason()


REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))

# PYTHON for the runs whose final weights the test reads: `python -m experiments.train`
# itself (runpy, __main__), with tfdist.run asked for the trained model too
# (return_model=True, its public keyword), whose weights every task writes to
# TFDIST_TEST_WEIGHTS with its rank filled in. Only the chief writes --model_dir; this
# is how the other rank's weights are seen.
WEIGHT_WRITER = """\
#!{python}
import os, runpy, sys
import numpy as np
import tfdist

run = tfdist.run

def run_and_write_weights(config, **kwargs):
    results, model = run(config, return_model=True)
    rank = os.environ.get("PMIX_RANK", os.environ.get("SLURM_PROCID", "0"))
    np.savez(os.environ["TFDIST_TEST_WEIGHTS"].format(rank=rank), *model.get_weights())
    return results

tfdist.run = run_and_write_weights
assert sys.argv[1] == "-m", sys.argv
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def weight_writer(directory):
    path = os.path.join(directory, "python-writing-weights")
    with open(path, "w") as f:
        f.write(textwrap.dedent(WEIGHT_WRITER).format(python=sys.executable))
    os.chmod(path, 0o755)
    return path


def submit(slurm, out_dir, name, *flags, model_dir=None, python=sys.executable):
    """sbatch of train-mpi.sbatch (2 tasks, 1 CPU each); returns (job id, paths)."""
    paths = {key: os.path.join(out_dir, f"{name}.{key}") for key in ("out", "json")}
    paths["model_dir"] = model_dir or os.path.join(out_dir, name)
    paths["weights"] = os.path.join(out_dir, f"{name}.rank{{rank}}.npz")
    env = dict(PYTHON=python, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
               TFDIST_TEST_WEIGHTS=paths["weights"])
    job_id = slurm.sbatch([SCRIPT, *FLAGS, *flags, f"--model_dir={paths['model_dir']}",
                           f"--results_json={paths['json']}"], output=paths["out"], cwd=REPO, env=env)
    return job_id, paths


def finish(slurm, job_id, paths, timeout=JOB_TIMEOUT):
    job = slurm.wait(job_id, timeout)
    output = read(paths["out"])
    results = json.load(open(paths["json"])) if os.path.exists(paths["json"]) else None
    return job, output, results


@pytest.fixture(scope="module")
def runs(slurm, tmp_path_factory):
    """Every job of this file: a job preempted with scancel --signal=TERM, then, overlapped
    (the node takes two 2-task jobs at once), its resubmission, the uninterrupted job and a
    one-device run of the same flags, all to the step steps_to_compare picks from the
    preempted job's checkpoint (a TERM can land hundreds of steps late on a loaded machine)."""
    out_dir = str(tmp_path_factory.mktemp("slurm-mpi"))
    writer = weight_writer(out_dir)
    started = time.monotonic()
    preempted = submit(slurm, out_dir, "preempted", "--train_steps=1000000")   # only TERM ends it
    result = preempt_after_step_10(slurm, *preempted)
    steps = result["steps"]
    # The resubmission: same script and flags, the same --model_dir, a --train_steps to stop at.
    resumed = submit(slurm, out_dir, "resumed", f"--train_steps={steps}",
                     model_dir=preempted[1]["model_dir"])
    uninterrupted = submit(slurm, out_dir, "mpi", f"--train_steps={steps}", python=writer)
    default_dir = os.path.join(out_dir, "default")
    one_device = subprocess.Popen(
        [writer, "-m", "experiments.train", "--strategy=default", "--simulate_devices=0", *FLAGS,
         f"--train_steps={steps}", f"--model_dir={default_dir}", f"--results_json={default_dir}.json"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2",
                           TFDIST_TEST_WEIGHTS=f"{default_dir}.npz"),
        stdout=subprocess.DEVNULL, stderr=open(f"{default_dir}.log", "w"))
    try:
        assert one_device.wait(JOB_TIMEOUT) == 0, read(f"{default_dir}.log")[-3000:]
    finally:
        one_device.kill()
    result.update(uninterrupted=(*finish(slurm, *uninterrupted), uninterrupted[1]),
                  resumed=finish(slurm, *resumed), default_dir=default_dir)
    print(f"slurm-mpi jobs: {time.monotonic() - started:.0f} s in all")
    return result


def test_sbatch_srun_mpi_two_tasks_train_like_one_device(runs):
    job, output, results, paths = runs["uninterrupted"]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, output[-3000:])
    assert results["strategy"] == "multi_worker_mirrored" and results["num_replicas"] == 2
    ranks = re.findall(r"collective mpi: rank (\d) of 2 \(a PMIx launcher", output)
    assert sorted(ranks) == ["0", "1"], output[-3000:]    # one world of 2, through srun's PMIx

    default_dir = runs["default_dir"]
    reference = equivalence.from_results_json(f"{default_dir}.json", "default",
                                              weights=f"{default_dir}.npz")
    tasks = [equivalence.from_results_json(paths["json"], f"srun --mpi=pmix task {rank}",
                                           weights=paths["weights"].format(rank=rank))
             for rank in (0, 1)]
    assert len(reference.losses) == runs["steps"] >= STEPS
    problems = equivalence.loss_mismatches(reference, tasks[0])   # refuses empty lists
    for task in tasks:
        problems += equivalence.weight_mismatches(reference, task)
    assert not problems, problems[:10]
    assert len(tasks[0].weights) == len(tasks[1].weights) > 0
    differing = [index for index, (a, b) in enumerate(zip(*(t.weights for t in tasks)))
                 if a.shape != b.shape or a.tobytes() != b.tobytes()]
    assert not differing, f"weights {differing} differ between the two tasks (bitwise)"

    expected, got = final_tensors(default_dir), final_tensors(paths["model_dir"])
    assert expected.keys() == got.keys() and expected
    worst = max(relative_difference(expected[name], got[name]) for name in expected)
    assert worst <= RTOL, worst
    print(f"losses: worst relative error {equivalence.max_relative_loss_error(reference, tasks[0]):.2e}; "
          f"checkpoint tensors: worst {worst:.2e}")


def test_scancel_term_under_srun_mpi_saves_exit_4_and_a_resubmitted_job_resumes_exactly(runs):
    job, output, _ = runs["preempted"]
    assert task_exit_codes(output) == {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, output[-3000:]
    assert job["ExitCode"] == f"{EXIT_PREEMPTED}:0", job
    saved = re.findall(r"saved a checkpoint at step (\d+)", output)
    assert len(saved) == 2 and saved[0] == saved[1], saved        # both tasks, one step
    step = int(saved[0])
    assert 10 <= step < runs["steps"], f"TERM landed at step {step}; {runs['steps']} leaves nothing to resume"
    assert json.loads(runs["checkpoints"])["checkpoints"][-1] == f"ckpt-{step}", runs["checkpoints"]
    print(f"TERM to job end: {runs['seconds_to_end']:.1f} s; checkpoint at step {step}; "
          f"compared to step {runs['steps']}")

    job, output, resumed = runs["resumed"]
    assert job["ExitCode"] == "0:0", (job, output[-3000:])
    assert resumed["start_step"] == step and len(resumed["losses"]) == runs["steps"] - step
    tail = equivalence.Record("uninterrupted", runs["uninterrupted"][2]["losses"][step:], None)
    candidate = equivalence.Record("resumed", resumed["losses"], None)
    problems = equivalence.loss_mismatches(tail, candidate)   # refuses empty lists
    assert not problems, problems[:10]
    print(f"resumed at {step}: worst relative loss error "
          f"{equivalence.max_relative_loss_error(tail, candidate):.2e}")


def test_srun_with_an_mpi_plugin_open_mpi_cannot_speak_is_refused(slurm):
    """srun --mpi=pmi2 with Open MPI 5 (PMIx only): each task initialises a world of
    one. Both would train alone as chief; instead each says so and exits 2."""
    env = dict(slurm.env, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    result = slurm.command(["srun", "--mpi=pmi2", "-n", "2", "--cpus-per-task=1", sys.executable,
                            "-m", "experiments.train", "--strategy=multi_worker_mirrored",
                            "--collective=mpi", "--train_steps=5"],
                           timeout=JOB_TIMEOUT, check=False, env=env, cwd=REPO)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert output.count("the launcher started 2 processes (PMI_SIZE=2), but MPI formed a "
                        "world of 1") == 2, output[-3000:]
    assert "srun --mpi=pmix" in output and "Traceback" not in output
