"""Users' own data through tfdist's input pipeline.

What a user may bring, and what tfdist does with it:
  (a) a tf.data.Dataset of unbatched examples (features, label) or
      (features, label, sample_weight): features and label any structure of
      tensors (a dict for named inputs, a tuple for several), label int or float,
      sample_weight a float scalar per example;
  (b) NumPy arrays (x, y) or (x, y, sample_weight), x an array, a dict of arrays
      or a list of arrays (a list becomes a tuple: tf.data reads a list as one
      tensor); floats become Keras' floatx, as Keras' own fit does;
  (c) a registry name or 'tfds:NAME', or 'MODULE:FUNCTION' returning (train, test);
  (d) a dataset_fn(input_context) that returns per-replica batches itself.
(a)-(c) become a DatasetSource and go through tfdist.data.pipeline: shuffled
before sharding, so the same seed and global batch give the same examples in
every global step whatever the number of replicas and workers. (d) is passed
through as it is: its sharding, order and batch size are the user's, and so is
the same-examples guarantee.

The dataset given must be deterministic and unshuffled: every input pipeline
(one per worker) reads it from the start, and tfdist shuffles it.
"""

import dataclasses
from typing import Callable, Dict, Optional

import numpy as np
import tensorflow as tf

from tfdist import user_code
from tfdist.data import pipeline
from tfdist.data.base import DatasetInfo, DatasetSource
from tfdist.errors import UsageError

ACCEPTED = ("a tf.data.Dataset of unbatched (features, label[, sample_weight]) examples, "
            "a tuple of NumPy arrays (x, y[, sample_weight]), a dataset name ('digits', "
            "'tfds:NAME', 'MODULE:FUNCTION'), a DatasetSource, or a dataset_fn(input_context)")
ARRAY_NAMES = ("x", "y", "sample_weight")
SPEC_NAMES = ("features", "label", "sample_weight")


class UserSource(DatasetSource):
    """A user's datasets as a source: examples in the order the user gave them."""

    def __init__(self, splits: Dict[str, tf.data.Dataset], name: str):
        self._splits = splits
        self.info = DatasetInfo(
            name=name, num_examples=tuple((split, int(dataset.cardinality()))
                                          for split, dataset in splits.items()))

    def examples(self, split: str):
        self.info.size(split)  # a UsageError naming the splits there are, if absent
        return self._splits[split]


def source_from_user_data(train, test=None, name: str = "user") -> UserSource:
    """A DatasetSource for a user's (train, test): each a tf.data.Dataset of
    unbatched examples or a tuple of NumPy arrays; test may be None."""
    splits = {"train": as_user_dataset(train, "the training data")}
    if test is not None:
        splits["test"] = as_user_dataset(test, "the test data")
    return UserSource(splits, name)


def as_user_dataset(data, what: str) -> tf.data.Dataset:
    """`data` (a tf.data.Dataset or a tuple of arrays) as a validated, unbatched
    tf.data.Dataset of known, finite length. Validating twice is cheap."""
    if isinstance(data, tf.data.Dataset):
        check_element_spec(data.element_spec, what)
        return with_known_length(float32_weights(data), what)
    if isinstance(data, (tuple, list)):
        return dataset_from_arrays(data, what)
    raise UsageError(f"{what} has type {type(data).__name__}; expected a tf.data.Dataset of "
                     f"unbatched (features, label[, sample_weight]) examples or a tuple of "
                     f"NumPy arrays (x, y[, sample_weight]).")


# --- tf.data.Dataset ----------------------------------------------------------

def check_element_spec(spec, what: str) -> None:
    """Elements must be (features, label[, weight]) of fixed-shape dense tensors."""
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):
        raise UsageError(
            f"{what} has elements {_describe_spec(spec)}; tfdist needs (features, label) or "
            f"(features, label, sample_weight) tuples, e.g. "
            f"dataset.map(lambda e: (e['image'], e['label'])).")
    for path, leaf in leaves_with_paths(spec, SPEC_NAMES):
        _check_leaf_spec(path, leaf, what)
    if len(spec) == 3:
        _check_weight_spec(spec[2], what)


