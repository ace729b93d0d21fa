"""The Colab notebooks (colab/*.ipynb) run top to bottom, headless, with a few steps.

Each notebook runs in a fresh kernel process (nbclient + ipykernel), so this
process's 4 simulated devices do not matter. The kernel's working directory is
an empty temporary directory, as on Colab: a notebook must not depend on it.
Every notebook found is run, so a new one is tested without editing this file.
"""

import glob
import importlib.util
import os

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from helpers import REPO

NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "colab", "*.ipynb")))
NOTEBOOK_STEPS = "5"      # TFDIST_NOTEBOOK_STEPS: enough to compare per-step losses
CELL_TIMEOUT = 300        # seconds; the notebooks' own subprocesses time out before this
BADGE = ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
         "(https://colab.research.google.com/github/tfdist/tfdist/blob/main/colab/{name})")


def name_of(path):
    return os.path.basename(path)


def test_there_are_at_least_four_notebooks():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


def test_generated_notebooks_are_committed_as_generated():
    spec = importlib.util.spec_from_file_location(
        "make_notebooks", os.path.join(REPO, "colab", "make_notebooks.py"))
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.main(["make_notebooks.py", "--check"]) == 0, \
        "edit colab/make_notebooks.py, run it, and commit the notebooks it writes"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=name_of)
def test_notebook_opens_with_badge_and_install_cell_and_has_no_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    first, second = notebook.cells[:2]
    assert first.cell_type == "markdown" and first.source.startswith("# "), first.source
    assert BADGE.format(name=name_of(path)) in first.source, first.source
    assert second.cell_type == "code", second.source
    for part in ("import tfdist", "except ImportError", "%pip install"):
        assert part in second.source, second.source
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, \
                f"clear the outputs before committing:\n{cell.source}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=name_of)
def test_notebook_runs_headless(path, tmp_path, monkeypatch):
    monkeypatch.setenv("TFDIST_NOTEBOOK_STEPS", NOTEBOOK_STEPS)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebooks' scratch dirs go away with it
    # This checkout's tfdist and experiments, whatever else is installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, kernel_name="python3", timeout=CELL_TIMEOUT,
                            resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except CellExecutionError as error:
        # The message holds the failing cell's source and its traceback.
        pytest.fail(f"{name_of(path)} failed:\n{error}", pytrace=False)
