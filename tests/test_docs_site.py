"""The docs site (mkdocs.yml, docs/) builds with `mkdocs build --strict`, and the API it
documents has docstrings.

mkdocs' strict mode turns every warning into a failure: a broken link or anchor between
pages, a page missing from the nav, a `--8<--` include of a results file that is gone, an
identifier mkdocstrings cannot resolve. mkdocstrings has no option that makes a missing
docstring a warning (with `show_if_no_docstring: false` such an object is left out
silently), so the tests below check the docstrings themselves: every name in
`tfdist.__all__`, every public method of `tfdist.Strategy`, and every object docs/reference.md
names.
"""

import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict_has_no_warnings(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                           str(tmp_path / "site")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-5000:]
    warnings = [line for line in log.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert not warnings, "\n".join(warnings)
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    for name in ("tfdist.Strategy", "fit", "check_equivalence"):
        assert name in reference, f"{name} is missing from the rendered API reference"
    assert (tmp_path / "site" / "scaling.png").stat().st_size > 0   # the benchmarks' plot


def _undocumented(objects):
    return [name for name, obj in objects if not (inspect.getdoc(obj) or "").strip()]


def test_public_names_and_strategy_methods_have_docstrings():
    import tfdist
    names = [(f"tfdist.{name}", getattr(tfdist, name)) for name in tfdist.__all__
             if not isinstance(getattr(tfdist, name), str)]          # __version__
    methods = [(f"tfdist.Strategy.{name}", member)
               for name, member in inspect.getmembers(tfdist.Strategy)
               if not name.startswith("_") and (inspect.isfunction(member)
                                                or inspect.ismethod(member))]
    assert methods, "found no public methods on tfdist.Strategy"
    assert not _undocumented(names + methods)


def reference_objects():
    """(identifier, object) for every `::: identifier` of docs/reference.md and each of its
    listed `members:`."""
    text = (REPO / "docs" / "reference.md").read_text()
    found = []
    for block in re.split(r"(?m)^(?=::: )", text):
        match = re.match(r"::: ([\w.]+)", block)
        if not match:
            continue
        identifier = match.group(1)
        found.append((identifier, _resolve(identifier)))
        members = re.search(r"(?m)^\s+members:\n((?:\s+- [\w.]+\n?)+)", block)
        for member in re.findall(r"- ([\w.]+)", members.group(1) if members else ""):
            found.append((f"{identifier}.{member}", _resolve(f"{identifier}.{member}")))
    return found


def _resolve(identifier):
    parts = identifier.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(identifier)


def test_every_object_of_the_api_reference_has_a_docstring():
    objects = reference_objects()
    assert len(objects) >= 6, objects
    assert not _undocumented(objects)


def test_readme_links_point_at_files_that_exist():
    """README.md is read on GitHub, outside the site: its relative links must resolve."""
    text = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\((?!https?://|#)([^)#\s]+)", text)
    assert targets
    missing = [target for target in targets if not (REPO / target).exists()]
    assert not missing, missing
