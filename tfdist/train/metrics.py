"""The user's compiled Keras metrics, updated on the host from every mode's outputs.

Why on the host: a mode's step returns this process's (y, y_pred, sample_weight)
as plain tensors (tf.distribute: its replicas' batches concatenated; dtensor:
the whole global batch, gathered; pipeline: the last stage's micro-batches), and
one plain tf.function updates the metrics from them. The metric objects are the
user's own (`model.compute_metrics`, so an override of it is honoured), their
variables stay ordinary ones, and the same code serves every mode.

Across processes (multi_worker_mirrored) each worker's metrics hold its own
examples. Every Keras metric state tfdist has met is a sum over examples (Mean:
total and count; AUC, Precision, Recall: confusion counts; MeanIoU: a confusion
matrix), so the job's result is the result of the summed states: the states are
summed over the workers (Parallelism.sum_over_workers), the result read, and the
local states put back. Every worker reads the same sums, so every worker's
callbacks see the same logs and take the same decisions (EarlyStopping,
ReduceLROnPlateau).
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf


def metric_objects(model):
    """The model's metrics other than its loss tracker (tfdist tracks the loss itself)."""
    return [m for m in model.metrics if m.name != "loss"]


def build_metrics(model, batch, predict=None) -> None:
    """Creates the compiled metrics' variables from one example of `batch`, eagerly and
    outside any strategy scope (so they are plain host variables that a step's
    tf.function updates), then resets them. Keras builds them symbolically in fit;
    one real example through the model does the same with public calls only.
    `predict(x)` runs the model where it cannot be called eagerly (a sharded one)."""
    from tfdist.train import step as step_math
    x, y, w = step_math.split_batch(batch)
    x, y, w = step_math.first_example((x, y, w))
    y_pred = predict(x) if predict else model(x, training=False)
    with results_not_read(model):
        model.compute_metrics(x, y, y_pred, w)
    model.reset_metrics()


@contextlib.contextmanager
def results_not_read(model):
    """While open, `model.get_metrics_result()` returns {} without reading any metric.

    Why: Keras' `compute_metrics` updates the metrics and then returns
    `get_metrics_result()`, which reads every metric, the loss tracker included.
    `compile` under a strategy's scope makes the loss tracker's variables
    SyncOnReadVariables, and reading one outside a replica context is a
    cross-replica sum: two TensorFlow all-reduces in every step of every
    multi-worker mode, even --collective=shm or mpi, each of which leaks about
    1.6 KB in TensorFlow (tensorflow/tensorflow#42616; measured: a 2-worker shm run
    grew 3 KB a step). tfdist discards that result (it reads the metrics in
    HostMetrics.logs, summed over the workers), so the step must not compute it.
    A user's `compute_metrics` override still runs; it gets {} from
    `get_metrics_result()` while the step is traced. `get_metrics_result` is public
    Keras API; the instance attribute shadows the method for the block only.
    """
    had_own = "get_metrics_result" in vars(model)
    own = vars(model).get("get_metrics_result")
    object.__setattr__(model, "get_metrics_result", _no_results)  # past Keras' attribute tracking
    try:
        yield
    finally:
        if had_own:
            object.__setattr__(model, "get_metrics_result", own)
        else:
            object.__delattr__(model, "get_metrics_result")


def _no_results():
    return {}


class HostMetrics:
    def __init__(self, model, parallel):
        self.model = model
        self.parallel = parallel
        self.metrics = metric_objects(model)
        self._update = None
        self._loss_sum = 0.0
        self._loss_count = 0

    @property
    def needs_outputs(self) -> bool:
        return bool(self.metrics)

    def reset(self) -> None:
        self._loss_sum, self._loss_count = 0.0, 0
        for metric in self.metrics:
            metric.reset_state()

    def snapshot(self):
        return ([np.array(v.numpy()) for m in self.metrics for v in m.variables],
                (self._loss_sum, self._loss_count))

    def restore(self, snapshot) -> None:
        values, (self._loss_sum, self._loss_count) = snapshot
        for variable, value in zip([v for m in self.metrics for v in m.variables], values):
            variable.assign(value)

    def add_loss(self, loss: float) -> None:
        """One step's global loss; logs['loss'] is their running mean (as Keras logs)."""
        self._loss_sum += loss
        self._loss_count += 1

    def updater(self, drop_zero_weights: bool = False):
        """fn((y, y_pred, w)) that updates the metrics, for a step to call inside its
        tf.function (None without metrics). Evaluation pads its last batch with
        weight-0 examples: `drop_zero_weights` keeps them out of unweighted metrics too.
        The variables must exist first (build_metrics)."""
        if not self.metrics:
            return None
        return lambda outputs: self._update_now(outputs, drop_zero_weights)

    def _update_now(self, outputs, drop_zero_weights):
        y, y_pred, w = outputs
        if drop_zero_weights:
            keep = tf.greater(tf.reshape(w, [-1]), 0)
            y, y_pred, w = tf.nest.map_structure(lambda t: tf.boolean_mask(t, keep),
                                                 (y, y_pred, w))
        with results_not_read(self.model):
            self.model.compute_metrics(None, y, y_pred, w)

    def logs(self) -> dict:
        """{'loss': running mean, metric name: value}, over every worker's examples."""
        logs = {}
        if self._loss_count:
            logs["loss"] = self._loss_sum / self._loss_count
        if not self.metrics:
            return logs
        with self._job_wide_states():
            for metric in self.metrics:
                result = metric.result()
                if isinstance(result, dict):
                    logs.update({k: _to_python(v) for k, v in result.items()})
                else:
                    logs[metric.name] = _to_python(result)
        return logs

    def _job_wide_states(self):
        return _SummedStates(self.parallel, [v for m in self.metrics for v in m.variables])


class _SummedStates:
    """While open, the metric variables hold their sums over the job's workers."""

    def __init__(self, parallel, variables):
        self.parallel, self.variables = parallel, variables
        self.local = None

    def __enter__(self):
        if not self.parallel.workers_hold_own_outputs or not self.variables:
            return self
        self.local = [np.array(v.numpy()) for v in self.variables]
        flat = np.concatenate([value.astype(np.float32).reshape(-1) for value in self.local])
        summed = self.parallel.sum_over_workers(flat)
        offset = 0
        for variable, value in zip(self.variables, self.local):
            size = value.size
            variable.assign(summed[offset:offset + size].reshape(value.shape).astype(value.dtype))
            offset += size
        return self

    def __exit__(self, *exc):
        if self.local is not None:
            for variable, value in zip(self.variables, self.local):
                variable.assign(value)
        return False


def _to_python(value):
    value = keras.ops.convert_to_numpy(value)
    return float(value) if np.ndim(value) == 0 else value
