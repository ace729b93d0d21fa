"""layout="auto" and the refusal of layouts DTensor cannot run on convolutions
(tfdist/parallel/dtensor/auto_layout.py, layout_check.py).

layout="auto" on models tfdist did not write, against one device (per-step losses
and final weights within 1e-5 relative, Adam, 8 steps):
- a keras-io-style text transformer (token + position embeddings, a subclassed
  block with MultiHeadAttention and a Sequential Dense-relu-Dense FFN): at least
  half of its Dense parameter bytes end up split over `model`;
- a convnet (Conv2D, BatchNormalization, pooling, a Dense head) and a MobileNet-shaped
  one (depthwise and separable convolutions): their convolutions stay replicated and
  they train, instead of failing at the first step. (keras.applications' MobileNetV2
  runs too, in 75 s here, too slow for this file, and is not within 1e-5: on one
  device alone, depthwise gradients 1e-7 apart move its step-4 loss by 13%.)
Each layout DTensor cannot run on a convnet (a split filter, a channel-split
normalisation before a convolution, a row-split final Dense after global
pooling: the three raw DTensor errors users met) is refused before anything is
sharded, in one paragraph with the layer, the rule and what is supported, from a
dict, a --layout JSON file and a keras.distribution LayoutMap alike.

Real DTensor on the 4 simulated CPUs, mesh batch=2,model=2; runs in the DTensor
pytest process (the `dtensor` marker, tests/conftest.py).
"""

import json
import logging
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from tfdist.errors import UsageError
from tfdist.testing import equivalence

pytestmark = pytest.mark.dtensor

MESH = "batch=2,model=2"
STEPS, BATCH = 8, 8
SEQ, VOCAB, CLASSES = 8, 32, 4
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS_PAGE = REPO_ROOT / "docs" / "tensor-parallel.md"
DOCS_HEADING = "## Tensor parallelism without a hand-written layout"
TF_ERROR_TEXT = ("tensorflow/", "SPMD", "{0}", "Filter for convolution", "channel dimension must",
                 "Traceback", "mlir")


# ------------------------------------------------------------------------- the models

def transformer():
    """keras-io's "Text classification with Transformer", dropout 0, Adam."""
    import keras
    layers = keras.layers

    from benchmarks.conformance_keras_io import (TokenAndPositionEmbedding,
                                                        TransformerBlock)

    inputs = keras.Input((SEQ,), dtype="int32")
    x = TokenAndPositionEmbedding(SEQ, VOCAB, 16)(inputs)
    x = TransformerBlock(16, 2, 32, rate=0.0)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dense(20, activation="relu")(x)
    model = keras.Model(inputs, layers.Dense(CLASSES)(x))
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def with_dense_head(inputs, x):
    """The convnets' shared ending: Dense-relu (fc) then Dense logits (head), the pair
    layout="auto" shards, compiled with Adam on integer labels."""
    import keras
    x = keras.layers.Dense(16, activation="relu", name="fc")(x)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(x))
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def convnet():
    """keras-io's MNIST convnet shape, with BatchNormalization and a Dense-relu-Dense head.
    conv1 has no bias: BatchNormalization subtracts it, so its gradient is rounding noise
    that Adam amplifies differently under any split (tfdist warns about it)."""
    import keras
    layers = keras.layers
    inputs = keras.Input((8, 8, 3))
    x = layers.Conv2D(8, 3, padding="same", use_bias=False, name="conv1")(inputs)
    x = layers.BatchNormalization(name="bn1")(x)
    x = layers.ReLU(name="relu1")(x)
    x = layers.Conv2D(8, 3, padding="same", name="conv2")(x)
    x = layers.MaxPooling2D()(x)
    x = layers.Flatten()(x)
    return with_dense_head(inputs, x)


