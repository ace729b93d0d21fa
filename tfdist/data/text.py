"""`text`: byte-level language-model windows over Python's own documentation.

The corpus ships with every CPython: `pydoc_data.topics.topics` (the text
behind `help()`), its entries joined with newlines in sorted key order and
encoded as UTF-8. It is the same on every machine with the same Python minor
version; other versions differ slightly, which changes the data, never the code.

Vocabulary: the 256 byte values, so it never depends on the corpus.
The last 10% of the bytes are the "test" split, the rest "train". Each split is
cut into non-overlapping windows of `seq_len`: x = bytes[i : i+L] and
y = bytes[i+1 : i+L+1] (the next byte at every position), i = 0, L, 2L, ...
while a full y fits. Both are int32 (seq_len,) vectors.
"""

import numpy as np
import tensorflow as tf

from tfdist.data.base import LANGUAGE_MODEL, DatasetInfo, DatasetSource
from tfdist.data.tfds_any import check_split
from tfdist.errors import UsageError

VOCAB_SIZE = 256
TEST_FRACTION = 0.1


def corpus_bytes() -> bytes:
    """Python's pydoc topics as UTF-8 bytes, in sorted key order."""
    from pydoc_data.topics import topics
    return "\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def split_bytes(corpus: bytes, split: str) -> np.ndarray:
    """The split's bytes as int32: train is the first 90%, test the last 10%."""
    boundary = int(len(corpus) * (1 - TEST_FRACTION))
    part = corpus[:boundary] if check_split(split) == "train" else corpus[boundary:]
    return np.frombuffer(part, dtype=np.uint8).astype(np.int32)


def windows(tokens: np.ndarray, seq_len: int):
    """Non-overlapping (x, y) windows with y the next token of each x position."""
    count = (len(tokens) - 1) // seq_len
    inputs = tokens[:count * seq_len].reshape(count, seq_len)
    targets = tokens[1:count * seq_len + 1].reshape(count, seq_len)
    return inputs, targets


class TextSource(DatasetSource):
    """Windows in corpus order (window k starts at byte k * seq_len of the split)."""

    def __init__(self, seq_len: int):
        self._seq_len = seq_len
        corpus = corpus_bytes()
        self._windows = {split: windows(split_bytes(corpus, split), seq_len)
                         for split in ("train", "test")}
        sizes = tuple((split, len(x)) for split, (x, _) in self._windows.items())
        if min(size for _, size in sizes) == 0:
            raise UsageError(
                f"--seq_len {seq_len} is too long for the text corpus: its test split has "
                f"{len(split_bytes(corpus, 'test'))} bytes. Use a --seq_len below that.")
        self.info = DatasetInfo(name="text", task=LANGUAGE_MODEL, input_shape=(seq_len,),
                                input_dtype="int32", num_classes=VOCAB_SIZE,
                                num_examples=sizes)

    def examples(self, split: str):
        inputs, targets = self._windows[check_split(split)]
        return tf.data.Dataset.from_tensor_slices((inputs, targets))


def make_source(config) -> TextSource:
    return TextSource(config.seq_len)
