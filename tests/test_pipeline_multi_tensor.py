"""Pipeline cuts that several tensors cross (tfdist/parallel/pipeline/partition.py):
which tensors a stage sends and which gradients come back, equal to one device,
and, in the placed graph, nothing but those tensors crosses devices.

The model: a skip connection spans two cuts (a is sent past b and c), and the
model input is read again by the last layers, so it travels along every stage.
"""

import numpy as np
import pytest
import keras
import tensorflow as tf

from tfdist.errors import UsageError
from tfdist.parallel.pipeline import PipelineParallelism, partition as partition_lib, schedule
from tfdist.testing import equivalence

EXAMPLES, GLOBAL_BATCH = 128, 32


def skip_model() -> keras.Model:
    features = keras.Input((8,), name="features")
    a = keras.layers.Dense(16, activation="tanh", name="a")(features)
    b = keras.layers.Dense(16, activation="tanh", name="b")(a)
    c = keras.layers.Dense(16, activation="tanh", name="c")(b)
    joined = keras.layers.Add(name="skip")([a, c])
    both = keras.layers.Concatenate(name="with_features")([joined, features])
    return keras.Model(features, keras.layers.Dense(1, name="out")(both), name="skip_model")


def compiled_skip_model(optimizer):
    def build():
        model = skip_model()
        model.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
        return model
    return build


def regression_data(n: int = EXAMPLES, seed: int = 3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (np.sin(x[:, :1]) + x[:, 1:2] * x[:, 2:3]).astype("float32")
    return x, y


def producers(boundary):
    return [(t.producer, t.differentiable) for t in boundary]


def test_each_cut_sends_every_tensor_that_crosses_it():
    model = skip_model()
    layers = partition_lib.chain_layers(model)
    names = [layer.name for layer in layers]
    cut = {name: names.index(name) for name in names}
    # The model input rides along (no gradient: nothing upstream to train).
    assert producers(partition_lib.boundary_tensors(model, layers, cut["b"])) == [
        (None, False), ("a", True)]
    assert producers(partition_lib.boundary_tensors(model, layers, cut["c"])) == [
        (None, False), ("a", True), ("b", True)]
    assert producers(partition_lib.boundary_tensors(model, layers, cut["skip"])) == [
        (None, False), ("a", True), ("c", True)]
    assert producers(partition_lib.boundary_tensors(model, layers, cut["out"])) == [
        ("with_features", True)]
    partition = partition_lib.partition_model(model, 4, ("b", "c", "skip"))
    assert [s.layers for s in partition.stages] == [
        ("a",), ("b",), ("c",), ("skip", "with_features", "out")]
    assert [len(s.boundary) for s in partition.stages] == [2, 3, 3, 0]
    assert "sends features (model input), " in partition.describe()


def test_automatic_balancing_cuts_where_one_computed_tensor_crosses():
    # a, b, c, out cost 144, 272, 272, 25 parameters. Model inputs ride along free, so
    # the cuts before b and before with_features are candidates (before, with the
    # model input crossing too, only the cut before 'out' was); the cuts before c and
    # before skip send two computed tensors and are left to a --pipeline_split.
    model = skip_model()
    partition = partition_lib.partition_model(model, 3)
    assert [s.layers for s in partition.stages] == [
        ("a",), ("b", "c", "skip"), ("with_features", "out")]
    assert producers(partition.stages[0].boundary) == [(None, False), ("a", True)]
    layers = partition_lib.chain_layers(model)
    problem = partition_lib._cut_problem(model, layers, 2)   # before c
    assert "2 computed tensors cross the cut before 'c'" in problem
    assert "--pipeline_split" in problem
    assert partition_lib._cut_problem(model, layers, 2, named=True) is None


def wide_model(width: int) -> keras.Model:
    """`width` branches computed before one layer that joins them all."""
    inputs = keras.Input((4,))
    branches = [keras.layers.Dense(2, name=f"branch_{i}")(inputs) for i in range(width)]
    joined = keras.layers.Concatenate(name="join")(branches)
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(joined))


def test_a_cut_that_too_many_tensors_cross_is_refused_with_what_crosses():
    limit = partition_lib.MAX_BOUNDARY_TENSORS
    assert partition_lib.partition_model(wide_model(limit), 2, ("join",))
    with pytest.raises(UsageError) as error:
        partition_lib.partition_model(wide_model(limit + 1), 2, ("join",))
    text = str(error.value)
    assert f"{limit + 1} tensors cross the cut before 'join'" in text
    assert f"at most {limit}" in text and "(branch_4)" in text and "\n" not in text


