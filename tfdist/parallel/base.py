"""The Parallelism interface: everything the training loop needs from a mode.

A mode decides where variables live (`scope`), what it does to a user's compiled
model (`adopt`: nothing, shard it, or place copies of it), how a dataset_fn
becomes per-step inputs (`distribute`), how one training and one eval step run
across its devices, and where the bytes of state ended up. The loop never asks
which mode it runs.
"""

import abc
import collections
import contextlib
import shutil
import tempfile
from typing import Callable, Dict, Iterable, List, Optional  # noqa: F401

from tfdist.errors import require


class Parallelism(abc.ABC):
    name: str
    num_replicas: int          # how many ways each global batch is split
    devices: List[str]
    is_chief: bool = True      # the process that writes results, logs and checkpoints
    _scratch_dirs = ()         # write_dir's scratch dirs, removed by close()
    accumulation_steps: int = 1   # micro-batches per replica batch (train/accumulation.py)

    def validate_global_batch(self, global_batch_size: int) -> None:
        require(global_batch_size % self.num_replicas == 0,
                f"--global_batch_size={global_batch_size} is not divisible by the "
                f"{self.num_replicas} replicas of strategy '{self.name}' "
                f"(devices: {', '.join(self.devices)}). Use a multiple of {self.num_replicas}.")
        steps = self.accumulation_steps
        per_replica = global_batch_size // self.num_replicas
        require(per_replica % steps == 0,
                f"--global_batch_size={global_batch_size} gives each of the {self.num_replicas} "
                f"replicas of strategy '{self.name}' {per_replica} examples, which "
                f"--accumulation_steps={steps} cannot cut into equal micro-batches. Use a "
                f"multiple of {self.num_replicas * steps}.")

    def scope(self):
        """Context in which the model and optimizer variables are created."""
        return contextlib.nullcontext()

    def adopt(self, model):
        """(model the steps train, optimizer) for a user's compiled Keras model.

        Here (the tf.distribute modes) that is the model itself, whose variables must
        have been created in scope(); modes that place or shard variables override
        this. The returned model's get_weights() gives the full weights in the order
        a single-device build would (the equivalence harness compares them).
        """
        require_compiled(model)
        with self.scope():
            if not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)
        return model, model.optimizer

    def replica_models(self, model) -> dict:
        """label -> each copy of the trained model in this process."""
        return {"model": model}

    def sync_hyperparameters(self, optimizer) -> None:
        """Makes the optimizers the steps use follow `optimizer`'s learning rate (set by a
        LearningRateScheduler or ReduceLROnPlateau); a no-op where they are the same."""

    def sync_to_user_model(self, model, trained_model) -> None:
        """Makes the user's model hold the trained weights (a no-op where they are the
        same model; the pipeline trains copies)."""

    @abc.abstractmethod
    def distribute(self, dataset_fn: Callable) -> Iterable:
        """Turns dataset_fn(input_context) into an iterable of per-step inputs."""

    @abc.abstractmethod
    def make_train_step(self, model, optimizer, global_batch_size: int,
                        jit_compile: bool, on_outputs: Callable = None) -> Callable:
        """Returns step(iterator) -> the global batch's loss (the model's compiled loss,
        a scalar tensor). `on_outputs((y, y_pred, w))`, the metrics' update, is called
        with this process's share of the step's labels, predictions and weights."""

    @abc.abstractmethod
    def make_eval_step(self, model, on_outputs: Callable = None) -> Callable:
        """Returns step(iterator) -> the global batch's loss, its padding weighing 0;
        on_outputs as for make_train_step."""

    @abc.abstractmethod
    def param_bytes_per_device(self, model, optimizer) -> Dict[str, int]:
        """Device name -> bytes of parameters plus optimizer state stored on it."""

    def gradient_bytes_per_device(self, model) -> Optional[Dict[str, int]]:
        """Device name -> bytes of the gradients the update reads there, where a mode
        shards them (--zero_stage); None where every replica holds them whole."""
        return None

    def checkpoint_objects(self, model, optimizer) -> Dict:
        """The trackable objects whose state a checkpoint must hold."""
        return {"model": model, "optimizer": optimizer}

    # True where each process's step outputs cover only its own examples (several
    # data-parallel workers): metric states are then summed over the workers.
    workers_hold_own_outputs = False

    def saving(self) -> None:
        """Called before each checkpoint save of checkpoint_objects()."""

    def restored(self) -> None:
        """Called after a checkpoint was read into checkpoint_objects(): a mode that saves
        one copy of what several hold (the pipeline's replicas) hands it on here."""

    def sum_over_workers(self, value):
        """Element-wise sum of a float32 array over the job's processes, each counted once."""
        return value

    def make_predict_step(self, user_model, model):
        """fn(x batch) -> y_pred as plain tensors on this process, from the trained
        `model` (or, where the mode trains copies, the synced `user_model`)."""
        import tensorflow as tf
        return tf.function(lambda x: model(x, training=False), reduce_retracing=True)

    def any_process(self, flag: bool) -> bool:
        """True if `flag` is true in any process of the job (one process: itself)."""
        return flag

    def write_dir(self, path):
        """Where this process writes under `path`: the chief writes there; any other
        process gets a scratch dir, removed at close (TF's multi-worker write-path
        pattern: every process takes part in a save, only the chief's copy is kept)."""
        if path is None or self.is_chief:
            return path
        scratch = tempfile.mkdtemp(prefix="tfdist-not-chief-")
        self._scratch_dirs = (*self._scratch_dirs, scratch)
        return scratch

    def guard(self, what: str):
        """Context for work that waits on other processes (a Keras fit batch, say):
        modes that span processes bound it by --collective_timeout."""
        return contextlib.nullcontext()

    def finish(self) -> None:
        """Called once, after a run succeeded: a mode whose processes must leave
        together waits for the others here (one process: nothing to wait for)."""

    def translate_failures(self):
        """Context that turns the mode's infrastructure failures into clear errors."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Releases what the mode holds (here: the scratch dirs of write_dir)."""
        for scratch in self._scratch_dirs:
            shutil.rmtree(scratch, ignore_errors=True)
        self._scratch_dirs = ()


def require_compiled(model) -> None:
    require(getattr(model, "compiled", False) and model.optimizer is not None
            and model.loss is not None,
            f"Model '{getattr(model, 'name', model)}' is not compiled with an optimizer and a "
            f"loss. Call model.compile(optimizer=..., loss=..., metrics=[...]) before training "
            f"(inside strategy.scope() for the tf.distribute modes).")


def add_bytes(totals: collections.Counter, device: str, tensor_like) -> None:
    totals[device] += tensor_like.shape.num_elements() * tensor_like.dtype.size
