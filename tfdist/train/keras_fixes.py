"""Repairs for Keras 3 `fit` under tf.distribute, each with its upstream issue.

Keras 3.15 `fit` under MultiWorkerMirroredStrategy fails before the first step:
`TensorFlowTrainer._maybe_symbolic_build` takes one distributed batch and calls
`strategy.reduce("MEAN", batch)` on it just to learn the input shapes, which a
collective strategy cannot do eagerly on a PerReplica batch ("Attempt to convert
a value (PerReplica...) to a Tensor"). Upstream: keras-team/keras#20585 and
tensorflow/tensorflow#72388, open since TF 2.16.

The repair gives the model a `_maybe_symbolic_build` that builds from one local
replica's batch instead (only its shapes matter). It overrides a private Keras
method on the instance only.

Past that, every step fails the same way one level down: the train function
reduces its (scalar) logs with `reduce_per_replica(..., "auto")`, which under a
multi-worker collective strategy calls `strategy.reduce("MEAN", v, axis=0)`, an
invalid axis for a scalar. The second repair wraps Keras' module-level
`reduce_per_replica` so scalars are reduced with axis=None (same issues).

Both touch private Keras code; tests/test_upstream_canaries.py fails when Keras
changes either, so the repairs are revisited (or dropped) then. The same goes for
`gradients_already_summed` (below), which is not about fit: it lets a step that
summed its gradients itself (--collective=tcp) apply them without a second sum.
"""

import contextlib
import json
import os
import threading
import types

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer


def _local_part(value):
    if isinstance(value, tf.distribute.DistributedValues):
        return tf.distribute.get_strategy().experimental_local_results(value)[0]
    return value


def _symbolic_build_from_local_batch(self, iterator=None, data_batch=None):
    strategy = self._distribute_strategy
    if strategy is None:
        return
    if iterator is not None:
        for _, _, batch_iterator in iterator:
            with strategy.scope():
                data_batch = tf.nest.map_structure(_local_part, next(batch_iterator))
            break
    with strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def repair_fit_for_collective_strategies(model) -> None:
    """Lets `model.fit` run under MultiWorkerMirroredStrategy (keras-team/keras#20585)."""
    repair_keras_log_reduction()
    model._maybe_symbolic_build = types.MethodType(_symbolic_build_from_local_batch, model)


def _is_scalar(value) -> bool:
    """A scalar tensor, or per-replica scalars (one local replica gives a plain tensor)."""
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    return getattr(value, "shape", None) is not None and value.shape.rank == 0


def _scalar_safe_reduce_per_replica(original):
    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and keras_tf_trainer._collective_all_reduce_multi_worker(
                strategy):
            return tf.nest.map_structure(
                lambda v: strategy.reduce("MEAN", v, axis=None) if _is_scalar(v)
                else original(v, strategy, reduction), values)
        return original(values, strategy, reduction)

    reduce_per_replica.tfdist_repaired = True
    reduce_per_replica.__wrapped__ = original  # inspect.unwrap finds Keras' own
    return reduce_per_replica


def repair_keras_log_reduction() -> None:
    """Makes fit's per-step log reduction valid under MWMS (keras-team/keras#20585). Idempotent."""
    current = keras_tf_trainer.reduce_per_replica
    if not getattr(current, "tfdist_repaired", False):
        keras_tf_trainer.reduce_per_replica = _scalar_safe_reduce_per_replica(current)


class ChiefOnlyBackupAndRestore(keras.callbacks.BackupAndRestore):
    """Keras' BackupAndRestore for multi-worker jobs: every worker restores from
    the same `backup_dir`, only the chief writes (and deletes) it.

    Plain BackupAndRestore would have every worker write the same files at once.
    Overrides the private `_save_model` (tests/test_upstream_canaries.py pins it).
    Note Keras 3 backs up model weights and the epoch, not the optimizer state.
    """

    def __init__(self, backup_dir: str, is_chief: bool, **kwargs):
        super().__init__(backup_dir, **kwargs)
        self.is_chief = is_chief

    def _save_model(self):
        if self.is_chief:
            super()._save_model()

    def on_train_end(self, logs=None):
        if self.is_chief:
            super().on_train_end(logs)


def backed_up_epoch(backup_dir: str) -> int:
    """The epoch BackupAndRestore will resume at (0: nothing backed up).

    Read before fit builds its dataset, so the data resumes at the same step.
    Keras' metadata file; pinned by tests/test_upstream_canaries.py.
    """
    path = os.path.join(backup_dir, "training_metadata.json")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return int(json.load(f)["epoch"])


_SUMMED_LOCK = threading.Lock()


@contextlib.contextmanager
def gradients_already_summed(optimizer):
    """While tracing `optimizer.apply`, skips Keras' own cross-replica gradient sum.

    Keras 3's TF optimizer always all-reduces gradients in a replica context
    (`_all_reduce_sum_gradients`, called by `_backend_update_step`); tf.keras had
    `experimental_aggregate_gradients=False` for callers that summed already, Keras 3
    has no public switch (keras-team/keras#19308, open). tfdist's steps sum them
    themselves (tfdist/train/step.py, --collective=tcp), so the private method is
    replaced on these instances for the trace. Re-entrant: MirroredStrategy traces
    every replica's step in its own thread, each entering this with the same
    optimizer; the method comes back when the last one leaves.
    Pinned by tests/test_upstream_canaries.py.
    """
    optimizers = [optimizer] + [o for o in [getattr(optimizer, "inner_optimizer", None)] if o]
    with _SUMMED_LOCK:
        for each in optimizers:
            each._tfdist_summed_depth = getattr(each, "_tfdist_summed_depth", 0) + 1
            each._all_reduce_sum_gradients = _unchanged
    try:
        yield
    finally:
        with _SUMMED_LOCK:
            for each in optimizers:
                each._tfdist_summed_depth -= 1
                if each._tfdist_summed_depth == 0:
                    del each._all_reduce_sum_gradients  # back to the class method


def _unchanged(grads_and_vars):
    return grads_and_vars


def all_layers(layer) -> list:
    """`layer` and all its sub-layers, recursively, each parent before its children.

    Private: Keras has no public recursive listing of sub-layers (keras-team/keras#4398,
    closed without one); _flatten_layers is what its own tracking uses. Canaries:
    tests/test_upstream_canaries.py::test_keras_private_batch_norm_api and
    tests/test_pipeline_user_layers.py::test_keras_still_lists_nested_layers_parents_first."""
    return layer._flatten_layers(include_self=True, recursive=True)
