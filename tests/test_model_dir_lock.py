"""One run per --model_dir: a second live run is exit 2 naming the holder; the lock of
a SIGKILLed run is taken over with a log line; an error releases it."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import REPO, run_cli, small_config
from tfdist.errors import UsageError
from tfdist.train import model_dir_lock, runner

FLAGS = ["--strategy=default", "--simulate_devices=0", "--model=mlp", "--global_batch_size=32",
         "--log_every=5"]


def lock_text(model_dir) -> str:
    path = os.path.join(model_dir, model_dir_lock.LOCK_FILE)
    return open(path).read() if os.path.exists(path) else ""


def test_second_run_is_refused_and_a_killed_runs_lock_is_taken_over(tmp_path):
    model_dir = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    first = subprocess.Popen([sys.executable, "-m", "experiments.train", *FLAGS, "--train_steps=100000",
                              f"--model_dir={model_dir}"], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while f'"pid": {first.pid}' not in lock_text(model_dir):   # taken before TensorFlow loads
            assert time.monotonic() < deadline and first.poll() is None, "the first run never locked"
            time.sleep(0.05)
        started = time.monotonic()
        second = run_cli([*FLAGS, "--train_steps=5", f"--model_dir={model_dir}"], timeout=60)
        assert second.returncode == 2, second.stderr[-2000:]
        assert (f"--model_dir {model_dir!r} is in use by another run: pid {first.pid} on host "
                f"{socket.gethostname()} since ") in second.stderr
        assert "Traceback" not in second.stderr
        print(f"second run refused in {time.monotonic() - started:.2f} s")
    finally:
        first.send_signal(signal.SIGKILL)   # dies holding the lock: its file still names it
        first.wait(timeout=30)
    third = run_cli([*FLAGS, "--train_steps=5", f"--model_dir={model_dir}"], timeout=120)
    assert third.returncode == 0, third.stderr[-2000:]
    assert f"taking over the stale lock of pid {first.pid} on host" in third.stderr
    assert lock_text(model_dir) == ""   # released cleanly: the next run has nothing to take over


def test_an_error_inside_the_run_releases_the_lock(tmp_path):
    model_dir = str(tmp_path / "run")
    with pytest.raises(UsageError, match="is not divisible"):
        runner.run(small_config(strategy="mirrored", simulate_devices=4, global_batch_size=30,
                                model_dir=model_dir))
    assert model_dir_lock._held == {} and lock_text(model_dir) == ""
    with model_dir_lock.hold(model_dir), model_dir_lock.hold(model_dir):   # nested holds share one
        assert f'"pid": {os.getpid()}' in lock_text(model_dir)