def mobile_convnet():
    """MobileNet's shapes: a depthwise convolution with stride 2 (channel multiplier 2)
    and a separable one, BatchNormalization, global pooling, a Dense-relu-Dense head."""
    import keras
    layers = keras.layers
    inputs = keras.Input((8, 8, 3))
    x = layers.Conv2D(4, 1, use_bias=False, name="stem")(inputs)
    x = layers.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2,
                               use_bias=False, name="depthwise")(x)
    x = layers.BatchNormalization(name="bn")(x)
    x = layers.ReLU(6.0)(x)
    x = layers.SeparableConv2D(8, 3, dilation_rate=1, name="separable")(x)
    x = layers.GlobalAveragePooling2D()(x)
    return with_dense_head(inputs, x)


def timeseries_classifier():
    """keras-io's "Timeseries classification from scratch": Conv1D + BatchNorm, global
    pooling, softmax Dense."""
    import keras
    layers = keras.layers
    inputs = keras.Input((16, 1))
    x = inputs
    for index in range(2):
        x = layers.Conv1D(8, 3, padding="same", name=f"conv{index}")(x)
        x = layers.BatchNormalization(name=f"bn{index}")(x)
        x = layers.ReLU()(x)
    x = layers.GlobalAveragePooling1D()(x)
    model = keras.Model(inputs, layers.Dense(CLASSES, activation="softmax", name="dense")(x))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def preprocessed_convnet():
    """keras.applications' stems: EfficientNet's Rescaling + Normalization (built, never
    adapted) and ConvNeXt's Normalization with given mean and variance, both of which keep
    their statistics as plain tensors; DenseNet's transition (1x1 conv, AveragePooling2D)
    and a 1-D average pooling with "same" padding."""
    import keras
    layers = keras.layers
    inputs = keras.Input((8, 8, 3))
    x = layers.Rescaling(1.0 / 255.0)(inputs)
    x = layers.Normalization(axis=-1, name="adaptable")(x)
    x = layers.Normalization(mean=[0.4, 0.5, 0.6], variance=[0.05, 0.06, 0.07], name="given")(x)
    x = layers.Conv2D(8, 3, padding="same", name="conv")(x)
    x = layers.AveragePooling2D(2, strides=2, name="transition_pool")(x)
    x = layers.Reshape((16, 8))(x)
    x = layers.AveragePooling1D(3, strides=2, padding="same", name="pool_1d")(x)
    x = layers.Flatten()(x)
    return with_dense_head(inputs, x)


def arrays(build):
    rng = np.random.default_rng(0)
    shape = build().input_shape[1:]
    n = STEPS * BATCH
    if build is transformer:
        x = rng.integers(0, VOCAB, (n,) + shape).astype("int32")
    else:
        x = rng.normal(size=(n,) + shape).astype("float32")
    return x, rng.integers(0, CLASSES, n).astype("int32")


# ------------------------------------------------------------------------- the runs

def train_sharded(build, layout):
    """strategy.fit under dtensor; returns (Record, the trained model, its strategy)."""
    import keras
    import tfdist
    x, y = arrays(build)
    strategy = tfdist.Strategy("dtensor", seed=0, simulate_devices=4, mesh=MESH, layout=layout)
    keras.utils.set_random_seed(0)
    model = build()
    strategy.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    record = equivalence.Record("dtensor auto", list(strategy.last_result.losses),
                                model.get_weights())
    return record, model, strategy


def train_one_device(build):
    x, y = arrays(build)
    run = equivalence.train_keras("default", build, x, y,
                                  fit_kwargs=dict(batch_size=BATCH, epochs=1, shuffle=False))
    return run.record()


def assert_exact(build, layout="auto"):
    reference = train_one_device(build)
    candidate, model, strategy = train_sharded(build, layout)
    try:
        assert len(candidate.losses) == STEPS
        equivalence.assert_equivalent(reference, candidate)
    finally:
        strategy.close()
    return model


def split_axes(variable):
    from tfdist.parallel.dtensor import sharding
    return [a for a in sharding.layout_of(variable).sharding_specs if a != "unsharded"]


def dense_variables(model):
    import keras
    return [v for layer in model._flatten_layers()
            if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))
            for v in layer.variables]


# ------------------------------------------------------------------------- layout="auto"

