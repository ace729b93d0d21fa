"""The issue's whole cross-worker pipeline matrix: not part of the suite (its file name is not
test_*.py), since it takes about 15 minutes here; run it by name:

    python -m pytest tests/pipeline_full_product.py

2 and 4 worker processes, S in {2, 4} (2x2, 4x2, 4x4), M in {1, 4, 8}, every schedule
(interleaved_1f1b with V=2 wherever M is a multiple of S), mlp and transformer, sgd and adam:
132 configs in 3 launches, each checked as tests/test_pipeline_cross_worker.py checks its cover
(per-step losses and every replica's every stage, read from the worker that holds it, within
1e-5 of one device; param_bytes_per_device by task).
"""

import json
import sys

import pytest

from test_pipeline_cross_worker import TRANSFORMER, check_run, launch, mlp, named, transformer

SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "interleaved_1f1b")
# interleaved_1f1b with S=4 and V=2 cuts the model into 8 chunks: deeper variants of both
DEEP = {"mlp": dict(name="mlp", hidden_sizes=[32] * 7),
        "transformer": dict(TRANSFORMER["model"], num_layers=6)}


def full_product(stages):
    configs = []
    for model in ("mlp", "transformer"):
        for optimizer in ("sgd", "adam"):
            for microbatches in (1, 4, 8):
                for schedule in SCHEDULES:
                    fields = dict(pipeline_stages=stages, microbatches=microbatches,
                                  pipeline_schedule=schedule)
                    if schedule == "interleaved_1f1b":
                        if microbatches % stages:
                            continue   # refused: M must be a multiple of S (test_pipeline_schedules.py)
                        fields["virtual_stages"] = 2
                    build = mlp if model == "mlp" else transformer
                    config = build(optimizer, **fields)
                    if schedule == "interleaved_1f1b" and stages == 4:
                        config["model"] = DEEP[model]
                    configs.append(config)
    return named(configs)


@pytest.mark.parametrize("workers,stages", [(2, 2), (4, 2), (4, 4)])
def test_full_product_trains_like_one_device(workers, stages, tmp_path):
    configs = full_product(stages)
    result = launch(workers, 1, [sys.executable, "tests/workers/pipeline_configs.py",
                                 json.dumps(configs), str(tmp_path)], timeout=3600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(configs) == 44
    for name, config in configs.items():
        check_run(tmp_path, name, config, workers, 1)
