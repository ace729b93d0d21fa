"""The public API: a user's own compiled Keras model, trained in any tfdist mode.

    strategy = tfdist.Strategy("mirrored", simulate_devices=2)
    with strategy.scope():                       # as with tf.distribute
        model = make_model()
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    history = strategy.fit(model, x, y, batch_size=64, epochs=3,
                           validation_split=0.2, callbacks=[...])
    model.fit(x, y, batch_size=64, epochs=3)     # the same: Keras' own call is routed here
    strategy.evaluate(model, x_val, y_val)
    strategy.predict(model, x_test)
    strategy.save(model, "model.keras")          # plain Keras loads it on one device

Why a function that takes the model (`strategy.fit(model, ...)`) rather than
Keras' own `model.fit` under a scope: in the dtensor and pipeline modes a step is
not one Keras can run (sharded variables with tfdist's exact optimizer update;
stages on their own devices with their own optimizers), and under
multi_worker_mirrored Keras 3's fit is broken upstream. tfdist runs every mode's
step itself, with the user's loss, metrics, optimizer and Keras callbacks, so
every mode is the same proven code; the user's model stays an ordinary Keras
model (mirrored, sharded in place, or, for the pipeline, the host copy that the
trained weights are written back to after every epoch).

Keras' own `model.fit`, `evaluate` and `predict` on a model compiled inside
`strategy.scope()` (or built there under a tf.distribute mode, or trained by
`strategy.fit` once) are routed to `strategy.fit(model, ...)` and its siblings,
with Keras' arguments. Why the scope marks the model rather than the strategy
patching the model's methods when it adopts it: a user calls `model.fit` before
tfdist has seen the model, so adoption is too late; and the mark leaves the model
object untouched (no instance attributes that saving, cloning or pickling would
carry). The dispatch is one wrapper per keras.Model method, shared with
keras.distribution's routes (tfdist/keras_calls.py, tfdist/keras_distribution.py). Where the model's
Strategy is gone (closed, or garbage-collected after a `with
tfdist.Strategy(...).scope():`), the call stops before any step, naming
`strategy.fit(model, ...)`.

Errors raised here name the Python arguments the user passed (batch_size=127),
not the command-line flags the same checks name on the CLI path (`tfdist.run`,
`python -m experiments.train`): one set of messages, translated at this edge
(python_names).

The registry path (`tfdist.run`, `python -m experiments.train`) is a client of
the same loop (tfdist.train.runner builds a registry model, compiles it and
trains it here).
"""

import contextlib
import dataclasses
import logging
import math
import os
import re
import sys
import threading
import types
import weakref
from typing import Mapping, Optional

from tfdist import config as cfg
from tfdist.errors import EXIT_USAGE_ERROR, UsageError, require

log = logging.getLogger("tfdist")
KERAS_DEFAULT_BATCH = 32
FIT_NAMES = {"global_batch_size": "batch_size"}   # RunConfig field -> strategy.fit argument
VALIDATION_NAMES = {"global_batch_size": "validation_batch_size"}

_thread = threading.local()   # .scopes: the Strategies whose scope() is open; .calling
_OWNERS = weakref.WeakKeyDictionary()      # user model -> weakref to its Strategy
_TF_OWNERS = weakref.WeakKeyDictionary()   # tf.distribute strategy -> weakref to its Strategy