def test_auto_layout_shards_a_transformer_and_trains_like_one_device(caplog):
    with caplog.at_level(logging.INFO, logger="tfdist"):
        model = assert_exact(transformer)
    dense = dense_variables(model)
    total = sum(v.numpy().nbytes for v in dense)
    split = sum(v.numpy().nbytes for v in dense if split_axes(v) == ["model"])
    assert split >= total / 2, (split, total)
    # the token table is split along its vocabulary; the position table stays whole
    tables = {v.path: split_axes(v) for v in model.variables if v.path.endswith("embeddings")}
    assert sorted(tables.values()) == [[], ["model"]], tables
    assert "layout=auto on mesh batch=2,model=2" in caplog.text
    assert "parameters per device" in caplog.text


def test_auto_layout_runs_a_convnet_with_its_convolutions_replicated():
    model = assert_exact(convnet)
    layouts = {v.path: split_axes(v) for v in model.variables}
    assert all(not layouts[p] for p in layouts if p.startswith(("conv", "bn"))), layouts
    assert layouts["fc/kernel"] == ["model"] and layouts["head/kernel"] == ["model"], layouts


def test_auto_layout_trains_depthwise_and_separable_convolutions_like_one_device():
    """DTensor cannot lay out TensorFlow's depthwise gradients; tfdist's rewrite of them
    (rewrites.py) makes a MobileNet-shaped model train, exact."""
    model = assert_exact(mobile_convnet)
    layouts = {v.path: split_axes(v) for v in model.variables}
    assert not any(layouts[p] for p in layouts if p.startswith(("stem", "depth", "separ", "bn")))
    assert layouts["fc/kernel"] == ["model"], layouts


def test_auto_layout_trains_normalization_stems_and_average_pooling_like_one_device():
    """Normalization's plain-tensor statistics are put on the mesh (sharding.
    replicate_layer_constants) and average pooling gets a gradient DTensor can run: the
    stems of EfficientNet and ConvNeXt and DenseNet's transitions failed at their first
    step under any DTensor layout before."""
    model = assert_exact(preprocessed_convnet)
    assert split_axes(model.get_layer("fc").kernel) == ["model"]


@pytest.mark.parametrize("shape,window,strides,padding", [
    ((2, 8, 8, 3), 2, 2, "VALID"), ((2, 9, 7, 3), 3, 2, "SAME"), ((2, 9, 7, 2), 3, 1, "VALID"),
    ((2, 11, 3), 3, 2, "SAME"), ((2, 10, 3), 2, 2, "VALID")])
def test_average_pooling_taps_give_tensorflows_gradients(shape, window, strides, padding):
    import tensorflow as tf
    from tfdist.parallel.dtensor import rewrites
    x = tf.constant(np.random.default_rng(len(shape) + window).normal(size=shape), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        native = tf.nn.avg_pool(x, window, strides, padding)
        rewritten = rewrites.avg_pool(x, window, strides, padding)
        native_loss, rewritten_loss = (tf.reduce_sum(tf.sin(y)) for y in (native, rewritten))
    np.testing.assert_array_equal(native.numpy(), rewritten.numpy())   # the forward is TF's
    want, got = tape.gradient(native_loss, x), tape.gradient(rewritten_loss, x)
    assert equivalence.relative_error(got, want) < 1e-6


@pytest.mark.parametrize("strides,padding,dilation,multiplier", [
    (1, "SAME", 1, 1), (2, "SAME", 1, 2), (1, "VALID", 2, 1), (2, "VALID", 1, 3),
    (3, "SAME", 1, 1)])
def test_depthwise_taps_give_tensorflows_gradients(strides, padding, dilation, multiplier):
    import tensorflow as tf
    from tfdist.parallel.dtensor import rewrites
    rng = np.random.default_rng(strides + multiplier)
    x = tf.constant(rng.normal(size=(2, 9, 10, 3)), tf.float32)
    kernel = tf.constant(rng.normal(size=(3, 3, 3, multiplier)), tf.float32)
    args = ([1, strides, strides, 1], padding)
    dilations = (dilation, dilation) if strides == 1 else None
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, kernel])
        native = tf.nn.depthwise_conv2d(x, kernel, *args, dilations=dilations)
        rewritten = rewrites.depthwise_conv2d(x, kernel, *args, dilations=dilations)
        native_loss, rewritten_loss = (tf.reduce_sum(tf.sin(y)) for y in (native, rewritten))
    np.testing.assert_array_equal(native.numpy(), rewritten.numpy())   # the forward is TF's
    for want, got in zip(tape.gradient(native_loss, [x, kernel]),
                         tape.gradient(rewritten_loss, [x, kernel])):
        assert equivalence.relative_error(got, want) < 1e-6


