"""The conformance corpus' fast subset (the whole corpus: `python -m benchmarks
--suite=conformance`, about an hour): two keras-io-shaped models of the corpus, the
token + arange-position transformer and the Conv1D + BatchNormalization classifier,
under mirrored and pipeline here and dtensor layout="auto" in the DTensor process,
Adam and SGD, 8 steps against plain Keras on one device. No cell may be a silent
mismatch; the cells exact today are held to exact. Also the harness' own rules
(what counts as refused, announced or silent) on records, and its command line.
"""

import functools
import json
import os
import subprocess
import sys
import time

import pytest

from helpers import REPO
from benchmarks import conformance

# (model, mode) -> the verdict today, per optimizer; None: only "not silent" is asserted
# (a cell another change is still settling: see the conformance table).
EXPECTED = {
    ("text_transformer", "mirrored"): {"adam": "exact", "sgd": "exact"},
    ("text_transformer", "pipeline"): {"adam": "exact", "sgd": "exact"},
    ("text_transformer", "dtensor_auto"): {"adam": "exact", "sgd": "exact"},
    # Adam: the conv biases before BatchNormalization get rounding-noise gradients that
    # Adam amplifies; announced today (the whole-word layer names in a tfdist warning).
    ("timeseries_fcn", "mirrored"): {"adam": None, "sgd": "exact"},
    # BatchNormalization over micro-batches: refused, as the issue asks
    ("timeseries_fcn", "pipeline"): {"adam": "refused", "sgd": "refused"},
    ("timeseries_fcn", "dtensor_auto"): {"adam": "exact", "sgd": "exact"},
}


def cell(model, mode):
    marks = [pytest.mark.dtensor] if mode.startswith("dtensor") else []
    return pytest.param(model, mode, marks=marks, id=f"{model}-{mode}")


@functools.lru_cache(maxsize=None)
def reference(model, optimizer):
    return conformance.train_here(model, conformance.REFERENCE, optimizer)


@pytest.mark.parametrize("model, mode", [cell(*key) for key in EXPECTED])
def test_no_silent_mismatch_on_third_party_models(model, mode):
    for optimizer, expected in EXPECTED[(model, mode)].items():
        ref = reference(model, optimizer)
        assert len(ref[0]["losses"]) == conformance.STEPS
        judged = conformance.judge_here(model, ref, conformance.train_here(model, mode, optimizer))
        where = f"{model} under {mode} with {optimizer}"
        assert judged["verdict"] != conformance.SILENT, f"{where}: {judged['message']}"
        if expected:
            assert judged["verdict"] == expected, f"{where}: {judged}"


# ------------------------------------------------------------- the harness' own rules

def record(losses=(1.0, 0.9), error=None, steps_done=2, warnings=()):
    return dict(mode="mirrored", losses=list(losses), replicas=["model"], error=error,
                steps_done=steps_done, warnings_before_training=list(warnings))


REF = (record(), [[[1.0, 2.0]]])
OUTCOME = dict(status=0, log="/nonexistent")


def judged(candidate):
    return conformance.judge(REF, candidate, dict(layers=["dense"], paths=["dense/kernel"]),
                             OUTCOME)


def usage_error(message="no"):
    return dict(type="tfdist.errors.UsageError", message=message, usage_error=True)


@pytest.mark.parametrize("candidate, verdict", [
    ((record(), [[[1.0, 2.0]]]), "exact"),
    ((record(error=usage_error("Use mirrored."), steps_done=0, losses=()), []), "refused"),
    # a UsageError once training ran is not a refusal before the first step
    ((record(error=usage_error(), steps_done=3, losses=()), []), "SILENT MISMATCH"),
    ((record(error=dict(type="tensorflow.python.framework.errors_impl.InvalidArgumentError",
                        message="boom", usage_error=False), steps_done=0, losses=()), []),
     "SILENT MISMATCH"),
    (None, "SILENT MISMATCH"),                                   # the process left no record
    ((record(losses=(1.0, 0.95)), [[[1.0, 2.0]]]), "SILENT MISMATCH"),
    ((record(), [[[1.0, 2.1]]]), "SILENT MISMATCH"),
    ((record(), [[[1.0, 2.0]], [[1.0, 2.1]]]), "SILENT MISMATCH"),   # a second replica off
    ((record(warnings=["[tfdist] mirrored: dense (Dense) is per replica"]), [[[1.0, 2.1]]]),
     "announced"),
    # Keras' own warnings, or a tfdist line naming no layer of the model, announce nothing
    ((record(warnings=["[python UserWarning] dense was built twice"]), [[[1.0, 2.1]]]),
     "SILENT MISMATCH"),
    ((record(warnings=["[tfdist] mirrored: dense_1 differs"]), [[[1.0, 2.1]]]),
     "SILENT MISMATCH"),
])
def test_each_run_lands_in_exactly_one_verdict(candidate, verdict):
    if candidate and len(candidate[1]) == 2:
        candidate[0]["replicas"] = ["replica 0", "replica 1"]
    assert judged(candidate)["verdict"] == verdict


