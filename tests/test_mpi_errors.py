"""--collective=mpi: bad input and a bad start end before training, in one paragraph.

Real launches (Open MPI's mpirun, directly or through `tfdist launch --mpi`), no mocks:
- outside an MPI launch: exit 2, saying how to launch (also under `tfdist launch`
  without --mpi, whose workers are not MPI ranks);
- without mpi4py: exit 2, saying what to install. mpi4py is installed here (the
  test extra), so the worker blocks its import before running the entrypoint
  (sys.modules["mpi4py"] = None, Python's own way to make an import fail);
- a TF_CONFIG that is also set and disagrees with the MPI world (size, or rank):
  exit 2 naming both;
- a rank dead at start-up: the job ends at once (mpirun sees it exit; raw mpirun
  can hang in Open MPI 5's teardown race, tfdist launch --mpi ends it); a rank
  stuck before MPI_Init: the others end with exit 3 within --collective_timeout
  (the watchdog reaches MPI_Init because tfdist initialises MPI without the GIL),
  and nothing is left running;
- `tfdist launch --mpi` refuses the flags it cannot honour, and names what to
  install when there is no mpirun.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from helpers import REPO
from test_mpi import mpi_unavailable

pytestmark = pytest.mark.skipif(mpi_unavailable() is not None, reason=str(mpi_unavailable()))
TRAIN = ["-m", "experiments.train", "--strategy=multi_worker_mirrored", "--collective=mpi",
         "--model=mlp", "--train_steps=5", "--global_batch_size=32"]


def environment(**extra):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)   # the caller's own, if any, is the one under test
    env.update(extra)
    return env


def run(command, timeout=180, **env):
    """The command in a session of its own: on a timeout the assertion shows what of the job
    still ran (mpirun, or which rank) and the end of its output, and the whole session is
    killed, so no rank outlives the test. (Once, in a full-suite run, mpirun with a rank dead
    at start-up neither ended nor let the test see why; it has not recurred in reruns.)"""
    process = subprocess.Popen(command, cwd=REPO, env=environment(**env), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        still_running = session_processes(process.pid)
        for pid in [int(line.split()[0]) for line in still_running]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"no end within {timeout} s: {' '.join(command[:12])} ...\nstill running:\n"
            + "\n".join(still_running) + f"\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-5000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def session_processes(session_id: int) -> list:
    """'PID ELAPSED STATE COMMAND' of every process in the session (real /proc, via ps)."""
    listing = subprocess.run(["ps", "-e", "-o", "pid=,sid=,etime=,stat=,args="],
                             capture_output=True, text=True).stdout.splitlines()
    rows = [line.split(None, 4) for line in listing]
    return [" ".join([pid, elapsed, state, args[:200]])
            for pid, sid, elapsed, state, args in (row for row in rows if len(row) == 5)
            if int(sid) == session_id]


def mpirun(np_, command, *mpirun_flags, timeout=180, **env):
    """Open MPI's mpirun started directly (not through tfdist launch, which drops TF_CONFIG)."""
    from tfdist import launch
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return run([launch.resolve_mpirun(), "-np", str(np_), "--bind-to", "none", "--mca", "btl",
                "self,sm", *root, *mpirun_flags, *command], timeout=timeout, **env)


def one_paragraph_error(result, *phrases):
    """Every rank's message (one line each after "tfdist: ...") holds the phrases; no traceback."""
    text = result.stdout + result.stderr
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if "--collective=mpi" in line or "cluster error" in line]
    assert lines, text[-3000:]
    for phrase in phrases:
        assert any(phrase in line for line in lines), (phrase, lines)


def test_outside_an_mpi_launch_says_how_to_launch():
    result = run([sys.executable, *TRAIN])
    assert result.returncode == 2, result.stderr[-2000:]
    one_paragraph_error(result, "needs an MPI launch", "mpirun -np N", "srun --mpi=pmix",
                        "tfdist launch --mpi")


