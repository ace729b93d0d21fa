"""The package's shape: no import cycles, and the installed package holds what users import.

The cycle check is pylint's (cyclic-import, R0401), which follows every import, those
inside functions too; the same command runs by hand:

    python -m pylint --disable=all --enable=cyclic-import tfdist experiments
"""

import ast
import pathlib
import subprocess
import sys

from helpers import REPO

INSTALLED = ("tfdist", "experiments")     # setup.py's packages
NOT_FOR_USERS = ("torch", "benchmarks")    # contenders and suites live in benchmarks/


def test_no_import_cycles():
    done = subprocess.run([sys.executable, "-m", "pylint", "--disable=all",
                           "--enable=cyclic-import", "--score=n", *INSTALLED],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "cyclic-import" not in done.stdout, done.stdout[-4000:]


def imported_modules(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_the_installed_package_imports_no_benchmark_and_no_torch():
    found = []
    for package in INSTALLED:
        files = sorted((pathlib.Path(REPO) / package).rglob("*.py"))
        assert files, f"no Python files under {package}/"
        for path in files:
            found += [f"{path.relative_to(REPO)}: {name}" for name in imported_modules(path)
                      if name.split(".")[0] in NOT_FOR_USERS]
    assert found == [], found
