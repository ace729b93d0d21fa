"""The pipeline runs the user's model as the user built it (tfdist/parallel/pipeline/
copying.py): keras-io's custom layers (no **kwargs in __init__), frozen layers (top-level,
inside a custom layer, inside a nested model) and non-trainable weights, each against one
device within 1e-5 over 8 steps, every replica's weights included; and a layer that cannot
be copied onto a stage is refused before training, with its name and the fix.

The transformer reproduces keras-io's "Text classification with Transformer"
(TokenAndPositionEmbedding, TransformerBlock, as written there: `super().__init__()`,
no get_config), at small sizes and dropout rate 0.
"""

import functools
import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

import tfdist
from tfdist.errors import UsageError
# keras-io's two custom layers as keras-io writes them (no **kwargs in __init__): the
# conformance corpus's copy, one for every test.
from benchmarks.conformance_keras_io import TokenAndPositionEmbedding, TransformerBlock
from tfdist.parallel.pipeline import PipelineParallelism, copying
from tfdist.testing import equivalence

MAXLEN, VOCAB, EMBED, HEADS, FF = 8, 20, 8, 2, 8
EXAMPLES, GLOBAL_BATCH = 64, 8    # one epoch: 8 steps
FIT = dict(batch_size=GLOBAL_BATCH, epochs=1)
LAYOUTS = {
    "2x4": dict(simulate_devices=2, pipeline_stages=2, microbatches=4),
    "2x1": dict(simulate_devices=2, pipeline_stages=2, microbatches=1),
    "hybrid_2x2": dict(simulate_devices=4, pipeline_stages=2, microbatches=2),
}
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1),
              "adam": lambda: keras.optimizers.Adam(0.01)}


def keras_io_transformer(optimizer: str, frozen: bool = False):
    """build_and_compile for keras-io's text classifier; `frozen`: the first Dense of the
    block's feed-forward and the top-level Dense are frozen after construction."""
    def build():
        inputs = layers.Input(shape=(MAXLEN,))
        x = TokenAndPositionEmbedding(MAXLEN, VOCAB, EMBED)(inputs)
        block = TransformerBlock(EMBED, HEADS, FF, rate=0.0)
        x = block(x)
        x = layers.GlobalAveragePooling1D()(x)
        hidden = layers.Dense(20, activation="relu")
        x = hidden(x)
        outputs = layers.Dense(2, activation="softmax")(x)
        model = keras.Model(inputs=inputs, outputs=outputs)
        if frozen:
            block.ffn.layers[0].trainable = False
            hidden.trainable = False
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model
    return build


def token_data():
    rng = np.random.default_rng(7)
    return (rng.integers(0, VOCAB, (EXAMPLES, MAXLEN)).astype("float32"),
            rng.integers(0, 2, (EXAMPLES,)))


# ---------------------------------------------------------------- non-trainable weights

class FixedScale(layers.Layer):
    """A buffer: a non-trainable weight the forward pass reads (no **kwargs either)."""

    def __init__(self, units):
        super().__init__()
        self.units = units

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(self.units,), initializer="random_normal",
                                     trainable=False)

    def call(self, x):
        return x * self.scale


