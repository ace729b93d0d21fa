"""Dataset sources on real TensorFlow and real files (pytest's tmp_path as data dir).

Nothing is mocked: digits is really prepared as a 4-shard tfds dataset, text
reads Python's own docs, tfds:NAME really asks tensorflow-datasets. One small
subprocess races a second preparation of digits against this process.
"""

import collections
import glob
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tfdist.config import DataConfig
from tfdist.data import digits, get_source, synthetic, text
from tfdist.errors import UsageError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS_SIZES = {"train": 1440, "test": 357}


def as_arrays(dataset):
    """All (features, labels) of an unbatched dataset, stacked, in dataset order."""
    pairs = [(x.numpy(), y.numpy()) for x, y in dataset]
    return np.stack([x for x, _ in pairs]), np.stack([y for _, y in pairs])


def example_counter(features, labels):
    """A multiset of examples, for comparing datasets whatever their order."""
    return collections.Counter(x.tobytes() + y.tobytes() for x, y in zip(features, labels))


def shard_files_on_disk(data_dir, split):
    pattern = os.path.join(data_dir, "tfdist_digits", "1.1.0",
                           f"tfdist_digits-{split}.tfrecord-*-of-00004")
    return sorted(glob.glob(pattern))


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("tfds_data"))
    digits.builder(DataConfig(name="digits", data_dir=data_dir))
    return data_dir


@pytest.fixture(scope="module")
def digits_source(digits_dir):
    return get_source(DataConfig(name="digits", data_dir=digits_dir))


# --- digits -----------------------------------------------------------------

@pytest.mark.parametrize("split", ["train", "test"])
def test_digits_writes_four_shard_files_per_split(digits_dir, digits_source, split):
    on_disk = shard_files_on_disk(digits_dir, split)
    assert len(on_disk) == digits.NUM_SHARDS == 4
    assert digits_source.files(split) == on_disk
    assert all(os.path.getsize(path) > 0 for path in on_disk)


def test_digits_info(digits_source):
    info = digits_source.info
    assert (info.name, info.task, info.input_shape, info.input_dtype, info.num_classes) == (
        "digits", "classification", (8, 8, 1), "float32", 10)
    assert dict(info.num_examples) == DIGITS_SIZES


@pytest.mark.parametrize("split", ["train", "test"])
def test_digits_examples_are_scaled_images_with_every_label(digits_source, split):
    dataset = digits_source.examples(split)
    assert dataset.element_spec[0].dtype.name == "float32"
    assert dataset.element_spec[1].dtype.name == "int32"
    features, labels = as_arrays(dataset)
    assert features.shape == (DIGITS_SIZES[split], 8, 8, 1)
    assert features.min() == 0.0 and features.max() == 1.0   # pixel 16 / 16
    assert labels.shape == (DIGITS_SIZES[split],)
    assert set(labels.tolist()) == set(range(10))


def test_digits_order_is_deterministic(digits_dir, digits_source):
    first = as_arrays(digits_source.examples("train"))
    again = as_arrays(digits_source.examples("train"))
    fresh = as_arrays(get_source(DataConfig(name="digits", data_dir=digits_dir)).examples("train"))
    for other in (again, fresh):
        np.testing.assert_array_equal(first[0], other[0])
        np.testing.assert_array_equal(first[1], other[1])


def test_digits_read_files_matches_examples(digits_source):
    files = digits_source.files("train")
    expected = as_arrays(digits_source.examples("train"))
    # All files in order: exactly examples(), order included (documented).
    everything = as_arrays(digits_source.read_files(files))
    np.testing.assert_array_equal(expected[0], everything[0])
    np.testing.assert_array_equal(expected[1], everything[1])
    # Two workers' disjoint file subsets cover the same multiset.
    worker_0 = as_arrays(digits_source.read_files(files[0::2]))
    worker_1 = as_arrays(digits_source.read_files(files[1::2]))
    assert len(worker_0[1]) + len(worker_1[1]) == DIGITS_SIZES["train"]
    assert int(digits_source.read_files(files[0::2]).cardinality()) == len(worker_0[1])
    assert (example_counter(*worker_0) + example_counter(*worker_1)
            == example_counter(*expected))


