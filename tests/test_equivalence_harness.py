"""tfdist/testing/equivalence.py itself: a comparison that can pass on nothing is none.

Pure numpy: records built by hand, results JSON and .npz written to tmp_path.
"""

import json

import numpy as np
import pytest

from tfdist.testing import equivalence
from tfdist.testing.equivalence import Record

W = [np.ones((2, 3), "float32"), np.arange(3, dtype="float32")]


def test_equal_records_match():
    assert not equivalence.weight_mismatches(Record("a", [1.0], W), Record("b", [1.0], list(W)))
    assert not equivalence.loss_mismatches(Record("a", [1.0, 2.0], W), Record("b", [1.0, 2.0], W))


@pytest.mark.parametrize("candidate,expected", [
    ([], "b has 0 weights, a has 2"),
    (W[:1], "b has 1 weights, a has 2"),
    ([W[0].T, W[1]], "weight 0: shape (3, 2) vs (2, 3)"),
    ([W[0][:1], W[1]], "weight 0: shape (1, 3) vs (2, 3)"),  # would broadcast
    ([W[0] * 1.001, W[1]], "weight 0 (2, 3): relative error 1.00e-03, largest difference "
                           f"{np.max(np.abs(W[0] * 0.001)):.1e}"),
    ([W[0], W[1] * np.nan], "weight 1 (3,): relative error nan, largest difference nan"),
])
def test_weight_mismatches_are_found(candidate, expected):
    assert equivalence.weight_mismatches(Record("a", [1.0], W),
                                         Record("b", [1.0], candidate)) == [expected]


def test_a_variable_near_zero_is_held_to_the_absolute_bound():
    """A bias that ended at 0.02 passes with differences of float32's O(1) rounding
    (relative to itself they exceed 1e-5), and fails beyond ATOL."""
    small = [np.array([0.024], np.float32)]
    rounding = [small[0] + np.float32(2.6e-7)]
    assert np.linalg.norm(rounding[0] - small[0]) / np.linalg.norm(small[0]) > 1e-5
    assert not equivalence.weight_mismatches(Record("a", [1.0], small), Record("b", [1.0], rounding))
    off = [small[0] + np.float32(5e-6)]
    assert equivalence.weight_mismatches(Record("a", [1.0], small), Record("b", [1.0], off))


def test_the_float64_run_arbitrates_where_the_float32_reference_is_itself_off():
    """A candidate 2e-5 from the float32 reference matches when it is within 1e-5 of the
    float64 run and no farther from it than the reference; otherwise it is still a
    mismatch (farther than the reference, beyond 1e-5 of float64, or no float64 run)."""
    exact = [np.full(4, 1.0, np.float64)]
    ref = [np.full(4, 1.0 + 1.5e-5, np.float32)]     # the reference's own rounding: 1.5e-5
    nearer = [np.full(4, 1.0 - 0.5e-5, np.float32)]  # 2e-5 from ref, 0.5e-5 from exact
    farther = [np.full(4, 1.0 + 3.5e-5, np.float32)]  # 2e-5 from ref, 3.5e-5 from exact
    a, b = Record("a", [1.0], ref), Record("b", [1.0], nearer)
    assert equivalence.weight_mismatches(a, b)                     # no arbiter: 2e-5 apart
    assert not equivalence.weight_mismatches(a, b, exact=exact)
    assert equivalence.weight_mismatches(a, Record("b", [1.0], farther), exact=exact)
    assert equivalence.weight_mismatches(a, b, exact=[np.ones(3)])  # wrong shape: no arbiter
    with pytest.raises(ValueError, match="the float64 run has 2 weights, 'a' has 1"):
        equivalence.weight_mismatches(a, b, exact=exact * 2)          # not the same model
    # within 1e-5 of float64 is required even when the reference is farther still
    assert not equivalence.closer_to_exact(np.full(4, 1.00002), np.full(4, 1.00003), exact[0])


def test_nothing_to_compare_is_a_mismatch():
    empty = Record("a", [], [])
    assert equivalence.weight_mismatches(empty, Record("b", [], [])) == [
        "b and a have no weights to compare"]
    assert equivalence.loss_mismatches(empty, Record("b", [], [])) == [
        "b and a have no losses to compare"]
    assert equivalence.loss_mismatches(Record("a", [1.0], W), Record("b", [float("nan")], W))
    with pytest.raises(ValueError, match="b has 0 losses, a 1"):
        equivalence.max_relative_loss_error(Record("a", [1.0], W), Record("b", [], W))


def test_results_json_carries_weights_only_when_given(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"strategy": "mirrored", "losses": [1.0]}))
    np.savez(tmp_path / "r.rank0.npz", *W)
    with_weights = equivalence.from_results_json(tmp_path / "r.json",
                                                 weights=tmp_path / "r.rank0.npz")
    assert with_weights.label == "mirrored" and with_weights.losses == [1.0]
    assert not equivalence.weight_mismatches(Record("a", [1.0], W), with_weights)
    losses_only = equivalence.from_results_json(tmp_path / "r.json")
    assert losses_only.weights is None
    assert not equivalence.loss_mismatches(Record("a", [1.0], W), losses_only)
    with pytest.raises(ValueError, match="record 'mirrored' has no weights"):
        equivalence.weight_mismatches(Record("a", [1.0], W), losses_only)
    with pytest.raises(ValueError, match="has no weights"):
        equivalence.assert_equivalent(Record("a", [1.0], W), losses_only)


def test_comparisons_report_their_largest_errors_when_asked(tmp_path, monkeypatch):
    report = tmp_path / "errors.jsonl"
    monkeypatch.setenv(equivalence.REPORT_FILE, str(report))
    reference = Record("one device", [1.0, 2.0], W)
    candidate = Record("mode", [1.0, 2.002], [W[0] * 1.01, W[1]])
    equivalence.loss_mismatches(reference, candidate)
    equivalence.weight_mismatches(reference, candidate)
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert lines[0] == dict(candidate="mode", reference="one device", steps=2,
                            max_loss_error=pytest.approx(1e-3))
    assert lines[1] == dict(candidate="mode", reference="one device", weights=2,
                            max_weight_error=pytest.approx(1e-2, rel=1e-5))
    monkeypatch.delenv(equivalence.REPORT_FILE)
    equivalence.loss_mismatches(reference, candidate)   # unset: nothing written
    assert len(report.read_text().splitlines()) == 2
