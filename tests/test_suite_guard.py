"""tests/suite_guard.py, on a small suite of its own in a real pytest subprocess.

No TensorFlow here: the suites below import only pytest, so each run is about
a second. Each case is a set of test files and the verdict the guard must give.
"""

import os
import subprocess
import sys
import re
import textwrap

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PROCESS = "TFDIST_GUARD_DEMO_PROCESS"

CONFTEST = f"""
import os
import sys
sys.path.insert(0, {TESTS_DIR!r})
import pytest
import suite_guard

def pytest_configure(config):
    suite_guard.install(config, [suite_guard.Process(
        env_var={PROCESS!r}, runner="test_runner.py", files=("test_elsewhere.py",),
        main_without_runner=bool(os.environ.get("DEMO_MAIN_WITHOUT_RUNNER")),
        balance_files=("test_balanced.py",))])

@pytest.fixture
def run_own_process(request, tmp_path):
    return lambda var, args, timeout: suite_guard.run_own_process(
        request.config, var, tmp_path, args, timeout)
"""
ELSEWHERE = """
import os
def test_one(): pass
def test_two(): assert os.environ.get("BREAK_TWO") is None
"""
# A known defect, declared where it is: the main process would accept its failure.
ELSEWHERE_WITH_XFAIL = ELSEWHERE + """
import pytest
@pytest.mark.xfail(strict=False, reason="a known defect")
def test_known_defect(): assert False
"""
# A lax runner on purpose: it asserts nothing, so only the guard can notice.
RUNNER = f"""
def test_runner(run_own_process):
    run_own_process({PROCESS!r}, ["test_elsewhere.py"], 60)
"""
ALLOWED = """
import pytest
@pytest.mark.skipif(True, reason="needs 2 GPUs (none on this machine)")
def test_gpu(): pass
def test_slurm(): pytest.skip("Slurm is not installed (apt-get install slurm-wlm munge)")
def test_optional_package(): pytest.importorskip("no_such_package_here")
"""
NOT_ALLOWED = """
import pytest
def test_flaky(): pytest.skip("flaky today")
"""


