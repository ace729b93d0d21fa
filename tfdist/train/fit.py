"""Training with Keras `model.fit` under a tf.distribute Parallelism.

The same model, optimizer, inputs and eval as the tfdist loop, so the two can be
compared number for number. To record the exact loss of every step (Keras logs a
running mean per epoch), fit runs `steps` one-step epochs over one persistent
iterator of the infinite training dataset. With --model_dir, Keras'
BackupAndRestore (chief-only writes under multi-worker) backs up every step and a
rerun resumes: Keras restores weights and epoch, tfdist starts the data there.
Keras 3 does not back up optimizer state, so only stateless optimizers (sgd)
resume exactly this way; tfdist's loop checkpoints the optimizer too.
"""

import os
import time

import keras

from tfdist import keras_calls
from tfdist.data import pipeline
from tfdist.train import checkpoint, keras_fixes
from tfdist.train.loop import LoopResult, TrainingLoop


class StepLosses(keras.callbacks.Callback):
    """Collects logs['loss'] at each epoch end (one step per epoch: that step's loss)."""

    def __init__(self):
        super().__init__()
        self.losses = []
        self.first_step_done = None

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(float(logs["loss"]))
        if self.first_step_done is None:
            self.first_step_done = time.perf_counter()
        checkpoint.failpoint("fit_epoch_end", epoch + 1)


class GuardBatches(keras.callbacks.Callback):
    """Each train and test batch under the mode's guard (the watchdog of a multi-worker
    run: a peer that stops answering ends the process within --collective_timeout)."""

    def __init__(self, parallel):
        super().__init__()
        self.parallel = parallel
        self._open = None

    def _begin(self, what):
        self._open = self.parallel.guard(what)
        self._open.__enter__()

    def end(self):
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None

    def on_train_batch_begin(self, batch, logs=None):
        self._begin("a Keras fit batch")

    def on_train_batch_end(self, batch, logs=None):
        self.end()

    def on_test_batch_begin(self, batch, logs=None):
        self._begin("a Keras evaluate batch")

    def on_test_batch_end(self, batch, logs=None):
        self.end()


def train_with_fit(config, parallel, source, model, optimizer, steps, eval_data) -> LoopResult:
    """Keras' own fit for `steps` steps, then tfdist's evaluation of `eval_data`
    (tfdist.train.runner.eval_data)."""
    start = time.perf_counter()
    keras_fixes.repair_fit_for_collective_strategies(model)
    with parallel.scope():   # the model's own loss and metrics, and --jit_compile
        model.compile(optimizer=optimizer, loss=model.loss, jit_compile=config.jit_compile)
    callbacks, start_step = backup_callbacks(config, parallel)
    dataset_fn = pipeline.train_dataset_fn(
        source, config.global_batch_size, config.seed, config.data, start_step)
    recorder, guard = StepLosses(), GuardBatches(parallel)
    # Keras' own fit (tfdist.api routes model.fit of a tfdist model to its loop; this
    # trainer is the comparison with Keras itself).
    keras_fit = keras_calls.keras_own("fit")
    try:
        keras_fit(model, parallel.distribute(dataset_fn), epochs=steps, steps_per_epoch=1,
                  callbacks=callbacks + [recorder, guard], verbose=0, shuffle=False)
    finally:
        guard.end()   # a batch that raised never reached on_train_batch_end: disarm anyway
    elapsed = time.perf_counter() - (recorder.first_step_done or start)
    rate = max(len(recorder.losses) - 1, 1) * config.global_batch_size / max(elapsed, 1e-9)
    logs = TrainingLoop(config, parallel, model, model, optimizer, None).evaluate(eval_data)
    return LoopResult(recorder.losses, logs["loss"], logs.get("accuracy"), rate,
                      time.perf_counter() - start, start_step, eval_metrics=logs)


def backup_callbacks(config, parallel):
    """With --model_dir: Keras BackupAndRestore (chief-only writes) every step, and
    the step it will resume at, so the data stream resumes there too."""
    if not config.model_dir:
        return [], 0
    backup_dir = os.path.join(config.model_dir, "backup")
    callback = keras_fixes.ChiefOnlyBackupAndRestore(
        backup_dir, is_chief=parallel.is_chief, delete_checkpoint=False)
    return [callback], keras_fixes.backed_up_epoch(backup_dir)
