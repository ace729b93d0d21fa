"""The one input pipeline every source goes through: shuffle, shard, batch, prefetch.

The order of operations is the equivalence guarantee. The seeded, stateless
shuffle runs on the whole source *before* sharding, so every input pipeline (one per worker)
computes the same global order. Pipeline p of P then keeps elements p, p+P, ...
and batches them per replica. Global step t therefore trains on exactly the
global-order elements [t*G, (t+1)*G) for a global batch G, however those are
split over replicas and workers; only the summation order differs.

Policies, explicitly:
- sharding: for a file-backed source (TFRecord shards), file-level when the
  number of input pipelines divides the number of files (each worker opens only
  its files), else data-level; for other sources data-level. The order is built
  so both give the same stream (see file_backed_stream). Sharding is done here,
  so tf.data's auto-shard is OFF (it would shard a second time). Logged once.
- remainder: training repeats forever and batches with drop_remainder=True, so
  every step is a full global batch (batches may span epochs). Evaluation pads
  the split up to a whole number of global batches with weight-0 examples, so
  every example is counted exactly once and no replica gets a ragged batch.
- prefetch: DataConfig.prefetch batches (-1: tf.data AUTOTUNE).
- vectorised: a source without files goes through the pipeline as whole permuted
  blocks, never one example at a time: `rebatch` cuts global batches out of the
  blocks and each input pipeline gathers its rows, the same stream as shard-then-
  batch at a tenth of the cost (0.24 against 3.68 ms a batch of 256 x 784 on
  one thread: `python -m benchmarks --suite=input`). The blocks are
  generated or decoded once and cached when the split is at most CACHE_LIMIT_BYTES.
- structure: an element is (features, label) or (features, label, sample_weight),
  where features and label may be any tf.nest structure (a dict for a model with
  named inputs, a tuple, a tensor). Every step below maps the whole structure
  with tf.nest, so the row order of every component is the same permutation.
"""

import logging
import math

import tensorflow as tf

from tfdist.errors import UsageError

log = logging.getLogger("tfdist")

MAX_SHUFFLE_BUFFER = 100_000  # whole-split permutations up to this many examples
CACHE_LIMIT_BYTES = 1 << 30   # in-memory splits up to this size are generated once


def shuffle_buffer_size(source, config) -> int:
    """Examples permuted together: --shuffle_buffer, or the whole split (capped)."""
    if config.shuffle_buffer:
        return config.shuffle_buffer
    return min(source.info.size("train"), MAX_SHUFFLE_BUFFER)


def num_rows(element):
    """Examples in a batched element: the leading size of its first component
    (every component has the same one, tf.data batches them together)."""
    return tf.shape(tf.nest.flatten(element)[0])[0]


def gather_rows(element, rows):
    """`element` (any structure of batched tensors) restricted to `rows`, in that order."""
    return tf.nest.map_structure(lambda tensor: tf.gather(tensor, rows), element)


def drop_rows(element, count):
    """`element` without its first `count` rows."""
    return tf.nest.map_structure(lambda tensor: tensor[count:], element)


def _finish(dataset, input_context, global_batch_size, config, sharded=False):
    """Shards by input pipeline (unless done), batches per replica, sets options, prefetches."""
    if not sharded:
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    per_replica = input_context.get_per_replica_batch_size(global_batch_size)
    return _with_options(dataset.batch(per_replica, drop_remainder=True), config)


def _with_options(dataset, config):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.deterministic = True
    dataset = dataset.with_options(options)
    return dataset.prefetch(tf.data.AUTOTUNE if config.prefetch < 0 else config.prefetch)


def shuffled_epoch(examples, block_size: int, seed: int, epoch, stream: int = 0):
    """One epoch of `examples`, permuted within blocks of `block_size` (the whole
    split by default), as a pure function of (seed, stream, epoch, block).

    Stateless on purpose: a Dataset.shuffle seed-generator advances with every new
    iterator, so a restart, or Keras fit re-creating its iterator, would see another
    order. This replays the same stream from any fresh iterator, on any worker.
    """
    def permute(block_index, block):
        return permuted_block(block, seed, stream, epoch, block_index)

    return examples.batch(block_size).enumerate().map(permute).unbatch()