def run_suite(tmp_path, files, env=None):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    clean = {k: v for k, v in os.environ.items()
             if k not in (PROCESS, "TFDIST_PASSED_IDS_FILE", "PYTEST_ADDOPTS")}
    clean["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # hypothesis' plugin alone costs seconds
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                          cwd=tmp_path, env=dict(clean, **(env or {})), capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("files,env,verdict", [
    ({"test_allowed.py": ALLOWED}, {}, None),
    ({"test_elsewhere.py": ELSEWHERE, "test_runner.py": RUNNER}, {}, None),
    ({"test_not_allowed.py": NOT_ALLOWED}, {},
     "test_not_allowed.py::test_flaky skipped with reason 'flaky today', which is not an "
     "allowed reason"),
    ({"test_elsewhere.py": ELSEWHERE}, {},
     f"test_elsewhere.py::test_one is skipped here because it runs in the {PROCESS}=1 "
     f"process, and this session did not start that process: include test_runner.py"),
    ({"test_elsewhere.py": ELSEWHERE, "test_runner.py": RUNNER}, {"BREAK_TWO": "1"},
     f"test_elsewhere.py::test_two is skipped here because it runs in the {PROCESS}=1 "
     f"process, but it did not pass there"),
    ({"test_elsewhere.py": ELSEWHERE_WITH_XFAIL, "test_runner.py": RUNNER}, {}, None),
], ids=["allowed_skips", "run_elsewhere", "reason_not_allowed", "runner_not_in_session",
        "failed_elsewhere", "declared_xfail_elsewhere"])
def test_guard_verdict(files, env, verdict, tmp_path):
    result = run_suite(tmp_path, files, env)
    output = result.stdout + result.stderr
    if verdict is None:
        assert result.returncode == 0, output
        assert "SUITE GUARD" not in output
    else:
        assert result.returncode == 1, output
        assert "SUITE GUARD: " + verdict in output, output
        assert re.search(r"!+ suite guard: \d problem\(s\), listed above !+", output), output


def test_the_other_process_runs_only_its_own_tests(tmp_path):
    """Started with PROCESS=1, the suite runs test_elsewhere.py's tests and deselects
    the rest (the main process runs those), so nothing is skipped there."""
    result = run_suite(tmp_path, {"test_elsewhere.py": ELSEWHERE, "test_runner.py": RUNNER},
                       {PROCESS: "1"})
    assert result.returncode == 0, result.stdout
    assert "2 passed, 1 deselected" in result.stdout, result.stdout


def test_the_other_process_starts_when_collection_ends_not_when_its_runner_runs(tmp_path):
    """test_a_first.py runs before the runner and waits for a file that the other
    process's test writes: it appears only if that process was started early, beside
    the main process (and it must leave nothing running behind when the session ends)."""
    marker = tmp_path / "elsewhere_ran"
    files = {
        "test_a_first.py": f"""
            import os, time
            def test_waits_for_the_other_process():
                deadline = time.monotonic() + 60
                while not os.path.exists({str(marker)!r}) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert os.path.exists({str(marker)!r}), "the other process did not start early"
            """,
        "test_elsewhere.py": f"""
            def test_one():
                open({str(marker)!r}, "w").close()
            """,
        "test_runner.py": RUNNER}
    result = run_suite(tmp_path, files)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed, 1 skipped" in result.stdout, result.stdout


@pytest.mark.parametrize("files,expected", [
    ({"test_elsewhere.py": ELSEWHERE}, "2 passed"),          # no runner: the main process runs them
    ({"test_elsewhere.py": ELSEWHERE, "test_runner.py": RUNNER}, "1 passed, 2 skipped"),
], ids=["without_runner", "with_runner"])
def test_a_process_that_may_run_in_main_does_so_without_its_runner(files, expected, tmp_path):
    """The second stream's kind (conftest.SECOND_STREAM): `pytest tests/test_x.py` of one of
    its files runs it in the main process instead of failing for a missing runner."""
    result = run_suite(tmp_path, files, {"DEMO_MAIN_WITHOUT_RUNNER": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert expected in result.stdout.strip().splitlines()[-1], result.stdout


def test_an_allowed_skip_in_the_other_process_counts_as_done_there(tmp_path):
    """A docs example its page marks as not runnable here skips in the main process and is
    accepted; run in another process (balance_files) it must be accepted as well."""
    skipping = ELSEWHERE + ALLOWED
    runner = RUNNER.replace('["test_elsewhere.py"]', '["test_balanced.py"]')
    result = run_suite(tmp_path, {"test_balanced.py": skipping, "test_runner.py": runner})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUITE GUARD" not in result.stdout + result.stderr


def test_a_file_run_elsewhere_for_balance_runs_in_main_without_the_runner(tmp_path):
    """conftest.DTENSOR's balance_files (tests/test_docs_examples.py): `pytest` of that file
    alone runs it here; in the suite (runner included) it runs in the other process."""
    alone = run_suite(tmp_path, {"test_balanced.py": ELSEWHERE})
    assert alone.returncode == 0 and "2 passed" in alone.stdout, alone.stdout + alone.stderr
    runner = RUNNER.replace('["test_elsewhere.py"]', '["test_balanced.py"]')
    with_runner = run_suite(tmp_path, {"test_balanced.py": ELSEWHERE, "test_runner.py": runner})
    assert with_runner.returncode == 0, with_runner.stdout + with_runner.stderr
    assert "1 passed, 2 skipped" in with_runner.stdout.strip().splitlines()[-1], with_runner.stdout


def test_the_cpu_report_counts_the_children_a_test_waited_for(tmp_path):
    """TFDIST_TEST_CPU_REPORT (tests/cpu_report.py): a test whose child process burns CPU
    is charged that CPU, and the per-file summary adds it up."""
    import json
    import cpu_report
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS_DIR!r})
        import cpu_report
        def pytest_configure(config):
            cpu_report.install(config, "demo")
        """))
    (tmp_path / "test_burn.py").write_text(textwrap.dedent("""
        import subprocess, sys
        BURN = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass"
        def test_burns_in_a_child():
            subprocess.run([sys.executable, "-c", BURN], check=True)
        def test_idle():
            pass
        """))
    report = tmp_path / "cpu.jsonl"
    clean = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=dict(clean, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
                                     **{cpu_report.REPORT_ENV: str(report)}))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(text) for text in report.read_text().splitlines()]
    burn = next(line for line in lines if line["test"].endswith("test_burns_in_a_child"))
    assert burn["stream"] == "demo" and burn["children_cpu"] >= 0.4, lines
    [(file, seconds, tests)] = cpu_report.per_file(lines)
    assert file == "test_burn.py" and seconds >= 0.4 and tests == 2, lines