class Strategy:
    """One tfdist mode for the user's own Keras models.

    `strategy` is a mode name (default, one_device, mirrored, multi_worker_mirrored,
    dtensor, pipeline); `options` are RunConfig fields (simulate_devices, mesh,
    layout, pipeline_stages, microbatches, pipeline_split, collective,
    accumulation_steps, model_dir, checkpoint_every, seed, ...), validated here, before
    TensorFlow does anything.
    """

    def __init__(self, strategy: str = "default", **options):
        _exit_with_usage_status_under_launcher()
        self._flag_names = False     # errors name Python arguments (from_config: flags)
        self._routes_keras_calls = True
        with self._python_arguments():
            self._start(strategy, options)

    @classmethod
    def from_config(cls, config: cfg.RunConfig) -> "Strategy":
        """The Strategy of a whole RunConfig (what tfdist.run trains with): its errors
        name command-line flags, and Keras' calls on its models stay Keras' own."""
        strategy = cls.__new__(cls)
        strategy._flag_names = True
        strategy._routes_keras_calls = False
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        strategy._start(fields.pop("strategy"), fields)
        return strategy

    def _start(self, strategy: str, options: dict) -> None:
        from tfdist import parallel as parallel_lib
        from tfdist.train import progress
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cfg.RunConfig)})
        require(not unknown, f"tfdist.Strategy got unknown option(s) {', '.join(unknown)}. "
                             f"Valid options: {', '.join(_option_names())}.")
        self.config = cfg.RunConfig(strategy=strategy, **options)
        progress.ensure_logging()
        parallel_lib.spanned_cluster(strategy)
        self.parallel = parallel_lib.build_parallelism(self.config)
        self._adopted = {}   # id(user model) -> _Adoption
        self._predict_steps = {}
        self._failed = False   # a fit or evaluate raised (a preemption too): close() says so
        self._closed = False
        if self._routes_keras_calls:
            self._route_keras_calls()

    def _route_keras_calls(self) -> None:
        """Keras' fit/evaluate/predict on this Strategy's models come here."""
        from tfdist import keras_calls
        keras_calls.install(router=KERAS_ROUTER)
        tf_strategy = getattr(self.parallel, "strategy", None)
        if tf_strategy is not None and _is_scoped(tf_strategy):
            _TF_OWNERS[tf_strategy] = weakref.ref(self)

    # ------------------------------------------------------------------ what the mode is
    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas that each take a share of every global batch, over all workers."""
        return self.parallel.num_replicas

    @property
    def is_chief(self) -> bool:
        """True in the process that writes files (worker 0, or the only process)."""
        return self.parallel.is_chief

    @property
    def devices(self):
        """This process's devices the mode trains on (TensorFlow's names)."""
        return list(self.parallel.devices)

    @contextlib.contextmanager
    def scope(self):
        """Where the model is built and compiled: the tf.distribute strategy's scope
        (variables mirrored), and a no-op for dtensor and pipeline (tfdist shards or
        places the built model when training starts). A model compiled here is this
        Strategy's: Keras' own model.fit / evaluate / predict on it run here."""
        with self.parallel.scope() as inner:
            scopes = _open_scopes()
            scopes.append(self)
            try:
                yield inner
            finally:
                scopes.pop()

    # ------------------------------------------------------------------ Keras' calls
    def fit(self, model, x=None, y=None, batch_size: Optional[int] = None, epochs: int = 1,
            verbose="auto", callbacks=None, validation_split: float = 0.0,
            validation_data=None, shuffle=True, class_weight=None, sample_weight=None,
            initial_epoch: int = 0, steps_per_epoch: Optional[int] = None,
            validation_steps: Optional[int] = None,
            validation_batch_size: Optional[int] = None, validation_freq=1):
        """Keras' `model.fit`, in this mode, with Keras' arguments and their meaning;
        returns the keras.callbacks.History. An argument tfdist cannot honour exactly
        is refused before the first step, naming it.

        batch_size is the GLOBAL batch (split over every replica and worker); a
        tf.data.Dataset given without it is taken as batched, as Keras does, its
        batch size being the global batch. Every step is a full global batch
        (the remainder of an epoch is not trained on), so each step is exactly the
        one-device step. shuffle: arrays and unbatched datasets are shuffled by
        tfdist's seeded order before sharding (shuffle=False keeps the user's order).
        validation_split: the last fraction of the arrays, taken before shuffling
        (Keras' rule). class_weight: a per-example sample weight, as Keras makes it.
        initial_epoch: the epochs counted from it (the data starts at that epoch)."""
        arguments = _Fit(x, y, batch_size, epochs, verbose, callbacks, validation_split,
                         validation_data, shuffle, class_weight, sample_weight, initial_epoch,
                         steps_per_epoch, validation_steps, validation_batch_size,
                         validation_freq)
        with self._python_arguments(FIT_NAMES), self._call():
            return self._fit(model, arguments)

    def _fit(self, model, a: "_Fit"):
        from tfdist.train.loop import TrainPlan
        a.check()
        data = _Data.of(a.x, a.y, a.sample_weight, a.batch_size, a.shuffle, "training data")
        config = self._config_for(data.global_batch_size, data.shuffle)
        validation = self._validation(a, config)
        steps_per_epoch = _steps_per_epoch(a.steps_per_epoch, data, config)
        loop = self._loop(model, config, data.sample_batch(config), training=True)
        plan = TrainPlan(
            train_dataset_fn=lambda start: data.train_dataset_fn(config, start),
            steps_per_epoch=steps_per_epoch, epochs=a.epochs,
            total_steps=a.epochs * steps_per_epoch,
            initial_step=a.initial_epoch * steps_per_epoch,
            validation=validation, validation_freq=a.validation_freq,
            callbacks=tuple(_redirect_files(a.callbacks or [], self.parallel)),
            verbose=_verbosity(a.verbose))
        with self._calling():
            result = loop.run(plan)
        self.last_result = result
        return result.history

    def evaluate(self, model, x=None, y=None, batch_size: Optional[int] = None,
                 verbose="auto", sample_weight=None, steps: Optional[int] = None,
                 callbacks=None, return_dict: bool = False):
        """Keras' `model.evaluate`: every example once (the first `steps` batches when
        given); the loss and metrics, as a list (or a scalar without metrics) or, with
        return_dict, a dict. Callbacks get Keras' test hooks."""
        with self._python_arguments(FIT_NAMES), self._call():
            logs = self._evaluate(model, x, y, batch_size, sample_weight, steps, callbacks,
                                  verbose)
        if return_dict:
            return logs
        values = [logs["loss"]] + [v for k, v in logs.items() if k != "loss"]
        return values[0] if len(values) == 1 else values

    def _evaluate(self, model, x, y, batch_size, sample_weight, steps, callbacks, verbose):
        import keras
        _require_steps("steps", steps)
        data = _Data.of(x, y, sample_weight, batch_size, False, "evaluation data")
        config = self._config_for(data.global_batch_size, False)
        loop = self._loop(model, config, data.sample_batch(config), training=False)
        eval_data = data.eval_data(config, limit=_examples_in(steps, data.global_batch_size))
        hooks = keras.callbacks.CallbackList(callbacks or [], model=model,
                                             verbose=_verbosity(verbose), steps=eval_data.steps)
        hooks.on_test_begin()
        with self._calling():
            logs = loop.evaluate(eval_data, hooks if callbacks else None)
        hooks.on_test_end(logs)
        return logs

    def predict(self, model, x, batch_size: Optional[int] = None, verbose="auto",
                steps: Optional[int] = None, callbacks=None):
        """Keras' `model.predict`: the model's outputs for every example of x (the first
        `steps` batches when given), as NumPy. Every process predicts every example
        (predictions need no gradient sum)."""
        with self._python_arguments(FIT_NAMES), self._call():
            return self._predict(model, x, batch_size, verbose, steps, callbacks)

    def _predict(self, model, x, batch_size, verbose, steps, callbacks):
        import keras
        import numpy as np
        import tensorflow as tf
        _require_steps("steps", steps)
        data = _Data.of(_with_dummy_labels(x), None, None, batch_size, False,
                        "prediction inputs", features_only=True)
        predict_step = self._predict_step(model)
        hooks = keras.callbacks.CallbackList(callbacks or [], model=model,
                                             verbose=_verbosity(verbose))
        hooks.on_predict_begin()
        outputs = []
        for index, batch in enumerate(data.feature_batches(steps)):
            hooks.on_predict_batch_begin(index)
            outputs.append(predict_step(batch))
            hooks.on_predict_batch_end(index, {"outputs": outputs[-1]})
        hooks.on_predict_end()
        return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *outputs)

    def save(self, model, filepath: str) -> None:
        """A standard .keras file of the trained model (written by the chief)."""
        from tfdist.train import export
        require(str(filepath).endswith(".keras"),
                f"save writes a Keras v3 file whose name ends in .keras; got {filepath!r}.")
        export.save(self._trained(model), filepath, self.is_chief)

    def export(self, model, dirpath: str) -> None:
        """A TensorFlow SavedModel of the trained model for serving (written by the chief)."""
        from tfdist.train import export
        export.export(self._trained(model), dirpath, self.is_chief)

    def replica_models(self, model) -> dict:
        """label -> every copy of the trained model this process holds (the pipeline's
        replicas; elsewhere the model itself), for equivalence checks."""
        adoption = self._adopted.get(id(model))
        return self.parallel.replica_models(adoption.model if adoption else model)

    def close(self) -> None:
        """Ends the mode. After calls that all succeeded, the processes that leave together
        are told so first (parallel.finish: the pipeline's serving workers then exit 0, not
        3 as after a failure); then its resources go."""
        self._closed = True
        try:
            if not self._failed:
                with self.parallel.translate_failures():
                    self.parallel.finish()
        finally:
            self.parallel.close()

    # ------------------------------------------------------------------ errors
    @contextlib.contextmanager
    def _python_arguments(self, renames: Mapping[str, str] = None):
        """UsageErrors raised inside name the Python arguments, not flags (python_names)."""
        try:
            yield
        except UsageError as error:
            if not self._flag_names:
                error.args = (python_names(str(error), renames or {}),) + error.args[1:]
            raise

    @contextlib.contextmanager
    def _call(self):
        """One fit/evaluate/predict: refused on a closed Strategy; Keras' own methods
        called inside (by tfdist or a callback) stay Keras' own."""
        require(not self._closed,
                f"This tfdist.Strategy({self.config.strategy!r}) was closed (strategy.close()); "
                f"create a new one, build and compile the model in its scope() and call "
                f"strategy.fit(model, ...) there.")
        outer, _thread.calling = getattr(_thread, "calling", False), True
        try:
            yield
        finally:
            _thread.calling = outer

    @contextlib.contextmanager
    def _calling(self):
        """A fit or evaluate: the mode's failures as clear errors, and remembered for close()."""
        try:
            with self.parallel.translate_failures():
                yield
        except BaseException:
            self._failed = True
            raise

    # ------------------------------------------------------------------ internals
    def _config_for(self, global_batch_size: int, shuffle: bool):
        self.parallel.validate_global_batch(global_batch_size)
        data = self.config.data if shuffle else dataclasses.replace(self.config.data,
                                                                      shuffle_buffer=1)
        return dataclasses.replace(self.config, global_batch_size=global_batch_size, data=data)

    def _validation(self, a: "_Fit", config):
        """validation_data (or the validation_split's arrays) as every example once, in
        global batches of validation_batch_size (default batch_size)."""
        if a.validation_data is None:
            return None
        import tensorflow as tf
        # A Dataset comes batched, as Keras takes it (Keras ignores validation_batch_size
        # there); its examples are evaluated in global batches of the training's size.
        is_dataset = isinstance(a.validation_data, tf.data.Dataset)
        batch_size = config.global_batch_size if is_dataset else (
            a.validation_batch_size or config.global_batch_size)
        with self._python_arguments(VALIDATION_NAMES):
            self.parallel.validate_global_batch(batch_size)
        data = _Data.of(a.validation_data, None, None, None if is_dataset else batch_size,
                        False, "validation_data", split_tuple=True)
        evaluation = data.eval_data(dataclasses.replace(config, global_batch_size=batch_size))
        _require_whole_validation(a.validation_steps, evaluation.steps)
        return evaluation

    def _loop(self, model, config, sample_batch, training: bool = True):
        from tfdist.train.loop import TrainingLoop
        train_model, optimizer = self.prepare(model, sample_batch, training)
        return TrainingLoop(config, self.parallel, model, train_model, optimizer,
                            self.parallel.write_dir(config.model_dir))

    def prepare(self, model, sample_batch, training: bool = True):
        """(model the steps train, its optimizer). The first time a model comes here (or
        after it was compiled again): built in scope, metrics built on the host, then
        handed to the mode (which may shard or place it). An optimizer that already holds
        state (a loaded model's) is kept where the mode trains the user's optimizer;
        evaluation and prediction set it aside where the mode cannot, and training
        there is refused (its update would not continue as one device's would)."""
        adoption = self._adopted.get(id(model))
        if adoption is None or adoption.user_optimizer is not model.optimizer:
            adoption = self._adopt(model, sample_batch, training, previous=adoption)
        if training:
            _require_optimizer_state_kept(model, adoption, self.config.strategy)
        return adoption.model, adoption.optimizer

    def _adopt(self, model, sample_batch, training: bool, previous=None) -> "_Adoption":
        """`previous`: the adoption before a new compile; the model then runs through
        the mode's predict step for the checks (under dtensor it is sharded in place)."""
        from tfdist.parallel.base import require_compiled
        from tfdist.train import accumulation, checks, guarantee, metrics
        _require_keras_model(model)
        if not model.built:
            from tfdist.train import step as step_math
            x, _, _ = step_math.split_batch(sample_batch)
            with self.parallel.scope():
                model(step_math.first_example(x), training=False)
        require_compiled(model)
        predict = previous and self.parallel.make_predict_step(model, previous.model)
        checks.check_model_on_example(model, sample_batch, predict)
        metrics.build_metrics(model, sample_batch, predict)
        if training:   # what exactness does not cover in this model, said once
            accumulation.refuse_keras_accumulation(model)
            accumulation.check_model(model, self.config.accumulation_steps, self.parallel.name)
            guarantee.announce(model, self.parallel.name)
        trained, optimizer, loaded, set_aside = self._adopt_with_optimizer(model, training)
        if training:   # on the model the mode trains (a copy or shards), before any trace
            from tfdist.train import remat
            where = f"{self.parallel.name}: "
            remat.adopt_keras_scopes(model, trained, where, option=self.config.remat)
            remat.apply(trained, self.config.remat, self.config.remat_layers,
                        self.config.remat_threshold, where=where)
        adoption = _Adoption(trained, optimizer, model.optimizer, loaded, set_aside)
        self._adopted[id(model)] = adoption
        self._predict_steps.pop(id(model), None)
        if self._routes_keras_calls:
            _OWNERS[model] = weakref.ref(self)
        return adoption

    def _adopt_with_optimizer(self, model, training: bool):
        """parallel.adopt(model), and what became of the optimizer the model came with:
        (trained model, its optimizer, that optimizer, whether its state was set aside).
        A built optimizer that took no step is replaced by an unbuilt copy (the same
        state; dtensor builds its slots on the shards). One that holds state is handed to
        the mode; a mode that refuses it (dtensor) gets an unbuilt copy to evaluate or
        predict with, the state set aside (and training refused, in prepare)."""
        loaded = model.optimizer
        if _optimizer_built(loaded) and not _stateful(loaded):
            model.optimizer = self._fresh_copy(loaded)
        try:
            return (*self.parallel.adopt(model), loaded, False)
        except UsageError:
            if training or not _stateful(loaded):
                raise
        model.optimizer = self._fresh_copy(loaded)
        try:
            trained, optimizer = self.parallel.adopt(model)
        finally:
            model.optimizer = loaded   # what the user loaded stays theirs (and is saved)
        return trained, optimizer, loaded, True

    def _fresh_copy(self, optimizer):
        """The same optimizer (class, config, schedule), unbuilt, its variables created
        in scope (Keras makes `iterations` at construction)."""
        import keras
        with self.parallel.scope():
            return keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))

    def _predict_step(self, model):
        """One traced predict function per model and state (kept: predict is called often)."""
        import tensorflow as tf
        adoption = self._adopted.get(id(model))
        cached = self._predict_steps.get(id(model))
        if cached is None or cached[0] is not adoption:
            if adoption is not None:   # trained here: predict where the weights live
                step = self.parallel.make_predict_step(model, adoption.model)
            else:                      # an ordinary model: on the default device
                step = tf.function(lambda batch: model(batch, training=False),
                                   reduce_retracing=True)
            self._predict_steps[id(model)] = cached = (adoption, step)
        return cached[1]

    def _trained(self, model):
        """The user's model holding the trained weights."""
        adoption = self._adopted.get(id(model))
        if adoption is not None:
            self.parallel.sync_to_user_model(model, adoption.model)
        return model

    def _weights_loaded(self, model) -> None:
        """After Keras' model.load_weights on a model trained here: every copy the mode
        trains (the pipeline's placed replicas) takes the loaded weights too. Where those
        copies have their own optimizers, the file's optimizer state cannot reach them:
        training it again then needs a new compile (prepare refuses until then)."""
        adoption = self._adopted.get(id(model))
        if adoption is None:
            return
        weights = None
        for copy in self.parallel.replica_models(adoption.model).values():
            if copy is not model:
                weights = model.get_weights() if weights is None else weights
                copy.set_weights(weights)
        if weights is not None and adoption.optimizer is not model.optimizer:
            adoption.weights_replaced = True