def _describe_spec(spec) -> str:
    if isinstance(spec, dict):
        return f"that are a dict with keys {sorted(spec)}"
    if isinstance(spec, tuple):
        return f"that are {len(spec)}-tuples"
    return f"of a single {type(spec).__name__} {spec}"


def _check_leaf_spec(path: str, leaf, what: str) -> None:
    if not isinstance(leaf, tf.TensorSpec):
        raise UsageError(
            f"{what}: {path} is a {type(leaf).__name__}; tfdist batches dense tensors only. "
            f"Densify it (e.g. .to_tensor() with a fixed length), or pass a "
            f"dataset_fn(input_context) that batches it yourself.")
    if not leaf.shape.is_fully_defined():
        batched = leaf.shape.rank and leaf.shape[0] is None
        hint = (" The dataset looks batched: give unbatched examples (dataset.unbatch()); "
                "tfdist batches them." if batched else "")
        raise UsageError(
            f"{what}: {path} has shape {leaf.shape}, with a size unknown to tf.data; tfdist "
            f"stacks examples into batches, so every example needs the same, known shape. "
            f"Set it with dataset.map(...tf.ensure_shape(t, SHAPE)...), or pass a "
            f"dataset_fn(input_context) that batches (e.g. padded_batch) itself.{hint}")


def _check_weight_spec(weight, what: str) -> None:
    if not isinstance(weight, tf.TensorSpec) or weight.shape.rank != 0 \
            or not weight.dtype.is_floating:
        raise UsageError(
            f"{what}: sample_weight is {weight}; it must be one float scalar per example "
            f"(shape (), a float dtype such as float32).")


