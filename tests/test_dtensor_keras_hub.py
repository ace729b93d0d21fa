"""keras-hub backbones under --strategy=dtensor, sharded by their own get_layout_map(mesh).

A third-party model: keras-hub's GemmaBackbone / LlamaBackbone, tiny config, random
weights, with a tied-embedding LM head (tests/keras_hub_models.py). On mesh
batch=2,model=2 its Keras LayoutMap (converted by tfdist.parallel.dtensor.
keras_layouts) must train to the one-device numbers: per-step losses and final
weights within 1e-5 relative (float32), and every variable the map shards holds
exactly total / (product of its axes' sizes) bytes per device.

Runs in the DTensor pytest process (the `dtensor` marker, tests/conftest.py).
"""

import functools
import json
import math
import os
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("keras_hub")
pytestmark = pytest.mark.dtensor

import keras  # noqa: E402  (after the skip: keras_hub needs it anyway)
import keras_hub_models  # noqa: E402

from tfdist.config import DataConfig, ModelConfig, RunConfig  # noqa: E402
from tfdist.errors import UsageError  # noqa: E402
from tfdist.parallel.dtensor import keras_layouts, presets  # noqa: E402
from tfdist.parallel.dtensor.layout_map import UNSHARDED, LayoutMap  # noqa: E402
from tfdist.testing import equivalence  # noqa: E402

MESH = "batch=2,model=2"
STEPS = 6


@pytest.fixture(autouse=True, scope="module")
def registered_models():
    """Registered when a test here runs (the DTensor process), not when the main process
    merely collects this file: the registry's list of names is part of other tests'
    expected messages."""
    keras_hub_models.register()
GLOBAL_BATCH = 16
SEED = 3
REPORT = os.environ.get("TFDIST_DTENSOR_REPORT")  # optional: append max errors as JSON lines
# Llama's attention kernels are (hidden, heads, head_dim); see test_llama_own_map_...
LLAMA_QKV = "transformer_layer.*self_attention.*(query|key|value).kernel"


def make_config(kind: str, strategy: str, optimizer: str, layout="data", mesh=MESH,
                num_heads=2, **overrides):
    model = ModelConfig(name=keras_hub_models.REGISTERED[kind], num_layers=2, d_model=32,
                        num_heads=num_heads, d_ff=64)
    fields = dict(strategy=strategy, simulate_devices=4, model=model,
                  data=DataConfig(name="text", seq_len=16), optimizer=optimizer,
                  global_batch_size=GLOBAL_BATCH, train_steps=STEPS, seed=SEED,
                  log_every=STEPS)
    if strategy == "dtensor":
        fields.update(mesh=mesh, layout=layout)
    fields.update(overrides)
    return RunConfig(**fields)


def keras_map(kind: str, fix_llama_qkv: bool = False):
    """The backbone's own keras.distribution.LayoutMap for MESH."""
    layout_map = keras_hub_models.backbone_class(kind).get_layout_map(
        keras_layouts.device_mesh(MESH))
    if fix_llama_qkv:
        del layout_map[LLAMA_QKV]
        layout_map[LLAMA_QKV] = ("batch", "model", None)  # hidden on batch, heads on model
    return layout_map


def train(config, label):
    from tfdist.train import runner
    results, model = runner.run(config, return_model=True)
    return equivalence.Record(label, results["losses"], model.get_weights()), results, model


@functools.lru_cache(maxsize=None)
def reference(kind: str, optimizer: str):
    return train(make_config(kind, "default", optimizer), "default")


@functools.lru_cache(maxsize=None)
def sharded(kind: str, optimizer: str):
    layout = keras_layouts.from_keras(keras_map(kind, fix_llama_qkv=kind == "llama"))
    return train(make_config(kind, "dtensor", optimizer, layout), f"dtensor {MESH} {kind}")


def report(**fields):
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(fields) + "\n")


def max_weight_error(ref, got) -> float:
    return max(float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-12))
               for r, g in zip(ref.weights, got.weights))


# ---- equivalence ----------------------------------------------------------------------

