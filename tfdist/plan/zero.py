"""Sharded data parallelism (ZeRO, Rajbhandari et al. 2020) in the planner's terms.

`--zero_stage=N` is run by `--strategy=dtensor`, over the mesh's `batch` axis (the
data-parallel devices). Each variable has a *zero layout*: its tensor-parallel spec with
`batch` added on the first dimension the spec leaves unsharded and the batch axis size
divides; a variable with no such dimension stays as it is (replicated over `batch`). The
planner cuts with the run's own rule (tfdist/parallel/dtensor/zero.py: zero_spec), as it
resolves layouts with the run's LayoutMap. Which parts of the state take the zero layout
(the others keep the tensor-parallel one):

    stage 1  the optimizer's slots (Adam's m and v, momentum)
    stage 2  + the gradients the update reads (reduce-scattered instead of all-reduced)
    stage 3  + the parameters

Optimizer scalars (iterations, learning rate) stay replicated at every stage.

`model_state_bytes` is the paper's formula (its Figure 1), with the bytes per parameter
as arguments, because the paper's accounting is not what tfdist allocates: the paper's
mixed-precision Adam keeps fp16 parameters and gradients and an fp32 master copy
(PAPER_BYTES); Keras keeps float32 variables and gradients under a mixed policy, with no
master copy (TFDIST_ADAM_BYTES). docs/planner.md shows both tables.
"""

from tfdist import config as cfg
from tfdist.errors import require

STAGES = cfg.ZERO_STAGES
# The parts of a variable's state that take the zero layout, by stage.
SHARDED_PARTS = {0: (), 1: ("optimizer",), 2: ("optimizer", "gradients"),
                 3: ("optimizer", "gradients", "params")}
# The paper's mixed-precision Adam, bytes per parameter: fp16 weights, fp16 gradients,
# K = 12 for the fp32 master weights, momentum and variance.
PAPER_BYTES = dict(param_bytes=2, grad_bytes=2, optimizer_bytes=12)
# What tfdist allocates under Keras (any dtype policy): float32 weights and gradients,
# Adam's two float32 slots, no master copy (the variables already are float32).
TFDIST_ADAM_BYTES = dict(param_bytes=4, grad_bytes=4, optimizer_bytes=8)


validate_stage = cfg.validate_zero_stage


def shards(stage: int, part: str) -> bool:
    """Whether `part` (params, optimizer, gradients) takes the zero layout at `stage`."""
    return part in SHARDED_PARTS[validate_stage(stage)]


def model_state_bytes(num_params: float, devices: int, stage: int, param_bytes: float,
                      grad_bytes: float, optimizer_bytes: float) -> float:
    """Model-state bytes per device under ZeRO stage `stage` (the paper's Figure 1 formula).

    Stage 0 (p+g+K)Ψ; stage 1 (p+g)Ψ + KΨ/N; stage 2 pΨ + (g+K)Ψ/N; stage 3 (p+g+K)Ψ/N,
    for Ψ parameters over N data-parallel devices with p, g and K bytes per parameter of
    weights, gradients and optimizer state. Only the model states: no activations, no
    buffers, no fragmentation.
    """
    require(num_params > 0 and devices >= 1,
            f"model_state_bytes needs num_params > 0 and devices >= 1, got "
            f"{num_params} and {devices}.")
    sharded = SHARDED_PARTS[validate_stage(stage)]
    per_param = {"params": param_bytes, "gradients": grad_bytes, "optimizer": optimizer_bytes}
    return sum(num_params * size / (devices if part in sharded else 1)
               for part, size in per_param.items())