@dataclasses.dataclass
class _Adoption:
    """What the mode made of one user model."""
    model: object             # the model the steps train
    optimizer: object         # and its optimizer (the pipeline's StageOptimizers, say)
    user_optimizer: object    # model.optimizer when adopted: a new compile re-adopts
    loaded_optimizer: object  # the optimizer the model came with
    state_set_aside: bool     # that optimizer's state is not what the steps train
    weights_replaced: bool = False   # load_weights reached the copies, not their optimizers


# ---------------------------------------------------------------------- Keras' calls, routed

def owner_of(model) -> Optional[Strategy]:
    """The Strategy whose Keras calls `model` takes: the one it was compiled in the scope
    of (or trained by), else, under a tf.distribute mode, the one it was built in the
    scope of. None for a model of no Strategy. Refused when that Strategy is gone."""
    reference = _OWNERS.get(model)
    built_under = _built_under(model)
    if reference is None and built_under is not None:
        reference = _TF_OWNERS.get(built_under)
    if reference is None:
        return None
    strategy = reference()
    require(strategy is not None,
            f"Model '{model.name}' was built in the scope of a tfdist.Strategy that no longer "
            f"exists (it was garbage-collected: `with tfdist.Strategy(...).scope():` keeps no "
            f"reference to it). Keep the Strategy in a variable and train with "
            f"strategy.fit(model, ...) (or Keras' model.fit, which tfdist then routes there); "
            f"Keras' own fit cannot run this model's mode.")
    return strategy


