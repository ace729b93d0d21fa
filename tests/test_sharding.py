"""Sharding the real digits TFRecord files across workers.

Each worker's input pipeline is what `dataset_fn(InputContext(P, p, ...))`
builds in that worker's process; here the P pipelines are built side by side.
"""

import collections

import pytest
import tensorflow as tf

from tfdist import data
from tfdist.config import DataConfig
from tfdist.data import pipeline

GLOBAL_BATCH = 32
SEED = 11


def digits():
    return data.get_source(DataConfig(name="digits"))


def key(x, y):
    return (x.numpy().tobytes(), int(y))


def worker_epoch(source, workers, worker, config=DataConfig()):
    """The examples one worker reads during one epoch (one replica per worker)."""
    fn = pipeline.train_dataset_fn(source, GLOBAL_BATCH, SEED, config)
    batches = fn(tf.distribute.InputContext(workers, worker, workers))
    steps = source.info.size("train") // GLOBAL_BATCH
    return [key(x, y) for xb, yb in batches.take(steps) for x, y in zip(xb, yb)]


def test_two_workers_see_every_digit_exactly_once_per_epoch():
    source = digits()
    seen = collections.Counter(worker_epoch(source, 2, 0) + worker_epoch(source, 2, 1))
    expected = collections.Counter(key(x, y) for x, y in source.examples("train"))
    assert sum(seen.values()) == 1440 and seen == expected


def test_each_worker_reads_only_its_own_files():
    source = digits()
    files = source.files("train")
    assert len(files) == 4
    for worker in range(2):
        own = collections.Counter(key(x, y) for x, y in source.read_files(files[worker::2]))
        assert collections.Counter(worker_epoch(source, 2, worker)) == own


def global_steps(source, workers, steps, config=DataConfig()):
    fn = pipeline.train_dataset_fn(source, GLOBAL_BATCH, SEED, config)
    streams = [iter(fn(tf.distribute.InputContext(workers, w, workers))) for w in range(workers)]
    return [sorted(key(x, y) for s in streams for x, y in zip(*next(s))) for _ in range(steps)]


@pytest.mark.parametrize("workers,sharding", [(2, "auto"), (4, "auto"), (2, "data")])
def test_global_steps_match_one_worker(workers, sharding):
    source = digits()
    steps = 50  # past the first epoch boundary (45 steps)
    config = DataConfig(sharding=sharding)
    assert global_steps(source, workers, steps, config) == global_steps(source, 1, steps)


def test_file_sharding_that_cannot_divide_is_an_error():
    from tfdist.errors import UsageError
    with pytest.raises(UsageError, match="--sharding=file needs the 4 training files"):
        worker_epoch(digits(), 3, 0, DataConfig(sharding="file"))


@pytest.mark.parametrize("workers,sharding", [(1, "auto"), (2, "auto"), (2, "data")])
def test_resumed_digits_steps_continue_the_same_stream(workers, sharding):
    source = digits()
    config = DataConfig(sharding=sharding)
    whole = global_steps(source, workers, 60, config)
    fn = pipeline.train_dataset_fn(source, GLOBAL_BATCH, SEED, config, start_step=47)
    streams = [iter(fn(tf.distribute.InputContext(workers, w, workers))) for w in range(workers)]
    resumed = [sorted(key(x, y) for s in streams for x, y in zip(*next(s))) for _ in range(13)]
    assert resumed == whole[47:]
