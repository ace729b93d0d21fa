"""`tfdist plan`'s per-device state bytes equal what --strategy=dtensor reports, exactly.

Runs in the DTensor test process (see conftest.py); the other modes are checked
in tests/test_plan.py.
"""

import pytest

from test_plan import MODEL_FLAGS, built_run, parse, reported_bytes
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


# (model, mesh, layout, optimizer, zero stage, mixed policy): each stage on a batch-only
# mesh and on a 2-D one; mlp-digits on batch=4 leaves dense_1/bias and the logits whole
# (4 divides none of their dimensions), so the per-variable cut is what is compared.
ZERO_CASES = [
    ("mlp-digits", "batch=4,model=1", "data", "adam", 1, None),
    ("mlp-digits", "batch=4,model=1", "data", "momentum", 2, None),
    ("mlp-digits", "batch=4,model=1", "data", "adam", 3, "mixed_bfloat16"),
    ("mlp-wide", "batch=2,model=2", "megatron", "adamw", 1, None),
    ("transformer", "batch=2,model=2", "megatron", "adam", 2, None),
    ("transformer-deep", "batch=2,model=2", "megatron", "adam", 3, None),
]


@pytest.mark.parametrize("name,mesh,layout,optimizer,stage,mixed", ZERO_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-zero{c[4]}{'-' + c[5] if c[5] else ''}"
                              for c in ZERO_CASES])
def test_zero_stage_bytes_equal_what_the_mode_reports(name, mesh, layout, optimizer, stage,
                                                      mixed):
    """param_bytes_per_device and gradient_bytes_per_device of a --zero_stage run, against
    the plan's, per device, byte for byte."""
    axes = dict(part.split("=") for part in mesh.split(","))
    replicas, model_ways = int(axes["batch"]), int(axes["model"])
    extra = [f"--optimizer={optimizer}", "--global_batch_size=16"]
    extra += [f"--dtype={mixed}"] if mixed else []
    args, work, hardware = parse(MODEL_FLAGS[name], extra=extra)
    candidate = Candidate("dtensor", 4, replicas=replicas, model_ways=model_ways,
                          layout=layout, zero_stage=stage)
    evaluated = evaluate(candidate, work, hardware)
    assert evaluated.problem is None, evaluated.problem
    planned = command._candidate_json(evaluated, hardware)
    strategy = dict(strategy="dtensor", mesh=mesh, layout=layout, simulate_devices=4,
                    zero_stage=stage)
    params, gradients = reported_zero_bytes(MODEL_FLAGS[name], strategy, optimizer, mixed)
    assert planned["param_bytes_per_device"] == params
    assert planned["gradient_bytes_per_device"] == gradients


def reported_zero_bytes(flags, strategy, optimizer, mixed):
    """What the run reports: (param_bytes_per_device, gradient_bytes_per_device)."""
    parallel, model, opt = built_run(flags, strategy, optimizer, mixed)
    return parallel.param_bytes_per_device(model, opt), parallel.gradient_bytes_per_device(model)