def weights_loaded(model) -> None:
    """Called after Keras' model.load_weights: a model trained by a live Strategy hands
    the loaded weights on to the copies its mode trains."""
    reference = _OWNERS.get(model)
    strategy = reference() if reference is not None else None
    if strategy is not None:
        strategy._weights_loaded(model)


def inside_tfdist_call() -> bool:
    """True while a Strategy's fit/evaluate/predict runs in this thread."""
    return getattr(_thread, "calling", False)


def compiled(model) -> None:
    """Called after Keras' model.compile: inside a Strategy's scope, the model is its."""
    scopes = _open_scopes()
    if scopes and scopes[-1]._routes_keras_calls:
        _OWNERS[model] = weakref.ref(scopes[-1])


def keras_call(strategy: Strategy, name: str, model, arguments: dict):
    """model.<name>(**arguments) (Keras' arguments, bound) as strategy.<name>(model, ...)."""
    import tensorflow as tf
    arguments = dict(arguments)
    extra = arguments.pop("kwargs", None) or {}
    require(not extra, f"model.{name}() got {', '.join(f'{k}={v!r}' for k, v in extra.items())}"
                       f", which tfdist.Strategy({strategy.config.strategy!r}).{name} does not "
                       f"take (Keras' own keyword arguments only).")
    if name == "fit" and isinstance(arguments.get("x"), tf.data.Dataset):
        arguments["shuffle"] = False   # Keras never shuffles a Dataset: its order is the user's
    result = getattr(strategy, name)(model, **arguments)
    if name == "fit":
        model.history = result
    return result


