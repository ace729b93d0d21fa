"""Where to cut a chain of layers into S stages: the min-max balanced partition.

Kept free of TensorFlow so that `tfdist plan` (which never imports TF) predicts
exactly the stages `--strategy=pipeline` will build: both call this function
with the same per-layer costs and the same valid cut points.
"""

from typing import List, Sequence

from tfdist.errors import UsageError


def balanced_cuts(costs: Sequence[int], num_stages: int, valid: Sequence[int],
                  model_name: str) -> List[int]:
    """Min-max contiguous partition over the valid cut points (dynamic programming)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    ends = sorted(set(valid) | {n})
    # best[s][e]: (max stage cost, cuts) for layers [0, e) in s stages ending at a valid end.
    best = [dict() for _ in range(num_stages + 1)]
    best[0][0] = (0, [])
    for s in range(1, num_stages + 1):
        for end in ends:
            for start, (worst, cuts) in best[s - 1].items():
                if start >= end:
                    continue
                candidate = (max(worst, prefix[end] - prefix[start]),
                             cuts + ([start] if start else []))
                if end not in best[s] or candidate[0] < best[s][end][0]:
                    best[s][end] = candidate
    if n not in best[num_stages]:
        raise UsageError(f"Model '{model_name}' has only {len(valid)} place(s) where one computed "
                         f"tensor (and any model inputs) crosses between layers, too few for "
                         f"{num_stages} stages; name the cuts with --pipeline_split (a cut "
                         f"that up to 4 tensors cross is allowed there).")
    return best[num_stages][n][1]
