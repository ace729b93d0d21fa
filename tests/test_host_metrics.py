"""The metrics' per-step update reads no metric: under a strategy, Keras' loss tracker
is a SyncOnReadVariable, and a read of one is a cross-replica sum (in multi-worker
modes two TensorFlow all-reduces a step, which leak in TensorFlow: see
tfdist.train.metrics.results_not_read)."""

import keras
import numpy as np
import tensorflow as tf

from tfdist.train import metrics as host_metrics


def compiled_under_two_replicas():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    batch = (np.ones((2, 4), np.float32), np.zeros((2,), np.int32))
    host_metrics.build_metrics(model, batch)
    return model


def handles_of(keras_variable):
    """The resource handles behind a Keras variable (one per replica when distributed)."""
    value = keras_variable.value
    components = getattr(value, "values", None) or [value]
    return [component.handle for component in components]


def captured_handles(concrete):
    return [external for external, _ in concrete.graph.captures]


def test_the_loss_tracker_is_distributed_so_the_check_below_means_something():
    model = compiled_under_two_replicas()
    tracker = [m for m in model.metrics if m.name == "loss"][0]
    assert len(handles_of(tracker.variables[0])) == 2


def test_the_traced_update_reads_no_distributed_metric_variable():
    model = compiled_under_two_replicas()
    update = host_metrics.HostMetrics(model, parallel=None).updater()
    y = tf.constant([0, 1], tf.int32)
    y_pred = tf.constant([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    w = tf.ones([2])
    concrete = tf.function(lambda: update((y, y_pred, w)) or 0).get_concrete_function()
    captured = {id(handle) for handle in captured_handles(concrete)}
    tracker = [m for m in model.metrics if m.name == "loss"][0]
    tracker_handles = [h for v in tracker.variables for h in handles_of(v)]
    accuracy_handles = [h for m in host_metrics.metric_objects(model)
                        for v in m.variables for h in handles_of(v)]
    assert len(tracker_handles) == 4 and accuracy_handles
    assert not [h for h in tracker_handles if id(h) in captured]
    # the update itself is traced: the accuracy's plain variables are captured
    assert all(id(h) in captured for h in accuracy_handles)
    concrete()
    assert float(host_metrics.metric_objects(model)[0].result()["accuracy"]) == 1.0


def test_get_metrics_result_is_the_models_own_again_after_the_block():
    model = compiled_under_two_replicas()
    with host_metrics.results_not_read(model):
        assert model.get_metrics_result() == {}
    assert "get_metrics_result" not in vars(model)
    assert set(model.get_metrics_result()) == {"loss", "accuracy"}
