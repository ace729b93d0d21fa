"""`tfds:NAME`: any tensorflow-datasets image classification dataset, offline.

NAME is what `tfds.builder` accepts: `mnist`, `mnist:3.0.1`,
`cifar10/plain_text:3.0.2`. The data must already be prepared in the data dir
(`--data_dir`, else $TFDS_DATA_DIR, else ~/tensorflow_datasets): tfdist never
downloads, so a missing dataset is a UsageError that says how to get it.
Namespaced names (`huggingface:x`, community `ns:x`) are refused because
resolving them needs the network.

Supported: datasets with an `image` feature of fixed shape (uint8) and a
`label` ClassLabel feature. Features become float32 in [0, 1] (uint8 / 255) and
labels int32 scalars.

Split mapping: tfdist's "train" is the tfds "train" split; tfdist's "test" is
the tfds "test" split when there is one, else "validation" (as for datasets
that publish no labelled test split).

`TfdsImageSource` is also the source behind the built-in `digits` dataset, so
`files()`/`read_files()` (file-level sharding across workers) work for both.
"""

import difflib
import logging
import os
import re
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdist.data.base import CLASSIFICATION, SPLITS, DatasetInfo, DatasetSource
from tfdist.errors import UsageError

log = logging.getLogger(__name__)

TFDS_PREFIX = "tfds:"
# tfds spells a version as digits and dots (or `*`); anything else after the
# first ':' of the dataset part is a namespace, e.g. `huggingface:mnist`.
_VERSION = re.compile(r"^[0-9*][0-9.*]*$")