def test_tfdist_launch_without_mpi_is_not_an_mpi_launch():
    result = run([sys.executable, "-m", "tfdist.launch", "--workers", "2", "--",
                  sys.executable, *TRAIN])
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    one_paragraph_error(result, "needs an MPI launch", "tfdist launch --mpi")


def test_without_mpi4py_says_what_to_install():
    block = ("import runpy, sys; sys.modules['mpi4py'] = None; sys.argv = ['train'] + sys.argv[1:]; "
             "runpy.run_module('experiments.train', run_name='__main__')")
    result = run([sys.executable, "-m", "tfdist.launch", "--mpi", "--workers", "2", "--",
                  sys.executable, "-c", block, *TRAIN[2:]])
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    one_paragraph_error(result, "needs mpi4py", 'pip install -e ".[mpi]"')


def tf_config(workers, index):
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{20000 + i}" for i in range(workers)]},
                       "task": {"type": "worker", "index": index}})


def test_tf_config_of_another_size_than_the_mpi_world():
    result = mpirun(2, [sys.executable, *TRAIN], "-x", "TF_CONFIG", TF_CONFIG=tf_config(3, 0))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    one_paragraph_error(result, "the MPI world has 2 rank(s), but TF_CONFIG names 3 worker(s)")


def test_tf_config_whose_task_is_not_the_mpi_rank():
    result = mpirun(2, [sys.executable, *TRAIN], "-x", "TF_CONFIG", TF_CONFIG=tf_config(2, 1))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    one_paragraph_error(result, "this process is MPI rank 0, but its TF_CONFIG says task worker:1")


RANK_1_EXITS_7_AFTER = ('[ "$OMPI_COMM_WORLD_RANK" = 1 ] && {{ sleep {delay}; exit 7; }}; '
                        f'exec {sys.executable} "$@"')


@pytest.mark.xfail(strict=False, reason=(
    "upstream Open MPI 5.0.11 (PRRTE) teardown race, not tfdist's: when a rank dies while another "
    "is connecting to mpirun's PMIx server, mpirun reports the failed rank, prints PMIX_ERR_UNREACH "
    "(ptl_base_connection_hdlr.c) and never ends, the other rank a zombie it never reaps. Here it "
    "hung in 5 of 15 runs with the rank dying 2.0-2.8 s after the start, never at 8 s, once in a "
    "loaded full-suite run. Raw mpirun has no guard; tfdist launch --mpi has one (next test)"))
def test_a_rank_dead_at_start_up_ends_the_job():
    start = time.monotonic()
    script = RANK_1_EXITS_7_AFTER.format(delay=8)
    result = mpirun(2, ["sh", "-c", script, "sh", *TRAIN, "--collective_timeout=60"])
    assert result.returncode == 7, result.stdout[-2000:] + result.stderr[-2000:]
    assert time.monotonic() - start < 60   # mpirun ended rank 0: no wait for the timeout


def test_a_rank_dead_at_start_up_ends_the_job_under_tfdist_launch():
    """The same, under tfdist launch --mpi, with the rank dying 2.4 s in: where mpirun's teardown
    race hangs it here a third of the time. The job ends well before rank 0's timeout either
    way: mpirun ends it with the rank's code, or the launcher's MpirunTeardownGuard does 15 s
    later, with the code mpirun reported or, when it hung before reporting (once in 8 runs
    here; the failed rank already reaped, its code lost), 1 and a message saying so."""
    start = time.monotonic()
    script = RANK_1_EXITS_7_AFTER.format(delay=2.4)
    result = run([sys.executable, "-m", "tfdist.launch", "--mpi", "--workers", "2", "--",
                  "sh", "-c", script, "sh", *TRAIN, "--collective_timeout=60"], timeout=120)
    unreported = "mpirun reported no failed rank" in result.stderr
    assert result.returncode == (1 if unreported else 7), \
        result.stdout[-2000:] + result.stderr[-2000:]
    assert time.monotonic() - start < 60   # not rank 0's 60 s timeout