def test_keras_calls_the_rewritten_functions():
    """Canary for rewrites.py: Keras' TF backend calls tf.nn.depthwise_conv2d,
    separable_conv2d, avg_pool and sparse_softmax_cross_entropy_with_logits by attribute,
    so the swap reaches its layers and losses."""
    import keras
    import tensorflow as tf
    from tfdist.parallel.dtensor import rewrites
    swapped = ("avg_pool", "depthwise_conv2d", "separable_conv2d",
               "sparse_softmax_cross_entropy_with_logits")
    calls = []

    def counted(name, function):
        return lambda *args, **kwargs: calls.append(name) or function(*args, **kwargs)

    with rewrites.dtensor_runnable_ops():
        for name in swapped:
            setattr(tf.nn, name, counted(name, getattr(tf.nn, name)))
        mobile_convnet()(np.zeros((1, 8, 8, 3), "float32"))
        predictions = preprocessed_convnet()(np.zeros((1, 8, 8, 3), "float32"))
        keras.losses.SparseCategoricalCrossentropy(from_logits=True)(np.array([1]), predictions)
    assert sorted(set(calls)) == list(swapped), calls
    assert all(getattr(tf.nn, name) is rewrites.native(name) for name in swapped)  # restored


# ------------------------------------------------------------------------- refusals

def _keras_layout_map(rules):
    import keras
    from tfdist.parallel.dtensor import keras_layouts
    layout_map = keras.distribution.LayoutMap(keras_layouts.device_mesh(MESH))
    for key, axes in rules.items():
        layout_map[key] = axes
    return layout_map


REFUSALS = {
    # DTensor's own error at the first step, for the record:
    "split_filter": (convnet, {"conv2/kernel": (None, None, None, "model")}, "conv2",
                     "Filter for convolution must have fully replicated layout."),
    "channel_split_norm": (convnet, {"bn1/gamma": ("model",), "bn1/beta": ("model",)}, "bn1",
                           "Conv input's channel dimension must be replicated."),
    "row_split_final_dense": (timeseries_classifier, {"dense/kernel": ("model", None)}, "dense",
                              "{0} only supports batch parallel layouts.tf.Conv2DBackpropFilter"),
}


@pytest.mark.parametrize("kind", ["dict", "json_file", "keras_layout_map"])
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_layout_dtensor_cannot_run_is_refused_before_the_first_step(case, kind, tmp_path):
    import tfdist
    from tfdist.parallel.dtensor import sharding
    build, rules, layer, _ = REFUSALS[case]
    if kind == "json_file":
        path = tmp_path / "layout.json"
        path.write_text(json.dumps({key: [a or "unsharded" for a in axes]
                                    for key, axes in rules.items()}))
        layout = str(path)
    elif kind == "keras_layout_map":
        layout = _keras_layout_map(rules)
    else:
        layout = rules
    x, y = arrays(build)
    strategy = tfdist.Strategy("dtensor", simulate_devices=4, mesh=MESH, layout=layout)
    model = build()
    with pytest.raises(UsageError) as raised:
        strategy.fit(model, x, y, batch_size=BATCH, epochs=1, verbose=0)
    strategy.close()
    message = str(raised.value)
    assert f"'{layer}" in message or f"{layer}/" in message, message
    assert "DTensor runs convolutions only with replicated filters and channel-replicated " \
           "inputs; it can split them only along the batch" in message
    assert re.search(r"(--layout=auto|layout='auto')", message) and "Dense" in message
    assert "\n" not in message and not any(text in message for text in TF_ERROR_TEXT), message
    # refused before anything moved: no variable has DTensor storage yet
    assert not any(isinstance(v.value, sharding.ShardedVariable) for v in model.variables)


