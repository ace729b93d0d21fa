"""TensorFlow's C++ start-up lines, filtered: a run starts with tfdist's lines, not TF's noise.

Why: since TF 2.16 TensorFlow logs through absl before anything initialises absl's log,
and such messages ignore TF_CPP_MIN_LOG_LEVEL (tensorflow/tensorflow#100442, open): every
process of a CPU machine prints, at `import tensorflow`, "All log messages before
absl::InitializeLog() ...", oneDNN's and cudart_stub's INFO lines (twice: two libraries
carry them), and at its first device query an `E... failed call to cuInit: ... CUDA error`.
The first thing a new user reads is an E line saying "CUDA error" on a machine that never
had a GPU.

How: while TensorFlow is imported and lists its physical devices, file descriptor 2 is a
pipe; a thread forwards every line to the real stderr at once, except the lines in NOISE
(patterns of what a healthy start prints, nothing else). Anything else (an error in the
import, a Python warning, a crash's message) still reaches stderr as it is written. The
filter is installed by `import tfdist` (a finder for the `tensorflow` module,
tfdist.import_hooks, as tfdist.lazy_keras has for Keras) and has effect when tfdist is
imported before TensorFlow (or before Keras, which imports it); it also sets
TF_CPP_MIN_LOG_LEVEL=2 (no INFO or WARNING lines, as the CLI) unless the environment sets
it. Under DTensor the first run of each step is filtered too, for grappler's cost-model
lines (GRAPPLER_NOISE). TFDIST_TF_LOGS=1, or TF_CPP_MIN_LOG_LEVEL=0 asked for explicitly,
turns all of it off. The canary
tests/test_upstream_canaries.py::test_tensorflow_still_logs_its_startup_before_absl_is_initialised
fails when TensorFlow stops printing these lines (then this module can go).
"""

import contextlib
import importlib.abc
import os
import re
import sys
import threading

from tfdist import import_hooks

try:
    import fcntl
except ImportError:      # not POSIX: the pipe keeps its default size
    fcntl = None

SWITCH = "TFDIST_TF_LOGS"
PURPOSE = "import TensorFlow with its start-up lines filtered"
# What a healthy TensorFlow start prints on a machine without a GPU (TF 2.21). An absl
# line reads "I0000 00:00:1796619734.949354    2470 port.cc:153] ...".
NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|[IW]\d{4} [\d:.]+ +\d+ (port\.cc|cudart_stub\.cc|cpu_feature_guard\.cc)"
    r"|E\d{4} [\d:.]+ +\d+ cuda_(platform|executor|diagnostics)\.cc:\d+\] failed call to cuInit"
    r")")
# Grappler's cost model on a DTensor program's sharded MatMuls (keras-hub models), once per
# device when the step is first optimised: an estimate it skips, not an error (the numbers
# are exact). No grappler option turns it off short of the whole meta-optimizer.
GRAPPLER_NOISE = re.compile(
    r"^E\d{4} [\d:.]+ +\d+ op_level_cost_estimator\.cc:\d+\] Incompatible Matrix dimensions")
PIPE_BYTES = 1 << 20   # larger than any start-up burst: the writer never waits for the GIL


def enabled() -> bool:
    return (os.environ.get(SWITCH) != "1"
            and os.environ.get("TF_CPP_MIN_LOG_LEVEL", "").strip() != "0")


@contextlib.contextmanager
def filtered_stderr(noise=NOISE):
    """File descriptor 2 goes through a filter that drops lines matching `noise`."""
    try:
        sys.stderr.flush()
        os.fstat(2)
    except (AttributeError, OSError, ValueError):   # no stderr (a daemon): nothing to filter
        yield
        return
    read_end, write_end = os.pipe()
    with contextlib.suppress(OSError):       # F_SETPIPE_SZ is Linux's; elsewhere 64 KiB
        if fcntl is not None:
            fcntl.fcntl(write_end, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    saved = os.dup(2)
    forwarder = threading.Thread(target=_forward, args=(read_end, saved, noise), daemon=True,
                                 name="tfdist-stderr-filter")
    forwarder.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)            # the pipe's last writer closes: the forwarder sees EOF
        forwarder.join(timeout=10)
        os.close(saved)


def first_call_filtered(call, noise=GRAPPLER_NOISE):
    """call, whose first run (where TensorFlow optimises the traced graph) goes through the
    filter; later runs go straight through, with no thread or pipe per step."""
    called = []

    def run(*args, **kwargs):
        if called or not enabled():
            return call(*args, **kwargs)
        called.append(True)
        with filtered_stderr(noise):
            return call(*args, **kwargs)

    return run


def _forward(read_end: int, target: int, noise) -> None:
    pending = b""
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                _write_unless_noise(target, line + b"\n", noise)
    if pending:
        _write_unless_noise(target, pending, noise)


def _write_unless_noise(target: int, line: bytes, noise) -> None:
    if not noise.match(line.decode("utf-8", "replace")):
        os.write(target, line)


class _QuietLoader(importlib.abc.Loader):
    """TensorFlow's loader, run inside the filter; then the physical devices are listed
    there too (where the cuInit line is printed)."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        with filtered_stderr():
            self._loader.exec_module(module)
            # Listing physical devices does not initialise the context: logical devices
            # (--simulate_devices) can still be configured afterwards.
            module.config.list_physical_devices()

    def __getattr__(self, name):         # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


def filter_tensorflow_startup() -> bool:
    """Installs the finder once; True if installed (TensorFlow not yet imported, not off)."""
    if import_hooks.installed(PURPOSE):
        return True
    if not enabled() or "tensorflow" in sys.modules:
        return False
    # TensorFlow's INFO and WARNING lines too, as `python -m experiments.train` has always
    # done: DTensor's "cache key lookup missed ..." at every new program, tf.data's notes on
    # generators it cannot optimise and caches a bounded run leaves unread. Errors show.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import_hooks.install(PURPOSE, ["tensorflow"], _QuietLoader)
    return True