class ExamplesSeen(layers.Layer):
    """A non-trainable weight updated in call: how many training examples went through."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def build(self, input_shape):
        self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x, training=None):
        if training:
            self.seen.assign_add(ops.cast(ops.shape(x)[0], self.seen.dtype))
        return x


def buffered_model(optimizer: str, count_examples: bool = False):
    """A nested functional encoder (Dense, frozen BatchNormalization: inference mode, its
    moving statistics non-trainable) then a FixedScale buffer, [ExamplesSeen,] a head."""
    def build():
        encoder_in = layers.Input((6,))
        norm = layers.BatchNormalization(
            moving_mean_initializer="random_normal", moving_variance_initializer="ones")
        encoded = norm(layers.Dense(12, activation="tanh")(encoder_in))
        encoder = keras.Model(encoder_in, encoded, name="encoder")
        norm.trainable = False
        inputs = layers.Input((6,))
        x = FixedScale(12)(encoder(inputs))
        if count_examples:
            x = ExamplesSeen(name="examples_seen")(x)
        x = layers.Dense(12, activation="relu")(x)
        model = keras.Model(inputs, layers.Dense(3, activation="softmax")(x))
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss="sparse_categorical_crossentropy")
        return model
    return build


def feature_data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(EXAMPLES, 6)).astype("float32"), rng.integers(0, 3, (EXAMPLES,))


# ---------------------------------------------------------------- helpers

@functools.lru_cache(maxsize=None)
def one_device(model: str, optimizer: str, frozen: bool = False):
    build, (x, y) = case(model, optimizer, frozen)
    return equivalence.train_keras("default", build, x, y, fit_kwargs=FIT)


def case(model: str, optimizer: str, frozen: bool = False):
    if model == "transformer":
        return keras_io_transformer(optimizer, frozen), token_data()
    return buffered_model(optimizer, count_examples=frozen), feature_data()


def pipeline_run(model: str, optimizer: str, layout: str, frozen: bool = False):
    build, (x, y) = case(model, optimizer, frozen)
    return equivalence.train_keras("pipeline", build, x, y, fit_kwargs=FIT,
                                   label=f"pipeline {layout}", **LAYOUTS[layout])


def replicas(layout: str) -> int:
    return LAYOUTS[layout]["simulate_devices"] // LAYOUTS[layout]["pipeline_stages"]


def assert_exact(reference, candidate, replicas: int):
    report = equivalence.compare_runs(reference, candidate)
    print(f"{candidate.label}: {equivalence.describe_errors(reference, candidate)}")
    assert len(reference.losses) == EXAMPLES // GLOBAL_BATCH
    assert len(candidate.replica_weights) == replicas
    assert report.equivalent, str(report)


def initial_weights_and_frozen(build):
    """The model's initial weights (train_keras seeds, then builds) and the indices of
    its non-trainable ones."""
    keras.utils.set_random_seed(0)
    model = build()
    trainable = {id(w) for w in model.trainable_weights}
    return model.get_weights(), [i for i, w in enumerate(model.weights)
                                 if id(w) not in trainable]


# ---------------------------------------------------------------- exactness

# Adam too: the position table is looked up with ops.arange, one sparse row per position
# per micro-batch, exact since the pipeline sums those rows before Adam squares them
# (bc92ca9, tfdist/train/sparse_rows.py).
@pytest.mark.parametrize("optimizer,layout", [("sgd", "2x4"), ("adam", "2x4"),
                                              ("sgd", "hybrid_2x2")])
def test_keras_io_transformer_without_kwargs_trains_like_one_device(optimizer, layout):
    candidate = pipeline_run("transformer", optimizer, layout)
    assert_exact(one_device("transformer", optimizer), candidate, replicas(layout))


@pytest.mark.parametrize("layout", ["2x4", "hybrid_2x2"])
def test_frozen_sub_layers_stay_bit_identical_and_the_rest_trains_exact(layout):
    """Frozen: a top-level Dense and a Dense inside the custom block's nested Sequential."""
    initial, frozen = initial_weights_and_frozen(keras_io_transformer("sgd", frozen=True))
    assert len(frozen) == 4, frozen   # two kernels, two biases
    candidate = pipeline_run("transformer", "sgd", layout, frozen=True)
    for replica, weights in candidate.replica_weights.items():
        for index in frozen:
            assert np.array_equal(weights[index], initial[index]), (replica, index)
    assert_exact(one_device("transformer", "sgd", frozen=True), candidate, replicas(layout))


def test_buffers_and_a_frozen_batch_norm_in_a_nested_model_behave_like_one_device():
    initial, frozen = initial_weights_and_frozen(buffered_model("adam"))
    # BatchNorm's 4 (frozen: gamma, beta and both moving statistics) and FixedScale's scale.
    assert len(frozen) == 5, frozen
    candidate = pipeline_run("buffered", "adam", "2x4")
    for index in frozen:
        assert np.array_equal(candidate.replica_weights["replica 0"][index], initial[index])
    assert_exact(one_device("buffered", "adam"), candidate, replicas("2x4"))


def test_a_weight_written_in_call_is_exact_without_micro_batches_and_refused_with_them():
    """ExamplesSeen writes its weight in call: one device writes it once a step; a
    pipeline of 2 stages x 1 micro-batch too (exact), of 4 micro-batches 4 times from
    parts of the batch: refused, naming the layer."""
    candidate = pipeline_run("buffered", "sgd", "2x1", frozen=True)
    assert_exact(one_device("buffered", "sgd", frozen=True), candidate, replicas("2x1"))
    assert candidate.replica_weights["replica 0"][-5] == EXAMPLES   # seen once each
    with pytest.raises(UsageError) as refused:
        pipeline_run("buffered", "sgd", "2x4", frozen=True)
    message = str(refused.value)
    assert "'examples_seen' (ExamplesSeen) writes examples_seen/" in message
    # The Python API names its arguments (microbatches=4), the command line its flags.
    assert "microbatches=4 micro-batches" in message and "microbatches=1" in message


# ---------------------------------------------------------------- refusals, before training

