"""`tfdist launch`, `tfdist doctor` and the Slurm/Kubernetes examples, with real subprocesses.

Workers are tiny Python scripts written to tmp_path (no TensorFlow, so each
starts in ~50 ms); only the doctor test imports TensorFlow. Every subprocess
and every wait has a timeout.
"""

import json
import os
import re
import select
import signal
import stat
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tfdist import cli, cluster
from tfdist import launch as launch_module
from tfdist.launch import mpirun as launch_mpirun
from tfdist.errors import UsageError

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 60


def clean_env(**extra) -> dict:
    """This environment without cluster variables, with the repository importable."""
    env = {name: value for name, value in os.environ.items()
           if name != "TF_CONFIG" and not name.startswith(("DTENSOR_", "TFDIST_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def launcher_command(*args) -> list:
    return [sys.executable, "-m", "tfdist.launch", *args]


def launch(*args, timeout=TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(launcher_command(*args), cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout)


def script(tmp_path: Path, body: str, name: str = "worker.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone: it no longer executes)."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def worker_lines(text: str, rank: int) -> list:
    prefix = f"[worker {rank}] "
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


# --------------------------------------------------------------------------- environment and output

def test_each_worker_gets_its_config_and_distinct_bindable_ports(tmp_path):
    worker = script(tmp_path, f"""
        import json, os, socket
        rank = os.environ["TFDIST_RANK"]
        def bindable(address):
            with socket.socket() as probe:
                probe.bind(("0.0.0.0", int(address.rsplit(":", 1)[1])))
            return True
        config = json.loads(os.environ["TF_CONFIG"])
        own = config["cluster"]["worker"][config["task"]["index"]]
        dtensor_own = os.environ["DTENSOR_JOBS"].split(",")[int(os.environ["DTENSOR_CLIENT_ID"])]
        report = {{name: value for name, value in os.environ.items()
                  if name == "TF_CONFIG" or name.startswith(("TFDIST_", "DTENSOR_", "KERAS_DIST"))}}
        report["bindable"] = bindable(own) and bindable(dtensor_own)
        with open(os.path.join({str(tmp_path)!r}, rank + ".json"), "w") as out:
            json.dump(report, out)
        """)
    result = launch("--workers", "3", "--devices_per_worker", "2", "--dtensor", "--", sys.executable, worker)
    assert result.returncode == 0, result.stderr
    reports = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(3)]
    configs = [cluster.parse_tf_config(report["TF_CONFIG"]) for report in reports]
    dtensor = [cluster.validate_dtensor_env(report) for report in reports]
    assert len({tuple(config.worker_addresses) for config in configs}) == 1
    assert [(config.task_type, config.task_index) for config in configs] == [("worker", i) for i in range(3)]
    assert [config.is_chief for config in configs] == [True, False, False]
    assert [env.client_id for env in dtensor] == [0, 1, 2] and len({tuple(env.jobs) for env in dtensor}) == 1
    # keras.distribution.initialize() reads the same clients (tfdist.keras_distribution)
    assert [(r["KERAS_DISTRIBUTION_JOB_ADDRESSES"], r["KERAS_DISTRIBUTION_NUM_PROCESSES"],
             r["KERAS_DISTRIBUTION_PROCESS_ID"]) for r in reports] == [
        (r["DTENSOR_JOBS"], "3", str(rank)) for rank, r in enumerate(reports)]
    for rank, report in enumerate(reports):
        assert (report["TFDIST_RANK"], report["TFDIST_NUM_WORKERS"]) == (str(rank), "3")
        assert report["TFDIST_SIMULATE_DEVICES"] == "2" and report["TFDIST_RESTART_COUNT"] == "0"
        assert report["bindable"]
    ports = [cluster.split_address(address)[1] for address in configs[0].worker_addresses + dtensor[0].jobs]
    assert len(set(ports)) == 6
    secrets = {report["TFDIST_JOB_SECRET"] for report in reports}   # one job, one secret
    assert len(secrets) == 1 and re.fullmatch("[0-9a-f]{64}", secrets.pop())


def test_every_output_line_carries_its_rank(tmp_path):
    worker = script(tmp_path, """
        import os, sys
        rank = os.environ["TFDIST_RANK"]
        for i in range(200):
            print(f"out {rank} {i}")
            print(f"err {rank} {i}", file=sys.stderr)
        sys.stdout.write(f"last {rank} without newline")
        """)
    result = launch("--workers", "2", "--", sys.executable, worker)
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert worker_lines(result.stdout, rank) == [f"out {rank} {i}" for i in range(200)] + \
            [f"last {rank} without newline"]
        assert worker_lines(result.stderr, rank) == [f"err {rank} {i}" for i in range(200)]
    assert all(line.startswith(("[worker 0] ", "[worker 1] ")) for line in result.stdout.splitlines())
    assert all(line.startswith(("[worker 0] ", "[worker 1] ", "[tfdist launch] "))
               for line in result.stderr.splitlines())


def read_until(pipe, wanted: bytes, timeout=TIMEOUT) -> bytes:
    """What the launcher has printed so far, once it includes `wanted` (os.read: no line buffering)."""
    seen, deadline = b"", time.monotonic() + timeout
    while wanted not in seen:
        ready, _, _ = select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(pipe.fileno(), 65536) if ready else b""
        assert chunk, f"no {wanted!r} ({'end of output' if ready else f'{timeout}s passed'}); got {seen!r}"
        seen += chunk
    return seen


def test_redraws_pass_through_as_they_come_and_only_the_chief_redraws(tmp_path):
    go = tmp_path / "go"
    worker = script(tmp_path, f"""
        import os, time
        rank = os.environ["TFDIST_RANK"]
        frames = ["abc", "abd"] if rank == "0" else ["xyz1", "xyz2"]
        for frame in frames:
            os.write(1, frame.encode() + b"\\r")
            time.sleep(0.1)
        os.write(1, b"caf\\xc3")      # a UTF-8 character cut in two writes
        time.sleep(0.5)
        os.write(1, b"\\xa9\\r")
        deadline = time.time() + 30
        while not os.path.exists({str(go)!r}) and time.time() < deadline:
            time.sleep(0.02)
        os.write(1, b"done " + rank.encode() + b"\\n")
        """)
    launcher = subprocess.Popen(launcher_command("--workers", "2", "--", sys.executable, worker), cwd=REPO,
                                env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        early = read_until(launcher.stdout, "[worker 0] café\r".encode())
        # The chief's redraws arrived, each with its prefix, while its line is still unfinished.
        assert b"[worker 0] abc\r[worker 0] abd\r" in early and b"done" not in early
        go.touch()
        rest = launcher.stdout.read()
        assert launcher.wait(timeout=TIMEOUT) == 0, launcher.stderr.read()
    finally:
        launcher.kill()
        launcher.stdout.close()
        launcher.stderr.close()
    text = (early + rest).decode()
    assert "[worker 0] done 0\n" in text
    # Worker 1's line shows once, as it ends; its redraws never do.
    assert "[worker 1] done 1\n" in text and "xyz" not in text and text.count("café") == 1


def test_tfdist_run_from_python_logs_progress_once_whatever_the_callers_logging():
    # No logging set up by the caller: tfdist's own handler shows the steps.
    train = ("import tfdist; tfdist.run(tfdist.RunConfig(strategy='default', simulate_devices=0, "
             "model=tfdist.ModelConfig(name='mlp'), global_batch_size=32, train_steps=10, log_every=5))")
    result = subprocess.run([sys.executable, "-c", train], cwd=REPO, env=clean_env(TF_CPP_MIN_LOG_LEVEL="2"),
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count("step 5/10") == 1 and result.stderr.count("step 10/10") == 1, result.stderr
    # The caller's own set-up is kept, and nothing prints twice (no TensorFlow needed to show it).
    configured = ("import logging; logging.basicConfig(format='caller: %(message)s'); "
                  "from tfdist.train import progress; progress.ensure_logging(); "
                  "logging.getLogger('tfdist').warning('once')")
    result = subprocess.run([sys.executable, "-c", configured], cwd=REPO, env=clean_env(),
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.stderr.splitlines() == ["caller: once"], result.stderr


# --------------------------------------------------------------------------- failures and signals

def test_failing_worker_returns_its_code_and_ends_its_peers_fast(tmp_path):
    worker = script(tmp_path, f"""
        import os, subprocess, sys, time
        here, rank = {str(tmp_path)!r}, os.environ["TFDIST_RANK"]
        if rank == "1":   # fail once both peers (and a grandchild) are up
            deadline = time.time() + 20
            while not all(os.path.exists(os.path.join(here, f"pid{{r}}")) for r in ("0", "2", "child")):
                if time.time() > deadline: sys.exit(99)
                time.sleep(0.02)
            print("failing now", flush=True)
            sys.exit(3)
        if rank == "0":   # a grandchild in the worker's process group must die too
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            open(os.path.join(here, "pidchild.tmp"), "w").write(str(child.pid))
            os.rename(os.path.join(here, "pidchild.tmp"), os.path.join(here, "pidchild"))
        open(os.path.join(here, "pid" + rank + ".tmp"), "w").write(str(os.getpid()))
        os.rename(os.path.join(here, "pid" + rank + ".tmp"), os.path.join(here, "pid" + rank))
        time.sleep(60)
        """)
    started = time.monotonic()
    result = launch("--workers", "3", "--grace_period", "5", "--", sys.executable, worker)
    elapsed = time.monotonic() - started
    assert result.returncode == 3, result.stderr
    assert elapsed < 15, f"launcher took {elapsed:.1f}s; the peers sleep 60s"
    assert "[worker 1] failing now" in result.stdout
    assert "worker 1 exited with code 3" in result.stderr
    pids = [int((tmp_path / f"pid{name}").read_text()) for name in ("0", "2", "child")]
    for pid in pids:
        wait_for(lambda: not alive(pid), timeout=5, what=f"pid {pid} to be gone")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_to_the_launcher_reach_every_worker(tmp_path, signum):
    worker = script(tmp_path, f"""
        import os, signal, sys, time
        here, rank = {str(tmp_path)!r}, os.environ["TFDIST_RANK"]
        def record(signum, frame):
            open(os.path.join(here, "got" + rank), "w").write(str(signum))
            sys.exit(0)
        signal.signal(signal.SIGTERM, record)
        signal.signal(signal.SIGINT, record)
        open(os.path.join(here, "ready" + rank), "w").close()
        time.sleep(60)
        """)
    launcher = subprocess.Popen(launcher_command("--workers", "2", "--", sys.executable, worker), cwd=REPO,
                                env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: all((tmp_path / f"ready{rank}").exists() for rank in range(2)), what="workers")
        launcher.send_signal(signum)
        _, err = launcher.communicate(timeout=TIMEOUT)
    finally:
        launcher.kill()
    assert [(tmp_path / f"got{rank}").read_text() for rank in range(2)] == [str(int(signum))] * 2
    assert launcher.returncode == 128 + signum, err   # workers exited cleanly: the launcher reports the signal
    assert f"interrupted by {signum.name}" in err


def test_start_timeout_ends_a_group_whose_worker_never_opens_its_port(tmp_path):
    worker = script(tmp_path, """
        import json, os, socket, time
        config = json.loads(os.environ["TF_CONFIG"])
        if config["task"]["index"] == 0:   # rank 0 serves its port like a TF server would
            server = socket.socket()
            server.bind(("127.0.0.1", int(config["cluster"]["worker"][0].rsplit(":", 1)[1])))
            server.listen(4)
        time.sleep(60)
        """)
    started = time.monotonic()
    result = launch("--workers", "2", "--start_timeout", "1.5", "--", sys.executable, worker)
    assert result.returncode == 124, result.stderr
    assert time.monotonic() - started < 15
    assert "worker 1 did not open its port" in result.stderr and "--start_timeout=1.5s" in result.stderr


# --------------------------------------------------------------------------- restarts

RESTART_WORKER = """
    import json, os, sys, time
    here, rank = {here!r}, os.environ["TFDIST_RANK"]
    attempt = os.environ["TFDIST_RESTART_COUNT"]
    with open(os.path.join(here, f"secret{{attempt}}-rank{{rank}}"), "w") as out:
        out.write(os.environ["TFDIST_JOB_SECRET"])
    with open(os.path.join(here, f"attempt{{attempt}}-rank{{rank}}.json"), "w") as out:
        out.write(os.environ["TF_CONFIG"])
    # Rank 1 fails only once rank 0 has written its files: the launcher ends rank 0 as
    # soon as rank 1 fails, so without this wait the test races the two processes.
    peer = os.path.join(here, f"attempt{{attempt}}-rank0.json")
    deadline = time.monotonic() + 30
    while rank == "1" and not os.path.exists(peer) and time.monotonic() < deadline:
        time.sleep(0.01)
    marker = os.path.join(here, "failed-once")
    if rank == "1" and ({always} or not os.path.exists(marker)):
        open(marker, "w").close()
        sys.exit(5)
    """


def test_max_restarts_restarts_the_group_with_fresh_ports(tmp_path):
    worker = script(tmp_path, RESTART_WORKER.format(here=str(tmp_path), always=False))
    result = launch("--workers", "2", "--max_restarts", "1", "--", sys.executable, worker)
    assert result.returncode == 0, result.stderr
    assert "restart 1/1" in result.stderr
    ports = [{cluster.split_address(address)[1]
              for address in json.loads((tmp_path / f"attempt{attempt}-rank0.json").read_text())["cluster"]["worker"]}
             for attempt in (0, 1)]
    assert ports[0].isdisjoint(ports[1])
    secrets = {path.read_text() for path in tmp_path.glob("secret*-rank*")}
    assert len(list(tmp_path.glob("secret*-rank*"))) == 4 and len(secrets) == 1   # restarts keep the job's


def test_max_restarts_gives_up_with_the_failing_code(tmp_path):
    worker = script(tmp_path, RESTART_WORKER.format(here=str(tmp_path), always=True))
    result = launch("--workers", "2", "--max_restarts", "1", "--", sys.executable, worker)
    assert result.returncode == 5
    assert result.stderr.count("restart 1/1") == 1 and "restart 2" not in result.stderr
    assert "giving up after 1 restart(s): worker 1 exited with code 5" in result.stderr
    assert sorted(path.name for path in tmp_path.glob("attempt*-rank1.json")) == \
        ["attempt0-rank1.json", "attempt1-rank1.json"]


def test_what_workers_leave_in_the_temp_dir_goes_with_the_launch(tmp_path):
    """Multi-process workers end with os._exit (or are killed), which skips the atexit
    handlers that delete TensorFlow's autograph files: the launch's own TMPDIR takes
    them, and whatever else a worker leaves there, with it (also after a restart)."""
    outer = tmp_path / "tmp"
    outer.mkdir()
    worker = script(tmp_path, f"""
        import os, tempfile
        rank, attempt = os.environ["TFDIST_RANK"], os.environ["TFDIST_RESTART_COUNT"]
        with open(os.path.join({str(tmp_path)!r}, f"tmp-{{attempt}}-{{rank}}"), "w") as out:
            out.write(tempfile.gettempdir())
        tempfile.NamedTemporaryFile(prefix="__autograph_generated_file", delete=False).close()
        os._exit(5 if attempt == "0" and rank == "1" else 0)
        """)
    result = subprocess.run(launcher_command("--workers", "2", "--max_restarts", "1", "--",
                                             sys.executable, worker),
                            cwd=REPO, env=clean_env(TMPDIR=str(outer)), capture_output=True,
                            text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    used = {(tmp_path / f"tmp-{attempt}-{rank}").read_text() for attempt in "01" for rank in "01"}
    assert len(used) == 1, used   # one directory for the whole launch
    job_dir = Path(used.pop())
    assert job_dir.parent == outer and job_dir.name.startswith("tfdist-job-")
    assert list(outer.iterdir()) == []


# --------------------------------------------------------------------------- dry run and usage errors

def test_dry_run_prints_every_config_and_starts_nothing(tmp_path):
    marker = tmp_path / "started"
    worker = script(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    result = launch("--workers", "3", "--dtensor", "--dry_run", "--", sys.executable, worker)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["rank"] for line in lines] == [0, 1, 2]
    configs = [cluster.parse_tf_config(line["TF_CONFIG"]) for line in lines]
    assert [config.task_index for config in configs] == [0, 1, 2]
    assert [cluster.validate_dtensor_env(line).client_id for line in lines] == [0, 1, 2]
    time.sleep(0.2)
    assert not marker.exists()


def test_job_secret_is_yours_when_exported_and_never_printed(tmp_path):
    worker = script(tmp_path, f"""
        import os
        with open(os.path.join({str(tmp_path)!r}, "secret" + os.environ["TFDIST_RANK"]), "w") as out:
            out.write(os.environ["TFDIST_JOB_SECRET"])
        """)
    mine = "0123456789abcdef" * 4

    def run(*args, secret=mine):
        return subprocess.run(launcher_command("--workers", "2", *args), cwd=REPO, capture_output=True,
                              text=True, timeout=TIMEOUT, env=clean_env(TFDIST_JOB_SECRET=secret))

    assert run("--", sys.executable, worker).returncode == 0
    assert [(tmp_path / f"secret{rank}").read_text() for rank in range(2)] == [mine, mine]
    dry = run("--dry_run", "--", sys.executable, worker)
    assert dry.returncode == 0 and mine not in dry.stdout + dry.stderr
    assert [json.loads(line)["TFDIST_JOB_SECRET"] for line in dry.stdout.splitlines()] == ["<set>"] * 2
    bad = run("--", sys.executable, worker, secret="not-hex")
    assert bad.returncode == 2 and "TFDIST_JOB_SECRET must be at least 32 hex digits" in bad.stderr


def test_missing_command_fails_fast_naming_it():
    started = time.monotonic()
    result = launch("--workers", "2", "--", "no-such-tfdist-worker-command", "--flag")
    assert result.returncode == 2
    assert "no-such-tfdist-worker-command" in result.stderr and "not found" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 10
    result = launch("--workers", "1", "--", "/no/such/dir/train.py")
    assert result.returncode == 2 and "'/no/such/dir/train.py'" in result.stderr


@pytest.mark.parametrize("args, expected", [
    (["--workers", "0", "--", "true"], "--workers must be >= 1, got 0"),
    (["--workers", "2", "--devices_per_worker", "-1", "--", "true"], "--devices_per_worker must be >= 0, got -1"),
    (["--workers", "2", "--max_restarts", "-2", "--", "true"], "--max_restarts must be >= 0, got -2"),
    (["--workers", "2"], "Give the command each worker runs after --"),
    (["--workers", "2", "--", ], "Give the command each worker runs after --"),
    (["--workers", "2", "python", "train.py"], "Put the command the workers run after --"),
    (["--", "true"], "--workers"),
    (["--workers", "two", "--", "true"], "invalid int value: 'two'"),
])
def test_launch_flag_errors(capsys, args, expected):
    assert cli.main(["launch", *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.startswith("tfdist launch: ") and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- doctor

def test_doctor_prints_versions_devices_and_cluster_problems():
    # One TensorFlow import for the whole doctor: a valid TF_CONFIG and a broken DTensor set-up.
    config = cluster.build_tf_config(["127.0.0.1:1", "127.0.0.1:2"], 1)
    env = clean_env(TF_CONFIG=json.dumps(config), TFDIST_SIMULATE_DEVICES="3",
                    DTENSOR_JOBS="127.0.0.1:7,127.0.0.1:8", DTENSOR_NUM_CLIENTS="3", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-m", "tfdist.cli", "doctor"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT)
    out = result.stdout
    for expected in ("Python: 3.", "TensorFlow: 2.", "Keras: 3.", "tensorflow-datasets:", "absl:",
                     "physical CPU", "TFDIST_SIMULATE_DEVICES=3: 3 logical CPU device(s)", "NCCL",
                     "GPU interconnect", "TF_CONFIG: valid; this is task worker:1 (not the chief)",
                     "PROBLEM: DTENSOR_NUM_CLIENTS=3 but DTENSOR_JOBS lists 2 client(s)"):
        assert expected in out, f"{expected!r} missing from:\n{out}\n{result.stderr}"
    assert result.returncode == 1 and "1 problem(s) found" in out


# --------------------------------------------------------------------------- examples

def fake_bin(tmp_path: Path) -> Path:
    """A bin dir whose `python` reports experiments.train's TF_CONFIG instead of training,
    and whose `tfdist` is this checkout's CLI (it may not be pip-installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = f"""#!{sys.executable}
import json, os, sys
if sys.argv[1:3] == ["-m", "experiments.train"]:
    print("TRAIN " + json.dumps({{"TF_CONFIG": os.environ.get("TF_CONFIG"), "argv": sys.argv[3:]}}))
    sys.exit(0)
os.execv({sys.executable!r}, [{sys.executable!r}] + sys.argv[1:])
"""
    tfdist = f"#!/bin/sh\nexec {sys.executable} -m tfdist.cli \"$@\"\n"
    srun = f"""#!{sys.executable}
# Runs the step's command once per node, with the variables srun sets (one task per node).
import os, subprocess, sys
command = sys.argv[1:]
while command and command[0].startswith("-"):
    command.pop(0)
nodes = int(os.environ["SLURM_NNODES"])
codes = [subprocess.run(command, timeout=30, env=dict(os.environ, SLURM_PROCID=str(rank), SLURM_NODEID=str(rank),
         SLURM_LOCALID="0", SLURM_STEP_NUM_TASKS=str(nodes), SLURM_NTASKS=str(nodes),
         SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"], SLURM_STEP_TASKS_PER_NODE=f"1(x{{nodes}})"
         )).returncode for rank in range(nodes)]
sys.exit(max(codes))
"""
    for name, text in (("python", python), ("tfdist", tfdist), ("srun", srun)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def trained_configs(stdout: str) -> list:
    runs = [json.loads(line[len("TRAIN "):]) for line in stdout.splitlines() if line.startswith("TRAIN ")]
    return [(cluster.parse_tf_config(run["TF_CONFIG"]), run["argv"]) for run in runs]


def assert_one_consistent_cluster(configs, expected_hosts):
    assert [config.task_index for config in configs] == list(range(len(expected_hosts)))
    for config in configs:
        assert config.cluster == {"worker": expected_hosts}   # every rank agrees
        assert config.address == expected_hosts[config.rank]   # and its own entry is its own host
    assert [config.is_chief for config in configs] == [True] + [False] * (len(expected_hosts) - 1)


def test_slurm_sbatch_gives_every_rank_a_consistent_tf_config(tmp_path):
    sbatch = REPO / "examples" / "slurm" / "train.sbatch"
    env = clean_env(PATH=f"{fake_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="node[01-04]",
                    SLURM_NNODES="4", SLURM_JOB_ID="42", SLURM_SUBMIT_DIR=str(REPO))
    result = subprocess.run(["bash", str(sbatch), "--train_steps=7"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    runs = trained_configs(result.stdout)
    assert_one_consistent_cluster([config for config, _ in runs], [f"node0{i}:29500" for i in range(1, 5)])
    for _, argv in runs:
        assert "--strategy=multi_worker_mirrored" in argv and argv[-1] == "--train_steps=7"


def test_kubernetes_indexed_job_gives_every_pod_a_consistent_tf_config(tmp_path):
    yaml = pytest.importorskip("yaml")
    documents = list(yaml.safe_load_all((REPO / "examples" / "kubernetes" / "indexed-job.yaml").read_text()))
    service = next(doc for doc in documents if doc["kind"] == "Service")
    job = next(doc for doc in documents if doc["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert service["spec"]["clusterIP"] == "None" and service["metadata"]["name"] == pod["subdomain"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert job["spec"]["completionMode"] == "Indexed"
    workers = job["spec"]["completions"]
    assert job["spec"]["parallelism"] == workers
    container_env = {item["name"]: item["value"] for item in container.get("env", [])}
    port = int(container_env["TFDIST_PORT"])
    assert port in [item["containerPort"] for item in container["ports"]]
    shell = container["command"] + container["args"]
    assert shell[:2] == ["/bin/sh", "-c"]
    env = clean_env(PATH=f"{fake_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}", **container_env)
    stdout = ""
    for index in range(workers):
        result = subprocess.run(["sh", "-c", shell[2]], cwd=REPO, env=dict(env, JOB_COMPLETION_INDEX=str(index)),
                                capture_output=True, text=True, timeout=TIMEOUT)
        assert result.returncode == 0, result.stderr
        stdout += result.stdout
    name, subdomain = job["metadata"]["name"], pod["subdomain"]
    runs = trained_configs(stdout)
    assert_one_consistent_cluster([config for config, _ in runs],
                                  [f"{name}-{i}.{subdomain}:{port}" for i in range(workers)])


# --------------------------------------------------------------------------- the workers' network

NETWORK_WORKER = """
    import json, os, socket
    here, rank = {here!r}, os.environ["TFDIST_RANK"]
    with open("/proc/net/dev") as f:
        interfaces = [line.split(":")[0].strip() for line in f.read().splitlines()[2:]]
    try:
        socket.create_connection(({host_address!r}, {host_port}), timeout=2).close()
        reached_host = True
    except OSError:
        reached_host = False
    report = dict(network=os.environ["TFDIST_NETWORK"], namespace=os.readlink("/proc/self/ns/net"),
                  interfaces=interfaces, reached_host=reached_host, uid=os.getuid())
    with open(os.path.join(here, rank + ".json"), "w") as out:
        json.dump(report, out)
    """


def network_reports(tmp_path, *flags, wrap=()):
    """Each worker's view of its network, with a listener of this test's on the host."""
    import socket
    with socket.create_server(("127.0.0.1", 0)) as host_listener:
        worker = script(tmp_path, NETWORK_WORKER.format(
            here=str(tmp_path), host_address="127.0.0.1",
            host_port=host_listener.getsockname()[1]))
        result = subprocess.run([*wrap, *launcher_command("--workers", "2", *flags, "--",
                                                          sys.executable, worker)],
                                cwd=REPO, env=clean_env(), capture_output=True, text=True,
                                timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    return result, [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")
def test_workers_share_a_private_loopback_only_network_by_default(tmp_path):
    result, reports = network_reports(tmp_path)
    assert "workers share a private network" in result.stderr
    ours = os.readlink("/proc/self/ns/net")
    assert reports[0]["namespace"] == reports[1]["namespace"] != ours   # one, not ours
    for report in reports:
        assert report["network"] == "private" and report["interfaces"] == ["lo"]
        assert not report["reached_host"]          # nothing crosses, either way
        assert report["uid"] == os.getuid()        # the workers keep the user's identity


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")
def test_network_host_gives_the_workers_this_hosts_network_and_says_what_it_exposes(tmp_path):
    result, reports = network_reports(tmp_path, "--network=host")
    assert "listens on every interface" in result.stderr and "firewall" in result.stderr
    for report in reports:
        assert report["network"] == "host" and report["reached_host"]
        assert report["namespace"] == os.readlink("/proc/self/ns/net")


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0,
                    reason="needs root and setpriv to take the namespace capability away")
def test_where_namespaces_are_not_allowed_the_launcher_says_so_and_uses_the_hosts(tmp_path):
    """A container without CAP_SYS_ADMIN (and no user namespaces for root) cannot make
    the private network: the launcher names why and what the host's network exposes;
    --network=private then refuses to start."""
    no_admin = ["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin"]
    result, reports = network_reports(tmp_path, wrap=no_admin)
    assert "workers use this host's network: cannot make a private network namespace" in \
        result.stderr and "Operation not permitted" in result.stderr
    assert all(report["network"] == "host" and report["reached_host"] for report in reports)
    refused = subprocess.run([*no_admin, *launcher_command("--workers", "2", "--network=private",
                                                           "--", sys.executable, "-c", "")],
                             cwd=REPO, env=clean_env(), capture_output=True, text=True,
                             timeout=TIMEOUT)
    assert refused.returncode == 2 and "--network=private: cannot make a private network" in \
        refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")
def test_start_timeout_sees_ports_opened_inside_the_private_network(tmp_path):
    """The launcher's port probes are made from inside the workers' network (by the
    holder process): ports opened there count, though this host cannot reach them."""
    worker = script(tmp_path, """
        import json, os, socket, time
        config = json.loads(os.environ["TF_CONFIG"])
        own = config["cluster"]["worker"][config["task"]["index"]]
        server = socket.create_server(("127.0.0.1", int(own.rsplit(":", 1)[1])))
        time.sleep(4)
        """)
    result = launch("--workers", "2", "--start_timeout", "2", "--", sys.executable, worker)
    assert result.returncode == 0, result.stderr
    assert "workers share a private network" in result.stderr


def test_a_private_network_cannot_hold_a_host_address():
    with pytest.raises(UsageError, match="--network=private gives the workers a loopback"):
        launch_module.parse_args(["--workers", "2", "--network=private", "--host=10.0.0.5",
                                  "--", "true"])


def test_mpi_over_tcp_in_the_private_network_uses_its_loopback():
    """Open MPI's TCP transport leaves loopback out by default, and in the private network
    loopback is the only interface: `--mca btl tcp,self` there gets btl_tcp_if_include=lo
    (tests/test_mpi.py's tcp cases run it for real), unless the user chose interfaces."""
    def flags(mpi_args, private):
        options = launch_module.LaunchOptions(workers=2, command=("true",), mpi=True,
                                              mpi_args=tuple(mpi_args.split()))
        return launch_mpirun.mpirun_command(options, "mpirun", ["true"], {}, private=private)

    tcp = "--mca btl tcp,self"
    assert "btl_tcp_if_include" in flags(tcp, private=True)
    assert "btl_tcp_if_include" not in flags(tcp, private=False)
    assert flags(tcp + " --mca btl_tcp_if_include eth0", private=True).count(
        "btl_tcp_if_include") == 1
    assert "btl_tcp_if_include" not in flags("", private=True)   # shared memory: no TCP