@pytest.mark.parametrize("kind,optimizer", [("gemma", "sgd"), ("gemma", "momentum"),
                                            ("gemma", "adam"), ("llama", "adam")])
def test_backbone_with_its_layout_map_matches_one_device(kind, optimizer):
    ref, ref_results, _ = reference(kind, optimizer)
    got, results, _ = sharded(kind, optimizer)
    report(model=f"keras_hub_{kind}", optimizer=optimizer, mesh=MESH,
           max_rel_loss_error=equivalence.max_relative_loss_error(ref, got),
           max_rel_weight_error=max_weight_error(ref, got))
    equivalence.assert_equivalent(ref, got)
    assert len(got.losses) == STEPS and got.losses[-1] < got.losses[0]
    assert results["num_replicas"] == 2
    assert results["eval_loss"] == pytest.approx(ref_results["eval_loss"], rel=1e-5)


def test_gemma_on_a_pure_tensor_parallel_mesh_matches_one_device():
    """batch=1,model=4: the map's `model` dimensions split 4 ways (4 heads, vocabulary
    256, FFN 32), its `batch` dimensions whole."""
    mesh = "batch=1,model=4"
    layout = keras_layouts.from_backbone(keras_hub_models.backbone_class("gemma"), mesh)
    ref = train(make_config("gemma", "default", "adam", num_heads=4), "default")[0]
    got, _, model = train(make_config("gemma", "dtensor", "adam", layout, mesh=mesh,
                                      num_heads=4), f"dtensor {mesh} gemma")
    report(model="keras_hub_gemma", optimizer="adam", mesh=mesh,
           max_rel_loss_error=equivalence.max_relative_loss_error(ref, got),
           max_rel_weight_error=max_weight_error(ref, got))
    equivalence.assert_equivalent(ref, got)
    assert specs_by_path(model)["decoder_block_0/attention/query/kernel"] == (
        "model", "batch", UNSHARDED)


def specs_by_path(model):
    from tensorflow.experimental import dtensor
    return {v.path: tuple(dtensor.fetch_layout(v.value).sharding_specs) for v in model.variables}


def test_gemma_map_shards_kernels_over_both_axes_at_their_exact_share():
    from tfdist.parallel.dtensor import sharding
    _, results, model = sharded("gemma", "adam")
    specs = specs_by_path(model)
    both = [p for p, s in specs.items() if {"batch", "model"} <= set(s)]
    # Every kernel of the map and the embedding, in both blocks; norms stay replicated.
    assert len(both) == 1 + 2 * 7, both
    assert specs["decoder_block_1/ffw_linear/kernel"] == ("model", "batch")
    assert specs["decoder_block_0/attention/query/kernel"] == ("model", "batch", UNSHARDED)
    assert specs["final_normalization/scale"] == (UNSHARDED,)
    per_device = {}
    for variable in model.variables:
        ways = math.prod(2 for axis in specs[variable.path] if axis != UNSHARDED)
        total = math.prod(variable.shape) * variable.value.dtype.size
        for device, shape in sharding.shard_shapes(variable):
            held = math.prod(shape) * variable.value.dtype.size
            assert held * ways == total, (variable.path, shape, specs[variable.path])
            per_device[device] = per_device.get(device, 0) + held
    # Adam: two slots with their parameter's layout, plus iterations (int64) and lr.
    expected = {device: 3 * held + 8 + 4 for device, held in per_device.items()}
    assert len(expected) == 4
    assert results["param_bytes_per_device"] == expected


# ---- Keras' matching semantics, kept exactly --------------------------------------------

PATHS = ["dense/kernel", "dense/bias", "model/dense/kernel", "dense_1/kernel",
         "block_0/attention/query/kernel", "block_0/attention/key/kernel",
         "block_0/attention/attention_output/kernel", "block_10/ffw/kernel"]


def sample_keras_map():
    layout_map = keras.distribution.LayoutMap(keras_layouts.device_mesh(MESH))
    layout_map["dense/kernel"] = (None, "model")      # exact key, also matched by .*kernel
    layout_map[r".*kernel"] = ("batch", None)
    layout_map["dense.*bias"] = ("model",)
    layout_map[r"block_\d/attention/(query|key)/kernel"] = ("model", None)  # overlaps .*kernel
    return layout_map


