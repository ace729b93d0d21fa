"""`synthetic`: deterministic, learnable classification data of any size and shape.

For throughput benchmarks and tests: nothing is read from disk and nothing big
is held in memory. Features are float32 of `synthetic_shape`, uniform in
[0, 1) like scaled pixels (and cheaper to draw than normals), generated in
blocks of BLOCK examples by stateless TF random ops seeded by (split seed,
block index), so example i of a split is the same in every run, on every
worker, whatever the run seed (TF keeps stateless random streams stable for a
given version and device type; tf.data runs on the CPU).
The dataset graph stays tiny (no embedded arrays), so distributing or
auto-sharding it costs nothing, even for 100k x 784.

Labels are learnable: argmax over `synthetic_classes` of a fixed random linear
projection of the flattened, centred features (x - 0.5) (the projection comes from a numpy RNG
with a fixed seed). Train has `synthetic_examples` examples, test 1/8 of that
(at least 1), drawn from a different seed.
"""

import math

import numpy as np
import tensorflow as tf

from tfdist.data.base import CLASSIFICATION, DatasetInfo, DatasetSource
from tfdist.data.tfds_any import check_split

DATA_SEED = 20240611   # fixed on purpose: the data must not change with --seed
SPLIT_SEEDS = {"train": 1, "test": 2}
BLOCK = 256            # examples generated per op call: amortises per-element overhead


def test_size(train_examples: int) -> int:
    return max(1, train_examples // 8)


def projection(num_features: int, num_classes: int) -> np.ndarray:
    """The fixed (features, classes) matrix whose argmax defines the labels."""
    rng = np.random.default_rng(DATA_SEED)
    return rng.standard_normal((num_features, num_classes)).astype(np.float32)


class SyntheticSource(DatasetSource):
    """Example i of a split is block i // BLOCK, row i % BLOCK; order is by i."""

    def __init__(self, shape, num_classes: int, train_examples: int):
        self._shape = tuple(int(d) for d in shape)
        self._num_features = math.prod(self._shape)
        self._projection = projection(self._num_features, num_classes)
        sizes = (("train", train_examples), ("test", test_size(train_examples)))
        self.info = DatasetInfo(name="synthetic", task=CLASSIFICATION, input_shape=self._shape,
                                input_dtype="float32", num_classes=num_classes,
                                num_examples=sizes)

    def examples(self, split: str):
        size = self.info.size(check_split(split))
        split_seed = SPLIT_SEEDS[split]
        blocks = tf.data.Dataset.range(math.ceil(size / BLOCK))
        dataset = blocks.map(lambda block: self._block(split_seed, block)).unbatch().take(size)
        # unbatch() forgets the length; the pipeline (epochs, steps) wants it.
        return dataset.apply(tf.data.experimental.assert_cardinality(size))

    def _block(self, split_seed: int, block):
        seed = tf.stack([tf.constant(DATA_SEED + split_seed, tf.int64), block])
        flat = tf.random.stateless_uniform((BLOCK, self._num_features), seed=seed)
        # Centred so that no class dominates: E[x - 0.5] = 0, like a zero-mean projection.
        scores = tf.matmul(flat - 0.5, self._projection)
        labels = tf.argmax(scores, axis=1, output_type=tf.int32)
        return tf.reshape(flat, (BLOCK,) + self._shape), labels


def make_source(config) -> SyntheticSource:
    return SyntheticSource(config.synthetic_shape, config.synthetic_classes,
                           config.synthetic_examples)