def test_a_silent_mismatch_names_the_variable_that_differs():
    message = judged((record(), [[[1.0, 2.1]]]))["message"]
    assert "weight 0 dense/kernel (2,): relative error" in message, message


def test_a_cell_is_its_worst_optimizer():
    assert max(["exact", "refused"], key=conformance.SEVERITY.index) == "refused"
    assert max(["announced", "SILENT MISMATCH", "exact"],
               key=conformance.SEVERITY.index) == "SILENT MISMATCH"


def test_the_noise_floor_moves_zeros_too():
    """A zero (a bias BatchNormalization cancels holds only rounding noise) moves to
    +-size; any other float entry is scaled by 1 + size; integers stay."""
    import numpy as np
    moved = conformance.perturbed(np.array([[0.0, 2.0], [0.0, 0.0]], np.float32), 1e-7)
    np.testing.assert_array_equal(moved, np.array([[1e-7, 2.0 * (1 + 1e-7)], [1e-7, -1e-7]],
                                                  np.float32))
    assert moved.dtype == np.float32
    counts = np.array([0, 3], np.int64)
    assert conformance.perturbed(counts, 1e-7) is counts


def test_bad_selections_name_the_valid_choices():
    from tfdist.errors import UsageError
    with pytest.raises(UsageError, match="unknown model or family 'resnet9'.*keras-io"):
        conformance.select_models("resnet9")
    with pytest.raises(UsageError, match="unknown mode.*tensor_parallel.*pipeline_2x2"):
        conformance.select_modes("mirrored,tensor_parallel", "--modes")
    assert conformance.select_models("keras-hub")[:2] == ["bert_classifier", "gpt2_lm"]
    assert conformance.select_modes("pipeline,mirrored", "--modes") == ["mirrored", "pipeline"]


def test_the_corpus_has_twenty_third_party_models_from_three_sources():
    families = [spec.family for spec in conformance.zoo.ZOO.values()]
    assert len(families) >= 20
    assert set(families) == {"keras.applications", "keras-hub", "keras-io"}


def test_the_suite_runs_end_to_end_and_writes_its_table(tmp_path):
    """The command, on the cheapest cell: a process per group, the records judged,
    conformance.json and conformance.md written, exit 0 (no silent mismatch)."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--suite=conformance",
         "--models=subclassed_mlp", "--modes=default", f"--out_dir={tmp_path}"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "conformance.json") as f:
        saved = json.load(f)
    assert [(c["model"], c["mode"], c["verdict"]) for c in saved["cells"]] == [
        ("subclassed_mlp", "default", "exact")]
    assert "| subclassed_mlp |" in (tmp_path / "conformance.md").read_text()


def test_a_process_that_finishes_no_cell_in_time_is_ended(tmp_path):
    """--cell_timeout: the whole process group goes (a launch's workers with it), and the
    outcome says why, for the cells it leaves SILENT MISMATCH."""
    started = time.time()
    outcome = conformance.run_process(
        [sys.executable, "-c", "import time; print('CELL m mode adam trained', flush=True); "
         "time.sleep(120)"], str(tmp_path / "group.log"), timeout=3)
    assert outcome["status"] == "no cell finished in 3 s: ended"
    assert time.time() - started < 60
    assert "CELL m mode adam" in (tmp_path / "group.log").read_text()