def keras_answer(layout_map, path):
    try:
        layout = layout_map[path]
    except ValueError:
        return "several"
    return None if layout is None else tuple(UNSHARDED if a is None else a for a in layout.axes)


def tfdist_answer(layout_map, path):
    keys = layout_map.matching_keys(path)
    if len(keys) > 1:
        return "several"
    return layout_map[keys[0]] if keys else None


def test_lookup_agrees_with_keras_layout_map_path_by_path():
    original = sample_keras_map()
    converted = keras_layouts.from_keras(original)
    answers = {p: (keras_answer(original, p), tfdist_answer(converted, p)) for p in PATHS}
    assert {p: k for p, (k, _) in answers.items()} == {p: t for p, (_, t) in answers.items()}
    # The cases that make it a test: exact key beats a regex, fullmatch not search,
    # two regexes matching is refused, and a regex-only match.
    assert answers["dense/kernel"][1] == (UNSHARDED, "model")
    assert answers["model/dense/kernel"][1] == ("batch", UNSHARDED)
    assert answers["block_0/attention/query/kernel"][1] == "several"
    assert answers["block_10/ffw/kernel"][1] == ("batch", UNSHARDED)


def test_several_matches_are_a_usage_error_naming_variable_and_keys():
    converted = keras_layouts.from_keras(sample_keras_map())
    with pytest.raises(UsageError, match=r"'block_0/attention/query/kernel' matches 2 layout "
                                         r"map keys: '\.\*kernel', 'block_"):
        converted.resolve([("block_0/attention/query/kernel", (4, 8)), ("dense/kernel", (8, 4)),
                           ("dense/bias", (4,))], {"batch": 2, "model": 2})


def test_dict_and_tensor_layouts_convert_with_axis_renames():
    converted = keras_layouts.from_keras(
        {"a/kernel": keras.distribution.TensorLayout(("data", None)), "a/bias": ("tensor",),
         "b/.*": None, "c/kernel": ["unsharded", "model"]},
        axis_names={"data": "batch", "tensor": "model"})
    assert dict(converted.items()) == {"a/kernel": ("batch", UNSHARDED), "a/bias": ("model",),
                                       "b/.*": None, "c/kernel": (UNSHARDED, "model")}
    assert converted.source_axes is None


# ---- bad input, before training ---------------------------------------------------------

GEMMA_PATHS = [("token_embedding/embeddings", (256, 32)), ("final_normalization/scale", (32,)),
               ("decoder_block_0/ffw_linear/kernel", (32, 32))]


def test_key_matching_no_variable_names_the_key_and_some_paths():
    layout_map = keras_map("gemma")
    layout_map["decoder_blok.*ffw_linear.kernel"] = ("model", "batch")  # typo
    with pytest.raises(UsageError) as error:
        from tfdist.train import runner
        runner.run(make_config("gemma", "dtensor", "sgd", keras_layouts.from_keras(layout_map)))
    message = str(error.value)
    assert "'decoder_blok.*ffw_linear.kernel' matches none of the model's 20 variables" in message
    assert "'decoder_block_0/ffw_linear/kernel'" in message and "\n" not in message


def test_activation_key_is_refused_with_the_reason():
    converted = keras_layouts.from_keras({"decoder_block_0/output": ("batch", None, "model")})
    with pytest.raises(UsageError, match=r"activation layout .*--strategy=dtensor lays out "
                                         r"only variables"):
        converted.resolve(GEMMA_PATHS, {"batch": 2, "model": 2})


def test_map_made_for_another_mesh_is_refused():
    converted = keras_layouts.from_keras(
        keras_hub_models.backbone_class("gemma").get_layout_map(
            keras_layouts.device_mesh("batch=1,model=4")))
    with pytest.raises(UsageError, match=r"made for mesh batch=1,model=4, but tfdist runs on "
                                         r"mesh batch=2,model=2"):
        converted.resolve(GEMMA_PATHS, {"batch": 2, "model": 2})


