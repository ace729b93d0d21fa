"""Parallelism modes: one registry, one interface (`base.Parallelism`).

The training loop only talks to a Parallelism; adding a mode means adding a
module and one line here.
"""

from tfdist.registry import Registry

MODES = Registry("strategy", {
    "default": "tfdist.parallel.strategy:build_default",
    "one_device": "tfdist.parallel.strategy:build_one_device",
    "mirrored": "tfdist.parallel.strategy:build_mirrored",
    "multi_worker_mirrored": "tfdist.parallel.multi_worker:build_multi_worker",
    "dtensor": "tfdist.parallel.dtensor:build_dtensor",
    "pipeline": "tfdist.parallel.pipeline:build_pipeline",
})


def build_parallelism(config):
    """Returns the Parallelism for a RunConfig (devices must be configured first)."""
    return MODES.get(config.strategy)(config)
