"""Runs the DTensor tests in one fresh pytest process (see conftest.py for why).

Which tests those are is decided in one place (conftest.DTENSOR: its files and
the `dtensor` marker); here every one this session skipped must pass there, by
node id, and tests/suite_guard.py checks the same at the end of the session. The
process starts when collection ends, beside the main one (suite_guard), so the
timeout counts from then.
"""

import suite_guard
from conftest import DTENSOR_PROCESS


def test_every_dtensor_case_in_a_fresh_process(run_own_process):
    result, requested, passed = run_own_process(DTENSOR_PROCESS, ["tests"], timeout=5400)
    suite_guard.assert_passed_there(result, requested, passed, "DTensor")
