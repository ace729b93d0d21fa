"""Parallelism modes: one registry, one interface (`base.Parallelism`).

The training loop only talks to a Parallelism; adding a mode means adding a
module and one line here (two if the mode spans several processes).
"""

import os
from typing import Mapping, Optional

from tfdist import cluster
from tfdist.errors import UsageError
from tfdist.registry import Registry

MODES = Registry("strategy", {
    "default": "tfdist.parallel.strategy:build_default",
    "one_device": "tfdist.parallel.strategy:build_one_device",
    "mirrored": "tfdist.parallel.strategy:build_mirrored",
    "multi_worker_mirrored": "tfdist.parallel.multi_worker:build_multi_worker",
    "dtensor": "tfdist.parallel.dtensor:build_dtensor",
    "pipeline": "tfdist.parallel.pipeline:build_pipeline",
})

# The modes whose one run spans several processes, each with the cluster variables
# it spans (tfdist.cluster.clusters_in_environment names them so). Every other mode
# is one process holding a whole model: started once per worker of a cluster, it
# would train one independent copy per worker, and each would log a complete run.
SPANS_WORKERS = {
    "multi_worker_mirrored": ("TF_CONFIG", "SLURM_STEP_NUM_TASKS",
                              *(size for size, _ in cluster.MPI_WORLD_VARIABLES)),
    "dtensor": ("DTENSOR_JOBS",),
    "pipeline": ("TF_CONFIG", "SLURM_STEP_NUM_TASKS"),   # stages in different workers
}
MODES_THAT_SPAN_WORKERS = (
    "multi_worker_mirrored (over TF_CONFIG or Slurm's srun; `tfdist launch --workers N`; "
    "MPI's mpirun with --collective=mpi), pipeline with its stages in different workers, and "
    "dtensor with DTENSOR_* clients (`tfdist launch --workers N --dtensor`)")


# The modes that run --zero_stage above 0 (sharded data parallelism over a mesh's batch
# axis: tfdist/parallel/dtensor/zero.py). tf.distribute's modes keep one whole copy of every
# variable per replica (MirroredVariable), which no option of theirs shards.
ZERO_MODES = ("dtensor",)


def check_zero_stage(strategy: str, zero_stage: int) -> None:
    """UsageError for a --zero_stage the mode cannot run, before any device is set up."""
    if zero_stage == 0 or strategy in ZERO_MODES:
        return
    instead = {
        "mirrored": "--strategy=dtensor --mesh=batch=N on the same N devices (the same "
                    "numbers as mirrored: data parallel over the mesh's batch axis)",
        "multi_worker_mirrored": "--strategy=dtensor over the same workers (`tfdist launch "
                                 "--workers N --dtensor -- ... --mesh=batch=M`)",
    }.get(strategy, "--strategy=dtensor with a batch axis of 2 or more devices")
    raise UsageError(
        f"--zero_stage={zero_stage} is not supported by --strategy={strategy}: sharded data "
        f"parallelism runs in {', '.join(ZERO_MODES)} (it shards variables over the mesh's "
        f"batch axis), while {strategy} keeps a whole copy of every variable on each "
        f"replica. Use {instead}, or --zero_stage=0.")


def build_parallelism(config):
    """Returns the Parallelism for a RunConfig (devices must be configured first)."""
    check_zero_stage(config.strategy, config.zero_stage)
    parallel = MODES.get(config.strategy)(config)
    parallel.accumulation_steps = config.accumulation_steps   # train/accumulation.py
    return parallel


def spanned_cluster(strategy: str, env: Optional[Mapping[str, str]] = None):
    """The cluster a run of `strategy` spans here, or None for a run of one process.

    Raises UsageError when the environment describes several workers that
    `strategy` cannot span. Pure Python: entry points call it before TensorFlow
    is imported, so the mistake costs milliseconds, not a run per worker.
    """
    env = os.environ if env is None else env
    several = [found for found in cluster.clusters_in_environment(env) if found.num_workers > 1]
    spanned = [found for found in several if found.variable in SPANS_WORKERS.get(strategy, ())]
    if several and not spanned:
        raise UsageError(_copies_message(strategy, several[0]))
    return spanned[0] if spanned else None


def writes_model_dir(strategy: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """True for the process that writes --model_dir: the chief (rank 0) of the cluster
    the run spans, or the only process (the others write scratch dirs, see
    Parallelism.write_dir)."""
    spanned = spanned_cluster(strategy, env)
    return spanned is None or spanned.rank == 0


def _copies_message(strategy: str, found) -> str:
    spans = SPANS_WORKERS.get(strategy)
    alone = f" without {' or '.join(spans)}" if spans else ""
    return (f"--strategy={strategy}{alone} runs in one process, but {found.variable} describes a cluster of {found.num_workers} workers "
            f"(this process is rank {found.rank}): every worker would train its own independent "
            f"full copy of the model. The modes that span workers are {MODES_THAT_SPAN_WORKERS}. "
            f"Use one of them, or start one process without {found.variable}.")
