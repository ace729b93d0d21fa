"""The input pipeline's guarantee: same seed and global batch, same examples per step.

Checked on a small real tf.data source whose labels are example ids, under real
MirroredStrategy replicas and under simulated worker input contexts.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfdist.config import DataConfig
from benchmarks.input_pipeline import element_by_element
from tfdist.data import base, pipeline

NUM_EXAMPLES = 50
GLOBAL_BATCH = 8


class IdSource(base.DatasetSource):
    """Examples whose label is their id, in id order."""

    info = base.DatasetInfo("ids", base.CLASSIFICATION, (1,), "float32", NUM_EXAMPLES,
                            (("train", NUM_EXAMPLES), ("test", 21)))

    def examples(self, split):
        n = self.info.size(split)
        ids = tf.range(n, dtype=tf.int32)
        return tf.data.Dataset.from_tensor_slices((tf.cast(ids[:, None], tf.float32), ids))


def steps_under_strategy(devices, steps, seed=3):
    strategy = tf.distribute.MirroredStrategy(devices)
    fn = pipeline.train_dataset_fn(IdSource(), GLOBAL_BATCH, seed, DataConfig())
    iterator = iter(strategy.distribute_datasets_from_function(fn))
    out = []
    for _ in range(steps):
        _, labels = next(iterator)
        parts = strategy.experimental_local_results(labels)
        out.append(sorted(np.concatenate([p.numpy() for p in parts]).tolist()))
    return out


def steps_of_workers(num_workers, replicas_per_worker, steps, seed=3):
    """What each global step holds when num_workers input pipelines feed the job."""
    fn = pipeline.train_dataset_fn(IdSource(), GLOBAL_BATCH, seed, DataConfig())
    replicas = num_workers * replicas_per_worker
    streams = [iter(fn(tf.distribute.InputContext(num_workers, w, replicas)))
               for w in range(num_workers)]
    out = []
    for _ in range(steps):
        ids = [next(s)[1].numpy() for s in streams for _ in range(replicas_per_worker)]
        out.append(sorted(np.concatenate(ids).tolist()))
    return out


def test_global_steps_identical_for_1_2_4_replicas():
    one = steps_under_strategy(["/cpu:0"], steps=15)
    assert steps_under_strategy(["/cpu:0", "/cpu:1"], steps=15) == one
    assert steps_under_strategy([f"/cpu:{i}" for i in range(4)], steps=15) == one


@pytest.mark.parametrize("workers,replicas_per_worker", [(2, 1), (2, 2), (4, 1)])
def test_global_steps_identical_across_workers(workers, replicas_per_worker):
    single = steps_of_workers(1, 1, steps=15)
    assert steps_of_workers(workers, replicas_per_worker, steps=15) == single


def test_every_epoch_is_a_permutation_and_epochs_differ():
    fn = pipeline.train_dataset_fn(IdSource(), GLOBAL_BATCH, 3, DataConfig())
    batches = fn(tf.distribute.InputContext()).take(13)  # 104 examples: two epochs and a bit
    stream = [i for batch in batches for i in batch[1].numpy().tolist()]
    first, second = stream[:NUM_EXAMPLES], stream[NUM_EXAMPLES:2 * NUM_EXAMPLES]
    assert sorted(first) == list(range(NUM_EXAMPLES)) == sorted(second)
    assert first != second and first != sorted(first)


def test_order_is_a_function_of_the_seed_only():
    fn = pipeline.train_dataset_fn(IdSource(), GLOBAL_BATCH, 5, DataConfig())
    dataset = fn(tf.distribute.InputContext())
    first = [b[1].numpy().tolist() for b in dataset.take(10)]
    again = [b[1].numpy().tolist() for b in dataset.take(10)]  # a fresh iterator
    assert first == again
    other_seed = pipeline.train_dataset_fn(IdSource(), GLOBAL_BATCH, 6, DataConfig())
    assert [b[1].numpy().tolist() for b in other_seed(tf.distribute.InputContext()).take(10)] != first


def test_eval_counts_every_example_once_with_padding():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    fn = pipeline.eval_dataset_fn(IdSource(), GLOBAL_BATCH, DataConfig())
    iterator = iter(strategy.distribute_datasets_from_function(fn))
    seen = []
    for _ in range(pipeline.eval_steps(IdSource(), GLOBAL_BATCH)):
        _, ids, weights = next(iterator)
        for i, w in zip(strategy.experimental_local_results(ids),
                        strategy.experimental_local_results(weights)):
            seen += [int(v) for v, keep in zip(i.numpy(), w.numpy()) if keep == 1.0]
    assert sorted(seen) == list(range(21))


@pytest.mark.parametrize("start_step", [1, 6, 7, 13])
def test_a_resumed_stream_continues_where_it_stopped(start_step):
    fn = pipeline.train_dataset_fn(IdSource(), GLOBAL_BATCH, 3, DataConfig())
    whole = [b[1].numpy().tolist() for b in fn(tf.distribute.InputContext()).take(20)]
    resumed_fn = pipeline.train_dataset_fn(IdSource(), GLOBAL_BATCH, 3, DataConfig(),
                                           start_step=start_step)
    resumed = [b[1].numpy().tolist()
               for b in resumed_fn(tf.distribute.InputContext()).take(20 - start_step)]
    assert resumed == whole[start_step:]


@pytest.mark.parametrize("workers,replicas,start_step,shuffle_buffer", [
    (1, 1, 0, 0), (2, 2, 0, 0), (2, 4, 5, 0), (1, 2, 13, 16), (4, 4, 3, 7)])
def test_vectorised_stream_equals_the_element_by_element_stream(workers, replicas, start_step,
                                                                shuffle_buffer):
    config = DataConfig(shuffle_buffer=shuffle_buffer)  # 16 and 7 do not divide the 50 examples
    for worker in range(workers):
        context = tf.distribute.InputContext(workers, worker, replicas)
        fast = pipeline.train_dataset_fn(IdSource(), GLOBAL_BATCH, 3, config, start_step)(context)
        slow = element_by_element(IdSource(), GLOBAL_BATCH, 3, config, context, start_step)
        for (fast_x, fast_y), (slow_x, slow_y) in zip(fast.take(40), slow.take(40)):
            assert fast_y.numpy().tolist() == slow_y.numpy().tolist()
            assert np.array_equal(fast_x.numpy(), slow_x.numpy())


@pytest.mark.parametrize("cache", [True, False])
def test_vectorised_stream_is_endless_with_or_without_the_cache(cache):
    blocks = pipeline.permuted_blocks_forever(IdSource(), NUM_EXAMPLES, 3, 0, cache)
    batches = pipeline.sharded_batches(blocks, tf.distribute.InputContext(), GLOBAL_BATCH)
    assert batches.cardinality() == tf.data.INFINITE_CARDINALITY
    stream = [i for _, ids in batches.take(25) for i in ids.numpy().tolist()]  # 4 epochs
    epochs = [stream[e * NUM_EXAMPLES:(e + 1) * NUM_EXAMPLES] for e in range(4)]
    assert all(sorted(epoch) == list(range(NUM_EXAMPLES)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 4
