"""What a dataset source provides to the input pipeline.

A source yields unbatched examples in one fixed, documented order. Shuffling,
sharding across input pipelines, batching and prefetch are done once, for every
source, in `tfdist.data.pipeline`, so that the same seed and global batch give
the same examples in every global step whatever the number of replicas.
"""

import abc
import dataclasses
from typing import Tuple

CLASSIFICATION = "classification"
LANGUAGE_MODEL = "language_model"
SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    name: str
    task: str                      # CLASSIFICATION or LANGUAGE_MODEL
    input_shape: Tuple[int, ...]   # one example's features, e.g. (8, 8, 1) or (64,)
    input_dtype: str               # "float32" or "int32"
    num_classes: int               # classes, or the vocabulary size for a language model
    num_examples: Tuple[Tuple[str, int], ...]  # (("train", n), ("test", m))

    def size(self, split: str) -> int:
        return dict(self.num_examples)[split]


class DatasetSource(abc.ABC):
    """An offline dataset: its info and its examples per split."""

    info: DatasetInfo

    @abc.abstractmethod
    def examples(self, split: str):
        """Returns an unbatched tf.data.Dataset of (features, label) in a fixed order.

        features match info.input_shape/input_dtype; label is int32 (a scalar for
        classification, a (seq_len,) vector of next tokens for a language model).
        """
