"""The one input pipeline every source goes through: shuffle, shard, batch, prefetch.

The order of operations is the equivalence guarantee. The seeded, stateless
shuffle runs on the whole source *before* sharding, so every input pipeline (one per worker)
computes the same global order. Pipeline p of P then keeps elements p, p+P, ...
and batches them per replica. Global step t therefore trains on exactly the
global-order elements [t*G, (t+1)*G) for a global batch G, however those are
split over replicas and workers; only the summation order differs.

Policies, explicitly:
- sharding: data-level (`Dataset.shard` on elements), done here, so tf.data's
  auto-shard is OFF (it would shard a second time).
- remainder: training repeats forever and batches with drop_remainder=True, so
  every step is a full global batch (batches may span epochs). Evaluation pads
  the split up to a whole number of global batches with weight-0 examples, so
  every example is counted exactly once and no replica gets a ragged batch.
- prefetch: DataConfig.prefetch batches (-1: tf.data AUTOTUNE).
"""

import math

import tensorflow as tf

MAX_SHUFFLE_BUFFER = 100_000  # whole-split permutations up to this many examples


def shuffle_buffer_size(source, config) -> int:
    """Examples permuted together: --shuffle_buffer, or the whole split (capped)."""
    if config.shuffle_buffer:
        return config.shuffle_buffer
    return min(source.info.size("train"), MAX_SHUFFLE_BUFFER)


def _finish(dataset, input_context, global_batch_size, config):
    """Shards by input pipeline, batches per replica, sets options, prefetches."""
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    per_replica = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = dataset.batch(per_replica, drop_remainder=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.deterministic = True
    dataset = dataset.with_options(options)
    return dataset.prefetch(tf.data.AUTOTUNE if config.prefetch < 0 else config.prefetch)


def shuffled_epoch(examples, block_size: int, seed: int, epoch):
    """One epoch of `examples`, permuted within blocks of `block_size` (the whole
    split by default), as a pure function of (seed, epoch, block).

    Stateless on purpose: a Dataset.shuffle seed-generator advances with every new
    iterator, so a restart, or Keras fit re-creating its iterator, would see another
    order. This replays the same stream from any fresh iterator, on any worker.
    """
    def permute(block_index, block):
        x, y = block
        epoch_block = tf.cast(epoch, tf.int64) * 1_000_003 + block_index
        order = tf.random.experimental.stateless_shuffle(
            tf.range(tf.shape(y)[0]), seed=tf.stack([tf.constant(seed, tf.int64), epoch_block]))
        return tf.gather(x, order), tf.gather(y, order)

    return examples.batch(block_size).enumerate().map(permute).unbatch()


def train_dataset_fn(source, global_batch_size: int, seed: int, config):
    """Returns dataset_fn(input_context) -> per-replica batches of (x, y), forever.

    Epoch e is the training split permuted by shuffled_epoch(seed, e); epochs follow
    each other without a gap, so a global batch may span two epochs.
    """
    block_size = shuffle_buffer_size(source, config)

    def dataset_fn(input_context):
        examples = source.examples("train")
        epochs = tf.data.Dataset.range(tf.int64.max).flat_map(
            lambda epoch: shuffled_epoch(examples, block_size, seed, epoch))
        return _finish(epochs, input_context, global_batch_size, config)

    return dataset_fn


def eval_steps(source, global_batch_size: int) -> int:
    return math.ceil(source.info.size("test") / global_batch_size)


def eval_dataset_fn(source, global_batch_size: int, config):
    """Returns dataset_fn(input_context) -> per-replica batches of (x, y, weight).

    The test split is padded with weight-0 copies of its first example up to
    eval_steps * global_batch_size examples, so sums over weights are exact.
    """
    size = source.info.size("test")
    padding = eval_steps(source, global_batch_size) * global_batch_size - size

    def dataset_fn(input_context):
        examples = source.examples("test")
        weighted = examples.map(lambda x, y: (x, y, tf.constant(1.0)))
        pad = examples.take(1).map(lambda x, y: (x, y, tf.constant(0.0))).repeat(padding)
        return _finish(weighted.concatenate(pad), input_context, global_batch_size, config)

    return dataset_fn