def test_digits_splits_are_disjoint(digits_source):
    train = example_counter(*as_arrays(digits_source.examples("train")))
    test = example_counter(*as_arrays(digits_source.examples("test")))
    # load_digits has a few duplicate images; a disjoint index split keeps overlap tiny.
    assert sum((train & test).values()) < 10


@pytest.mark.parametrize("name", ["digits", "text", "synthetic"])
def test_unknown_split_is_a_usage_error(digits_dir, name):
    source = get_source(DataConfig(name=name, data_dir=digits_dir, synthetic_examples=8))
    with pytest.raises(UsageError, match="Valid splits: train, test"):
        source.examples("validation")


RACER = """
import logging, os, sys, time
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from tfdist.data import digits
data_dir, ready_file, go_file = sys.argv[1:4]
open(ready_file, "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(go_file) and time.monotonic() < deadline:
    time.sleep(0.005)
prepared = digits.prepare(data_dir)
print("SIZES", prepared.info.splits["train"].num_examples, prepared.info.splits["test"].num_examples)
"""


def test_two_processes_preparing_together_give_one_valid_dataset(tmp_path, caplog):
    data_dir, ready_file, go_file = (str(tmp_path / n) for n in ("data", "ready", "go"))
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    racer = subprocess.Popen([sys.executable, "-c", RACER, data_dir, ready_file, go_file],
                             env=env, cwd=REPO_ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_file(ready_file, racer)
        open(go_file, "w").close()        # both start preparing now
        with caplog.at_level(logging.INFO, logger=digits.__name__):
            prepared = digits.prepare(data_dir)
        stdout, stderr = racer.communicate(timeout=120)
    finally:
        racer.kill()
    assert racer.returncode == 0, stderr
    assert "SIZES 1440 357" in stdout
    here = sum("Prepared dataset tfdist_digits" in r.getMessage() for r in caplog.records)
    there = stderr.count("Prepared dataset tfdist_digits")
    assert here + there == 1, (here, stderr)
    for split in ("train", "test"):
        assert len(shard_files_on_disk(data_dir, split)) == 4
        assert prepared.info.splits[split].num_examples == DIGITS_SIZES[split]
    assert not glob.glob(os.path.join(data_dir, "tfdist_digits", "incomplete*"))
    source = digits.DigitsSource(digits.prepare(data_dir))
    assert len(as_arrays(source.examples("test"))[1]) == DIGITS_SIZES["test"]


def wait_for_file(path, process, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"racer did not start: {process.communicate()[1][-2000:]}")
        time.sleep(0.01)


def test_lock_wait_times_out_as_usage_error(tmp_path):
    lock = str(tmp_path / "lock")
    with digits.exclusive_lock(lock, timeout_s=1):
        # flock locks belong to the open file, so a second open conflicts even here.
        with pytest.raises(UsageError, match="Waited"):
            with digits.exclusive_lock(lock, timeout_s=0.2):
                pass
    with digits.exclusive_lock(lock, timeout_s=0.2):   # released: free again
        pass


# --- text -------------------------------------------------------------------

def test_text_windows_are_next_byte_targets():
    source = get_source(DataConfig(name="text", seq_len=32))
    info = source.info
    assert (info.task, info.input_shape, info.input_dtype, info.num_classes) == (
        "language_model", (32,), "int32", 256)
    corpus = text.corpus_bytes()
    assert len(corpus) > 200_000
    boundary = int(len(corpus) * 0.9)
    assert info.size("train") == (boundary - 1) // 32
    assert info.size("test") == (len(corpus) - boundary - 1) // 32
    inputs, targets = as_arrays(source.examples("train"))
    assert inputs.shape == targets.shape == (info.size("train"), 32)
    assert inputs.dtype == targets.dtype == np.int32
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])      # shifted by one
    np.testing.assert_array_equal(inputs[1:, 0], targets[:-1, -1])     # stride L, no overlap
    assert bytes(inputs[0].astype(np.uint8)) == corpus[:32]
    test_inputs, _ = as_arrays(source.examples("test"))
    assert bytes(test_inputs[0].astype(np.uint8)) == corpus[boundary:boundary + 32]


