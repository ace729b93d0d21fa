"""`tfdist plan`'s per-device state bytes equal what --strategy=dtensor reports, exactly.

Runs in the DTensor test process (see conftest.py); the other modes are checked
in tests/test_plan.py.
"""

import pytest

from test_plan import MODEL_FLAGS, parse, reported_bytes
from tfdist.plan import command
from tfdist.plan.memory import Candidate
from tfdist.plan.recommend import evaluate

CASES = [
    ("mlp-digits", "batch=2,model=2", "megatron", "adam"),
    ("mlp-wide", "batch=1,model=4", "megatron", "momentum"),
    ("mlp-wide", "batch=4,model=1", "data", "adamw"),
    ("transformer", "batch=2,model=2", "megatron", "adam"),
    ("transformer-deep", "batch=1,model=2", "megatron", "sgd"),
]


@pytest.mark.parametrize("name,mesh,layout,optimizer", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_dtensor_state_bytes_equal_what_the_mode_reports(name, mesh, layout, optimizer):
    axes = dict(part.split("=") for part in mesh.split(","))
    replicas, model_ways = int(axes["batch"]), int(axes["model"])
    devices = replicas * model_ways
    args, work, hardware = parse(MODEL_FLAGS[name], devices=devices,
                                 extra=[f"--optimizer={optimizer}", "--global_batch_size=16"])
    candidate = Candidate("dtensor", devices, replicas=replicas, model_ways=model_ways,
                          layout=layout)
    evaluated = evaluate(candidate, work, hardware)
    planned = command._candidate_json(evaluated, hardware)["param_bytes_per_device"]
    strategy = dict(strategy="dtensor", mesh=mesh, layout=layout, simulate_devices=devices)
    assert planned == reported_bytes(MODEL_FLAGS[name], strategy, optimizer)
