"""The tfdist training loop: one loop for every Parallelism.

Begin / step / end, in the manner of Orbit's controller: the loop owns the step
counter, progress, periodic eval, TensorBoard scalars and the profiler window;
the Parallelism owns how a step runs on its devices.
"""

import contextlib
import dataclasses
import os
import time
from typing import List, Optional

import tensorflow as tf

from tfdist.data import pipeline
from tfdist.errors import Preempted
from tfdist.train import checkpoint, preemption
from tfdist.train.progress import Progress


@dataclasses.dataclass
class LoopResult:
    losses: List[float]
    eval_loss: Optional[float]
    eval_accuracy: Optional[float]
    examples_per_sec: float
    train_seconds: float
    start_step: int = 0           # > 0 when the run resumed from a checkpoint


class TrainingLoop:
    def __init__(self, config, parallel, source, model, optimizer, log_dir: Optional[str]):
        self.config = config
        self.parallel = parallel
        self.source = source
        self.model = model
        self.optimizer = optimizer
        self.log_dir = log_dir
        self.train_step = parallel.make_train_step(
            model, optimizer, config.global_batch_size, config.jit_compile)
        self.eval_step = parallel.make_eval_step(model)
        self.writers = self._make_writers()

    def _make_writers(self):
        if not self.log_dir:
            return {}
        return {name: tf.summary.create_file_writer(os.path.join(self.log_dir, name))
                for name in ("train", "eval")}

    def _scalars(self, writer_name: str, step: int, **values) -> None:
        writer = self.writers.get(writer_name)
        if writer is None:
            return
        with writer.as_default(step=step):
            for name, value in values.items():
                tf.summary.scalar(name, value)

    def evaluate(self):
        return evaluate(self.parallel, self.eval_step, self.source, self.config)

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

    def run(self, total_steps: int) -> LoopResult:
        """Trains to `total_steps`, resuming from --model_dir's newest good checkpoint."""
        checkpointer = self._make_checkpointer()
        start_step = checkpointer.restore() if checkpointer else 0
        watcher = preemption.PreemptionWatcher() if checkpointer else contextlib.nullcontext()
        with watcher:
            return self._train(total_steps, start_step, checkpointer, watcher)

    def _train(self, total_steps, start_step, checkpointer, watcher) -> LoopResult:
        config = self.config
        dataset_fn = pipeline.train_dataset_fn(
            self.source, config.global_batch_size, config.seed, config.data, start_step)
        iterator = iter(self.parallel.distribute(dataset_fn))
        progress = Progress(total_steps, config.global_batch_size, config.log_every,
                            enabled=self.parallel.is_chief)
        losses, eval_result = [], (None, None)
        first_step_done = start = time.perf_counter()
        for step in range(start_step + 1, total_steps + 1):
            if self._profile(step, 0):
                tf.profiler.experimental.start(os.path.join(self.log_dir, "profile"))
            loss = float(self.train_step(iterator))
            if self._profile(step, 1):
                tf.profiler.experimental.stop()
            if step == start_step + 1:
                first_step_done = time.perf_counter()  # excludes tracing from throughput
            losses.append(loss)
            progress.update(step, loss)
            if step % config.log_every == 0:
                self._scalars("train", step, loss=loss)
            if checkpointer and self._due(step, total_steps):
                checkpointer.save(step)
            if checkpointer and self.parallel.any_process(watcher.requested):
                if not self._due(step, total_steps):
                    checkpointer.save(step)
                raise Preempted(step, config.model_dir)
            if config.eval_every and step % config.eval_every == 0 and step != total_steps:
                eval_result = self._eval_and_log(step, progress)
        elapsed = time.perf_counter() - first_step_done
        eval_result = self._eval_and_log(total_steps, progress)
        timed_steps = max(len(losses) - 1, 1)
        rate = timed_steps * config.global_batch_size / max(elapsed, 1e-9)
        self._scalars("train", total_steps, examples_per_sec=rate)
        for writer in self.writers.values():
            writer.flush()
        return LoopResult(losses, eval_result[0], eval_result[1], rate,
                          time.perf_counter() - start, start_step)

    def _eval_and_log(self, step: int, progress: Progress):
        loss, accuracy = self.evaluate()
        self._scalars("eval", step, loss=loss, accuracy=accuracy)
        progress.message(f"eval at step {step}: loss {loss:.4f}  accuracy {accuracy:.4f}")
        return loss, accuracy


def evaluate(parallel, eval_step, source, config):
    """Mean loss and accuracy over the whole test split (every example once)."""
    dataset_fn = pipeline.eval_dataset_fn(source, config.global_batch_size, config.data)
    iterator = iter(parallel.distribute(dataset_fn))
    totals = [0.0, 0.0, 0.0]
    for _ in range(pipeline.eval_steps(source, config.global_batch_size)):
        for i, value in enumerate(eval_step(iterator)):
            totals[i] += float(value)
    loss_sum, correct_sum, weight_sum = totals
    return loss_sum / weight_sum, correct_sum / weight_sum