def _built_under(model):
    """The tf.distribute strategy whose scope built the model (Keras records it)."""
    return getattr(model, "distribute_strategy", None)


def _is_scoped(tf_strategy) -> bool:
    """False for TensorFlow's default strategy (every plain model's): never an owner."""
    import tensorflow as tf
    with tf_strategy.scope():
        return tf.distribute.has_strategy()


def _open_scopes() -> list:
    if not hasattr(_thread, "scopes"):
        _thread.scopes = []
    return _thread.scopes


def _exit_with_usage_status_under_launcher() -> None:
    """In a worker of `tfdist launch`, an uncaught UsageError is printed as its one
    paragraph and ends the process with EXIT_USAGE_ERROR (2), the status the launcher
    reads as "fix the command" (no restart advice), as tfdist's own entry points do.
    Other exceptions keep Python's traceback."""
    if "TFDIST_RESTART_COUNT" not in os.environ or getattr(sys.excepthook, "tfdist", False):
        return
    previous = sys.excepthook

    def hook(kind, error, traceback):
        if not issubclass(kind, UsageError):
            return previous(kind, error, traceback)
        print(f"tfdist: error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_USAGE_ERROR)   # no TensorFlow teardown: it can stall (loop.keep_last_iterator)

    hook.tfdist = True
    sys.excepthook = hook


# ---------------------------------------------------------------------- naming

_FLAG = re.compile(r"--([a-z][a-z0-9_]*)(?:=([^\s;()]*[^\s;().,:'\"]))?")
_NUMBER = re.compile(r"-?\d+(\.\d*)?(e-?\d+)?|True|False|None")


def python_names(message: str, renames: Mapping[str, str]) -> str:
    """`message` with each flag of a config field (--name or --name=value) written as
    the Python argument the user passed (name or name=value), `renames` mapping a
    field to the argument that sets it (global_batch_size -> batch_size in fit).
    Flags of other programs (the launcher's --devices_per_worker, srun's --mpi) stay."""
    fields = _config_fields()

    def as_argument(match):
        name, value = match.group(1), match.group(2)
        if name not in fields:
            return match.group(0)
        name = renames.get(name, name)
        if value is None:
            return name
        return f"{name}={value if _NUMBER.fullmatch(value) else repr(value)}"

    return _FLAG.sub(as_argument, message)


def _config_fields() -> set:
    return {f.name for config in (cfg.RunConfig, cfg.DataConfig, cfg.ModelConfig)
            for f in dataclasses.fields(config)}


# ---------------------------------------------------------------------- fit's arguments

@dataclasses.dataclass
class _Fit:
    """Keras' fit arguments, checked and turned into what tfdist trains on."""
    x: object
    y: object
    batch_size: Optional[int]
    epochs: int
    verbose: object
    callbacks: object
    validation_split: float
    validation_data: object
    shuffle: object
    class_weight: Optional[dict]
    sample_weight: object
    initial_epoch: int
    steps_per_epoch: Optional[int]
    validation_steps: Optional[int]
    validation_batch_size: Optional[int]
    validation_freq: object

    def check(self) -> None:
        """Refuses what cannot be honoured exactly; then applies validation_split and
        class_weight as Keras does (the split first: the validation part is unweighted)."""
        _require_count("epochs", self.epochs, minimum=0)
        _require_count("initial_epoch", self.initial_epoch, minimum=0)
        _require_steps("steps_per_epoch", self.steps_per_epoch)
        _require_steps("validation_steps", self.validation_steps)
        _require_steps("validation_batch_size", self.validation_batch_size)
        require(isinstance(self.shuffle, bool),
                f"fit(shuffle={self.shuffle!r}): tfdist takes shuffle=True (its seeded order, "
                f"the same in every mode) or False (the data's order). Keras' \"batch\" "
                f"shuffles within chunks of a batch, which tfdist does not do.")
        _check_validation_freq(self.validation_freq)
        require(self.verbose in ("auto", 0, 1, 2),
                f"fit(verbose={self.verbose!r}): give \"auto\", 0, 1 or 2, as Keras takes.")
        self._split_validation()
        self._weight_classes()

    def _split_validation(self) -> None:
        require(isinstance(self.validation_split, (int, float))
                and 0 <= self.validation_split < 1,
                f"fit(validation_split={self.validation_split!r}): give a fraction in [0, 1) "
                f"of the arrays to hold out (their last part, as Keras takes it).")
        if not self.validation_split or self.validation_data is not None:
            return   # Keras: validation_data wins over validation_split
        require(_are_arrays(self.x),
                f"fit(validation_split={self.validation_split}) splits arrays, as Keras does; "
                f"the training data is {_kind(self.x)}. Give validation_data instead (e.g. "
                f"dataset.take(n) for validation and dataset.skip(n) for training).")
        rows = _rows(self.x)
        split_at = int(math.floor(rows * (1.0 - self.validation_split)))
        require(split_at > 0,
                f"fit(validation_split={self.validation_split}) leaves no training example of "
                f"the {rows}; give more data or a smaller fraction.")
        parts = (self.x, self.y, self.sample_weight)
        train, held_out = (_slice_rows(parts, 0, split_at), _slice_rows(parts, split_at, rows))
        self.x, self.y, self.sample_weight = train
        self.validation_data = tuple(part for part in held_out if part is not None)

    def _weight_classes(self) -> None:
        if self.class_weight is None:
            return
        _check_class_weight(self.class_weight)
        require(self.sample_weight is None,
                "fit() got both class_weight and sample_weight; Keras refuses that too. "
                "Multiply the class weights into your sample weights and give sample_weight "
                "alone.")
        import tensorflow as tf
        if isinstance(self.x, tf.data.Dataset):
            self.x = _class_weighted(self.x, self.class_weight, batched=self.batch_size is None)
            return
        require(_are_arrays(self.x),
                f"fit(class_weight=...) weighs the examples of arrays or a tf.data.Dataset; the "
                f"training data is {_kind(self.x)}, whose labels tfdist does not see here. Give "
                f"each example its weight in the data (x, y, sample_weight) instead.")
        require(not isinstance(self.y, (dict, list, tuple)),
                "fit(class_weight=...) is for a model with one output (Keras' rule); y has "
                "several. Give sample_weight instead.")
        self.sample_weight = class_weights_of(self.y, self.class_weight)


def class_weights_of(y, class_weight: dict):
    """Keras' per-example weights for class_weight (data_adapter_utils.
    class_weight_to_sample_weights): the class is the label (rounded), the argmax of a
    one-hot row, or the one column of (n, 1); a class not in the dict weighs 1."""
    import numpy as np
    labels = np.asarray(y)
    if labels.ndim > 1:
        labels = labels.argmax(-1) if labels.shape[-1] != 1 else labels.squeeze(-1)
    require(labels.ndim == 1,
            f"fit(class_weight=...) needs one class per example; the labels have shape "
            f"{np.shape(y)}. Give sample_weight instead.")
    classes = np.round(labels).astype("int64")
    weights = np.ones(len(classes), "float32")
    for label, weight in class_weight.items():
        weights[classes == int(label)] = weight
    return weights


def _class_weighted(dataset, class_weight: dict, batched: bool):
    """The Dataset's (x, y) elements as (x, y, w), w as class_weights_of gives it (Keras'
    make_class_weight_map_fn; `batched`: elements are batches, else single examples)."""
    import numpy as np
    import tensorflow as tf
    spec = dataset.element_spec
    require(isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], tf.TensorSpec),
            "fit(class_weight=...) weighs a Dataset of (x, y) elements with one label tensor "
            "(Keras' rule: no sample weights, one output); this Dataset's elements are "
            f"{spec}.")
    table = np.ones(max(class_weight) + 1, "float32")
    for label, weight in class_weight.items():
        table[int(label)] = weight
    per_example_rank = spec[1].shape.rank - (1 if batched else 0)
    require(per_example_rank in (0, 1),
            f"fit(class_weight=...) needs one class per example; the labels are {spec[1]}.")

    def with_weights(x, y):
        classes = y
        if per_example_rank == 1:
            classes = (tf.argmax(y, -1) if spec[1].shape[-1] != 1 else tf.squeeze(y, -1))
        classes = tf.cast(tf.round(tf.cast(classes, tf.float64)), tf.int64)
        known = (classes >= 0) & (classes < len(table))
        weights = tf.gather(table, tf.clip_by_value(classes, 0, len(table) - 1))
        return x, y, tf.where(known, weights, tf.ones_like(weights))

    return dataset.map(with_weights)


