"""The equivalence harness: train one config in two modes, compare number for number.

Every parallel mode is held to this: per-step losses and final weights within
`rtol` (1e-5, float32) of the single-device `default` run with the same seed and
global batch. Weights are compared per variable by relative norm,
||candidate - reference|| / ||reference||, which is robust to entries near 0.
"""

import dataclasses
import json
from typing import List, Optional

import numpy as np

RTOL = 1e-5


@dataclasses.dataclass
class Record:
    label: str
    losses: List[float]
    weights: Optional[List[np.ndarray]]  # None: this record has no weights to compare


def train(config, label: str = None) -> Record:
    """Runs `config` in this process and records its losses and final weights."""
    from tfdist.train import runner
    results, model = runner.run(config, return_model=True)
    return Record(label or config.strategy, results["losses"], model.get_weights())


def from_results_json(path: str, label: str = None, weights: str = None) -> Record:
    """A Record of a run launched elsewhere: its results JSON's losses and, if
    `weights` names an .npz of its final weights (np.savez(path, *model.get_weights()),
    as tests/workers/train_configs.py writes per rank), those weights. Without one the
    record has weights=None, which weight_mismatches refuses rather than passing."""
    with open(path) as f:
        results = json.load(f)
    return Record(label or results["strategy"], results["losses"],
                  load_weights(weights) if weights else None)


def load_weights(npz_path: str) -> List[np.ndarray]:
    """The list of arrays np.savez(npz_path, *arrays) wrote, in order."""
    with np.load(npz_path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def loss_mismatches(reference: Record, candidate: Record, rtol: float = RTOL) -> List[str]:
    if len(reference.losses) != len(candidate.losses):
        return [f"{candidate.label} ran {len(candidate.losses)} steps, "
                f"{reference.label} ran {len(reference.losses)}"]
    if not reference.losses:  # equal on no steps is not a comparison
        return [f"{candidate.label} and {reference.label} have no losses to compare"]
    out = []
    for step, (ref, got) in enumerate(zip(reference.losses, candidate.losses), start=1):
        error = abs(got - ref) / max(abs(ref), 1e-12)
        if not error <= rtol:  # also NaN
            out.append(f"step {step}: loss {got!r} vs {ref!r} (relative error {error:.2e})")
    return out


def weight_mismatches(reference: Record, candidate: Record, rtol: float = RTOL) -> List[str]:
    """Per variable: same shape, then relative norm within `rtol`. A record without
    weights is a ValueError (the caller compared nothing); different counts, or none
    at all, are mismatches."""
    for record in (reference, candidate):
        if record.weights is None:
            raise ValueError(f"record {record.label!r} has no weights (from_results_json "
                             f"without weights=?): cannot compare weights")
    if len(reference.weights) != len(candidate.weights):
        return [f"{candidate.label} has {len(candidate.weights)} weights, "
                f"{reference.label} has {len(reference.weights)}"]
    if not reference.weights:
        return [f"{candidate.label} and {reference.label} have no weights to compare"]
    out = []
    for index, (ref, got) in enumerate(zip(reference.weights, candidate.weights)):
        ref, got = np.asarray(ref), np.asarray(got)
        if ref.shape != got.shape:  # before any arithmetic: numpy would broadcast
            out.append(f"weight {index}: shape {got.shape} vs {ref.shape}")
            continue
        error = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-12)
        if not error <= rtol:  # also NaN
            out.append(f"weight {index} {ref.shape}: relative error {error:.2e}")
    return out


def max_relative_loss_error(reference: Record, candidate: Record) -> float:
    if len(reference.losses) != len(candidate.losses) or not reference.losses:
        raise ValueError(f"{candidate.label} has {len(candidate.losses)} losses, "
                         f"{reference.label} {len(reference.losses)}: no step-by-step error")
    return max(abs(g - r) / max(abs(r), 1e-12)
               for r, g in zip(reference.losses, candidate.losses))


def assert_equivalent(reference: Record, candidate: Record, rtol: float = RTOL) -> None:
    problems = loss_mismatches(reference, candidate, rtol)
    problems += weight_mismatches(reference, candidate, rtol)
    assert not problems, (f"{candidate.label} differs from {reference.label} beyond "
                          f"rtol={rtol}:\n  " + "\n  ".join(problems[:10]))
