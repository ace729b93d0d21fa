"""The suite guard: no test is skipped everywhere, and every skip gives an allowed reason.

Some tests must run in a pytest process of their own (DTensor and tf.distribute
share process-wide collective state; the pipeline placement check wants a fresh
program). The main process skips them, and a "runner" test there starts the
other process with ENV_VAR=1 (run_own_process). Nothing used to notice when a
runner stopped running one of them, or when a test skipped for a reason nobody
meant, so this plugin, installed by tests/conftest.py in every pytest process:

- decides where each test runs from something explicit: its file (a process's
  file list), a marker (`dtensor`), or `@pytest.mark.own_process("ENV_VAR")`;
  in the main process the others are skipped, in another process the main
  process's tests are deselected (the main process runs them);
- in a process started by a runner, appends each passed node id (and each test
  that failed as its own xfail mark declares, or skipped for an allowed reason) to
  $TFDIST_PASSED_IDS_FILE; the
  runner hands those ids back to the main process;
- at the end of the session fails it (exit 1), naming node id and reason, if a
  test skipped here "because it runs elsewhere" did not pass there, or if any
  other skip's reason is not in ALLOWED_SKIPS.

A declared Process (install's list) starts as soon as the main process has
collected, at its `nice` level, and its runner test waits for it. Most of the
main suite keeps one of this machine's two cores busy (a test's single training
process, or `import tensorflow` in a launch), so such a process runs in the
other core's idle time instead of after everything else (the DTensor process
alone took 7 of the suite's 42 minutes in CI).

Order in the main process: its own tests, then the time-sensitive files
(install's `time_sensitive_files`: collective timeouts, watchdogs, restarts),
then the runners. The processes started early run at nice 19 (CFS weight 15
against 1024 at nice 0), so beside a time-sensitive test they take about 1.5%
of a contended core each, and the cores the test leaves idle (a SIGSTOPped
peer, a --collective_timeout being waited out) go to them instead of to nobody.
"""

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

import pytest

PASSED_IDS_FILE = "TFDIST_PASSED_IDS_FILE"
OWN_PROCESS_MARKER = "own_process"

# What a skip may say; anything else fails the session. Keep it short: a skip
# is a test that does not run, so each kind must be a fact about the machine.
ALLOWED_SKIPS: Tuple[Tuple[str, "re.Pattern"], ...] = (
    ("no GPU", re.compile(r"\bneeds \d+ GPUs?\b|\bno GPUs?\b", re.I)),
    ("a missing optional system, with the command that installs it (e.g. 'Slurm not "
     "installed: apt-get install slurm-wlm munge')",
     re.compile(r"\b(apt-get|apt|pip|conda) install \S", re.I)),
    ("a missing optional Python package (pytest.importorskip)",
     re.compile(r"^could not import '[\w.]+'")),
    ("a docs example its page marks as not runnable here, with the reason "
     "(<!-- example: skip because ... -->, tests/test_docs_examples.py)",
     re.compile(r"^docs example, not run: \S")),
)


@dataclasses.dataclass(frozen=True)
class Process:
    """A pytest process of its own: started with `env_var`=1 by `runner`."""
    env_var: str
    runner: str                       # the main-process test that starts it
    files: Tuple[str, ...] = ()       # every test in these files (rootdir-relative) runs there
    marker: Optional[str] = None      # ... and every test with this marker
    nice: int = 19                    # started early at this niceness (see the docstring)
    main_without_runner: bool = False  # its tests may run in the main process instead
    # Files it runs only to balance the streams (they share nothing with its own tests):
    # like main_without_runner, in the main process when the session lacks the runner.
    balance_files: Tuple[str, ...] = ()


