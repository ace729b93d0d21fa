"""`--model=MODULE:FUNCTION` and `--dataset=MODULE:FUNCTION` (tfdist.user_code).

Real modules are written into tmp_path and imported from sys.path; each test
uses module names of its own, so Python's module cache never answers for another.
"""

import itertools
import os
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tfdist import user_code
from tfdist.config import DataConfig
from tfdist import data as tfdist_data
from tfdist.data import get_source, user
from tfdist.errors import UsageError

_names = itertools.count()


@pytest.fixture
def write_module(tmp_path, monkeypatch):
    """write_module(source) -> the name of a new module holding `source`, importable."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str, name: str = None) -> str:
        name = name or f"tfdist_user_module_{os.getpid()}_{next(_names)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return write


def refused(make, *fragments):
    with pytest.raises(UsageError) as caught:
        make()
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


MODELS = """
    import keras

    def functional():
        inputs = keras.Input((3,))
        return keras.Model(inputs, keras.layers.Dense(2)(inputs))

    def sequential():
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])

    class Subclassed(keras.Model):
        def __init__(self, units=2):
            super().__init__()
            self.dense = keras.layers.Dense(units)

        def call(self, x):
            return self.dense(x)

    def not_a_model():
        return [keras.layers.Dense(2)]

    def needs_arguments(width, depth=2):
        return functional()

    ANSWER = 42
"""


# --- recognising a spec -------------------------------------------------------

@pytest.mark.parametrize("name,expected", [
    ("my_models:build", True), ("pkg.sub.module:make", True), ("digits", False),
    ("tfds:mnist", False), ("tfds:mnist:3.0.1", False), ("tfds:cifar10/plain_text:3.0.2", False),
    (None, False)])
def test_is_user_code_spec(name, expected):
    assert user_code.is_user_code_spec(name) is expected


@pytest.mark.parametrize("spec", ["nocolon", ":build", "module:", " : ", "a:b:c"])
def test_a_malformed_spec_says_the_expected_form(spec):
    refused(lambda: user_code.load_function(spec, "--model"),
            f"--model={spec!r}", "MODULE:FUNCTION")


# --- loading a function -------------------------------------------------------

def test_load_function_imports_the_module_and_returns_the_function(write_module):
    module = write_module("def make():\n    return 7\n")
    assert user_code.load_function(f"{module}:make", "--model")() == 7


def test_the_current_directory_is_on_sys_path_as_python_m_puts_it(tmp_path, monkeypatch):
    (tmp_path / "cwd_only_module_for_tfdist.py").write_text("def make():\n    return 'here'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    function = user_code.load_function("cwd_only_module_for_tfdist:make", "--dataset")
    assert function() == "here"


def test_a_module_that_is_not_found_gets_a_sys_path_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(lambda: user_code.load_function("no_such_module_xyz:build", "--model"),
            "module 'no_such_module_xyz' does not import", "No module named 'no_such_module_xyz'",
            "sys.path", str(tmp_path), "PYTHONPATH")


def test_a_module_whose_own_import_fails_names_the_missing_dependency(write_module):
    module = write_module("import a_dependency_that_is_not_installed\n")
    refused(lambda: user_code.load_function(f"{module}:build", "--model"),
            f"module {module!r} does not import",
            "No module named 'a_dependency_that_is_not_installed'",
            "something it imports was not (a_dependency_that_is_not_installed)")


def test_a_module_with_a_syntax_error_or_raising_code_says_where(write_module):
    broken = write_module("def build(:\n    pass\n")
    refused(lambda: user_code.load_function(f"{broken}:build", "--model"),
            "raised SyntaxError", f"{broken}.py:1")
    raising = write_module("x = 1\nraise RuntimeError('no GPU here')\n")
    refused(lambda: user_code.load_function(f"{raising}:build", "--model"),
            "raised RuntimeError: no GPU here", f"{raising}.py:2")


def test_a_missing_function_lists_the_public_callables(write_module):
    module = write_module(MODELS)
    message = refused(lambda: user_code.load_function(f"{module}:functionl", "--model"),
                      "has no attribute 'functionl'", f"Did you mean {module}:functional?",
                      "Public callables", "Subclassed, functional, needs_arguments, "
                      "not_a_model, sequential")
    assert "keras" not in message.split("Public callables")[1]   # imports are not listed


def test_a_function_that_is_not_callable_names_its_type(write_module):
    module = write_module(MODELS)
    refused(lambda: user_code.load_function(f"{module}:ANSWER", "--model"),
            f"{module}.ANSWER is an int (42), not a function", "Public callables")


# --- --model ------------------------------------------------------------------

@pytest.mark.parametrize("function", ["functional", "sequential", "Subclassed"])
def test_build_user_model_returns_the_users_keras_model(write_module, function):
    import keras
    module = write_module(MODELS)
    model = user_code.build_user_model(f"{module}:{function}")
    assert isinstance(model, keras.Model)
    assert model(np.zeros((1, 3), np.float32)).shape == (1, 2)


def test_a_function_returning_no_model_is_refused_naming_the_type(write_module):
    module = write_module(MODELS)
    refused(lambda: user_code.build_user_model(f"{module}:not_a_model"),
            f"--model='{module}:not_a_model' returned a list, not a keras.Model",
            "uncompiled Keras 3 model")


def test_a_function_needing_arguments_is_refused_before_it_is_called(write_module):
    module = write_module(MODELS)
    refused(lambda: user_code.build_user_model(f"{module}:needs_arguments"),
            "needs_arguments(width, depth=2) needs arguments")


# --- --dataset ----------------------------------------------------------------

DATASETS = """
    import numpy as np
    import tensorflow as tf

    def arrays():
        x = {"a": np.arange(12.0).reshape(6, 2), "b": np.arange(6)}
        return (x, np.arange(6) * 0.5, np.ones(6)), (x, np.arange(6) * 0.5)

    def datasets_without_test():
        return tf.data.Dataset.from_tensor_slices((np.zeros((5, 3)), np.arange(5))), None

    def one_dataset():
        return tf.data.Dataset.from_tensor_slices((np.zeros((5, 3)), np.arange(5)))

    def three_things():
        return 1, 2, 3

    def ragged_lengths():
        return (np.zeros((5, 3)), np.arange(4)), None

    def four_tuples():
        return tf.data.Dataset.from_tensor_slices(([1.0], [1], [1.0], [1.0])), None

    def no_train():
        return None, None
