"""The input pipeline's CPU cost per batch, vectorised against element by element.

    python -m benchmarks --suite=input --steps=300 --trials=3

The throughput benchmark's data (`synthetic`, 16384 x 784 floats, global batch
512) as worker 0 of 2 sees it, with one thread (the suite sets TF's limits): the
per-batch time of tfdist's pipeline (permuted blocks, `rebatch`, a gather per
worker) against the element-by-element stream it replaced, which yields the
same batches (tests/test_pipeline.py checks that with this very function).
"""

import statistics
import time

import tensorflow as tf

from tfdist import config as cfg
from tfdist.data import pipeline
from tfdist.data.synthetic import SyntheticSource


WARMUP_BATCHES = 40   # past the first blocks' generation, which the cache then keeps


def element_by_element(source, global_batch, seed, config, input_context, start_step=0):
    """The reference stream: shuffled epochs one element at a time, skipped to the
    start step, sharded, batched per replica."""
    examples = source.examples("train")
    block = pipeline.shuffle_buffer_size(source, config)
    epoch, offset = pipeline.resume_point(start_step * global_batch, source.info.size("train"))
    stream = pipeline.forever(lambda e: pipeline.shuffled_epoch(examples, block, seed, e), epoch)
    stream = stream.skip(offset).shard(input_context.num_input_pipelines,
                                       input_context.input_pipeline_id)
    return stream.batch(input_context.get_per_replica_batch_size(global_batch), True)


def ms_per_batch(dataset, batches: int) -> float:
    iterator = iter(dataset)
    for _ in range(WARMUP_BATCHES):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return (time.perf_counter() - start) / batches * 1e3


def compare(batches: int = 300, trials: int = 3):
    source = SyntheticSource((784,), 10, 16384)
    config, context = cfg.DataConfig(name="synthetic"), tf.distribute.InputContext(2, 0, 2)
    contenders = {
        "vectorised (tfdist)": lambda: pipeline.train_dataset_fn(source, 512, 0, config)(context),
        "element by element": lambda: element_by_element(source, 512, 0, config, context),
    }
    times = {name: [] for name in contenders}
    for _ in range(trials):
        for name, make in contenders.items():
            times[name].append(ms_per_batch(make(), batches))
    return [{"pipeline": name, "ms_per_batch_median": round(statistics.median(t), 3),
             "trials": " ".join(f"{x:.2f}" for x in t)} for name, t in times.items()]