def _check_class_weight(class_weight) -> None:
    require(isinstance(class_weight, dict) and class_weight and all(
                _is_int(k) and k >= 0 for k in class_weight),
            f"fit(class_weight={class_weight!r}): give a dict of class index (an integer >= 0) "
            f"-> weight, e.g. {{0: 1.0, 1: 5.0}}.")


def _check_validation_freq(freq) -> None:
    ok = (_is_int(freq) and freq >= 1) or (
        isinstance(freq, (list, tuple)) and all(_is_int(e) and e >= 1 for e in freq))
    require(ok, f"fit(validation_freq={freq!r}): give an integer >= 1 (validate after every "
                f"N-th epoch) or a list of epochs (1-based), as Keras takes.")


def _require_whole_validation(validation_steps, batches: int) -> None:
    """Keras validates `validation_steps` batches that continue where the previous
    validation stopped (its iterator is kept across epochs); tfdist validates every
    example once, which is Keras' rule only when the steps cover the whole data."""
    require(validation_steps is None or validation_steps >= batches,
            f"fit(validation_steps={validation_steps}): the validation data has {batches} "
            f"batches; Keras would validate {validation_steps} of them per epoch, each time "
            f"continuing where the last validation stopped, which tfdist does not reproduce. "
            f"Drop validation_steps (every validation example is then evaluated once), or "
            f"give validation_data with just the examples to validate.")