def test_channels_first_depthwise_convolutions_are_refused_whatever_the_layout():
    """DTensor has no layout rule for DepthwiseConv2dNative's gradients; tfdist rewrites
    them for channels_last only, so a channels_first one is refused before any trace."""
    import keras
    from tfdist.parallel.dtensor import layout_check
    inputs = keras.Input((3, 8, 8))
    x = keras.layers.DepthwiseConv2D(3, data_format="channels_first", name="dw")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(x)))
    replicated = {v.path: ("unsharded",) * len(v.shape) for v in model.variables}
    with pytest.raises(UsageError, match=r"channels_first depthwise convolutions: 'dw' "
                                         r"\(DepthwiseConv2D\).*channels_last"):
        layout_check.check(model, replicated)


def test_a_keras_activation_layout_that_splits_channels_before_a_convolution_is_refused():
    """keras.distribution's `<layer path>/output` keys relayout a layer's output (Keras'
    Layer.__call__): one splitting the channels that reach a convolution is refused too."""
    from tfdist.parallel.dtensor import layout_check
    model = convnet()
    replicated = {v.path: ("unsharded",) * len(v.shape) for v in model.variables}
    with pytest.raises(UsageError, match=re.escape("the activation layout 'relu.?/output'") +
                       r".*convolution 'conv[12]'"):
        layout_check.check(model, replicated, {"relu.?/output": ("batch", None, None, "model")})
    layout_check.check(model, replicated, {"relu.?/output": ("batch", None, None, None)})


# ------------------------------------------------------------------------- what auto picks

def _choices(model, ways=2):
    from tfdist.parallel.dtensor import auto_layout
    return {c.path: c.spec for c in auto_layout.choose(model, ways)}


def test_auto_layout_replicates_every_pair_it_cannot_prove_sealed():
    import keras
    layers = keras.layers
    norm = layers.LayerNormalization   # not elementwise: it ends any chain
    inputs = keras.Input((6,))
    a = layers.Dense(8, activation="relu", name="used_twice")(inputs)
    b = layers.Dense(8, name="after_used_twice")(a)
    x = norm()(layers.Add()([a, b]))
    x = layers.Dense(8, activation="softmax", name="softmax_first")(x)
    x = norm()(layers.Dense(6, name="after_softmax")(x))
    x = layers.Dense(7, activation="relu", name="odd_hidden")(x)
    x = norm()(layers.Dense(6, name="after_odd")(x))
    x = layers.Dense(8, activation="gelu", name="column")(x)
    x = layers.Activation("tanh")(x)
    out = layers.Dense(3, name="row")(x)
    chosen = _choices(keras.Model(inputs, out))
    assert chosen == {"column/kernel": ("unsharded", "model"), "column/bias": ("model",),
                      "row/kernel": ("model", "unsharded")}, chosen


def test_auto_layout_reads_einsum_dense_pairs_and_respects_the_model_axis():
    import keras
    layers = keras.layers
    inputs = keras.Input((4, 6))
    x = layers.EinsumDense("abc,cd->abd", output_shape=(None, 12), bias_axes="d",
                           activation="relu", name="up")(inputs)
    out = layers.EinsumDense("abd,de->abe", output_shape=(None, 6), name="down")(x)
    model = keras.Model(inputs, out)
    assert _choices(model, 2) == {"up/kernel": ("unsharded", "model"), "up/bias": ("model",),
                                  "down/kernel": ("model", "unsharded")}
    assert _choices(model, 3) == _choices(model, 2)
    assert _choices(model, 5) == {}   # 12 hidden units do not split 5 ways