def permuted_block(block, seed: int, stream, epoch, block_index):
    """Block `block_index` of `epoch`, in the order drawn from (seed, stream, epoch, block).

    `block` is a tuple (x, y) or (x, y, w) of structures; one permutation orders them all.
    """
    epoch_block = tf.cast(epoch, tf.int64) * 1_000_003 + block_index
    key = tf.stack([tf.constant(seed * 100_003 + stream, tf.int64), epoch_block])
    order = tf.random.experimental.stateless_shuffle(tf.range(num_rows(block)), seed=key)
    return gather_rows(block, order)


def forever(epoch_fn, start_epoch: int = 0):
    """Epochs start_epoch, start_epoch + 1, ... back to back (a global batch may span two).

    Declared infinite: flat_map hides the length, and on a dataset of unknown length
    MultiWorkerMirroredStrategy's iterator runs a cross-worker all-reduce at every
    step to agree that every worker still has data (partial-batch handling), a
    gRPC round trip per step that an endless stream never needs.
    """
    stream = tf.data.Dataset.range(start_epoch, tf.int64.max).flat_map(epoch_fn)
    return stream.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))


def permuted_blocks_forever(source, block_size: int, seed: int, consumed: int, cache: bool):
    """The whole global order (epochs of shuffled_epoch, back to back) as permuted
    blocks, forever, starting after `consumed` elements: the vectorised stream.

    Block k of the repeated split is block k % n of epoch k // n; the first
    epoch's blocks lose the elements already consumed (they may become empty).
    """
    size = source.info.size("train")
    num_blocks = math.ceil(size / block_size)
    start_epoch, offset = resume_point(consumed, size)
    blocks = source.examples("train").batch(block_size)
    blocks = blocks.cache() if cache else blocks

    def block_of_the_stream(k, block):
        index = k % num_blocks
        permuted = permuted_block(block, seed, 0, start_epoch + k // num_blocks, index)
        length = tf.cast(num_rows(permuted), tf.int64)
        already_consumed = tf.where(k < num_blocks,
                                    tf.clip_by_value(offset - index * block_size, 0, length), 0)
        return drop_rows(permuted, already_consumed)

    return blocks.repeat().enumerate().map(block_of_the_stream)


def sharded_batches(blocks, input_context, global_batch_size: int):
    """Per-replica batches of this input pipeline from a stream of blocks: global
    batch t is elements [t*G, (t+1)*G) of the stream; pipeline p of P keeps its
    rows p, p+P, ... and splits them into per-replica batches in order (exactly
    what shard(P, p).batch(per_replica) makes of the unbatched stream)."""
    pipelines, index = input_context.num_input_pipelines, input_context.input_pipeline_id
    batches = blocks.rebatch(global_batch_size, drop_remainder=True)
    if pipelines > 1:
        mine = tf.range(index, global_batch_size, pipelines)
        batches = batches.map(lambda *element: gather_rows(element, mine))
    per_replica = input_context.get_per_replica_batch_size(global_batch_size)
    batches = batches.rebatch(per_replica, drop_remainder=True)
    return batches.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))


def example_bytes(element_spec):
    """Bytes of one example of this (unbatched) spec, or None when a size is unknown."""
    total = 0
    for spec in tf.nest.flatten(element_spec):
        if not isinstance(spec, tf.TensorSpec) or not spec.shape.is_fully_defined():
            return None
        total += spec.shape.num_elements() * spec.dtype.size
    return total


def fits_cache(source) -> bool:
    """Whether the training split fits the cache (its size known from the element spec)."""
    one_example = example_bytes(source.examples("train").element_spec)
    return one_example is not None and one_example * source.info.size("train") <= CACHE_LIMIT_BYTES


def resume_point(consumed: int, epoch_length: int):
    """(epoch, offset) of the element after `consumed` elements of a stream of epochs."""
    return consumed // epoch_length, consumed % epoch_length


def source_files(source):
    """The training split's shard files, or None when the source is not file-backed."""
    files = getattr(source, "files", None)
    return files("train") if files else None


def round_robin_files(source, files, file_ids, per_file: int, seed: int, epoch):
    """One epoch over `files`: each file permuted on its own (stream = its global
    id), trimmed to `per_file` examples, then taken one example per file in turn."""
    streams = [shuffled_epoch(source.read_files([path]).take(per_file), per_file,
                              seed, epoch, stream=file_id)
               for path, file_id in zip(files, file_ids)]
    order = tf.data.Dataset.range(len(streams)).repeat(per_file)
    return tf.data.Dataset.choose_from_datasets(streams, order)


def file_lengths(source, files):
    return [int(source.read_files([path]).cardinality()) for path in files]