def float32_weights(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Sample weights as float32 (what Keras' losses and the eval pad flag use)."""
    spec = dataset.element_spec
    if len(spec) == 2 or spec[2].dtype == tf.float32:
        return dataset
    return dataset.map(lambda x, y, w: (x, y, tf.cast(w, tf.float32)))


def with_known_length(dataset: tf.data.Dataset, what: str) -> tf.data.Dataset:
    """The dataset with its length declared: counted once when tf.data cannot tell."""
    length = int(dataset.cardinality())
    if length == tf.data.INFINITE_CARDINALITY:
        raise UsageError(
            f"{what} is an infinite tf.data.Dataset (a .repeat() without a count?). Give a "
            f"finite dataset of one epoch (tfdist repeats and shuffles it itself), or a "
            f"dataset_fn(input_context) returning per-replica batches.")
    if length == tf.data.UNKNOWN_CARDINALITY:
        # One pass to count it (a filter or a generator hides the length); the pipeline
        # needs it for epochs, blocks and eval padding.
        length = int(dataset.reduce(np.int64(0), lambda count, *_: count + 1))
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(length))
    if length == 0:
        raise UsageError(f"{what} has no examples.")
    return dataset


# --- NumPy arrays -------------------------------------------------------------

def dataset_from_arrays(arrays, what: str) -> tf.data.Dataset:
    """(x, y[, w]) arrays -> an unbatched dataset, after checking lengths and weights."""
    if len(arrays) not in (2, 3):
        raise UsageError(f"{what} is a {type(arrays).__name__} of {len(arrays)} items; arrays "
                         f"must come as (x, y) or (x, y, sample_weight).")
    if any(isinstance(part, tf.data.Dataset) for part in arrays):
        raise UsageError(f"{what} is a tuple holding tf.data.Datasets; give one dataset of "
                         f"(features, label[, sample_weight]) examples (the training data), "
                         f"and the evaluation data separately.")
    names = ARRAY_NAMES[:len(arrays)]
    checked = tuple(map_with_paths(lambda path, leaf: _as_array(path, leaf, what),
                                   _as_tuples(part), name) for name, part in zip(names, arrays))
    lengths = {path: array.shape[0] for path, array in leaves_with_paths(checked, names)}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{path}: {n}" for path, n in lengths.items())
        raise UsageError(f"{what}: the arrays hold different numbers of examples ({shown}); "
                         f"every array needs one row per example.")
    if next(iter(lengths.values())) == 0:
        raise UsageError(f"{what} has no examples (arrays of length 0).")
    if len(arrays) == 3:
        _check_weight_array(checked[2], what)
    standard = tuple(map_with_paths(_standard_dtype, part, name)
                     for name, part in zip(names, checked))
    return tf.data.Dataset.from_tensor_slices(standard)


def _as_tuples(structure):
    """Lists -> tuples, all the way down (tf.data would stack a list into one tensor)."""
    if isinstance(structure, dict):
        return {key: _as_tuples(value) for key, value in structure.items()}
    if isinstance(structure, (list, tuple)):
        return tuple(_as_tuples(value) for value in structure)
    return structure


def _as_array(path: str, leaf, what: str) -> np.ndarray:
    array = np.asarray(leaf)
    if array.ndim == 0 or not (np.issubdtype(array.dtype, np.number)
                               or array.dtype == np.bool_):
        raise UsageError(f"{what}: {path} is {_short(leaf)} ({array.dtype}, shape "
                         f"{array.shape}); expected a numeric array with one row per example.")
    return array


def _check_weight_array(weights: np.ndarray, what: str) -> None:
    if weights.ndim != 1 or not np.issubdtype(weights.dtype, np.floating):
        raise UsageError(
            f"{what}: sample_weight has dtype {weights.dtype} and shape {weights.shape}; it "
            f"must be one float per example, shape (n,) (e.g. weights.astype('float32')).")


def _standard_dtype(path: str, array: np.ndarray) -> np.ndarray:
    """Floats in Keras' floatx (Keras' fit does the same to arrays); weights float32."""
    import keras
    if path == "sample_weight":
        return array.astype(np.float32)
    if np.issubdtype(array.dtype, np.floating):
        return array.astype(keras.backend.floatx())
    return array


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def map_with_paths(fn, structure, path: str):
    """`structure` with every leaf replaced by fn(its path, leaf); dicts and tuples kept."""
    if isinstance(structure, dict):
        return {key: map_with_paths(fn, value, f"{path}[{key!r}]")
                for key, value in structure.items()}
    if isinstance(structure, tuple):
        return tuple(map_with_paths(fn, value, f"{path}[{index}]")
                     for index, value in enumerate(structure))
    return fn(path, structure)


def leaves_with_paths(structure, top_names):
    """[(path, leaf)] in tf.nest's flatten order, paths like "features['a']" or "x[1]"."""
    found = []
    for name, part in zip(top_names, structure):
        _walk(part, name, found)
    return found


def _walk(structure, path: str, found: list) -> None:
    if isinstance(structure, dict):
        for key in sorted(structure):  # tf.nest flattens dicts in sorted key order
            _walk(structure[key], f"{path}[{key!r}]", found)
    elif isinstance(structure, (tuple, list)):
        for index, value in enumerate(structure):
            _walk(value, f"{path}[{index}]", found)
    else:
        found.append((path, structure))


# --- any data -> dataset_fns --------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DatasetFns:
    """What the training loop and evaluation need from any data.

    train:      dataset_fn(input_context) -> per-replica batches of (x, y) or (x, y, w),
                forever, from global step start_step on.
    evaluate:   dataset_fn(input_context) -> per-replica (x, y, w) batches covering every
                evaluation example once, padded with weight-0 examples (w = sample weight
                * pad flag); None when there is no evaluation data.
    eval_steps: global batches `evaluate` yields; None for a user's own eval dataset_fn
                (iterate it to its end).
    train_size: examples in one epoch of the training data; None for a user dataset_fn.
    source:     the DatasetSource behind `train` (None for a user dataset_fn), whose
                info the registry models read.
    """
    train: Callable
    evaluate: Optional[Callable]
    eval_steps: Optional[int]
    train_size: Optional[int]
    source: Optional[DatasetSource]


def as_dataset_fns(data, global_batch_size: int, seed: int = 0, data_config=None,
                   start_step: int = 0, validation_data=None) -> DatasetFns:
    """dataset_fns for any training data (a)-(d) and optional validation data.

    Evaluation reads `validation_data` when given (a Dataset, arrays, a
    DatasetSource's test split, or a user's eval dataset_fn, passed through), else
    the test split of `data` when it has one.
    """
    _check_batch(global_batch_size, start_step)
    config = data_config if data_config is not None else default_data_config()
    if _is_dataset_fn(data):
        train, source, size = _resumed(data, start_step), None, None
    else:
        source = as_source(data)
        size = source.info.size("train")
        train = pipeline.train_dataset_fn(source, global_batch_size, seed, config, start_step)
    evaluate, steps = _eval_fns(validation_data, source, global_batch_size, config)
    return DatasetFns(train, evaluate, steps, size, source)


def as_source(data) -> DatasetSource:
    """A DatasetSource for a source, a tf.data.Dataset or a tuple of arrays (a dataset's
    name is the registry's: tfdist.data.as_source)."""
    if isinstance(data, DatasetSource):
        return data
    if isinstance(data, str):
        raise UsageError(f"The data is the dataset name {data!r}: resolve it with "
                         f"tfdist.data.as_source or tfdist.data.as_dataset_fns.")
    if isinstance(data, (tf.data.Dataset, tuple, list)):
        return source_from_user_data(data)
    raise UsageError(f"The data has type {type(data).__name__}; tfdist accepts {ACCEPTED}.")


def _eval_fns(validation_data, source, global_batch_size: int, config):
    if validation_data is None:
        if source is None or not source.info.has_split("test"):
            return None, None
        eval_source = source
    elif _is_dataset_fn(validation_data):
        return validation_data, None
    elif isinstance(validation_data, DatasetSource):
        eval_source = validation_data
    else:
        eval_source = UserSource({"test": as_user_dataset(validation_data, "the validation "
                                                          "data")}, "validation")
    return (pipeline.eval_dataset_fn(eval_source, global_batch_size, config),
            pipeline.eval_steps(eval_source, global_batch_size))


def _is_dataset_fn(data) -> bool:
    # A Dataset, a source or arrays are data; any other callable is a dataset_fn.
    return callable(data) and not isinstance(data, (tf.data.Dataset, DatasetSource, str))


def _resumed(dataset_fn: Callable, start_step: int) -> Callable:
    """The user's dataset_fn as it is; when resuming, without the batches already
    trained on (each input pipeline feeds its local replicas one batch a step)."""
    if start_step == 0:
        return dataset_fn

    def resumed(input_context):
        local_replicas = input_context.num_replicas_in_sync // input_context.num_input_pipelines
        return dataset_fn(input_context).skip(start_step * max(local_replicas, 1))

    return resumed


def _check_batch(global_batch_size, start_step) -> None:
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
            or global_batch_size <= 0:
        raise UsageError(f"global_batch_size must be a positive int, got {global_batch_size!r}.")
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise UsageError(f"start_step must be an int >= 0, got {start_step!r}.")


def default_data_config():
    from tfdist.config import DataConfig
    return DataConfig()


def load_user_datasets(spec: str, flag: str = "--dataset"):
    """Calls FUNCTION() of 'MODULE:FUNCTION', expecting (train, test).

    Each of train and test is a tf.data.Dataset of unbatched (features, label) or
    (features, label, sample_weight) examples, or a tuple of NumPy arrays
    (x, y) / (x, y, sample_weight); test may be None. Returns them validated, as
    tf.data.Datasets of known length (as_user_dataset), test possibly None.
    """
    result = user_code.call_without_arguments(user_code.load_function(spec, flag), spec, flag)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        got = (f"a {type(result).__name__} of length {len(result)}"
               if isinstance(result, (tuple, list))
               else user_code.with_article(user_code.type_name(result)))
        raise UsageError(
            f"{flag}={spec!r} returned {got}; FUNCTION() must return (train, test), each a "
            f"tf.data.Dataset of unbatched (features, label[, sample_weight]) examples or a "
            f"tuple of NumPy arrays (x, y[, sample_weight]); test may be None.")
    train, test = result
    if train is None:
        raise UsageError(f"{flag}={spec!r} returned (None, ...): the training data is required.")
    train = as_user_dataset(train, f"the training data of {flag}={spec}")
    if test is not None:
        test = as_user_dataset(test, f"the test data of {flag}={spec}")
    return train, test