def _steps_per_epoch(asked: Optional[int], data: "_Data", config) -> int:
    """fit's steps_per_epoch over arrays or a Dataset: Keras' epochs are exact here when
    they divide the data's full batches (Keras restarts its iterator only at the end of
    the data, so an epoch that reaches it is cut short, with "ran out of data"; tfdist's
    stream runs on). A dataset_fn's length is the user's: steps_per_epoch is required."""
    if data.source is None:
        return asked or data.steps_per_epoch(config)
    full = data.steps_per_epoch(config)
    divisors = [d for d in range(1, full + 1) if full % d == 0]
    require(asked is None or asked in divisors,
            f"fit(steps_per_epoch={asked}): the training data has {full} full batches of "
            f"{config.global_batch_size}; Keras would cut the epoch that reaches their end "
            f"short (its iterator restarts only there), which tfdist does not reproduce. Give "
            f"a steps_per_epoch that divides {full} ({', '.join(map(str, divisors[:12]))}"
            f"{', ...' if len(divisors) > 12 else ''}), or leave it None (one pass).")
    return asked or full


def _require_count(name: str, value, minimum: int) -> None:
    require(_is_int(value) and value >= minimum,
            f"fit({name}={value!r}): give an integer >= {minimum}.")


def _require_steps(name: str, value) -> None:
    require(value is None or (_is_int(value) and value >= 1),
            f"{name}={value!r}: give an integer >= 1, or None.")


def _examples_in(steps: Optional[int], global_batch_size: int) -> Optional[int]:
    return None if steps is None else steps * global_batch_size


def _is_int(value) -> bool:
    import numbers
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _are_arrays(x) -> bool:
    """Arrays (NumPy, tensors) or a dict/list/tuple of them: what Keras can slice."""
    import tensorflow as tf
    if isinstance(x, (str, tf.data.Dataset)) or callable(x):
        return False
    leaves = tf.nest.flatten(x)
    return bool(leaves) and all(hasattr(leaf, "shape") and hasattr(leaf, "__getitem__")
                                for leaf in leaves)


def _kind(x) -> str:
    import tensorflow as tf
    if isinstance(x, tf.data.Dataset):
        return "a tf.data.Dataset"
    if isinstance(x, str):
        return f"the dataset name {x!r}"
    if callable(x):
        return "a dataset_fn"
    return f"a {type(x).__name__}"


def _rows(x) -> int:
    import tensorflow as tf
    return int(tf.nest.flatten(x)[0].shape[0])


def _slice_rows(parts, start: int, end: int):
    import tensorflow as tf
    return tuple(None if part is None else tf.nest.map_structure(lambda a: a[start:end], part)
                 for part in parts)


# ---------------------------------------------------------------------- optimizers

def _optimizer_built(optimizer) -> bool:
    return bool(getattr(optimizer, "built", False))


def _stateful(optimizer) -> bool:
    """True for an optimizer that has taken steps (a loaded model's): its slots hold state."""
    return _optimizer_built(optimizer) and int(optimizer.iterations.numpy()) > 0


def _require_optimizer_state_kept(model, adoption: _Adoption, mode: str) -> None:
    """Training must continue from the optimizer state the user's model holds."""
    loaded = adoption.loaded_optimizer
    lost = adoption.state_set_aside or (_stateful(loaded) and adoption.optimizer is not loaded)
    if not lost and not adoption.weights_replaced:
        return
    what = ("model.load_weights replaced the weights after training; the optimizers tfdist "
            "trains kept theirs" if adoption.weights_replaced else
            f"{type(loaded).__name__}, {int(loaded.iterations.numpy())} steps taken, loaded "
            f"with the model")
    raise UsageError(
        f"Model '{model.name}' holds optimizer state that strategy {mode!r} cannot carry into "
        f"the optimizers it trains ({what}), so training on would not continue as one device "
        f"would. Compile the model again (model.compile(optimizer=..., loss=...)) to train on "
        f"from these weights with a new optimizer state, or continue training in a "
        f"tf.distribute mode (mirrored, multi_worker_mirrored), which keeps it. Evaluating "
        f"and predicting need no optimizer and work as they are.")


# ---------------------------------------------------------------------- helpers

def _option_names():
    return sorted(f.name for f in dataclasses.fields(cfg.RunConfig) if f.name != "strategy")


def _verbosity(verbose) -> int:
    return 1 if verbose == "auto" else int(verbose)


def _require_keras_model(model) -> None:
    import keras
    require(isinstance(model, keras.Model),
            f"tfdist trains Keras 3 models (keras.Model); got {type(model).__module__}."
            f"{type(model).__name__}.")


def _redirect_files(callbacks, parallel):
    """On a process that is not the chief, Keras' file-writing callbacks write into a
    scratch dir that is removed at the end (TF's multi-worker write pattern), so only
    the chief leaves files; they still run, so every worker takes the same decisions."""
    if parallel.is_chief:
        return list(callbacks)
    for callback in callbacks:
        for attribute in ("filepath", "log_dir", "filename"):
            path = getattr(callback, attribute, None)
            if isinstance(path, str):
                scratch = parallel.write_dir(os.path.dirname(os.path.abspath(path)) or ".")
                setattr(callback, attribute, os.path.join(scratch, os.path.basename(path)))
    return list(callbacks)


