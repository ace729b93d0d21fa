"""Property-based fuzzing of everything a user types or exports: TF_CONFIG, DTENSOR_*,
--mesh, layout files and the training flags.

The property everywhere: a malformed value is a UsageError (exit 2 at the entry
points) whose message is one paragraph and names the value, never another
exception (a traceback for the user) and never a hang (hypothesis' deadline).
In-process for the pure-Python validators (thousands of cases in seconds), and
a few real `python -m experiments.train` processes for the exit code.
"""

import json
import os
import string
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from helpers import REPO
from tfdist import cluster, config as cfg
from tfdist.errors import UsageError
from tfdist.parallel.dtensor import layout_map, mesh, presets

FAST = settings(max_examples=300, deadline=2000, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

# Text that looks like what people mistype: digits of other scripts ("²", "١"),
# separators, brackets, whitespace, and ordinary letters.
TRICKY = "0123456789²³١٢:=,[]{}.-_ /\\\"'\t\n" + string.ascii_letters
tricky_text = st.text(alphabet=st.sampled_from(TRICKY) | st.characters(), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 40, 2 ** 40) | st.floats(allow_nan=False)
    | tricky_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky_text, inner, max_size=4),
    max_leaves=12)


def one_paragraph_usage_error(call, *args):
    """Runs call(*args); returns None on success, else the UsageError's message,
    after checking that it is one readable paragraph."""
    try:
        call(*args)
    except UsageError as error:
        message = str(error)
        assert message and "Traceback" not in message
        # Received values are quoted with repr, so even one holding a newline stays on one line.
        assert len(message.splitlines()) == 1, message
        return message
    return None


# --------------------------------------------------------------------------- TF_CONFIG

def near_valid_tf_config():
    """A valid 2-worker TF_CONFIG with one field replaced by something arbitrary."""
    base = {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
            "task": {"type": "worker", "index": 0}}
    paths = [("cluster",), ("cluster", "worker"), ("cluster", "worker", 0), ("task",),
             ("task", "type"), ("task", "index"), ("rpc_layer",), ("cluster", "chief")]

    def mutate(path_and_value):
        path, value = path_and_value
        config = json.loads(json.dumps(base))
        target = config
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return config, value

    return st.tuples(st.sampled_from(paths), json_values).map(mutate)


@FAST
@given(st.one_of(tricky_text, json_values.map(json.dumps)))
def test_any_tf_config_text_is_parsed_or_refused_in_one_paragraph(text):
    message = one_paragraph_usage_error(cluster.parse_tf_config, text)
    if message is not None:
        assert "TF_CONFIG" in message


@FAST
@given(near_valid_tf_config())
def test_a_bad_tf_config_field_is_named_in_the_message(config_and_value):
    config, value = config_and_value
    message = one_paragraph_usage_error(cluster.parse_tf_config, json.dumps(config))
    if message is not None and isinstance(value, (int, str)) and not isinstance(value, bool):
        shown = [repr(value), str(value), json.dumps(value)]
        assert any(s[:40] in message for s in shown) or "TF_CONFIG" in message, message


# --------------------------------------------------------------------------- DTENSOR_*

@FAST
@given(st.dictionaries(st.sampled_from(cluster.DTENSOR_VARIABLES), tricky_text, min_size=1))
@example({"DTENSOR_NUM_CLIENTS": "²"})
@example({"DTENSOR_CLIENT_ID": "0\x1f"})
def test_any_dtensor_environment_is_validated_or_refused(env):
    message = one_paragraph_usage_error(cluster.validate_dtensor_env, env)
    if message is not None:
        assert "DTENSOR" in message or "DTensor" in message, message


# --------------------------------------------------------------------------- --mesh

@FAST
@given(tricky_text, st.integers(1, 16))
@example("batch=²", 2)
def test_any_mesh_string_is_parsed_or_refused_naming_it(spec, devices):
    message = one_paragraph_usage_error(mesh.parse_mesh, spec, devices)
    if message is not None:
        assert repr(spec) in message, message


