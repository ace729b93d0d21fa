"""The tfdist training loop: one loop for every Parallelism, driven like Keras' fit.

Begin / step / end, in the manner of Orbit's controller, with Keras' own
CallbackList and History: the loop owns the step counter, epochs, the model's
compiled metrics (tfdist.train.metrics), validation, progress, checkpoints,
preemption, TensorBoard scalars and the profiler window; the Parallelism owns
how a step runs on its devices. Every user callback sees the Keras logs (loss,
metrics, val_*), and the same values in every mode and on every worker.
"""

import contextlib
import dataclasses
import os
import time
from typing import Callable, Dict, Iterator, List, Optional

import keras
import numpy as np
import tensorflow as tf

from tfdist.errors import Preempted
from tfdist.train import checkpoint, preemption
from tfdist.train.metrics import HostMetrics
from tfdist.train.progress import Progress

# The last training iterator and the last evaluation iterator of this process; see
# keep_last_iterator.
_LAST_ITERATORS: Dict[str, object] = {}


def keep_last_iterator(iterator, role: str = "train") -> None:
    """Keeps this process's newest iterator of `role` ("train" or "eval") alive, replacing
    the previous one, instead of destroying it as the run returns.

    Why: destroying a tf.data iterator now and then blocks for seconds, holding the GIL.
    On TF 2.21 its destructor waits for the iterator's autotune thread
    (Model::OptimizeLoop), which sleeps out its optimization period (up to 10 s) instead
    of waking at cancellation: a 10-line pure-TF loop took 4.2 s to delete an iterator
    in 2 of 8 trials here, and tf.data.Options(autotune.enabled=False) on the source does
    not help under tf.distribute (its per-device datasets keep their own). A process of
    a multi-process run ends with os._exit, which skips destructors, so keeping the
    iterator takes the stall off the job's end: it had delayed every rank's exit by
    ~10 s in about 1 run of 3 (shm and mpi alike, measured). Kept from its creation on,
    so a run that ends by an exception (a preemption's exit 4 included) skips the wait
    too. Bounded: one of each role per process.
    """
    _LAST_ITERATORS[role] = iterator


@dataclasses.dataclass
class LoopResult:
    losses: List[float]
    eval_loss: Optional[float]
    eval_accuracy: Optional[float]
    examples_per_sec: float
    train_seconds: float
    start_step: int = 0           # > 0 when the run resumed from a checkpoint
    history: Optional[keras.callbacks.History] = None
    train_metrics: dict = dataclasses.field(default_factory=dict)
    eval_metrics: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class EvalData:
    """Every example of a split once: `steps` global batches, the last one padded
    with weight-0 examples (tfdist.data.pipeline.eval_dataset_fn)."""
    dataset_fn: Callable
    steps: int
    size: int                           # real examples (the rest of the last batch is padding)
    global_batch_size: int = 0          # of its batches; 0: the training's

    _batches: Optional[tuple] = dataclasses.field(default=None, repr=False, compare=False)

    def batches(self, parallel) -> Iterator:
        """The iterator every evaluation in `parallel` takes exactly `steps` batches from:
        one per mode, over the split repeated without end, so each evaluation reads one
        whole pass (the same batches, in the same order, as a fresh iterator would).

        Why one iterator, not one per evaluation: under tf.distribute (mirrored,
        multi_worker_mirrored) every new iterator builds a MultiDeviceIterator, and
        TensorFlow keeps about 13-21 KB of native memory from each for good (a pure-TF
        loop making iterators over one distributed dataset, measured; Python's share
        under 1 KB). One per evaluation grew every 2-worker job 32 KB an evaluation
        (docs/benchmarks.md, Soak). Why endless: in multi-worker mode tf.distribute gives a finite
        dataset's iterator partial-batch handling, a TensorFlow all-reduce in every
        get_next, which runs over gRPC whatever --collective says and leaks in TensorFlow
        (tensorflow#42616); the padding makes every batch full, so repeating the split
        loses nothing. An evaluation that stops part-way must call `forget` (the next
        one would start mid-pass). The iterator is kept past the run (keep_last_iterator):
        its destructor can stall like the training iterator's."""
        if self._batches is None or self._batches[0] is not parallel:
            iterator = iter(parallel.distribute(lambda context: self.dataset_fn(context).repeat()))
            keep_last_iterator(iterator, role="eval")
            self._batches = (parallel, iterator)
        return self._batches[1]

    def forget(self) -> None:
        """Drops the iterator: the next evaluation starts a fresh pass."""
        self._batches = None