class _Data:
    """The user's data (arrays, a Dataset, a dataset_fn) as tfdist's input pipeline."""

    def __init__(self, source, dataset_fn, global_batch_size, shuffle, named=False):
        self.source = source            # a DatasetSource, or None for a user dataset_fn
        self.dataset_fn = dataset_fn
        self.global_batch_size = global_batch_size
        self.shuffle = shuffle
        self.named = named              # a named dataset: evaluation reads its test split

    @classmethod
    def of(cls, x, y, sample_weight, batch_size, shuffle, what, split_tuple=False,
           features_only=False):
        import tensorflow as tf
        from tfdist.data import user
        if split_tuple and isinstance(x, (tuple, list)):
            x, y, sample_weight = (tuple(x) + (None, None))[:3]
        if isinstance(x, str):   # a registry dataset, tfds:NAME or MODULE:FUNCTION
            require(y is None and sample_weight is None,
                    f"The {what} is the dataset name {x!r}: its examples carry the labels; "
                    f"do not pass y or sample_weight too.")
            from tfdist import data
            return cls(data.as_source(x, cfg.DataConfig()), None,
                       batch_size or KERAS_DEFAULT_BATCH, shuffle, named=True)
        if callable(x) and not isinstance(x, tf.data.Dataset):
            require(batch_size, f"The {what} is a dataset_fn(input_context); give batch_size "
                                f"(the global batch its per-replica batches add up to).")
            return cls(None, x, batch_size, shuffle)
        if isinstance(x, tf.data.Dataset):
            require(y is None and sample_weight is None,
                    f"The {what} is a tf.data.Dataset: its elements carry the labels (and "
                    f"weights); do not pass y or sample_weight too.")
            if batch_size is None:   # Keras' convention: a Dataset comes batched
                batch_size = _batch_size_of(x, what)
                x = x.unbatch()
            return cls(user.source_from_user_data(x), None, batch_size, shuffle)
        if y is None:   # arrays without labels: only predict's inputs may be that
            require(features_only, f"The {what} are arrays without labels: give y (and "
                                   f"sample_weight if any), or a Dataset of (x, y) examples.")
            arrays = (x, _zeros_like_rows(x))
        else:
            arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
        return cls(user.source_from_user_data(arrays), None, batch_size or KERAS_DEFAULT_BATCH,
                   shuffle)

    def steps_per_epoch(self, config) -> int:
        require(self.source is not None,
                "fit on a dataset_fn(input_context) needs steps_per_epoch (its length is "
                "the user's).")
        size = self.source.info.size("train")
        require(size >= config.global_batch_size,
                f"The training data has {size} examples, fewer than one global batch of "
                f"{config.global_batch_size}; use a smaller batch_size.")
        if size % config.global_batch_size:
            log.warning("the training data has %d examples, %d more than %d global batches of "
                        "%d: each epoch trains the full batches only (Keras would train a last, "
                        "smaller one, which replicas cannot all share equally)", size,
                        size % config.global_batch_size, size // config.global_batch_size,
                        config.global_batch_size)
        return size // config.global_batch_size

    def train_dataset_fn(self, config, start_step: int):
        from tfdist.data import pipeline, user
        if self.source is None:
            return user.as_dataset_fns(self.dataset_fn, config.global_batch_size,
                                       start_step=start_step).train
        return pipeline.train_dataset_fn(self.source, config.global_batch_size, config.seed,
                                         config.data, start_step)

    def eval_data(self, config, limit: Optional[int] = None):
        """Every example once (the first `limit` when given: evaluate's `steps` batches),
        in global batches of config.global_batch_size."""
        from tfdist.data import pipeline, user
        from tfdist.train.loop import EvalData
        require(self.source is not None,
                "evaluation on a dataset_fn(input_context) is not supported yet; give arrays "
                "or a tf.data.Dataset (every example is then evaluated exactly once).")
        test = self.source if self.named and limit is None else user.UserSource(
            {"test": self._examples(limit)}, "evaluation")
        batch = config.global_batch_size
        return EvalData(pipeline.eval_dataset_fn(test, batch, config.data),
                        pipeline.eval_steps(test, batch), test.info.size("test"),
                        global_batch_size=batch)

    def _examples(self, limit: Optional[int] = None):
        examples = self.source.examples("test" if self.named else "train")
        return examples if limit is None else examples.take(limit)

    def sample_batch(self, config):
        """One small batch on the host: builds an unbuilt model and the metrics."""
        if self.source is None:
            import tensorflow as tf
            return next(iter(self.dataset_fn(tf.distribute.InputContext()).take(1)))
        return next(iter(self.source.examples("train").batch(1).take(1)))

    def feature_batches(self, steps: Optional[int] = None):
        """The features of every example once, in order, in batches (for predict; the
        first `steps` batches when given)."""
        dataset = self.source.examples("train").batch(self.global_batch_size)
        for batch in dataset if steps is None else dataset.take(steps):
            yield batch[0]


def _with_dummy_labels(x):
    """predict's inputs as (features, 0) examples, so they pass the same pipeline. A
    Dataset's elements are x, (x,), (x, y) or (x, y, w), batched: x is kept, as Keras'
    predict does (map passes a tuple's parts as arguments, anything else as one)."""
    import tensorflow as tf
    if not isinstance(x, tf.data.Dataset):
        return x

    def features_and_zeros(features, *_):
        return features, tf.zeros(tf.shape(tf.nest.flatten(features)[0])[:1])

    return x.map(features_and_zeros)


def _batch_size_of(dataset, what) -> int:
    import tensorflow as tf
    first = next(iter(dataset.take(1)), None)
    require(first is not None, f"The {what} dataset is empty.")
    leaves = tf.nest.flatten(first)
    require(leaves and leaves[0].shape.rank, f"The {what} dataset's elements have no batch "
                                             f"dimension; give batch_size (the global batch).")
    return int(leaves[0].shape[0])


def _zeros_like_rows(x):
    """Labels for inputs given alone (predict): one 0 per example."""
    import numpy as np
    import tensorflow as tf
    first = tf.nest.flatten(x)[0]
    return np.zeros(len(first), np.float32)


__all__ = ["Strategy", "UsageError"]


# What keras.Model's wrapped methods ask this module (tfdist.keras_calls.Router).
KERAS_ROUTER = types.SimpleNamespace(inside_tfdist_call=inside_tfdist_call, owner_of=owner_of,
                                     keras_call=keras_call, compiled=compiled,
                                     weights_loaded=weights_loaded)