def resolve_data_dir(data_dir: Optional[str]) -> str:
    """The tfds data dir: the given one, else $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
    chosen = data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"
    return os.path.abspath(os.path.expanduser(chosen))


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise UsageError(f"Unknown split {split!r}. Valid splits: {', '.join(SPLITS)}.")
    return split


class TfdsImageSource(DatasetSource):
    """Examples of a prepared tfds image classification dataset, in file order.

    Order: the split's shard files one after another in shard order, each file
    front to back (tfds writes examples in a fixed hashed-key order). So
    `read_files(files(split))` yields exactly `examples(split)`, and any subset
    of files yields its examples in the same relative order.
    """

    def __init__(self, builder, name: str, split_names: Dict[str, str], max_value: float):
        self.builder = builder
        self._split_names = split_names    # tfdist split -> tfds split
        self._max_value = max_value        # pixel value that maps to 1.0
        features = builder.info.features
        self.info = DatasetInfo(
            name=name,
            task=CLASSIFICATION,
            input_shape=tuple(features["image"].shape),
            input_dtype="float32",
            num_classes=features["label"].num_classes,
            num_examples=tuple(
                (split, builder.info.splits[tfds_split].num_examples)
                for split, tfds_split in split_names.items()),
        )

    def examples(self, split: str):
        tfds_split = self._split_names[check_split(split)]
        # cycle_length 1: read shard files in order instead of tfds' default
        # 16-way interleave, so examples() matches read_files(files()).
        read_config = tfds.ReadConfig(interleave_cycle_length=1)
        dataset = self.builder.as_dataset(
            split=tfds_split, shuffle_files=False, read_config=read_config)
        return dataset.map(self._to_pair, num_parallel_calls=tf.data.AUTOTUNE,
                           deterministic=True)

    def files(self, split: str) -> List[str]:
        """The split's shard files, in shard order (the order examples() reads them)."""
        self._require_tfrecord()
        tfds_split = self._split_names[check_split(split)]
        return [os.fspath(path) for path in self.builder.info.splits[tfds_split].filepaths]

    def read_files(self, files: Sequence[str]):
        """Unbatched (features, label) from these shard files: each file front to
        back, the files one after another in the order given (no interleave)."""
        self._require_tfrecord()
        files = [os.fspath(path) for path in files]
        features = self.builder.info.features
        records = tf.data.TFRecordDataset(files)
        dataset = records.map(lambda record: self._to_pair(features.deserialize_example(record)),
                              num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        # TFRecordDataset cannot know its length; tfds recorded each shard's.
        lengths = self._shard_lengths()
        if all(path in lengths for path in files):
            count = sum(lengths[path] for path in files)
            dataset = dataset.apply(tf.data.experimental.assert_cardinality(count))
        return dataset

    def _shard_lengths(self) -> Dict[str, int]:
        """Examples per shard file, for every split tfdist uses."""
        lengths = {}
        for tfds_split in self._split_names.values():
            split_info = self.builder.info.splits[tfds_split]
            paths = [os.fspath(path) for path in split_info.filepaths]
            lengths.update(zip(paths, split_info.shard_lengths))
        return lengths

    def _to_pair(self, example):
        image = tf.cast(example["image"], tf.float32) / self._max_value
        return image, tf.cast(example["label"], tf.int32)

    def _require_tfrecord(self):
        file_format = self.builder.info.file_format
        # None: written before tfds recorded formats, when TFRecord was the only one.
        if file_format not in (None, tfds.core.FileFormat.TFRECORD):
            raise UsageError(
                f"Dataset {self.info.name!r} is stored as {file_format.value}; file-level "
                f"sharding needs TFRecord files. Use examples() or re-prepare it as TFRecord.")


def make_source(config) -> TfdsImageSource:
    """Builds the source for `tfds:NAME` from data already prepared in data_dir."""
    spec = config.name[len(TFDS_PREFIX):] if config.name.startswith(TFDS_PREFIX) else config.name
    data_dir = resolve_data_dir(config.data_dir)
    builder = load_builder(spec, data_dir)
    require_prepared(builder, spec, data_dir)
    split_names = supported_splits(builder, spec)
    require_image_classification(builder, spec)
    return TfdsImageSource(builder, name=TFDS_PREFIX + spec, split_names=split_names,
                           max_value=255.0)


def load_builder(spec: str, data_dir: str):
    """tfds.builder(spec) reading only data_dir, with every failure a UsageError."""
    _refuse_namespace(spec)
    try:
        return tfds.builder(spec, data_dir=data_dir, try_gcs=False)
    except tfds.core.DatasetNotFoundError:
        raise UsageError(_unknown_message(spec)) from None
    except Exception as error:  # a bad config/version, a missing optional dependency...
        raise UsageError(f"Cannot load tensorflow-datasets dataset {spec!r}: "
                         f"{_one_paragraph(error)}") from None


def _one_paragraph(error: Exception, limit: int = 600) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def _refuse_namespace(spec: str) -> None:
    dataset_part = spec.split("/")[0]
    if ":" in dataset_part and not _VERSION.match(dataset_part.split(":", 1)[1]):
        raise UsageError(
            f"'{TFDS_PREFIX}{spec}' names a namespaced (community or Hugging Face) dataset, "
            f"which needs the network to resolve; tfdist only reads datasets prepared "
            f"locally. Use NAME, NAME:VERSION or NAME/CONFIG:VERSION.")


def _unknown_message(spec: str) -> str:
    name = re.split(r"[/:]", spec)[0]
    known = tfds.list_builders(with_community_datasets=False)
    close = difflib.get_close_matches(name, known, n=3)
    hint = f" Did you mean {', '.join(repr(TFDS_PREFIX + c) for c in close)}?" if close else ""
    return (f"Unknown tensorflow-datasets dataset {name!r} (from '{TFDS_PREFIX}{spec}').{hint} "
            f"tfds.list_builders() lists the {len(known)} known names.")


def is_prepared(builder) -> bool:
    """builder.is_prepared(), without its warning when the folder does not exist yet."""
    info_file = os.path.join(os.fspath(builder.data_path), "dataset_info.json")
    return os.path.exists(info_file) and builder.is_prepared()


def require_prepared(builder, spec: str, data_dir: str) -> None:
    """Raises a UsageError explaining how to get the data unless it is prepared."""
    if is_prepared(builder):
        return
    name = builder.name
    if name == "tfdist_digits":  # tfdist's own dataset: it prepares itself, offline
        raise UsageError(
            f"'{TFDS_PREFIX}{spec}' is not prepared in data dir {data_dir}. Run tfdist once "
            f"with the dataset 'digits' and the same data dir; it prepares it offline.")
    raise UsageError(
        f"tensorflow-datasets dataset '{spec}' is not prepared in data dir {data_dir} "
        f"(looked for {os.fspath(builder.data_path)}), and tfdist never downloads. "
        f"On a machine with network run: python -c \"import tensorflow_datasets as tfds; "
        f"tfds.builder('{spec}').download_and_prepare()\" (tfds 4.9.10 there also needs "
        f"`pip install importlib_resources`, tensorflow/datasets#11212) then copy the folder "
        f"~/tensorflow_datasets/{name} to {os.path.join(data_dir, name)} here; or pass "
        f"--data_dir (or set TFDS_DATA_DIR) to a directory that already holds {name}/.")


def supported_splits(builder, spec: str) -> Dict[str, str]:
    """Maps tfdist splits to tfds splits: train->train, test->test else validation."""
    available = set(builder.info.splits.keys())
    test_split = next((s for s in ("test", "validation") if s in available), None)
    if "train" not in available or test_split is None:
        raise UsageError(
            f"'{TFDS_PREFIX}{spec}' has splits {sorted(available)}; tfdist needs 'train' "
            f"and 'test' (or 'validation').")
    return {"train": "train", "test": test_split}


def require_image_classification(builder, spec: str) -> None:
    """Raises a UsageError naming why unless features are a fixed-shape uint8 image + ClassLabel."""
    features = builder.info.features
    keys = set(features.keys()) if hasattr(features, "keys") else set()
    problem = None
    if not {"image", "label"} <= keys:
        problem = f"it has features {sorted(keys)}, not 'image' and 'label'"
    elif not isinstance(features["image"], tfds.features.Image):
        problem = f"its 'image' feature is a {type(features['image']).__name__}, not an Image"
    elif None in features["image"].shape:
        problem = (f"its images have variable shape {features['image'].shape}; "
                   f"tfdist needs a fixed shape (no resizing is done)")
    elif np.dtype(features["image"].np_dtype) != np.uint8:
        problem = f"its images are {features['image'].np_dtype}, not uint8"
    elif not isinstance(features["label"], tfds.features.ClassLabel):
        problem = f"its 'label' feature is a {type(features['label']).__name__}, not a ClassLabel"
    if problem:
        raise UsageError(f"'{TFDS_PREFIX}{spec}' is not supported: {problem}. tfdist reads "
                         f"image classification datasets ('image' + 'label' features).")
