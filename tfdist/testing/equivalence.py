"""The equivalence harness: train one config in two modes, compare number for number.

Every parallel mode is held to this: per-step losses and final weights within
`rtol` (1e-5, float32) of the single-device `default` run with the same seed and
global batch. Weights are compared per variable by relative norm,
||candidate - reference|| / ||reference||, which is robust to entries near 0.
"""

import dataclasses
import json
from typing import List

import numpy as np

RTOL = 1e-5


@dataclasses.dataclass
class Record:
    label: str
    losses: List[float]
    weights: List[np.ndarray]


def train(config, label: str = None) -> Record:
    """Runs `config` in this process and records its losses and final weights."""
    from tfdist.train import runner
    results, model = runner.run(config, return_model=True)
    return Record(label or config.strategy, results["losses"], model.get_weights())


def from_results_json(path: str, label: str = None) -> Record:
    """A Record with the losses of a run launched elsewhere (weights not compared)."""
    with open(path) as f:
        results = json.load(f)
    return Record(label or results["strategy"], results["losses"], [])


def loss_mismatches(reference: Record, candidate: Record, rtol: float = RTOL) -> List[str]:
    if len(reference.losses) != len(candidate.losses):
        return [f"{candidate.label} ran {len(candidate.losses)} steps, "
                f"{reference.label} ran {len(reference.losses)}"]
    out = []
    for step, (ref, got) in enumerate(zip(reference.losses, candidate.losses), start=1):
        error = abs(got - ref) / max(abs(ref), 1e-12)
        if error > rtol:
            out.append(f"step {step}: loss {got!r} vs {ref!r} (relative error {error:.2e})")
    return out


def weight_mismatches(reference: Record, candidate: Record, rtol: float = RTOL) -> List[str]:
    out = []
    for index, (ref, got) in enumerate(zip(reference.weights, candidate.weights)):
        error = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-12)
        if ref.shape != got.shape or error > rtol:
            out.append(f"weight {index} {ref.shape}: relative error {error:.2e}")
    return out


def max_relative_loss_error(reference: Record, candidate: Record) -> float:
    return max(abs(g - r) / max(abs(r), 1e-12)
               for r, g in zip(reference.losses, candidate.losses))


def assert_equivalent(reference: Record, candidate: Record, rtol: float = RTOL) -> None:
    problems = loss_mismatches(reference, candidate, rtol)
    problems += weight_mismatches(reference, candidate, rtol)
    assert not problems, (f"{candidate.label} differs from {reference.label} beyond "
                          f"rtol={rtol}:\n  " + "\n  ".join(problems[:10]))