def test_axis_not_in_the_mesh_is_named():
    converted = keras_layouts.from_keras({"token_embedding/embeddings": ("tensor", None),
                                          "final_normalization/scale": None,
                                          "decoder_block_0/ffw_linear/kernel": None})
    with pytest.raises(UsageError, match=r"shards over mesh axis 'tensor', which is not in the "
                                         r"mesh \(axes: batch=2, model=2\)"):
        converted.resolve(GEMMA_PATHS, {"batch": 2, "model": 2})


@pytest.mark.parametrize("value,match", [
    ({"a": ("batch", ("model", "batch"))}, r"each entry must be one mesh axis name or None"),
    ({"a": "model"}, r"expected a keras.distribution.TensorLayout, a tuple"),
    (42, r"must be a keras.distribution.LayoutMap, a dict .*got int"),
])
def test_malformed_maps_are_usage_errors(value, match):
    with pytest.raises(UsageError, match=match):
        keras_layouts.from_keras(value)


axis_values = st.one_of(st.none(), st.sampled_from(["batch", "model", "unsharded", "data", ""]),
                        st.text(max_size=4), st.integers(), st.tuples(st.text(max_size=3)))
layout_values = st.one_of(st.none(), st.text(max_size=6), st.integers(),
                          st.lists(axis_values, max_size=3),
                          st.lists(axis_values, max_size=3).map(tuple))


@settings(max_examples=200, deadline=2000, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.one_of(st.text(max_size=8), st.integers(),
                                 st.sampled_from(["dense/.*", "dense/kernel", "(", ".*"])),
                       layout_values, max_size=4))
def test_any_dict_converts_and_resolves_or_is_refused_in_one_paragraph(rules):
    try:
        keras_layouts.from_keras(rules).resolve(
            [("dense/kernel", (8, 4)), ("dense/bias", (4,))], {"batch": 2, "model": 2})
    except UsageError as error:
        assert str(error) and len(str(error).splitlines()) == 1, str(error)


# ---- presets: objects accepted, --layout strings unchanged ------------------------------

def test_layout_map_for_accepts_map_objects_and_keeps_its_strings():
    original = keras_map("gemma")
    converted = presets.layout_map_for(original, "ignored")
    assert isinstance(converted, keras_layouts.KerasLayoutMap)
    assert converted["token_embedding/embeddings"] == ("model", "batch")
    assert presets.layout_map_for(converted, "x") is converted
    assert presets.layout_map_for({"x/.*": None}, "x")["x/.*"] is None
    assert dict(presets.layout_map_for("data", "mlp").items()) == {".*": None}
    assert isinstance(presets.layout_map_for("megatron", "transformer"), LayoutMap)
    with pytest.raises(UsageError, match=r"got int: 7"):
        presets.layout_map_for(7, "mlp")
    with pytest.raises(UsageError, match=r"neither a preset \(data, megatron, auto\)"):
        presets.layout_map_for("no_such_file.json", "mlp")


LAYOUT_FILE = """
from keras_hub.models import GemmaBackbone
from tfdist.parallel.dtensor import keras_layouts
LAYOUT_MAP = {}
"""


@pytest.mark.parametrize("expression", [
    'keras_layouts.from_backbone(GemmaBackbone, "batch=2,model=2")',
    'GemmaBackbone.get_layout_map(keras_layouts.device_mesh("batch=2,model=2"))'])
def test_layout_file_may_hold_a_keras_hub_map(tmp_path, expression):
    """How the --layout flag reaches a keras-hub model's own map: a .py layout file."""
    path = tmp_path / "gemma_layout.py"
    path.write_text(LAYOUT_FILE.format(expression))
    got = presets.layout_map_for(str(path), "ignored")
    assert isinstance(got, keras_layouts.KerasLayoutMap)
    assert got.to_dict() == keras_layouts.from_keras(keras_map("gemma")).to_dict()