# --------------------------------------------------------------------------- layout files

VARIABLES = [("dense/kernel", (8, 4)), ("dense/bias", (4,)), ("out/kernel", (4, 2))]
MESH_AXES = {"batch": 2, "model": 2}


def resolve_layout_file(path):
    layout_map_ = presets.load_file(str(path))
    layout_map_.resolve(VARIABLES, MESH_AXES, strict=False)


@FAST
@given(st.one_of(json_values.map(lambda v: json.dumps(v).encode()),
                 st.dictionaries(tricky_text, json_values, max_size=4).map(
                     lambda v: json.dumps(v).encode()),
                 st.binary(max_size=64)))
def test_any_json_layout_file_loads_or_is_refused(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("layout") / "layout.json"
    path.write_bytes(content)
    message = one_paragraph_usage_error(resolve_layout_file, path)
    if message is not None:
        assert "layout" in message.lower() or "Variable" in message, message


@FAST
@given(st.dictionaries(tricky_text, st.one_of(
    st.none(), tricky_text, st.lists(st.sampled_from(["batch", "model", "unsharded", "x", ""]),
                                     max_size=3)), max_size=4))
def test_any_layout_rules_resolve_or_are_refused(rules):
    def build_and_resolve():
        layout_map.LayoutMap(rules).resolve(VARIABLES, MESH_AXES, strict=True)
    one_paragraph_usage_error(build_and_resolve)


# --------------------------------------------------------------------------- flag values

INT_FIELDS = ["simulate_devices", "num_gpus", "num_packs", "bytes_per_pack",
              "collective_timeout", "pipeline_stages", "microbatches", "global_batch_size",
              "train_steps", "epochs", "seed", "checkpoint_every", "keep_checkpoints",
              "eval_every", "log_every"]
CHOICE_FIELDS = ["strategy", "optimizer", "cross_device_ops", "collective",
                 "pipeline_schedule", "trainer", "mixed_precision", "layout"]


@FAST
@given(st.sampled_from(INT_FIELDS), st.integers(-2 ** 31, 2 ** 31))
def test_any_integer_flag_value_is_accepted_or_refused_naming_it(field, value):
    message = one_paragraph_usage_error(lambda: cfg.RunConfig(strategy="default", **{field: value}))
    if message is not None:
        assert str(value) in message, message


@FAST
@given(st.sampled_from(CHOICE_FIELDS), tricky_text)
def test_any_choice_flag_value_is_accepted_or_refused_with_the_choices(field, value):
    message = one_paragraph_usage_error(lambda: cfg.RunConfig(**{field: value}))
    if message is not None:
        assert repr(value) in message or value in message, message


@FAST
@given(tricky_text)
def test_any_comma_separated_ints_are_parsed_or_refused(text):
    message = one_paragraph_usage_error(cfg.parse_ints, text, "hidden_sizes")
    if message is not None:
        assert repr(text) in message


@FAST
@given(tricky_text)
@example("host:²")
@example("host:22\x1f")
def test_any_address_is_split_or_refused_naming_it(address):
    message = one_paragraph_usage_error(cluster.split_address, address)
    if message is not None:
        assert repr(address) in message or repr(address.strip()) in message, message


# --------------------------------------------------------------------------- the real CLI

CLI_CASES = [
    ["--train_steps=abc"],                       # absl's own type check
    ["--global_batch_size=-3"],
    ["--strategy=mirored"],
    ["--mesh=batch=²", "--strategy=dtensor"],    # a digit int() cannot read
    ["--hidden_sizes=100,x"],
    ["--layout=/nonexistent.json", "--strategy=dtensor"],
]


@pytest.mark.parametrize("flags", CLI_CASES, ids=lambda f: " ".join(f))
def test_bad_flags_exit_2_with_one_paragraph_and_no_traceback(flags):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-m", "experiments.train", "--train_steps=1",
                             *flags], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("tfdist: error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    bad_value = flags[0].split("=", 1)[1]
    assert bad_value in errors[0] or bad_value.split("=")[-1] in errors[0], errors[0]
