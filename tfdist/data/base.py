"""What a dataset source provides to the input pipeline.

A source yields unbatched examples in one fixed, documented order. Shuffling,
sharding across input pipelines, batching and prefetch are done once, for every
source, in `tfdist.data.pipeline`, so that the same seed and global batch give
the same examples in every global step whatever the number of replicas.
"""

import abc
import dataclasses
from typing import Optional, Tuple

from tfdist.errors import UsageError

CLASSIFICATION = "classification"
LANGUAGE_MODEL = "language_model"
SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What the pipeline and the registry models know about a source.

    The pipeline needs only `name` and the split sizes. The registry models also
    read task, input_shape, input_dtype and num_classes to build themselves; a
    user's own data leaves them None (unknown), since a user's model is built by
    the user, and its examples may be any structure (tf.data's element_spec says
    what they are).
    """
    name: str
    task: Optional[str] = None                   # CLASSIFICATION, LANGUAGE_MODEL or None
    input_shape: Optional[Tuple[int, ...]] = None  # one example's features, e.g. (8, 8, 1)
    input_dtype: Optional[str] = None            # "float32" or "int32"
    num_classes: Optional[int] = None            # classes, or the vocabulary size
    num_examples: Tuple[Tuple[str, int], ...] = ()  # (("train", n), ("test", m)); test optional

    def has_split(self, split: str) -> bool:
        return split in dict(self.num_examples)

    def size(self, split: str) -> int:
        sizes = dict(self.num_examples)
        if split not in sizes:
            raise UsageError(f"Dataset {self.name!r} has no {split!r} split; it has "
                             f"{', '.join(sizes) or 'none'}.")
        return sizes[split]


class DatasetSource(abc.ABC):
    """An offline dataset: its info and its examples per split."""

    info: DatasetInfo

    @abc.abstractmethod
    def examples(self, split: str):
        """Returns an unbatched tf.data.Dataset of (features, label) or
        (features, label, sample_weight), in a fixed order.

        Registry sources: features match info.input_shape/input_dtype; label is
        int32 (a scalar for classification, a (seq_len,) vector of next tokens for
        a language model). User sources (tfdist.data.user): features and label of
        any structure, label int or float, sample_weight a float32 scalar.
        """
