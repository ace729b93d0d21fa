"""Users' own data through tfdist's input pipeline (tfdist.data.user), on real tf.data.

Examples carry their id in a feature, so every check can say which examples a
global step trained on and that their features, labels and weights stayed together.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfdist.config import DataConfig
from tfdist import data as tfdist_data
from tfdist.data import get_source, pipeline, user
from tfdist.errors import UsageError

NUM_EXAMPLES = 37   # not a multiple of any batch: epochs and eval padding have ragged ends
GLOBAL_BATCH = 8
SEED = 11


def user_arrays(n=NUM_EXAMPLES):
    """(x, y, w) with dict features, float (regression) labels, float64 weights: all of id."""
    ids = np.arange(n)
    x = {"id": ids.astype(np.int32), "pixels": np.stack([ids, -ids], axis=1).astype(np.float64)}
    return x, ids * 0.5, 1.0 + ids / 100.0


def user_dataset(n=NUM_EXAMPLES):
    x, y, w = user_arrays(n)
    return tf.data.Dataset.from_tensor_slices((x, y.astype(np.float32), w.astype(np.float32)))


def rows(batch):
    """[(id, pixels, label, weight)] of one per-replica batch of (x, y, w)."""
    x, y, w = (tf.nest.map_structure(lambda t: t.numpy(), part) for part in batch)
    return [(int(i), tuple(p.tolist()), float(label), float(weight))
            for i, p, label, weight in zip(x["id"], x["pixels"], y, w)]


def expected_row(i):
    return (i, (float(i), float(-i)), i * 0.5, np.float32(1.0 + i / 100.0).item())


def global_steps(dataset_fn, pipelines, replicas, steps):
    """The examples of each global step, fed by `pipelines` input pipelines."""
    streams = [iter(dataset_fn(tf.distribute.InputContext(pipelines, p, replicas)))
               for p in range(pipelines)]
    local = replicas // pipelines
    return [sorted(row for stream in streams for _ in range(local) for row in rows(next(stream)))
            for _ in range(steps)]


# --- the structure survives, the guarantee holds -------------------------------

@pytest.mark.parametrize("make_data", [user_arrays, user_dataset], ids=["arrays", "dataset"])
def test_same_examples_every_global_step_for_1_2_4_pipelines(make_data):
    fn = user.as_dataset_fns(make_data(), GLOBAL_BATCH, SEED).train
    one = global_steps(fn, 1, 1, steps=12)   # 96 examples: two epochs and a bit
    assert global_steps(fn, 2, 2, steps=12) == one
    assert global_steps(fn, 4, 4, steps=12) == one
    assert global_steps(fn, 1, 4, steps=12) == one
    assert global_steps(fn, 2, 4, steps=12) == one


def test_structure_dtypes_and_rows_round_trip():
    fn = user.as_dataset_fns(user_arrays(), GLOBAL_BATCH, SEED).train
    x, y, w = next(iter(fn(tf.distribute.InputContext())))
    assert set(x) == {"id", "pixels"}
    assert (x["id"].dtype, x["pixels"].dtype, y.dtype, w.dtype) == (
        tf.int32, tf.float32, tf.float32, tf.float32)   # float64 arrays -> floatx, as Keras does
    assert x["pixels"].shape == (GLOBAL_BATCH, 2) and w.shape == (GLOBAL_BATCH,)
    stream = [row for batch in fn(tf.distribute.InputContext()).take(9) for row in rows(batch)]
    assert all(row == expected_row(row[0]) for row in stream)   # x, y, w stayed together
    first_epoch = sorted(row[0] for row in stream[:NUM_EXAMPLES])
    assert first_epoch == list(range(NUM_EXAMPLES))


def test_same_examples_under_a_real_mirrored_strategy():
    fn = user.as_dataset_fns(user_dataset(), GLOBAL_BATCH, SEED).train
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    iterator = iter(strategy.distribute_datasets_from_function(fn))
    mirrored = []
    for _ in range(6):
        parts = [strategy.experimental_local_results(part)
                 for part in tf.nest.flatten(next(iterator))]
        per_replica = [tf.nest.pack_sequence_as(fn_spec(fn), [p[r] for p in parts])
                       for r in range(2)]
        mirrored.append(sorted(row for batch in per_replica for row in rows(batch)))
    assert mirrored == global_steps(fn, 1, 1, steps=6)


def fn_spec(fn):
    return fn(tf.distribute.InputContext()).element_spec


def test_keras_fit_takes_the_stream_with_dict_inputs_and_weights():
    import keras
    pixels = keras.Input((2,), name="pixels")
    ids = keras.Input((), dtype="int32", name="id")
    hidden = keras.layers.Dense(1)(pixels)
    model = keras.Model({"pixels": pixels, "id": ids}, keras.layers.Reshape(())(hidden))
    model.compile(optimizer="sgd", loss="mse")
    fn = user.as_dataset_fns(user_arrays(), GLOBAL_BATCH, SEED).train
    history = model.fit(fn(tf.distribute.InputContext()), steps_per_epoch=2, epochs=1, verbose=0,
                        shuffle=False)
    assert np.isfinite(history.history["loss"][0])


# --- evaluation: every example once, padding weighs nothing -------------------

def eval_rows(fns, pipelines=2, replicas=2):
    found = []
    for p in range(pipelines):
        dataset = fns.evaluate(tf.distribute.InputContext(pipelines, p, replicas))
        batches = list(dataset)
        assert len(batches) == fns.eval_steps * replicas // pipelines
        found += [row for batch in batches for row in rows(batch)]
    return found


def test_validation_data_counts_every_example_once_with_its_weight():
    fns = user.as_dataset_fns(user_arrays(10), GLOBAL_BATCH, SEED, validation_data=user_dataset())
    assert fns.eval_steps == 5   # ceil(37 / 8)
    found = eval_rows(fns)
    real = sorted(row for row in found if row[3] != 0.0)
    assert real == [expected_row(i) for i in range(NUM_EXAMPLES)]
    assert len(found) - len(real) == 5 * GLOBAL_BATCH - NUM_EXAMPLES


def test_without_weights_the_eval_weight_is_the_pad_flag():
    x, y, _ = user_arrays()
    fns = user.as_dataset_fns((x, y), GLOBAL_BATCH, SEED, validation_data=(x, y))
    weights = [row[3] for row in eval_rows(fns)]
    assert sorted(set(weights)) == [0.0, 1.0] and weights.count(1.0) == NUM_EXAMPLES
    train_batch = next(iter(fns.train(tf.distribute.InputContext())))
    assert len(train_batch) == 2   # (x, y): no weights invented for training


def test_eval_uses_the_test_split_when_there_is_no_validation_data():
    source = user.source_from_user_data(user_arrays(), user_dataset(20), name="mine")
    fns = user.as_dataset_fns(source, GLOBAL_BATCH, SEED)
    assert (fns.train_size, fns.eval_steps) == (NUM_EXAMPLES, 3)
    assert sorted(r[0] for r in eval_rows(fns) if r[3]) == list(range(20))
    assert user.as_dataset_fns(user_dataset(), GLOBAL_BATCH, SEED).evaluate is None


def test_a_dataset_of_unknown_length_is_counted_once():
    dataset = user_dataset(50).filter(lambda x, y, w: x["id"] < NUM_EXAMPLES)
    assert dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY
    source = user.source_from_user_data(dataset)
    assert source.info.size("train") == NUM_EXAMPLES
    assert source.info.input_shape is None and source.info.task is None
    fn = user.as_dataset_fns(source, GLOBAL_BATCH, SEED).train
    assert global_steps(fn, 2, 2, steps=5) == global_steps(
        user.as_dataset_fns(user_dataset(), GLOBAL_BATCH, SEED).train, 1, 1, steps=5)


# --- (d): the user's own dataset_fn, passed through ----------------------------

def test_a_dataset_fn_is_passed_through_and_resumes_by_skipping_batches():
    def dataset_fn(input_context):
        return tf.data.Dataset.range(1000).shard(
            input_context.num_input_pipelines, input_context.input_pipeline_id).batch(2)

    fns = user.as_dataset_fns(dataset_fn, GLOBAL_BATCH, SEED)
    assert fns.train is dataset_fn and fns.source is None and fns.train_size is None
    resumed = user.as_dataset_fns(dataset_fn, GLOBAL_BATCH, SEED, start_step=3).train
    context = tf.distribute.InputContext(2, 1, 4)   # 2 local replicas: 2 batches a step
    skipped = [b.numpy().tolist() for b in resumed(context).take(2)]
    whole = [b.numpy().tolist() for b in dataset_fn(context).take(8)]
    assert skipped == whole[6:8]


# --- the registry sources keep their streams ----------------------------------

def test_registry_source_stream_unchanged():
    """Golden values of the pipeline before user data (commit 8dc0294): labels and
    feature sums of synthetic's first two batches on pipeline 1 of 2, from step 2."""
    config = DataConfig(name="synthetic", synthetic_examples=600, synthetic_shape=(4,),
                        synthetic_classes=5)
    fns = tfdist_data.as_dataset_fns("synthetic", 8, 7, config, start_step=2)
    batches = list(fns.train(tf.distribute.InputContext(2, 1, 2)).take(2))
    assert [y.numpy().tolist() for _, y in batches] == [[0, 1, 2, 2], [3, 2, 3, 1]]
    sums = [float(np.sum(x.numpy().astype(np.float64))) for x, _ in batches]
    np.testing.assert_allclose(sums, [8.91857373714447, 8.699920058250427], rtol=0, atol=1e-9)
    assert fns.eval_steps == pipeline.eval_steps(get_source(config), 8)


