"""Pipeline parallelism: layer stages on their own devices, GPipe micro-batches,
optionally combined with data-parallel replicas.

    --strategy=pipeline --pipeline_stages=S --microbatches=M [--pipeline_split=a,b]
        [--pipeline_schedule=gpipe|1f1b|interleaved_1f1b|zero_bubble] [--virtual_stages=V]

With D devices, S stages and R = D / S replicas, replica r runs stage k on
device r*S + k (interleaved_1f1b: the model is cut into S*V chunks and chunk c
runs on device r*S + c mod S). Each global step takes R consecutive per-replica
batches (one input pipeline), splits each into M micro-batches and runs the
schedule (schedule.py); a step is mathematically the full-batch step of one device.
Modules: parallelism.py (the mode on local devices), cluster.py (stages across
workers), partition.py (where to cut), placement.py (what lives where),
copying.py (the user's model as built, in every replica), schedule.py (the step);
tfdist/train/split_state.py finds the layers a split batch cannot hold.
"""

from tfdist import devices as devices_lib
from tfdist.errors import require
from tfdist.parallel.pipeline.parallelism import PipelineParallelism, validate_layout


def build_pipeline(config) -> PipelineParallelism:
    require(config.trainer == "loop",
            f"--trainer={config.trainer} is not supported by --strategy=pipeline; use "
            f"--trainer=loop (Keras fit cannot drive per-stage devices and optimizers).")
    require(config.mixed_precision != "mixed_float16",
            "--mixed_precision=mixed_float16 is not supported by --strategy=pipeline: each "
            "stage optimizer would keep its own dynamic loss scale. Use mixed_bfloat16.")
    from tfdist import parallel as parallel_lib
    if parallel_lib.spanned_cluster("pipeline") is not None:   # stages in several processes
        from tfdist.parallel.multi_worker import cluster_from_environment
        from tfdist.parallel.pipeline import cluster as cross_worker
        return cross_worker.build_cross_worker_pipeline(config, cluster_from_environment())
    local = devices_lib.configure(config.simulate_devices, config.num_gpus)
    validate_layout(len(local), config.pipeline_stages, local)
    # --accumulation_steps=K: K times the micro-batches, still one update per batch.
    return PipelineParallelism(local, config.pipeline_stages,
                               config.microbatches * config.accumulation_steps,
                               config.pipeline_split, config.pipeline_schedule,
                               config.virtual_stages)