def file_backed_stream(source, files, seed, input_context, config, consumed: int = 0):
    """This input pipeline's share of the global stream of a file-backed source.

    The global order is a round-robin over all F files (each permuted per epoch).
    With P pipelines and P dividing F, pipeline p reads only files p, p+P, ...
    round-robin, which yields exactly elements p, p+P, ... of the global order
    (file-level sharding). Otherwise every pipeline reads all files and keeps
    every P-th element (data-level); the streams are the same either way.
    """
    pipelines, index = input_context.num_input_pipelines, input_context.input_pipeline_id
    lengths = file_lengths(source, files)
    per_file = min(lengths)  # equal files per round; longer files lose their tail each epoch
    file_level = config.sharding != "data" and len(files) % pipelines == 0
    if config.sharding == "file" and not file_level:
        raise UsageError(f"--sharding=file needs the {len(files)} training files to divide "
                         f"evenly over {pipelines} input pipelines; use --sharding=auto.")
    log_sharding_once(file_level, len(files), pipelines, lengths)
    ids = list(range(len(files)))
    epoch, offset = resume_point(consumed, per_file * len(files))  # in global elements
    if file_level:
        mine = ids[index::pipelines]
        return forever(lambda e: round_robin_files(
            source, [files[i] for i in mine], mine, per_file, seed, e),
            epoch).skip(offset // pipelines), True
    everything = forever(lambda e: round_robin_files(source, files, ids, per_file, seed, e), epoch)
    return everything.skip(offset).shard(pipelines, index), True


_logged = set()


def log_sharding_once(file_level: bool, num_files: int, pipelines: int, lengths) -> None:
    key = (file_level, num_files, pipelines)
    if key in _logged:
        return
    _logged.add(key)
    if file_level:
        log.info("input: file-level sharding, each of %d input pipeline(s) reads %d of %d "
                 "TFRecord files", pipelines, num_files // pipelines, num_files)
    else:
        log.info("input: data-level sharding over %d files (%d files do not divide over %d "
                 "input pipelines)", num_files, num_files, pipelines)
    if len(set(lengths)) > 1:
        log.info("input: files hold %s examples; each epoch uses the first %d of each "
                 "(after its shuffle) to keep pipelines in step", lengths, min(lengths))


def train_dataset_fn(source, global_batch_size: int, seed: int, config, start_step: int = 0):
    """Returns dataset_fn(input_context) -> per-replica batches of (x, y), or (x, y, w)
    for a source with sample weights, forever, starting at global step `start_step`
    (a resumed run continues the same stream).

    A file-backed source uses file_backed_stream, element by element; any other
    source is permuted whole per epoch (as shuffled_epoch would) and cut into
    batches as blocks (permuted_blocks_forever, sharded_batches).
    """
    block_size = shuffle_buffer_size(source, config)
    files = source_files(source)
    consumed = start_step * global_batch_size  # global elements already trained on

    def dataset_fn(input_context):
        if files:
            stream, sharded = file_backed_stream(source, files, seed, input_context, config,
                                                 consumed)
            return _finish(stream, input_context, global_batch_size, config, sharded)
        blocks = permuted_blocks_forever(source, block_size, seed, consumed, fits_cache(source))
        return _with_options(sharded_batches(blocks, input_context, global_batch_size), config)

    return dataset_fn


def eval_steps(source, global_batch_size: int) -> int:
    return math.ceil(source.info.size("test") / global_batch_size)


def eval_dataset_fn(source, global_batch_size: int, config):
    """Returns dataset_fn(input_context) -> per-replica batches of (x, y, weight).

    The test split is padded with weight-0 copies of its first example up to
    eval_steps * global_batch_size examples, so sums over weights are exact. The
    weight is the pad flag (1 real, 0 padding) times the example's own sample
    weight when it has one.
    """
    size = source.info.size("test")
    padding = eval_steps(source, global_batch_size) * global_batch_size - size

    def dataset_fn(input_context):
        examples = source.examples("test")
        real = examples.map(lambda *element: flagged(element, 1.0))
        pad = examples.take(1).map(lambda *element: flagged(element, 0.0)).repeat(padding)
        return _finish(real.concatenate(pad), input_context, global_batch_size, config)

    return dataset_fn


def flagged(element, pad_flag: float):
    """(x, y, w) from (x, y) or (x, y, sample_weight): w = sample_weight * pad_flag."""
    flag = tf.constant(pad_flag)
    if len(element) == 3:
        return element[0], element[1], tf.cast(element[2], tf.float32) * flag
    return element[0], element[1], flag