@dataclasses.dataclass
class _State:
    processes: Tuple[Process, ...]
    time_sensitive_files: Tuple[str, ...] = ()
    here: Optional[str] = None                                   # env var of this process
    elsewhere: Dict[str, str] = dataclasses.field(default_factory=dict)  # node id -> env var
    passed_in: Dict[str, Set[str]] = dataclasses.field(default_factory=dict)
    skips: Dict[str, str] = dataclasses.field(default_factory=dict)      # node id -> reason
    problems: List[str] = dataclasses.field(default_factory=list)
    started: Dict[str, "_Started"] = dataclasses.field(default_factory=dict)  # env var ->


@dataclasses.dataclass
class _Started:
    """A process of its own started early, before its runner test asked for it."""
    popen: subprocess.Popen
    requested: List[str]
    directory: str                    # its output and passed-ids files; removed when read
    started_at: float


_state: Optional[_State] = None  # one per pytest process, like the plugin itself


def install(config, processes: Sequence[Process],
            time_sensitive_files: Sequence[str] = ()) -> None:
    """Called from a conftest's pytest_configure. `time_sensitive_files` (rootdir-relative)
    run in the main process after its other tests and before the runners (module docstring)."""
    global _state
    _state = _State(tuple(processes), time_sensitive_files=tuple(time_sensitive_files))
    config.addinivalue_line(
        "markers", f"{OWN_PROCESS_MARKER}(env_var): runs only in the pytest process a runner "
                   "test starts with env_var=1 (tests/suite_guard.py)")
    for process in processes:
        if process.marker:
            config.addinivalue_line("markers", f"{process.marker}: runs in the pytest process "
                                               f"with {process.env_var}=1 ({process.runner})")
    config.pluginmanager.register(sys.modules[__name__], "tfdist_suite_guard")


def process_of(item, selected_files: Set[str] = frozenset()) -> Optional[str]:
    """The env var of the process `item` runs in; None for the main process. A process that
    is only a way to use both cores (main_without_runner) leaves its tests to the main
    process when the session does not include its runner (pytest tests/test_x.py)."""
    marker = item.get_closest_marker(OWN_PROCESS_MARKER)
    if marker:
        return marker.args[0]
    path = pathlib.Path(item.path).relative_to(item.config.rootpath).as_posix()
    for process in _state.processes:
        balance = path in process.balance_files
        if (path in process.files or balance
                or (process.marker and item.get_closest_marker(process.marker))):
            if ((process.main_without_runner or balance) and process.runner not in selected_files
                    and not os.environ.get(process.env_var)):
                return None
            return process.env_var
    return None


def runner_of(env_var: str) -> str:
    return next((p.runner for p in _state.processes if p.env_var == env_var),
                f"the test that uses {OWN_PROCESS_MARKER}({env_var!r})")


def elsewhere_reason(env_var: str) -> str:
    return f"runs in its own pytest process ({env_var}=1, started by {runner_of(env_var)})"


def _current_process(wanted: Set[str]) -> Optional[str]:
    chosen = sorted(var for var in wanted if os.environ.get(var))
    if len(chosen) > 1:
        raise pytest.UsageError(f"Set at most one of {', '.join(chosen)} (each names one "
                                f"pytest process of its own).")
    return chosen[0] if chosen else None


@pytest.hookimpl(trylast=True)  # after -k/-m: only the tests this session really selected
def pytest_collection_modifyitems(session, config, items):
    selected_files = {item.nodeid.split("::")[0] for item in items}
    where = {item.nodeid: process_of(item, selected_files) for item in items}
    _state.here = _current_process({p.env_var for p in _state.processes}
                                   | {v for v in where.values() if v})
    keep, deselected = [], []
    for item in items:
        there = where[item.nodeid]
        if there == _state.here:
            keep.append(item)
        elif _state.here is None:
            _state.elsewhere[item.nodeid] = there
            item.add_marker(pytest.mark.skip(reason=elsewhere_reason(there)))
            keep.append(item)
        else:
            deselected.append(item)  # a main-process test: the main process runs it
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = keep
    if _state.here is None and not config.option.collectonly:
        _start_early(config, selected_files)
        # Their runners wait for them, so they go last: the main process keeps testing
        # meanwhile, the time-sensitive files last of its own, beside processes niced to 19.
        runners = {p.runner for p in _state.processes if p.env_var in _state.started}
        def phase(item):
            path = item.nodeid.split("::")[0]
            return 2 if path in runners else 1 if path in _state.time_sensitive_files else 0
        items.sort(key=phase)   # stable: each phase keeps its order