CASES = {
    # (optimizer, strategy options)
    "sgd-2_stages-3_tensors": (lambda: keras.optimizers.SGD(0.05), dict(
        simulate_devices=2, pipeline_stages=2, microbatches=2, pipeline_split=("c",))),
    "adam-4_stages-1f1b": (lambda: keras.optimizers.Adam(0.01), dict(
        simulate_devices=4, pipeline_stages=4, microbatches=2,
        pipeline_split=("b", "c", "skip"), pipeline_schedule="1f1b")),
    "adam-2x2_hybrid-automatic": (lambda: keras.optimizers.Adam(0.01), dict(
        simulate_devices=4, pipeline_stages=2, microbatches=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_skip_connection_across_cuts_trains_like_one_device(case):
    optimizer, options = CASES[case]
    x, y = regression_data()
    fit_kwargs = dict(batch_size=GLOBAL_BATCH, epochs=2, validation_data=(x[:32], y[:32]))
    build = compiled_skip_model(optimizer)
    reference = equivalence.train_keras("default", build, x, y, fit_kwargs=fit_kwargs)
    candidate = equivalence.train_keras("pipeline", build, x, y, fit_kwargs=fit_kwargs,
                                        label=case, **options)
    report = equivalence.compare_runs(reference, candidate)
    print(f"{case}: {equivalence.describe_errors(reference, candidate)}")
    assert len(candidate.losses) == 2 * EXAMPLES // GLOBAL_BATCH
    assert report.equivalent, str(report)


# ---------------------------------------------------------------- what crosses devices

def typed_sends(step, iterator) -> list:
    """[(producer name, sending device, receiving device, a captured scalar?)] of one placed
    step: test_pipeline_parallel.cross_device_sends plus what the producer is, from the
    same run metadata (Grappler off, so producers keep our names)."""
    from test_pipeline_parallel import _is_train_step, placed_run_metadata
    metadata = placed_run_metadata(step, iterator)
    sends = []
    for function_graph in filter(_is_train_step, metadata.function_graphs):
        for graph in function_graph.partition_graphs:
            nodes = {node.name: node for node in graph.node}
            for node in graph.node:
                if node.op not in ("_Send", "_HostSend"):
                    continue
                producer = nodes[node.input[0].split(":")[0].lstrip("^")]
                if producer.op == "Const" and "/ctrl/" in producer.name:
                    continue   # a control edge, no data
                sends.append((producer.name, node.attr["send_device"].s.decode(),
                              node.attr["recv_device"].s.decode(), _captured_scalar(producer)))
    assert sends, "no cross-device transfers found: run metadata format changed?"
    return sends


def _captured_scalar(producer) -> bool:
    """A float scalar the step captured from outside (an _Arg of the function)."""
    shapes = producer.attr["_output_shapes"].list.shape
    return (producer.op == "_Arg" and producer.attr["T"].type == tf.float32.as_datatype_enum
            and len(shapes) == 1 and not shapes[0].dim and not shapes[0].unknown_rank)


ISOLATED = "TFDIST_PIPELINE_MULTI_TENSOR_PLACEMENT"


def test_placement_checks_in_a_fresh_process(run_own_process):
    """Runs the checks below in a fresh process, as tests/test_pipeline_parallel.py does
    its own (a long shared test process once misplaced an input split)."""
    result, requested, passed = run_own_process(
        ISOLATED, ["tests/test_pipeline_multi_tensor.py"], timeout=400)
    assert result.returncode == 0, result.stdout[-3000:]
    import importlib.util
    expected = 2 if importlib.util.find_spec("keras_hub") else 1   # keras-hub: a test extra
    assert len(passed) == expected and set(requested) <= passed, (requested, passed)


def gemma_lm_compiled():
    pytest.importorskip("keras_hub")
    import keras_hub_pipeline_models
    return keras_hub_pipeline_models.compiled_gemma_lm("adam")(), \
        keras_hub_pipeline_models.token_data(16)


PLACED = {
    # name: (compiled model and data, stages, devices, split)
    "skip_model-4_stages": (lambda: (compiled_skip_model(keras.optimizers.Adam)(),
                                     regression_data(16)), 4, 4, ("b", "c", "skip")),
    "gemma_lm-2x2_hybrid": (gemma_lm_compiled, 2, 4, None),
}


@pytest.mark.own_process(ISOLATED)
@pytest.mark.parametrize("name", sorted(PLACED))
def test_only_the_boundary_tensors_cross_devices(name):
    from test_pipeline_parallel import classify
    make, stages, num_devices, split = PLACED[name]
    microbatches = 2
    (model, (x, y)) = make()
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:num_devices]
    parallel = PipelineParallelism(devices, stages, microbatches, split)
    replica0, optimizer = parallel.adopt(model)
    replicas = num_devices // stages
    per_replica = len(y) // replicas
    step = parallel.make_train_step(replica0, optimizer, len(y), False)
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(per_replica).repeat()
    index = {tf.DeviceSpec.from_string(d).device_index: i for i, d in enumerate(devices)}

    def position(device):
        return divmod(index[tf.DeviceSpec.from_string(device).device_index], stages)

    kinds = ["captured scalar" if captured_scalar
             else classify(producer, source, target, position, stages)
             for producer, source, target, captured_scalar in typed_sends(step, iter(batches))]
    # Besides the boundary tensors, only keras-hub's sqrt(hidden_dim): a scalar made
    # eagerly on the host when the backbone is built, which every replica's clone
    # shares; the step captures it from the host and sends it to the other replicas.
    assert kinds.count("captured scalar") <= (replicas - 1) * microbatches
    boundaries = [s.boundary for s in parallel.partition.stages]
    sent = replicas * microbatches * sum(len(b) for b in boundaries)
    returned = replicas * microbatches * sum(t.differentiable for b in boundaries for t in b)
    assert sent > returned > 0      # integer tensors and model inputs get no gradient
    assert kinds.count("activation") == sent
    assert kinds.count("gradient") == returned
    assert schedule.BOUNDARY_ACTIVATION == "pipeline_boundary_activation"  # names kept
