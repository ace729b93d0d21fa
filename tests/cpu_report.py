"""Where the suite's CPU goes: with TFDIST_TEST_CPU_REPORT=PATH, every test appends one JSON
line to PATH (its id, the pytest process it ran in, when it ended, wall seconds, and CPU seconds of this
process and of the child processes it waited for, which includes the workers a launcher
waited for). The suite's time on a 2-core machine is its CPU work over two cores, so this,
not the wall time of a test that shared the cores, says what a cut would save.

    TFDIST_TEST_CPU_REPORT=/tmp/cpu.jsonl python -m pytest
    python tests/cpu_report.py /tmp/cpu.jsonl      # CPU seconds per file, heaviest first
"""

import collections
import json
import os
import sys
import time

import pytest

REPORT_ENV = "TFDIST_TEST_CPU_REPORT"
# The runners of the other pytest processes: their children's CPU is those processes' tests.
RUNNERS = ("tests/test_second_stream.py", "tests/test_isolated_dtensor.py")


class CpuReport:
    def __init__(self, path: str, stream: str):
        self.path, self.stream = path, stream
        self.skipped = set()

    def pytest_runtest_logreport(self, report):
        if report.skipped:
            self.skipped.add(report.nodeid)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        wall, before = time.monotonic(), os.times()
        yield
        after = os.times()
        if item.nodeid in self.skipped:   # e.g. it runs in another pytest process
            return
        line = {"test": item.nodeid, "stream": self.stream, "ended": round(time.time(), 1),
                "wall": round(time.monotonic() - wall, 2),
                "cpu": round(after.user + after.system - before.user - before.system, 2),
                "children_cpu": round(after.children_user + after.children_system
                                      - before.children_user - before.children_system, 2)}
        with open(self.path, "a") as f:   # one short append per test: the processes share it
            f.write(json.dumps(line) + "\n")


def install(config, stream: str) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        config.pluginmanager.register(CpuReport(path, stream), "tfdist-cpu-report")


def per_file(lines) -> list:
    """[(file, cpu seconds, tests)], heaviest first; the runners' children left out."""
    totals, counts = collections.Counter(), collections.Counter()
    for line in lines:
        file = line["test"].split("::")[0]
        children = 0.0 if file in RUNNERS else line["children_cpu"]
        totals[file] += line["cpu"] + children
        counts[file] += 1
    return [(file, seconds, counts[file]) for file, seconds in totals.most_common()]


def main(path: str) -> None:
    with open(path) as f:
        lines = [json.loads(text) for text in f if text.strip()]
    rows = per_file(lines)
    total = sum(seconds for _, seconds, _ in rows)
    print(f"{len(lines)} tests, {total / 60:.1f} CPU-minutes")
    start = min(line["ended"] - line["wall"] for line in lines)
    for stream in sorted({line["stream"] for line in lines}):
        ends = [line["ended"] for line in lines if line["stream"] == stream]
        print(f"  stream {stream}: last test ended {(max(ends) - start) / 60:.1f} min "
              f"after the first began")
    for file, seconds, count in rows:
        print(f"{seconds:8.0f} s {100 * seconds / total:5.1f}%  {count:4d}  {file}")


if __name__ == "__main__":
    main(sys.argv[1])
