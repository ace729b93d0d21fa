"""Runs the DTensor tests in one fresh pytest process (see conftest.py for why).

Which tests those are is decided in one place (conftest.DTENSOR: its files and
the `dtensor` marker); here every one this session skipped must pass there, by
node id, and tests/suite_guard.py checks the same at the end of the session.
"""

from conftest import DTENSOR_PROCESS


def test_every_dtensor_case_in_a_fresh_process(run_own_process):
    result, requested, passed = run_own_process(DTENSOR_PROCESS, ["tests"], timeout=1500)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(result.stdout[-100_000:])  # pytest shows it under the failure: every traceback
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert result.returncode == 0, "\n".join([summary, *failed, result.stderr[-2000:]])
    missing = sorted(set(requested) - passed)
    assert not missing, f"{len(missing)} DTensor test(s) did not pass there: {missing[:10]}"
    assert passed, summary  # with nothing requested, the whole DTensor set ran