# --- bad input: one paragraph, the values received, what would work ------------

def refused(make, *fragments):
    with pytest.raises(UsageError) as caught:
        make()
    message = str(caught.value)
    assert "\n" not in message and "Traceback" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_elements_must_be_2_or_3_tuples():
    four = tf.data.Dataset.from_tensor_slices(([1.0], [1], [1.0], [1.0]))
    refused(lambda: user.source_from_user_data(four), "4-tuples", "(features, label)")
    records = tf.data.Dataset.from_tensor_slices({"image": [[1.0]], "label": [1]})
    refused(lambda: user.source_from_user_data(records), "dict with keys ['image', 'label']",
            "dataset.map(")
    single = tf.data.Dataset.from_tensor_slices([1.0, 2.0])
    refused(lambda: user.source_from_user_data(single), "single TensorSpec")
    refused(lambda: user.source_from_user_data((np.zeros(3),)), "tuple of 1 items")


def test_arrays_of_different_lengths_name_every_length():
    x, y, w = user_arrays()
    x = dict(x, pixels=x["pixels"][:30])
    refused(lambda: user.source_from_user_data((x, y, w)),
            "x['id']: 37", "x['pixels']: 30", "y: 37", "sample_weight: 37")
    refused(lambda: user.source_from_user_data(([np.zeros(4), np.zeros(5)], np.zeros(4))),
            "x[0]: 4", "x[1]: 5", "y: 4")