class NeedsAllArguments(layers.Layer):
    """Its get_config forgets an __init__ argument: from_config fails, also on retry."""

    def __init__(self, units, activation, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(units, activation=activation)

    def call(self, x):
        return self.dense(x)

    def get_config(self):
        return {**super().get_config(), "units": self.dense.units}


class TakesALock(layers.Layer):
    """An __init__ argument Keras cannot serialise: get_config raises."""

    def __init__(self, lock):
        super().__init__()
        self.lock = lock

    def call(self, x):
        return x


class TiedHead(layers.Layer):
    """Reads the token embedding layer's table: one weight, two top-level layers."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return ops.matmul(x, ops.transpose(self.embedding.embeddings))


class LearnsBatchStatistics(layers.Layer):
    """A BatchNormalization inside a custom layer, trainable: batch statistics."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = layers.BatchNormalization()

    def call(self, x):
        return self.norm(x)


def model_around(make_layer, embed=False):
    def build():
        inputs = layers.Input((6,))
        x = layers.Dense(6, name="first")(inputs)
        if embed:
            table = layers.Embedding(VOCAB, 6, name="tokens")
            x = TiedHead(table, name="tied_head")(x + table(ops.zeros_like(x[:, :1], "int32"))[:, 0])
        else:
            x = make_layer()(x)
        model = keras.Model(inputs, layers.Dense(3, name="out")(x))
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        return model
    return build


def refusal(build) -> str:
    x, y = feature_data()
    with pytest.raises(UsageError) as refused:
        equivalence.train_keras("pipeline", build, x, y, fit_kwargs=FIT, **LAYOUTS["2x4"])
    error = refused.value
    # One paragraph, no upstream error chained to it (the user sees no TensorFlow trace).
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
    assert "\n" not in str(error) and "Traceback" not in str(error)
    return str(error)


def test_a_layer_from_config_cannot_rebuild_is_refused_with_its_name_and_the_fix():
    message = refusal(model_around(lambda: NeedsAllArguments(4, "relu", name="needs_all")))
    assert "Layer 'needs_all' (NeedsAllArguments) cannot be copied onto a pipeline stage" in message
    assert "also without the keys Keras adds (name, trainable, dtype)" in message
    assert "activation" in message   # the upstream reason: the missing argument
    assert "**kwargs" in message and "get_config()" in message and "mirrored" in message


def test_a_layer_whose_get_config_raises_is_refused_with_its_name_and_the_fix():
    import threading
    message = refusal(model_around(lambda: TakesALock(threading.Lock())))
    assert "(TakesALock) cannot be copied onto a pipeline stage: get_config() failed" in message
    assert "**kwargs" in message and "get_config()" in message


def test_a_weight_shared_by_two_layers_is_refused():
    message = refusal(model_around(None, embed=True))
    assert "Layer 'tied_head' (TiedHead) shares the weight 'tokens/embeddings'" in message
    assert "layer 'tokens' (Embedding)" in message


def test_batch_norm_inside_a_custom_layer_is_refused_with_micro_batches():
    message = refusal(model_around(lambda: LearnsBatchStatistics(name="learns")))
    assert "has BatchNormalization (learns/batch_normalization" in message
    assert "microbatches=4 micro-batches" in message and "trainable=False" in message


# ---------------------------------------------------------------- placement

def test_a_nested_model_is_built_on_its_stage_device():
    """The nested encoder's variables (created as it is copied, outside clone_model's
    call_function) live on its stage's device, as every other layer's."""
    keras.utils.set_random_seed(0)
    model = buffered_model("sgd")()
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    parallel = PipelineParallelism(devices, num_stages=2, microbatches=1)
    parallel.adopt(model)
    replica = parallel.replicas[0]
    encoder_stage = next(stage for stage in replica.stages
                         if "encoder" in [op.name for op in stage.model.layers])
    encoder = replica.model.get_layer("encoder")
    for weight in encoder.weights:
        assert tf.DeviceSpec.from_string(weight.value.device).device_index == \
            tf.DeviceSpec.from_string(encoder_stage.device).device_index, weight.path
    assert np.array_equal(replica.model.get_weights()[0], model.get_weights()[0])


def test_a_lambda_layer_and_keras_ops_calls_are_copied_exactly():
    """keras-io examples use Lambda(lambda t: ...): Keras' own from_config refuses a Python
    lambda outside a deserialization scope; the copy keeps the user's function."""
    inputs = keras.Input((4,))
    x = layers.Lambda(lambda t: t * 2.0, name="double")(inputs)
    x = layers.Dense(3, name="head")(x + 1.0)
    model = keras.Model(inputs, x)
    copy = copying.copy_model(model)
    features = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
    assert np.array_equal(np.asarray(copy(features)), np.asarray(model(features)))
    names = [op.name for op in model.operations][1:]   # the input's name is clone_model's
    assert [op.name for op in copy.operations][1:] == names and names[0] == "double"


# ---------------------------------------------------------------- canaries

def test_keras_lambda_from_config_still_takes_safe_mode():
    """copying._from_config passes safe_mode=False for the user's live Lambda layers."""
    assert "safe_mode" in inspect.signature(keras.layers.Lambda.from_config).parameters


def test_keras_still_lists_nested_layers_parents_first():
    """copying.all_layers (Layer._flatten_layers, private: keras-team/keras#4398) and
    copying._GRAPH_MODELS (keras.src Functional, which keras exports no name for)."""
    assert list(inspect.signature(keras.layers.Layer._flatten_layers).parameters) == [
        "self", "include_self", "recursive"]
    block = TransformerBlock(EMBED, HEADS, FF)
    block(np.zeros((1, MAXLEN, EMBED), "float32"))
    found = copying.all_layers(block)
    assert found[0] is block and block.ffn in found and block.ffn.layers[0] in found
    assert found.index(block.ffn) < found.index(block.ffn.layers[0])
    inputs = keras.Input((2,))
    assert isinstance(keras.Model(inputs, layers.Dense(1)(inputs)), copying._GRAPH_MODELS)