@dataclasses.dataclass
class TrainPlan:
    """What fit was asked for, in global steps."""
    train_dataset_fn: Callable          # start_step -> dataset_fn(input_context)
    steps_per_epoch: int
    epochs: int
    total_steps: int                    # epochs * steps_per_epoch, or fewer (--train_steps)
    initial_step: int = 0               # fit's initial_epoch * steps_per_epoch
    validation: Optional[EvalData] = None
    validation_freq: object = 1         # Keras': every N-th epoch, or a list of epochs (1-based)
    callbacks: tuple = ()
    verbose: int = 0                    # Keras' progress bar (1) or epoch lines (2)
    progress: bool = False              # tfdist's own step log lines (the registry runs)


class TrainingLoop:
    def __init__(self, config, parallel, user_model, model, optimizer, log_dir: Optional[str]):
        self.config = config
        self.parallel = parallel
        self.user_model = user_model     # what callbacks see, and what the user saves
        self.model = model               # what the steps train (the pipeline's copy, say)
        self.optimizer = optimizer
        self.log_dir = log_dir
        self.metrics = HostMetrics(user_model, parallel)
        self.train_step = parallel.make_train_step(
            model, optimizer, config.global_batch_size, config.jit_compile,
            on_outputs=self.metrics.updater())
        self.eval_step = parallel.make_eval_step(
            model, on_outputs=self.metrics.updater(drop_zero_weights=True))
        self.writers = self._make_writers()
        self.eval_seconds = 0.0

    def _make_writers(self):
        if not self.log_dir:
            return {}
        return {name: tf.summary.create_file_writer(os.path.join(self.log_dir, name))
                for name in ("train", "eval")}

    def _scalars(self, writer_name: str, step: int, **values) -> None:
        writer = self.writers.get(writer_name)
        if writer is not None:
            write_scalars(writer, step, values)

    def _profile(self, step: int, edge: int) -> bool:
        """True when step is the profiler window's start (edge 0) or stop (edge 1)."""
        window = self.config.profile_steps
        return bool(window and self.log_dir and step == window[edge])

    def _make_checkpointer(self):
        model_dir = self.config.model_dir
        if not model_dir:
            return None
        objects = self.parallel.checkpoint_objects(self.model, self.optimizer)
        return checkpoint.Checkpointer(
            objects, read_dir=model_dir, write_dir=self.parallel.write_dir(model_dir),
            keep=self.config.keep_checkpoints,
            run_fingerprint=checkpoint.fingerprint(self.config, self.model))

    def _due(self, step: int, total_steps: int) -> bool:
        every = self.config.checkpoint_every
        return step == total_steps or bool(every and step % every == 0)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, data: EvalData, callbacks=None):
        """(mean loss over the split's examples, metric logs): every example once."""
        iterator = data.batches(self.parallel)
        self.metrics.reset()
        total = 0.0
        try:
            for batch in range(data.steps):
                if callbacks is not None:
                    callbacks.on_test_batch_begin(batch)
                loss = float(self.eval_step(iterator))
                total += loss
                if callbacks is not None:
                    callbacks.on_test_batch_end(batch, {"loss": total / (batch + 1)})
        except BaseException:
            data.forget()   # part of a pass was read: the next evaluation starts afresh
            raise
        # Each step's loss is its padded global batch's mean; padding weighs 0.
        batch_size = data.global_batch_size or self.config.global_batch_size
        logs = {"loss": total * batch_size / max(data.size, 1)}
        logs.update({k: v for k, v in self.metrics.logs().items() if k != "loss"})
        return logs

    # ------------------------------------------------------------------ training

    def run(self, plan: TrainPlan) -> LoopResult:
        """Trains to plan.total_steps from plan.initial_step, or from --model_dir's newest
        good checkpoint when it is further on."""
        checkpointer = self._make_checkpointer()
        restored = checkpointer.restore() if checkpointer else 0
        if restored:
            self.parallel.restored()
        start_step = max(restored, plan.initial_step)
        watcher = preemption.PreemptionWatcher() if checkpointer else contextlib.nullcontext()
        with watcher:
            return self._train(plan, start_step, checkpointer, watcher)

    def _callback_list(self, plan: TrainPlan, history):
        return keras.callbacks.CallbackList(
            list(plan.callbacks) + [history], add_history=False,
            add_progbar=bool(plan.verbose) and self.parallel.is_chief,
            model=self.user_model, verbose=plan.verbose, epochs=plan.epochs,
            steps=plan.steps_per_epoch)

    def _train(self, plan: TrainPlan, start_step, checkpointer, watcher) -> LoopResult:
        config = self.config
        history = keras.callbacks.History()
        callbacks = self._callback_list(plan, history)
        # Batch logs cost a metric read (and, across workers, a sum) per step: only
        # computed when a callback has batch hooks (as Keras skips them too). Every
        # worker must take part in those sums, so the workers agree once, here: the
        # chief's progress bar (or any worker's own callback) decides for all. Hooks no
        # callback implements are not called at all (Keras would hand each no-op call
        # to its thread pool, every step).
        batch_hooks = any(implements_batch_hooks(c) for c in callbacks.callbacks)
        wants_batch_logs = self.parallel.any_process(batch_hooks)
        iterator = iter(self.parallel.distribute(plan.train_dataset_fn(start_step)))
        keep_last_iterator(iterator, role="train")
        progress = Progress(plan.total_steps, config.global_batch_size, config.log_every,
                            enabled=self.parallel.is_chief and plan.progress)
        losses, epoch_logs, eval_logs = [], {}, {}
        self.user_model.stop_training = False
        start = first_step_done = time.perf_counter()
        callbacks.on_train_begin()
        step = start_step
        for epoch in range(start_step // plan.steps_per_epoch, plan.epochs):
            if step >= plan.total_steps or self.user_model.stop_training:
                break
            callbacks.on_epoch_begin(epoch)
            self.parallel.sync_hyperparameters(self.user_model.optimizer)
            self.metrics.reset()
            epoch_end = min((epoch + 1) * plan.steps_per_epoch, plan.total_steps)
            while step < epoch_end:
                batch = step - epoch * plan.steps_per_epoch
                if batch_hooks:
                    callbacks.on_train_batch_begin(batch)
                step += 1
                loss = self._train_one(step, iterator)
                if step == start_step + 1:
                    first_step_done = time.perf_counter()  # excludes tracing from throughput
                losses.append(loss)
                self.metrics.add_loss(loss)
                progress.update(step, loss)
                if step % config.log_every == 0:
                    self._scalars("train", step, loss=loss)
                self._checkpoint(checkpointer, watcher, step, plan.total_steps)
                if batch_hooks:   # else Keras would dispatch a no-op to its thread pool
                    callbacks.on_train_batch_end(batch, self.metrics.logs() if wants_batch_logs
                                                 else None)
                elif wants_batch_logs:
                    self.metrics.logs()   # another worker's callback needs this step's sums
                if config.eval_every and step % config.eval_every == 0 \
                        and plan.validation is not None and step != plan.total_steps:
                    self._eval_and_log(step, plan.validation, progress, callbacks)
                if self.user_model.stop_training:
                    break
            epoch_logs = self.metrics.logs()
            if plan.validation is not None and (
                    validates_after(epoch, plan.validation_freq) if not config.eval_every
                    else epoch_end == plan.total_steps):
                eval_logs = self._eval_and_log(step, plan.validation, progress, callbacks)
                epoch_logs.update({f"val_{k}": v for k, v in eval_logs.items()})
            self.parallel.sync_to_user_model(self.user_model, self.model)
            callbacks.on_epoch_end(epoch, epoch_logs)
        callbacks.on_train_end(epoch_logs)
        elapsed = time.perf_counter() - first_step_done - self.eval_seconds
        timed_steps = max(len(losses) - 1, 1)
        rate = timed_steps * config.global_batch_size / max(elapsed, 1e-9)
        self._scalars("train", step, examples_per_sec=rate)
        for writer in self.writers.values():
            writer.flush()
        train_metrics = {k: v for k, v in epoch_logs.items() if not k.startswith("val_")}
        return LoopResult(losses, eval_logs.get("loss"), _accuracy(eval_logs), rate,
                          time.perf_counter() - start, start_step, history, train_metrics,
                          eval_logs)

    def _train_one(self, step: int, iterator) -> float:
        if self._profile(step, 0):
            tf.profiler.experimental.start(os.path.join(self.log_dir, "profile"))
        loss = float(self.train_step(iterator))
        if self._profile(step, 1):
            tf.profiler.experimental.stop()
        return loss

    def _checkpoint(self, checkpointer, watcher, step: int, total_steps: int) -> None:
        if checkpointer is None:
            return
        if self._due(step, total_steps):
            self._save(checkpointer, step)
        if self.parallel.any_process(watcher.requested):
            if not self._due(step, total_steps):
                self._save(checkpointer, step)
            raise Preempted(step, self.config.model_dir)

    def _save(self, checkpointer, step: int) -> None:
        self.parallel.saving()
        checkpointer.save(step)

    def _eval_and_log(self, step: int, data: EvalData, progress: Progress,
                      callbacks=None) -> dict:
        """A validation: fit's callbacks get Keras' test hooks, as Keras' fit hands them to
        its evaluate (on_test_begin, each batch, on_test_end with the logs)."""
        # Evaluation shares the metric objects: the epoch's training state comes back.
        started = time.perf_counter()
        training_state = self.metrics.snapshot()
        if callbacks is not None:
            callbacks.on_test_begin()
        logs = self.evaluate(data, callbacks)
        if callbacks is not None:
            callbacks.on_test_end(logs)
        self.metrics.restore(training_state)
        self._scalars("eval", step, **{k: v for k, v in logs.items() if _is_scalar(v)})
        shown = "  ".join(f"{k} {v:.4f}" for k, v in logs.items() if _is_scalar(v))
        progress.message(f"eval at step {step}: {shown}")
        self.eval_seconds += time.perf_counter() - started   # not training time
        return logs


def validates_after(epoch: int, validation_freq) -> bool:
    """Keras' rule (Trainer._should_eval): after epoch (0-based) when its 1-based number
    is a multiple of an int validation_freq, or one of a list's epochs."""
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq


def write_scalars(writer, step: int, values: dict) -> None:
    """TensorBoard scalars at `step`, handed to TensorFlow as numpy scalars.

    Why not Python's int and float: TensorFlow keeps the eager tensor of every distinct
    Python scalar it converts, for good (its scalar handle cache, tensorflow#68196: about
    0.77 KB a value here), and every step number and loss is a new value. Written with
    --log_every=10 and an evaluation every 100 steps, that grew 2-worker jobs about 0.3 KB
    a step. Numpy scalars are not cached. TensorBoard keeps scalars as float32 anyway."""
    with writer.as_default(step=np.int64(step)):
        for name, value in values.items():
            tf.summary.scalar(name, np.float32(value))


def implements_batch_hooks(callback) -> bool:
    """Whether the callback's class overrides a train-batch hook of keras.callbacks.Callback."""
    base = keras.callbacks.Callback
    return any(getattr(type(callback), hook) is not getattr(base, hook)
               for hook in ("on_train_batch_end", "on_batch_end", "on_train_batch_begin",
                            "on_batch_begin"))


def _is_scalar(value) -> bool:
    return isinstance(value, float)


def _accuracy(logs: dict):
    for name in ("accuracy", "sparse_categorical_accuracy", "categorical_accuracy"):
        if name in logs:
            return logs[name]
    return None