def test_weights_must_be_float_scalars_per_example():
    x, y, _ = user_arrays()
    refused(lambda: user.source_from_user_data((x, y, np.ones(NUM_EXAMPLES, np.int64))),
            "dtype int64", "one float per example")
    refused(lambda: user.source_from_user_data((x, y, np.ones((NUM_EXAMPLES, 1)))),
            f"shape ({NUM_EXAMPLES}, 1)")
    as_vectors = tf.data.Dataset.from_tensor_slices((x, y, np.ones((NUM_EXAMPLES, 2))))
    refused(lambda: user.source_from_user_data(as_vectors), "sample_weight is TensorSpec",
            "float scalar")


def test_infinite_batched_ragged_and_empty_datasets_are_refused():
    refused(lambda: user.source_from_user_data(user_dataset().repeat()),
            "infinite", "finite dataset", "dataset_fn")
    refused(lambda: user.source_from_user_data(user_dataset().batch(4)),
            "features['id'] has shape (None,)", "dataset.unbatch()")
    ragged = tf.data.Dataset.from_tensor_slices(
        (tf.ragged.constant([[1.0], [2.0, 3.0]]), [0, 1]))
    refused(lambda: user.source_from_user_data(ragged), "RaggedTensorSpec", "dataset_fn")
    refused(lambda: user.source_from_user_data(user_dataset().take(0)), "has no examples")
    refused(lambda: user.source_from_user_data((np.zeros((0, 2)), np.zeros(0))), "no examples")


def test_wrong_kinds_of_data_are_named():
    refused(lambda: user.as_dataset_fns(42, GLOBAL_BATCH), "has type int", "tf.data.Dataset")
    refused(lambda: user.as_dataset_fns((user_dataset(), user_dataset()), GLOBAL_BATCH),
            "tuple holding tf.data.Datasets")
    refused(lambda: user.source_from_user_data((np.array(["a", "b"]), np.zeros(2))),
            "x is array(['a', 'b']", "numeric")
    refused(lambda: user.as_dataset_fns(user_arrays(), 0), "positive int, got 0")
    refused(lambda: user.as_dataset_fns(user_arrays(), 8, start_step=-1), "got -1")
    refused(lambda: user.source_from_user_data(user_arrays()).examples("test"),
            "no 'test' split", "train")