def test_layout_file_dicts_and_other_values_keep_their_meaning(tmp_path):
    path = tmp_path / "layout.py"
    path.write_text('LAYOUT_MAP = {"dense_0/kernel": ["unsharded", "model"]}')
    got = presets.layout_map_for(str(path), "mlp")
    assert type(got) is LayoutMap and got["dense_0/kernel"] == (UNSHARDED, "model")
    path.write_text('LAYOUT_MAP = [1, 2]')
    with pytest.raises(UsageError, match=r"must hold an object of regex -> list of axis "
                                         r"names, got list"):
        presets.layout_map_for(str(path), "mlp")


def test_from_backbone_is_its_own_map_converted():
    gemma = keras_hub_models.backbone_class("gemma")
    assert keras_layouts.from_backbone(gemma, MESH).to_dict() == (
        keras_layouts.from_keras(keras_map("gemma")).to_dict())
    with pytest.raises(UsageError, match=r"Dense has no get_layout_map\(device_mesh\)"):
        keras_layouts.from_backbone(keras.layers.Dense(2), MESH)


def test_a_checkpointed_run_with_a_map_layout_resumes(tmp_path):
    """--model_dir with a map object as the layout (once a TypeError writing the
    checkpoint's fingerprint): a rerun resumes from the saved step."""
    from tfdist.train import runner
    layout = keras_layouts.from_backbone(keras_hub_models.backbone_class("gemma"), MESH)
    model_dir = str(tmp_path / "run")
    first = runner.run(make_config("gemma", "dtensor", "sgd", layout, train_steps=1,
                                   model_dir=model_dir))
    again = runner.run(make_config("gemma", "dtensor", "sgd", layout, train_steps=2,
                                   model_dir=model_dir))
    assert len(first["losses"]) == 1 and again["start_step"] == 1 and len(again["losses"]) == 1


@pytest.mark.parametrize("kind", ["gemma", "llama"])
def test_zero_argument_builders_are_the_tested_models(kind):
    """keras_hub_models.gemma_lm / llama_lm (for --model=MODULE:FUNCTION) build what the
    equivalence tests train."""
    from tfdist import data, models
    config = make_config(kind, "default", "sgd")
    info = data.get_source(config.data).info
    tested = models.build_model(info, config.model)
    zero_argument = getattr(keras_hub_models, f"{kind}_lm")()
    assert ([(v.path, tuple(v.shape)) for v in zero_argument.variables]
            == [(v.path, tuple(v.shape)) for v in tested.variables])


def test_device_mesh_has_tfdists_axes():
    mesh = keras_layouts.device_mesh(MESH)
    assert tuple(mesh.shape) == (2, 2) and list(mesh.axis_names) == ["batch", "model"]
    with pytest.raises(UsageError, match=r"needs 8 devices, but only 4 are available"):
        keras_layouts.device_mesh("batch=2,model=4")
    assert re.fullmatch(r".*cpu:3", str(mesh.devices.flat[-1]), re.I)


# ---- what DTensor refuses: Llama's own map (last: a failed SPMD compile) ---------------

def test_llama_own_map_is_refused_by_dtensors_matmul_expander():
    """keras-hub 0.32 writes Llama's q/k/v rule as for Gemma's (heads, hidden, head_dim)
    kernels, ("model", "batch", None), but Llama's are (hidden, heads, head_dim): the
    hidden (contracting) dimension lands on `model` while the activations carry it on
    `batch` (from the embedding's ("model", "batch")). GSPMD (JAX) reshards that
    silently; DTensor's MatMul SPMD expander refuses it. This canary fails when
    DTensor (or keras-hub's map) changes; then drop fix_llama_qkv."""
    import tensorflow as tf
    layout = keras_layouts.from_keras(keras_map("llama"))
    assert layout[LLAMA_QKV] == ("model", "batch", UNSHARDED)
    with pytest.raises(tf.errors.UnknownError,
                       match=r"Contracting dimension for matmul has sharding dimension batch "
                             r"for the left input and model for the right input"):
        train(make_config("llama", "dtensor", "sgd", layout, train_steps=1), "llama own map")
