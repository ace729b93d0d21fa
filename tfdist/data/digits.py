"""`digits`: scikit-learn's bundled 8x8 handwritten digits as a real tfds dataset.

Offline by construction: `sklearn.datasets.load_digits` ships its 1797 images
inside the package. On first use they are written, once, as the tfds dataset
`tfdist_digits` 1.1.0 into the data dir (`--data_dir`, else $TFDS_DATA_DIR, else
~/tensorflow_datasets): 4 TFRecord shard files per split, so that file-level
sharding across workers is real, and readable by any tfds tool (also as
`tfds:tfdist_digits`).

Splits: a fixed stratified split, train 1440 and test 357: 1440 = 4 shards of
360, so every worker count that divides 4 reads equal whole files (file-level
sharding keeps the same-examples-per-step guarantee only with equal files). Examples are
float32 (8, 8, 1) images in [0, 1] (pixel / 16) and int32 labels 0..9, in the
file order documented on `TfdsImageSource`.

Two workers of one job may start together: preparation holds an exclusive
lock file in the data dir, and tfds itself writes into a temporary directory
that it renames into place, so a reader never sees a half-written dataset.
"""

import contextlib
import errno
import fcntl
import logging
import os
import time

import numpy as np
import tensorflow_datasets as tfds

from tfdist.config import check_writable_dir
from tfdist.data.tfds_any import TfdsImageSource, is_prepared, resolve_data_dir
from tfdist.errors import UsageError

log = logging.getLogger(__name__)

NUM_SHARDS = 4            # per split; > 1 so per-file sharding across workers is real
TEST_SIZE = 357           # leaves 1440 = 4 x 360 training examples: equal shard files
SPLIT_SEED = 0            # fixes the train/test split forever (it is part of the version)
MAX_PIXEL = 16.0          # load_digits pixels are 0..16
LOCK_TIMEOUT_S = 300.0    # preparing takes seconds; a longer wait means something is stuck
_LOCK_POLL_S = 0.1


class TfdistDigits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn's handwritten digits (UCI optdigits test set), 8x8, 10 classes."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {"1.0.0": "Stratified 80/20 split of sklearn.datasets.load_digits.",
                     "1.1.0": "Stratified 1440/357 split: four equal training shards."}
    # Nothing is downloaded, so there are no URL checksums. Saying so also skips
    # tfds' search for a checksums file next to this module, which (tfds 4.9.10)
    # imports `importlib_resources`, a package tfds needs but does not declare on
    # Python >= 3.9 (tensorflow/datasets#11212).
    url_infos = None

    def _info(self) -> tfds.core.DatasetInfo:
        # tfds.core.DatasetInfo directly, not dataset_info_from_configs: that would
        # read a README.md that happens to sit next to this module as the description.
        return tfds.core.DatasetInfo(
            builder=self,
            description=("scikit-learn's bundled 8x8 handwritten digits, pixel values "
                         "0..16, split 1440/357 stratified by label (random_state=0)."),
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(8, 8, 1), dtype=np.uint8),
                "label": tfds.features.ClassLabel(num_classes=10),
            }),
            supervised_keys=("image", "label"),
            homepage="https://scikit-learn.org/stable/datasets/toy_dataset.html",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download: the data ships with scikit-learn
        train_indices, test_indices = _stratified_split()
        return {"train": self._generate_examples(train_indices),
                "test": self._generate_examples(test_indices)}

    def _generate_examples(self, indices):
        images, labels = _load_digits()
        for index in indices:
            image = images[index].reshape(8, 8, 1).astype(np.uint8)
            yield int(index), {"image": image, "label": int(labels[index])}


def _load_digits():
    from sklearn.datasets import load_digits  # imported here: only preparation needs it
    digits = load_digits()
    return digits.images, digits.target


def _stratified_split():
    from sklearn.model_selection import train_test_split
    _, labels = _load_digits()
    return train_test_split(np.arange(len(labels)), test_size=TEST_SIZE,
                            random_state=SPLIT_SEED, stratify=labels)


def builder(config) -> TfdistDigits:
    """The prepared `tfdist_digits` builder in config's data dir (prepared on first use)."""
    return prepare(resolve_data_dir(config.data_dir))


def prepare(data_dir: str, lock_timeout_s: float = LOCK_TIMEOUT_S) -> TfdistDigits:
    """Prepares tfdist_digits in data_dir unless it is there; safe for racing processes."""
    ready = TfdistDigits(data_dir=data_dir)
    if is_prepared(ready):
        return ready
    check_writable_dir(data_dir, "--data_dir")  # a UsageError, not an OSError trace
    with exclusive_lock(os.path.join(data_dir, ".tfdist_digits.lock"), lock_timeout_s):
        # A fresh builder: another process may have prepared it while we waited.
        ready = TfdistDigits(data_dir=data_dir)
        if not is_prepared(ready):
            _download_and_prepare(ready)
    return ready


def _download_and_prepare(new_builder: TfdistDigits) -> None:
    config = tfds.download.DownloadConfig(
        num_shards=NUM_SHARDS,
        try_download_gcs=False,  # never look for a prebuilt copy online
    )
    # tqdm bars from every worker would bury the one log line that matters;
    # tfdist never downloads, so no other tfds progress is lost.
    tfds.disable_progress_bar()
    new_builder.download_and_prepare(download_config=config)
    log.info("Prepared dataset tfdist_digits %s (%d shards per split) in %s",
             new_builder.version, NUM_SHARDS, os.fspath(new_builder.data_path))


@contextlib.contextmanager
def exclusive_lock(path: str, timeout_s: float):
    """Holds an exclusive flock on `path`, waiting up to timeout_s for it.

    flock is released by the kernel when its holder dies, so a crashed worker
    never leaves a stale lock behind (a leftover lock file is harmless).
    """
    with open(path, "a") as lock_file:
        deadline = time.monotonic() + timeout_s
        while not _try_flock(lock_file):
            if time.monotonic() >= deadline:
                raise UsageError(
                    f"Waited {timeout_s:.0f} s for another process preparing the digits "
                    f"dataset (lock {path}). If none is running, check that the data dir "
                    f"is on a local file system that supports flock.")
            time.sleep(_LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _try_flock(lock_file) -> bool:
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as error:
        if error.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


class DigitsSource(TfdsImageSource):
    """The digits examples, read through tfds in file order."""

    def __init__(self, prepared: TfdistDigits):
        super().__init__(prepared, name="digits", split_names={"train": "train", "test": "test"},
                         max_value=MAX_PIXEL)


def make_source(config) -> DigitsSource:
    return DigitsSource(builder(config))