def test_launch_ends_an_mpirun_that_outlives_its_ranks():
    """mpirun's hang made certain: each rank stops mpirun (SIGSTOP), then exits 5, so mpirun
    neither reaps them nor ends. The guard kills it once the ranks are all zombies for 15 s,
    with the ranks' status and a message naming the hang; nothing is left running."""
    marker = f"tfdist-hung-{uuid.uuid4().hex[:8]}"
    start = time.monotonic()
    result = run([sys.executable, "-m", "tfdist.launch", "--mpi", "--workers", "2", "--",
                  "sh", "-c", "kill -STOP $PPID; exit 5", marker], timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 5, result.stdout[-2000:] + result.stderr[-2000:]
    assert "mpirun was still running 15 s after its last rank ended" in result.stderr, \
        result.stderr[-2000:]
    assert "Open MPI's teardown hang" in result.stderr and "Traceback" not in result.stderr
    assert 15 <= elapsed < 15 + 20, elapsed
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the hung job still run: {left}"


def test_a_rank_stuck_before_mpi_init_ends_the_others_with_exit_3():
    marker = f"tfdist-stuck-{uuid.uuid4().hex[:8]}"   # finds this job's processes afterwards
    script = f'[ "$OMPI_COMM_WORLD_RANK" = 1 ] && kill -STOP $$; exec {sys.executable} "$@"'
    start = time.monotonic()
    result = mpirun(2, ["sh", "-c", script, marker, *TRAIN, "--collective_timeout=10"],
                    timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    one_paragraph_error(result, "MPI rank 0: joining the MPI world",
                        "--collective_timeout=10 s")
    assert elapsed < 10 + 30, elapsed   # the timeout, plus TensorFlow's import and mpirun's teardown
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the stuck job still run: {left}"


@pytest.mark.parametrize("flags,phrase", [
    (["--dtensor"], "--mpi and --dtensor cannot be combined"),
    (["--start_timeout", "5"], "--start_timeout probes the ports"),
])
def test_launch_refuses_what_mpi_cannot_honour(flags, phrase):
    result = run([sys.executable, "-m", "tfdist.launch", "--mpi", "--workers", "2", *flags, "--",
                  "true"])
    assert result.returncode == 2 and phrase in result.stderr, result.stderr[-2000:]


def test_mpi_args_without_mpi():
    result = run([sys.executable, "-m", "tfdist.launch", "--workers", "2",
                  "--mpi_args=--mca btl tcp,self", "--", "true"])
    assert result.returncode == 2 and "needs --mpi" in result.stderr, result.stderr[-2000:]


def test_launch_without_mpirun_says_what_to_install(tmp_path):
    """A Python whose directory has no mpirun, on a PATH without one."""
    python = tmp_path / "python"
    python.symlink_to(sys.executable)
    result = run([str(python), "-m", "tfdist.launch", "--mpi", "--workers", "2", "--", "true"],
                 PATH=f"{tmp_path}:/usr/bin:/bin")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "needs Open MPI's mpirun" in result.stderr and 'pip install -e ".[mpi]"' in result.stderr


def test_mpirun_report_of_the_failed_rank_is_read_across_chunks():
    """mpirun's report as it printed it here (Open MPI 5.0.11), split between two reads, as the
    pump may see it: the rank and its code are kept, and the text passes through unchanged."""
    from tfdist.launch.mpirun import MpirunOutput
    report = ("prterun detected that one or more processes exited with non-zero status,\n"
              "thus causing the job to be terminated. The first process to do so was:\n\n"
              "   Process name: [prterun-vm-11824@1,1]\n   Exit code:    7\n")
    output = MpirunOutput()
    cut = report.index("Exit code")
    assert output(report[:cut]) + output(report[cut:]) == report
    assert (output.failed_rank, output.failed_exit_code) == (1, 7)
    assert output("[1,0]<stdout>: step 1\n") == "[worker 0] step 1\n"