def test_auto_layout_never_splits_what_reaches_a_convolution():
    from tfdist.parallel.dtensor import layout_check
    for build in (convnet, timeseries_classifier):
        model = build()
        chosen = _choices(model)
        specs = {v.path: chosen.get(v.path, ("unsharded",) * len(v.shape))
                 for v in model.variables}
        layout_check.check(model, specs)
        assert not any(p.startswith(("conv", "bn")) for p in chosen), chosen


def test_auto_layout_finds_the_pair_a_subclassed_block_calls_in_python():
    """tfdist's own transformer block calls mlp_fc_in then mlp_fc_out in its Python call:
    tracing it shows the pair; its hand-written attention (reshapes into heads) is not a
    pattern auto can prove, so it stays replicated."""
    from tfdist import models
    from tfdist.config import ModelConfig
    from tfdist.data.base import LANGUAGE_MODEL, DatasetInfo
    info = DatasetInfo(name="text", task=LANGUAGE_MODEL, input_shape=(SEQ,), input_dtype="int32",
                       num_classes=VOCAB)
    model = models.build_model(info, ModelConfig(name="transformer", num_layers=1, d_model=16,
                                                 num_heads=2, d_ff=32))
    chosen = _choices(model)
    assert chosen == {"embedding/embeddings": ("model", "unsharded"),
                      "block_0/mlp_fc_in/kernel": ("unsharded", "model"),
                      "block_0/mlp_fc_in/bias": ("model",),
                      "block_0/mlp_fc_out/kernel": ("model", "unsharded")}, chosen
    # the trace wrapped sublayers' call on the instance only while it ran
    assert not any("call" in vars(layer) for layer in model._flatten_layers())


def test_auto_layout_reads_keras_hub_transformer_blocks():
    """keras-hub's TransformerEncoder (BERT) calls its feed-forward Denses directly, with
    keras-hub's own gelu: the pair is split; attention by heads; the token table by
    vocabulary, the position table kept whole."""
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.BertBackbone(vocabulary_size=64, num_layers=1, num_heads=2,
                                             hidden_dim=16, intermediate_dim=32,
                                             max_sequence_length=SEQ)
    chosen = _choices(backbone)
    block = "transformer_layer_0"
    assert chosen[f"{block}/feedforward_intermediate_dense/kernel"] == ("unsharded", "model")
    assert chosen[f"{block}/feedforward_output_dense/kernel"] == ("model", "unsharded")
    assert chosen[f"{block}/self_attention_layer/query/kernel"] == ("unsharded", "model",
                                                                    "unsharded")
    assert chosen["token_embedding/embeddings"] == ("model", "unsharded")
    assert not any("position" in path for path in chosen), chosen


def test_keras_graph_api_canary():
    """model_graph reads Keras' private graph attributes; this fails if they change."""
    import keras
    from tfdist.parallel.dtensor import model_graph
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="d")], name="inner")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(inner(inputs)))
    assert isinstance(model._nodes_by_depth, dict) and inner._functional is not None
    assert [l.name for l in model_graph.sublayers(model)
            if not isinstance(l, keras.layers.InputLayer)] == ["inner", "d", "head"]
    (graph,) = model_graph.read(model)
    names = [call.layer.name for call in graph.calls]
    assert names == ["d", "head"], names          # the nested Sequential read in place
    assert graph.calls[0].outputs == graph.calls[1].inputs
    assert graph.calls[0].inputs == graph.inputs


# ------------------------------------------------------------------------- docs and CLI

