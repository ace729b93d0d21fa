"""Training with Keras `model.fit` under a tf.distribute Parallelism.

The same model, optimizer, inputs and eval as the tfdist loop, so the two can be
compared number for number. To record the exact loss of every step (Keras logs a
running mean per epoch), fit runs `steps` one-step epochs over one persistent
iterator of the infinite training dataset.
"""

import time

import keras

from tfdist.data import pipeline
from tfdist.train import keras_fixes
from tfdist.train.loop import LoopResult, evaluate


class StepLosses(keras.callbacks.Callback):
    """Collects logs['loss'] at each epoch end (one step per epoch: that step's loss)."""

    def __init__(self):
        super().__init__()
        self.losses = []
        self.first_step_done = None

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(float(logs["loss"]))
        if epoch == 0:
            self.first_step_done = time.perf_counter()


def train_with_fit(config, parallel, source, model, optimizer, steps) -> LoopResult:
    start = time.perf_counter()
    keras_fixes.repair_fit_for_collective_strategies(model)
    with parallel.scope():
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=config.jit_compile)
    dataset_fn = pipeline.train_dataset_fn(
        source, config.global_batch_size, config.seed, config.data)
    recorder = StepLosses()
    model.fit(parallel.distribute(dataset_fn), epochs=steps, steps_per_epoch=1,
              callbacks=[recorder], verbose=0, shuffle=False)
    elapsed = time.perf_counter() - (recorder.first_step_done or start)
    rate = max(steps - 1, 1) * config.global_batch_size / max(elapsed, 1e-9)
    eval_loss, eval_accuracy = evaluate(parallel, parallel.make_eval_step(model), source, config)
    return LoopResult(recorder.losses, eval_loss, eval_accuracy, rate, time.perf_counter() - start)