def _start_early(config, selected_files: Set[str]) -> None:
    """Starts, niced, every declared process whose runner test this session runs and
    which has tests to run (the runner asks for them later: run_own_process)."""
    for process in _state.processes:
        requested = sorted(n for n, var in _state.elsewhere.items() if var == process.env_var)
        if process.runner not in selected_files or not requested:
            continue
        directory = tempfile.mkdtemp(prefix="tfdist-own-process-")
        env = dict(os.environ, **{process.env_var: "1",
                                  PASSED_IDS_FILE: os.path.join(directory, "passed")})
        with open(os.path.join(directory, "stdout"), "w") as out, \
                open(os.path.join(directory, "stderr"), "w") as err:
            # nice(1), not a preexec_fn: this process already runs TensorFlow's threads
            nice = ["nice", "-n", str(process.nice)] if shutil.which("nice") else []
            popen = subprocess.Popen(
                [*nice, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 *requested],
                cwd=config.rootpath, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        _state.started[process.env_var] = _Started(popen, requested, directory, time.monotonic())


def _finish_started(started: "_Started", env_var: str, timeout: float):
    """Waits for an early-started process (its timeout counted from its start) and returns
    (result, requested, passed) as run_own_process does."""
    try:
        started.popen.wait(timeout=max(1.0, timeout - (time.monotonic() - started.started_at)))
    except subprocess.TimeoutExpired:
        started.popen.kill()
        started.popen.wait()
        raise
    finally:
        read = lambda name: pathlib.Path(started.directory, name).read_text() \
            if os.path.exists(os.path.join(started.directory, name)) else ""
        stdout, stderr, passed = read("stdout"), read("stderr"), set(read("passed").splitlines())
        shutil.rmtree(started.directory, ignore_errors=True)
        _state.passed_in.setdefault(env_var, set()).update(passed)
    result = subprocess.CompletedProcess(started.popen.args, started.popen.returncode,
                                         stdout, stderr)
    return result, started.requested, passed


def pytest_unconfigure(config):
    """A session that ends early (a failure with -x, ^C) leaves no niced pytest behind."""
    for started in _state.started.values() if _state else ():
        if started.popen.poll() is None:
            started.popen.kill()
            started.popen.wait()
        shutil.rmtree(started.directory, ignore_errors=True)


def pytest_runtest_logreport(report):
    done = ((report.when == "call" and _passed_or_declared_xfail(report))
            or _allowed_skip(report))
    if done and os.environ.get(PASSED_IDS_FILE):
        with open(os.environ[PASSED_IDS_FILE], "a") as f:
            f.write(report.nodeid + "\n")
    if report.skipped and not hasattr(report, "wasxfail"):
        _state.skips[report.nodeid] = _reason(report)


def _allowed_skip(report) -> bool:
    """A skip the main process would accept (a docs example its page marks as not runnable
    here, no GPU): a process of its own counts it as done, as the main process would.
    The docs examples moved to the DTensor process failed the suite on their 9 such skips."""
    return (report.skipped and not hasattr(report, "wasxfail")
            and any(pattern.search(_reason(report)) for _, pattern in ALLOWED_SKIPS))


def _passed_or_declared_xfail(report) -> bool:
    """A pass, or the outcome a test's own xfail mark declares (it failed as its reason
    says): the main process accepts such a test, so a process of its own must count it too,
    or a known defect moved to the second stream fails the suite there alone. A strict
    xfail that passes is a failure and is not counted."""
    return report.passed or (report.skipped and hasattr(report, "wasxfail"))


def pytest_collectreport(report):
    if report.skipped:  # a whole module skipped (pytest.skip or importorskip at import)
        _state.skips[report.nodeid] = _reason(report)


def _reason(report) -> str:
    text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def run_own_process(config, env_var: str, tmp_path, fallback_args: Sequence[str],
                    timeout: float):
    """Runs, in a fresh `pytest` with env_var=1, the tests this session skipped for it
    (or, if it skipped none, `fallback_args`); returns (result, requested ids, passed ids).
    The passed ids are recorded for the end-of-session check. A process started early
    (_start_early) is waited for instead of started again."""
    if env_var in _state.started:
        return _finish_started(_state.started.pop(env_var), env_var, timeout)
    requested = sorted(n for n, var in _state.elsewhere.items() if var == env_var)
    passed_file = pathlib.Path(tmp_path) / f"{env_var}.passed"
    env = dict(os.environ, **{env_var: "1", PASSED_IDS_FILE: str(passed_file)})
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         *(requested or fallback_args)],
        cwd=config.rootpath, env=env, capture_output=True, text=True, timeout=timeout)
    passed = set(passed_file.read_text().splitlines()) if passed_file.exists() else set()
    _state.passed_in.setdefault(env_var, set()).update(passed)
    return result, requested, passed