def readme_example() -> str:
    text = DOCS_PAGE.read_text()
    section = text.split(DOCS_HEADING, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs_as_written(caplog):
    namespace = {}
    with caplog.at_level(logging.INFO, logger="tfdist"):
        exec(compile(readme_example(), str(DOCS_PAGE), "exec"), namespace)  # noqa: S102
    namespace["strategy"].close()
    assert "layout=auto on mesh batch=2,model=2" in caplog.text
    kernels = {v.path: split_axes(v) for v in namespace["model"].variables
               if v.path.endswith("kernel")}
    assert kernels["ffn_in/kernel"] == kernels["ffn_out/kernel"] == ["model"], kernels
    assert kernels["attention/query/kernel"] == ["model"] and kernels["head/kernel"] == []


def test_cli_layout_auto_prints_its_table(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--strategy=dtensor", "--simulate_devices=4",
         "--mesh=batch=2,model=2", "--layout=auto", "--model=mlp", "--dataset=synthetic",
         "--train_steps=1", "--global_batch_size=8", f"--results_json={tmp_path}/r.json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "layout=auto on mesh batch=2,model=2" in log, log[-3000:]
    assert re.search(r"dense_0/kernel +\[unsharded, model\]", log), log[-3000:]
    assert re.search(r"dense_1/kernel +\[model, unsharded\]", log), log[-3000:]


def float64_dense_model(from_logits=False):
    import keras
    with equivalence.dtype_policy("float64"):
        inputs = keras.Input((12,))
        hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
        outputs = keras.layers.Dense(CLASSES, activation=None if from_logits else "softmax",
                                     name="head")(hidden)
        model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits))
    return model


@pytest.mark.parametrize("from_logits", [False, True])
def test_a_float64_model_with_its_classes_split_trains_like_one_device(from_logits):
    """DTensor computes a float64 sparse cross-entropy over split classes as 0 (with
    logits) or -inf (Keras' log of probabilities) where its propagation keeps the classes
    split up to the loss: the canary below, and ResNet50 / MobileNetV2 in the conformance
    corpus. A model this small may gather them first; this holds the rewrite (rewrites.py),
    which every float64 model under DTensor now takes, to one device's numbers."""
    import keras
    import tfdist
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(STEPS * BATCH, 12)), rng.integers(0, CLASSES, STEPS * BATCH)

    def build():
        return float64_dense_model(from_logits)

    reference = equivalence.train_keras(
        "default", build, x, y, fit_kwargs=dict(batch_size=BATCH, epochs=1, shuffle=False))
    split = {"hidden/kernel": (None, "model"), "hidden/bias": ("model",),
             "head/kernel": ("model", None)}
    if from_logits:      # the classes themselves split, as the canary's
        split = {"head/kernel": (None, "model"), "head/bias": ("model",)}
    strategy = tfdist.Strategy("dtensor", seed=0, simulate_devices=4, mesh=MESH, layout=split)
    try:
        keras.utils.set_random_seed(0)
        model = build()
        strategy.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        candidate = equivalence.Record("dtensor float64 split", list(strategy.last_result.losses),
                                       model.get_weights())
    finally:
        strategy.close()
    assert len(candidate.losses) == STEPS and model.get_weights()[0].dtype == np.float64
    equivalence.assert_equivalent(reference.record(), candidate)


def test_dtensor_float64_sparse_cross_entropy_canary():
    """Why rewrites.py rewrites this loss in float64: DTensor computes it as 0 on float64
    logits split along their classes (float32 is right). When this fails, upstream fixed
    it: the rewrite can go."""
    import tensorflow as tf
    from tensorflow.experimental import dtensor
    mesh = dtensor.create_mesh([("batch", 2), ("model", 2)],
                               devices=[f"CPU:{i}" for i in range(4)])
    logits = np.random.default_rng(0).uniform(0.1, 1, size=(4, 10))
    labels = np.array([1, 7, 3, 9])
    expected = float(tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)))

    @tf.function
    def total(split_logits, split_labels):
        return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(split_labels,
                                                                            split_logits))

    def on_mesh(value, axes):
        replicated = dtensor.copy_to_mesh(tf.constant(value),
                                          dtensor.Layout.replicated(mesh, len(axes)))
        return dtensor.relayout(replicated, dtensor.Layout(axes, mesh))

    results = {}
    for dtype in ("float32", "float64"):
        value = total(on_mesh(logits.astype(dtype), ["batch", "model"]),
                      on_mesh(labels, ["batch"]))
        results[dtype] = float(dtensor.unpack(value)[0])
    assert abs(results["float32"] - expected) < 1e-5 * expected
    assert results["float64"] == 0.0, results