"""


def test_load_user_datasets_validates_and_returns_datasets(write_module):
    module = write_module(DATASETS)
    train, test = user.load_user_datasets(f"{module}:arrays")
    assert int(train.cardinality()) == int(test.cardinality()) == 6
    x, y, w = next(iter(train))
    assert (x["a"].dtype, x["b"].dtype, y.dtype, w.dtype) == (
        tf.float32, tf.int64, tf.float32, tf.float32)
    train, test = user.load_user_datasets(f"{module}:datasets_without_test")
    assert test is None and int(train.cardinality()) == 5


@pytest.mark.parametrize("function,fragments", [
    ("one_dataset", ["returned a tensorflow.", "must return (train, test)"]),
    ("three_things", ["returned a tuple of length 3", "must return (train, test)"]),
    ("ragged_lengths", ["the training data of --dataset=", "x: 5", "y: 4"]),
    ("four_tuples", ["4-tuples", "(features, label)"]),
    ("no_train", ["training data is required"]),
])
def test_bad_datasets_from_user_code_are_refused(write_module, function, fragments):
    module = write_module(DATASETS)
    refused(lambda: user.load_user_datasets(f"{module}:{function}"), *fragments)


def test_a_dataset_config_names_user_code_and_get_source_loads_it(write_module):
    module = write_module(DATASETS)
    config = DataConfig(name=f"{module}:arrays")   # validated without importing it
    source = get_source(config)
    assert isinstance(source, user.UserSource)
    assert source.info.name == f"{module}:arrays"
    assert (source.info.size("train"), source.info.size("test")) == (6, 6)
    fns = tfdist_data.as_dataset_fns(f"{module}:arrays", 4, 1)
    assert (fns.train_size, fns.eval_steps) == (6, 2)


def test_dataset_names_keep_their_meaning():
    refused(lambda: DataConfig(name=":arrays"), "--dataset=':arrays'", "MODULE:FUNCTION")
    refused(lambda: DataConfig(name="digitz"), "Unknown dataset 'digitz'", "MODULE:FUNCTION")
    assert DataConfig(name="tfds:mnist:3.0.1").name == "tfds:mnist:3.0.1"   # not user code
