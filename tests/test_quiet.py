"""TensorFlow's C++ start-up lines are filtered out of stderr (tfdist.quiet); the rest is not.

Each case is a fresh interpreter: the filter acts where TensorFlow is first imported."""

import os
import subprocess
import sys

from helpers import REPO
from tfdist import quiet

TF_LINE = r"^([IWE]\d{4} |WARNING: All log messages before absl)"


def stderr_of(code: str, **env) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", **env))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def tensorflow_lines(text: str) -> list:
    import re
    return [line for line in text.splitlines() if re.match(TF_LINE, line) or "cuInit" in line]


IMPORT_AND_USE = ("import sys, tfdist, keras, tensorflow as tf\n"
                  "print('before', file=sys.stderr, flush=True)\n"
                  "tf.config.list_logical_devices(); print(tf.reduce_sum([1., 2.]).numpy())\n"
                  "print('after', file=sys.stderr, flush=True)\n")


def test_importing_tfdist_first_leaves_no_tensorflow_startup_line_and_keeps_the_rest():
    text = stderr_of(IMPORT_AND_USE)
    assert tensorflow_lines(text) == [], text
    assert text.splitlines()[-2:] == ["before", "after"], text


def test_the_switch_shows_them_again():
    text = stderr_of(IMPORT_AND_USE, TFDIST_TF_LOGS="1")
    assert tensorflow_lines(text), text


def test_lines_that_are_not_noise_pass_through_as_written_and_in_order(capfd):
    lines = [b"I0000 00:00:1796619734.949354    2470 port.cc:153] oneDNN custom operations\n",
             b"a real error: keep me\n",
             b"E0000 00:00:1796619736.036528    2470 cuda_platform.cc:52] failed call to cuInit: x\n",
             b"partial line without an end"]
    with quiet.filtered_stderr():
        for line in lines:
            os.write(2, line)
    assert capfd.readouterr().err == "a real error: keep me\npartial line without an end"


def test_a_burst_larger_than_a_pipe_does_not_block_the_writer(capfd):
    """A start-up that logs more than a pipe holds (64 KiB) while holding the GIL must not
    wait for the forwarding thread: the pipe is sized past any start-up burst."""
    burst = b"x" * 99 + b"\n"
    with quiet.filtered_stderr():
        os.write(2, burst * 5000)        # 500 KB in one write, no GIL released in between
    assert capfd.readouterr().err.count("x" * 99) == 5000


def test_asking_tensorflow_for_every_log_turns_the_filter_off(monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    assert not quiet.enabled()


def test_a_process_without_stderr_still_imports_tensorflow():
    """A daemon may run with file descriptor 2 closed: the filter steps aside."""
    done = subprocess.run(["bash", "-c", f"'{sys.executable}' -c 'import tfdist, tensorflow; "
                           f"print(tensorflow.constant(1).numpy())' 2>&-"], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode == 0 and done.stdout.strip() == "1", done


def test_only_the_first_call_goes_through_the_filter(capfd, monkeypatch):
    """Under dtensor a step's first run (grappler optimises it then) is filtered; the
    following runs are not, so nothing is paid per step."""
    import re
    monkeypatch.delenv(quiet.SWITCH, raising=False)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    step = quiet.first_call_filtered(lambda: os.write(2, b"drop me\nkeep me\n"),
                                     re.compile("^drop"))
    step()
    step()
    assert capfd.readouterr().err == "keep me\ndrop me\nkeep me\n"


def test_tensorflows_info_lines_are_off_unless_the_environment_says_otherwise():
    code = "import os, tfdist; print(os.environ['TF_CPP_MIN_LOG_LEVEL'])"
    for given, expected in ((None, "2"), ("3", "3")):
        env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        if given is not None:
            env["TF_CPP_MIN_LOG_LEVEL"] = given
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                              text=True, timeout=120, env=dict(env, PYTHONPATH=REPO))
        assert done.stdout.strip() == expected, done
