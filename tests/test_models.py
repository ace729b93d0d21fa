"""Model builders: shapes, dtypes, seeded weights, strategy-independent weights,
the transformer's variable-path interface, causality and input validation."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.config import ModelConfig
from tfdist.data.base import DatasetInfo
from tfdist.errors import UsageError
from tfdist.models import build_model

SPLITS = (("train", 100), ("test", 10))
DIGITS = DatasetInfo("digits", "classification", (8, 8, 1), "float32", 10, SPLITS)
CIFAR = DatasetInfo("cifar", "classification", (32, 32, 3), "float32", 10, SPLITS)
TEXT = DatasetInfo("text", "language_model", (16,), "int32", 256, SPLITS)
FLAT = DatasetInfo("flat", "classification", (64,), "float32", 10, SPLITS)

SMALL_INFO = {"mlp": DIGITS, "cnn": DIGITS, "resnet": DIGITS, "transformer": TEXT}
SHAPE_CASES = [("mlp", DIGITS), ("mlp", CIFAR), ("cnn", DIGITS), ("cnn", CIFAR),
               ("resnet", DIGITS), ("resnet", CIFAR), ("transformer", TEXT)]

TRANSFORMER_BLOCK_PATHS = [
    "attention_norm/gamma", "attention_norm/beta",
    "query/kernel", "query/bias", "key/kernel",
    "value/kernel", "value/bias", "attention_output/kernel", "attention_output/bias",
    "mlp_norm/gamma", "mlp_norm/beta",
    "mlp_fc_in/kernel", "mlp_fc_in/bias", "mlp_fc_out/kernel", "mlp_fc_out/bias",
]
TRANSFORMER_PATHS = (
    ["embedding/embeddings", "position_embedding/embeddings"]
    + [f"block_{i}/{path}" for i in range(2) for path in TRANSFORMER_BLOCK_PATHS]
    + ["final_norm/gamma", "final_norm/beta", "lm_head/kernel", "lm_head/bias"])


def seeded_build(name, info, seed=0, **config):
    keras.utils.set_random_seed(seed)
    return build_model(info, ModelConfig(name=name, **config))


def example_batch(info, batch_size=3, seed=0):
    rng = np.random.RandomState(seed)
    if info.task == "language_model":
        return rng.randint(0, info.num_classes, (batch_size,) + info.input_shape).astype("int32")
    return rng.rand(batch_size, *info.input_shape).astype("float32")


def weights(model):
    return {v.path: np.array(v.numpy()) for v in model.variables}


def assert_same_weights(model_a, model_b):
    paths_a = [v.path for v in model_a.variables]
    assert paths_a == [v.path for v in model_b.variables]
    for (path, a), b in zip(weights(model_a).items(), weights(model_b).values()):
        np.testing.assert_array_equal(a, b, err_msg=path)


@pytest.fixture(scope="module")
def mirrored():
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


@pytest.fixture
def mixed_bfloat16():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


# --- shapes and dtypes -------------------------------------------------------

@pytest.mark.parametrize("name,info", SHAPE_CASES, ids=lambda c: getattr(c, "name", c))
def test_built_model_outputs_float32_logits(name, info):
    model = seeded_build(name, info)
    expected = (3, 16, 256) if info.task == "language_model" else (3, 10)
    assert model.name == name and model.built and model.variables
    assert model.output.dtype == "float32"
    logits = model(example_batch(info))
    assert tuple(logits.shape) == expected and logits.dtype == tf.float32
    assert np.isfinite(logits.numpy()).all()


@pytest.mark.parametrize("name", sorted(SMALL_INFO))
def test_mixed_precision_computes_low_and_returns_float32(name, mixed_bfloat16):
    info = SMALL_INFO[name]
    model = seeded_build(name, info)
    assert all(v.dtype == "float32" for v in model.variables)  # master weights
    head = "lm_head" if name == "transformer" else "logits"
    assert model.get_layer(head).compute_dtype == "bfloat16"
    logits = model(example_batch(info))
    assert logits.dtype == tf.float32 and np.isfinite(logits.numpy()).all()


def test_mlp_layer_names():
    model = seeded_build("mlp", DIGITS, hidden_sizes=(20, 10, 5))
    dense = [layer.name for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    assert dense == ["dense_0", "dense_1", "dense_2", "logits"]
    assert model.get_layer("dense_2").units == 5


def test_cnn_stops_pooling_at_2x2():
    model = seeded_build("cnn", DIGITS, filters=(4, 4, 4))
    pools = [layer.name for layer in model.layers if isinstance(layer, keras.layers.MaxPooling2D)]
    assert pools == ["pool_0", "pool_1"]  # 8 -> 4 -> 2, then no 1x1
    assert tuple(model(example_batch(DIGITS)).shape) == (3, 10)


# --- weights depend only on the seed -----------------------------------------

@pytest.mark.parametrize("name", sorted(SMALL_INFO))
def test_same_seed_gives_identical_weights(name):
    info = SMALL_INFO[name]
    assert_same_weights(seeded_build(name, info), seeded_build(name, info))
    other = weights(seeded_build(name, info, seed=1))
    first_kernel = next(path for path in other if "kernel" in path or "embeddings" in path)
    assert not np.array_equal(weights(seeded_build(name, info))[first_kernel], other[first_kernel])


@pytest.mark.parametrize("name", sorted(SMALL_INFO))
def test_mirrored_scope_gives_default_weights(name, mirrored):
    info = SMALL_INFO[name]
    default = seeded_build(name, info)
    with mirrored.scope():
        distributed = seeded_build(name, info)
    assert_same_weights(default, distributed)
    for variable in distributed.variables:  # every replica holds the same copy
        for replica in mirrored.experimental_local_results(variable.value):
            np.testing.assert_array_equal(replica.numpy(), variable.numpy(), err_msg=variable.path)


# --- resnet: synchronized batch norm ------------------------------------------

def test_resnet_batch_norm_is_synchronized():
    model = seeded_build("resnet", DIGITS)
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert norms and all(layer.synchronized for layer in norms)


def test_resnet_training_step_on_two_replicas_matches_one_device(mirrored):
    images = example_batch(DIGITS, batch_size=8)
    single = seeded_build("resnet", DIGITS, filters=(8, 16))
    expected = single(images, training=True).numpy()
    with mirrored.scope():
        model = seeded_build("resnet", DIGITS, filters=(8, 16))
    batches = mirrored.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(images).batch(8))

    @tf.function
    def forward(batch):
        return mirrored.run(lambda x: model(x, training=True), args=(batch,))

    per_replica = mirrored.experimental_local_results(forward(next(iter(batches))))
    assert [r.shape[0] for r in per_replica] == [4, 4]
    np.testing.assert_allclose(np.concatenate(per_replica), expected, rtol=1e-4, atol=1e-5)


# --- transformer: variable paths and causality ---------------------------------

def test_transformer_variable_paths_are_pinned():
    model = seeded_build("transformer", TEXT, num_layers=2, d_model=64, num_heads=4, d_ff=256)
    assert [v.path for v in model.variables] == TRANSFORMER_PATHS
    shapes = {v.path: tuple(v.shape) for v in model.variables}
    assert shapes["embedding/embeddings"] == (256, 64)
    assert shapes["position_embedding/embeddings"] == (16, 64)
    for dense in ("query", "key", "value", "attention_output"):
        assert shapes[f"block_1/{dense}/kernel"] == (64, 64)
    assert shapes["block_0/mlp_fc_in/kernel"] == (64, 256)
    assert shapes["block_0/mlp_fc_out/kernel"] == (256, 64)
    assert shapes["lm_head/kernel"] == (64, 256)


def test_transformer_is_causal():
    model = seeded_build("transformer", TEXT)
    tokens = example_batch(TEXT, batch_size=2)
    logits = model(tokens).numpy()
    for position in (0, 7, 14):
        changed = tokens.copy()
        changed[:, position + 1:] = (changed[:, position + 1:] + 1) % TEXT.num_classes
        new_logits = model(changed).numpy()
        np.testing.assert_allclose(new_logits[:, :position + 1], logits[:, :position + 1],
                                   rtol=1e-6, atol=1e-6)
        assert not np.allclose(new_logits[:, position + 1:], logits[:, position + 1:])


# --- input validation -----------------------------------------------------------

@pytest.mark.parametrize("name,info,needs", [
    ("transformer", DIGITS, "language_model"),
    ("mlp", TEXT, "classification"),
    ("cnn", TEXT, "classification"),
    ("resnet", TEXT, "classification"),
])
def test_task_mismatch_is_a_usage_error(name, info, needs):
    with pytest.raises(UsageError, match=f"Model '{name}' needs a {needs} dataset") as error:
        build_model(info, ModelConfig(name=name))
    assert f"dataset '{info.name}' is a {info.task} dataset" in str(error.value)


@pytest.mark.parametrize("name", ["cnn", "resnet"])
def test_image_models_reject_flat_features(name):
    with pytest.raises(UsageError, match=r"needs images shaped \(height, width, channels\)"):
        build_model(FLAT, ModelConfig(name=name))
    assert tuple(seeded_build("mlp", FLAT)(example_batch(FLAT)).shape) == (3, 10)


def test_transformer_rejects_float_tokens():
    floats = DatasetInfo("floats", "language_model", (16,), "float32", 256, SPLITS)
    with pytest.raises(UsageError, match="needs integer token ids"):
        build_model(floats, ModelConfig(name="transformer"))