def test_text_seq_len_longer_than_test_split_is_a_usage_error():
    with pytest.raises(UsageError, match="--seq_len"):
        get_source(DataConfig(name="text", seq_len=10_000_000))


# --- synthetic --------------------------------------------------------------

@pytest.mark.parametrize("shape", [(28, 28, 1), (784,)])
def test_synthetic_shapes_sizes_and_determinism(shape):
    config = DataConfig(name="synthetic", synthetic_shape=shape, synthetic_classes=7,
                        synthetic_examples=600)
    source = get_source(config)
    assert source.info.input_shape == shape
    assert dict(source.info.num_examples) == {"train": 600, "test": 75}
    dataset = source.examples("train")
    assert int(dataset.cardinality()) == 600
    features, labels = as_arrays(dataset)
    assert features.shape == (600,) + shape and features.dtype == np.float32
    assert 0.0 <= features.min() and features.max() < 1.0
    assert labels.dtype == np.int32 and set(labels.tolist()) == set(range(7))
    again = as_arrays(get_source(config).examples("train"))
    np.testing.assert_array_equal(features, again[0])
    np.testing.assert_array_equal(labels, again[1])
    test_features, _ = as_arrays(source.examples("test"))
    assert test_features.shape == (75,) + shape
    assert not np.array_equal(test_features, features[:75])


def test_synthetic_labels_follow_the_fixed_projection():
    source = synthetic.SyntheticSource((5,), 3, 300)
    features, labels = as_arrays(source.examples("train"))
    scores = (features - 0.5) @ synthetic.projection(5, 3)
    np.testing.assert_array_equal(labels, scores.argmax(axis=1))


def test_synthetic_test_split_has_at_least_one_example():
    source = get_source(DataConfig(name="synthetic", synthetic_examples=3))
    assert source.info.size("test") == 1
    assert len(as_arrays(source.examples("test"))[1]) == 1


# --- tfds:NAME --------------------------------------------------------------

def test_tfds_known_but_not_prepared_says_how_to_get_it(tmp_path):
    with pytest.raises(UsageError) as raised:
        get_source(DataConfig(name="tfds:mnist", data_dir=str(tmp_path)))
    message = str(raised.value)
    assert "not prepared" in message and str(tmp_path) in message
    assert "tfds.builder('mnist').download_and_prepare()" in message
    assert "--data_dir" in message
    assert not os.listdir(tmp_path)   # nothing downloaded or created


def test_tfds_unknown_name_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="Unknown tensorflow-datasets dataset 'nonexistent_zzz'"):
        get_source(DataConfig(name="tfds:nonexistent_zzz", data_dir=str(tmp_path)))
    with pytest.raises(UsageError, match="Did you mean 'tfds:mnist'"):
        get_source(DataConfig(name="tfds:mnsit", data_dir=str(tmp_path)))


@pytest.mark.parametrize("name", ["tfds:huggingface:mnist", "tfds:mnist:9.9.9"])
def test_tfds_network_names_and_bad_versions_are_usage_errors(tmp_path, name):
    with pytest.raises(UsageError):
        get_source(DataConfig(name=name, data_dir=str(tmp_path)))


@pytest.mark.parametrize("name", ["tfds:tfdist_digits", "tfds:tfdist_digits:1.1.0"])
def test_tfds_prepared_dataset_loads(digits_dir, digits_source, name):
    source = get_source(DataConfig(name=name, data_dir=digits_dir))
    assert source.info.input_shape == (8, 8, 1) and source.info.num_classes == 10
    assert dict(source.info.num_examples) == DIGITS_SIZES
    assert source.files("test") == digits_source.files("test")
    features, labels = as_arrays(source.examples("test"))
    assert features.shape == (357, 8, 8, 1)
    assert 0.0 <= features.min() and features.max() == pytest.approx(16 / 255)   # uint8 / 255
    _, digits_labels = as_arrays(digits_source.examples("test"))
    np.testing.assert_array_equal(labels, digits_labels)