def assert_passed_there(result, requested: Sequence[str], passed: Set[str], what: str) -> None:
    """A runner's verdict on its process: exit 0, and every test it was given passed (or
    skipped for an allowed reason, _allowed_skip)."""
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(result.stdout[-100_000:])  # pytest shows it under the failure: every traceback
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert result.returncode == 0, "\n".join([summary, *failed, result.stderr[-2000:]])
    missing = sorted(set(requested) - passed)
    assert not missing, f"{len(missing)} {what} test(s) did not pass there: {missing[:10]}"
    assert passed, summary  # with nothing requested, the fallback set ran


def _problems(session_ok: bool) -> List[str]:
    problems = []
    for nodeid, reason in sorted(_state.skips.items()):
        var = _state.elsewhere.get(nodeid)
        if var is not None and reason == elsewhere_reason(var):
            # Only a whole, passing session has run its runners to the end.
            if session_ok and nodeid not in _state.passed_in.get(var, ()):
                problems.append(_not_run_elsewhere(nodeid, var))
        elif not any(pattern.search(reason) for _, pattern in ALLOWED_SKIPS):
            allowed = "; ".join(name for name, _ in ALLOWED_SKIPS)
            problems.append(f"{nodeid} skipped with reason {reason!r}, which is not an "
                            f"allowed reason (allowed: {allowed}; or runs in a process of "
                            f"its own, see tests/suite_guard.py)")
    return problems


def _not_run_elsewhere(nodeid: str, var: str) -> str:
    if var in _state.passed_in:
        return (f"{nodeid} is skipped here because it runs in the {var}=1 process, "
                f"but it did not pass there")
    path = nodeid.split("::")[0]
    return (f"{nodeid} is skipped here because it runs in the {var}=1 process, and this "
            f"session did not start that process: include {runner_of(var)}, or run "
            f"`{var}=1 python -m pytest {path}`")


def pytest_sessionfinish(session, exitstatus):
    if session.config.option.collectonly:
        return
    _state.problems = _problems(session_ok=exitstatus == pytest.ExitCode.OK)
    if _state.problems:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        session.shouldfail = f"suite guard: {len(_state.problems)} problem(s), listed above"


def pytest_terminal_summary(terminalreporter):
    if _state.problems:
        terminalreporter.section("suite guard", red=True, bold=True)
        for problem in _state.problems:
            terminalreporter.line("SUITE GUARD: " + problem, red=True)
