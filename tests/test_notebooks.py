"""The Colab notebooks run top to bottom, headless, with a few steps.

Each notebook's source is a plain-text file in jupytext's percent format,
colab/NN_name.py (`# %%` cells); colab/NN_name.ipynb, which Colab opens from
GitHub, is made from it by jupytext and committed with its outputs cleared.
Edit the .py, then run REGENERATE. Every source found is checked and run, so a
new notebook is tested without editing this file.

Each notebook runs in a fresh kernel process (nbclient + ipykernel), so this
process's 4 simulated devices do not matter. The kernel's working directory is
an empty temporary directory, as on Colab: a notebook must not depend on it.
"""

import ast
import collections
import glob
import os

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from helpers import REPO

COLAB = os.path.join(REPO, "colab")
SOURCES = sorted(glob.glob(os.path.join(COLAB, "*.py")))
# --update keeps the committed cell ids and notebook metadata, so a diff shows only what changed.
REGENERATE = "jupytext --to ipynb --update colab/*.py"
NOTEBOOK_STEPS = "5"      # TFDIST_NOTEBOOK_STEPS: enough to compare per-step losses
CELL_TIMEOUT = 300        # seconds; the notebooks' own subprocesses time out before this
BADGE = ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
         "(https://colab.research.google.com/github/tfdist/tfdist/blob/main/colab/{name})")


def ipynb_of(source):
    return os.path.splitext(source)[0] + ".ipynb"


def name_of(source):
    """The test id: the notebook's name, as Colab shows it."""
    return os.path.basename(ipynb_of(source))


def cells(notebook):
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


def test_there_are_at_least_four_notebooks():
    assert len(SOURCES) >= 4, SOURCES


def test_every_committed_notebook_has_a_source():
    orphans = set(glob.glob(os.path.join(COLAB, "*.ipynb"))) - set(map(ipynb_of, SOURCES))
    assert not orphans, \
        f"notebooks without a colab/*.py source: {sorted(map(os.path.basename, orphans))}"


@pytest.mark.parametrize("source", SOURCES, ids=name_of)
def test_committed_notebook_is_what_jupytext_makes_of_its_source(source):
    path = ipynb_of(source)
    assert os.path.exists(path), f"{name_of(source)} is missing: run `{REGENERATE}` and commit it"
    committed, made = cells(nbformat.read(path, as_version=4)), cells(jupytext.read(source))
    differing = [i for i, (a, b) in enumerate(zip(committed, made)) if a != b]
    where = (f"cell {differing[0]} differs" if differing
             else f"{len(committed)} cells committed, {len(made)} in the source")
    assert committed == made, (f"colab/{name_of(source)} is not what jupytext makes of "
                               f"colab/{os.path.basename(source)} ({where}): "
                               f"run `{REGENERATE}` and commit the notebooks")


@pytest.mark.parametrize("source", SOURCES, ids=name_of)
def test_notebook_opens_with_badge_and_install_cell_and_has_no_outputs(source):
    notebook = nbformat.read(ipynb_of(source), as_version=4)
    nbformat.validate(notebook)
    first, second = notebook.cells[:2]
    assert first.cell_type == "markdown" and first.source.startswith("# "), first.source
    assert BADGE.format(name=name_of(source)) in first.source, first.source
    assert second.cell_type == "code", second.source
    for part in ("import tfdist", "except ImportError", "%pip install"):
        assert part in second.source, second.source
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, \
                f"clear the outputs before committing:\n{cell.source}"


def test_cells_shared_by_notebooks_stay_the_same():
    """Each notebook is self-contained for Colab, so the install cell and the helpers
    (run, show_table, ...) are copied into several sources: the copies must not drift."""
    install_cells = {jupytext.read(source).cells[1].source for source in SOURCES}
    assert len(install_cells) == 1, "the install cells differ:\n\n" + "\n\n".join(install_cells)
    definitions = collections.defaultdict(dict)  # function name -> {source: its code, sans comments}
    for source in SOURCES:
        with open(source) as f:
            for node in ast.parse(f.read(), source).body:
                if isinstance(node, ast.FunctionDef):
                    definitions[node.name][os.path.basename(source)] = ast.dump(node)
    drifted = {name: sorted(by_source) for name, by_source in definitions.items()
               if len(set(by_source.values())) > 1}
    assert not drifted, f"functions defined differently in these notebooks: {drifted}"


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES, ids=name_of)
def test_notebook_runs_headless(source, tmp_path, monkeypatch):
    """Runs the notebook jupytext makes of the source (the committed one is that, as checked above)."""
    monkeypatch.setenv("TFDIST_NOTEBOOK_STEPS", NOTEBOOK_STEPS)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebooks' scratch dirs go away with it
    # This checkout's tfdist and experiments, whatever else is installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    notebook = jupytext.read(source)
    client = NotebookClient(notebook, kernel_name="python3", timeout=CELL_TIMEOUT,
                            resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except CellExecutionError as error:
        # The message holds the failing cell's source and its traceback.
        pytest.fail(f"{name_of(source)} failed:\n{error}", pytrace=False)
