"""Runs the second stream of the main suite (conftest.SECOND_STREAM_FILES) in a pytest
process of its own, started beside the main one when collection ends (suite_guard), so
that the suite uses both of this machine's cores; every test it was given must pass
there, by node id, and tests/suite_guard.py checks the same at the end of the session."""

import suite_guard
from conftest import SECOND_STREAM_FILES, SECOND_STREAM_PROCESS


def test_the_second_stream_passes_in_its_own_process(run_own_process):
    result, requested, passed = run_own_process(SECOND_STREAM_PROCESS, list(SECOND_STREAM_FILES),
                                                timeout=5400)
    suite_guard.assert_passed_there(result, requested, passed, "second-stream")
