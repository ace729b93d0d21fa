"""Runs every DTensor test in one fresh pytest process (see conftest.py for why)."""

import os
import re
import subprocess
import sys

from conftest import DTENSOR_PROCESS
from helpers import REPO

DTENSOR_TESTS = ["tests/test_dtensor.py", "tests/test_dtensor_multiclient.py",
                 "tests/test_checkpoint_modes.py", "tests/test_dtensor_plan.py"]


def test_every_dtensor_case_in_a_fresh_process():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DTENSOR_TESTS],
        cwd=REPO, env=dict(os.environ, **{DTENSOR_PROCESS: "1"}), capture_output=True,
        text=True, timeout=1200)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(summary)
    assert result.returncode == 0, result.stdout[-5000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 40, summary  # every DTensor test ran, none silently skipped
