"""The public API: a user's own compiled Keras model, trained in any tfdist mode.

    strategy = tfdist.Strategy("mirrored", simulate_devices=2)
    with strategy.scope():                       # as with tf.distribute
        model = make_model()
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    history = strategy.fit(model, x, y, batch_size=64, epochs=3,
                           validation_data=(x_val, y_val), callbacks=[...])
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

The registry path (`tfdist.run`, `python -m experiments.train`) is a client of
the same loop (tfdist.train.runner builds a registry model, compiles it and
trains it here).
"""

import contextlib
import dataclasses
import logging
from typing import Optional

from tfdist import config as cfg
from tfdist.errors import UsageError, require

log = logging.getLogger("tfdist")
KERAS_DEFAULT_BATCH = 32


class Strategy:
    """One tfdist mode for the user's own Keras models.

    `strategy` is a mode name (default, one_device, mirrored, multi_worker_mirrored,
    dtensor, pipeline); `options` are RunConfig fields (simulate_devices, mesh,
    layout, pipeline_stages, microbatches, pipeline_split, collective, model_dir,
    checkpoint_every, seed, ...), validated here, before TensorFlow does anything.
    """

    def __init__(self, strategy: str = "default", **options):
        from tfdist import parallel as parallel_lib
        from tfdist.train import progress
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cfg.RunConfig)})
        require(not unknown, f"tfdist.Strategy got unknown option(s) {', '.join(unknown)}. "
                             f"Valid options: {', '.join(_option_names())}.")
        self.config = cfg.RunConfig(strategy=strategy, **options)
        progress.ensure_logging()
        parallel_lib.spanned_cluster(strategy)
        self.parallel = parallel_lib.build_parallelism(self.config)
        self._adopted = {}   # id(user model) -> (model the steps train, its optimizer)
        self._predict_steps = {}
        self._failed = False   # a fit or evaluate raised (a preemption too): close() says so

    @classmethod
    def from_config(cls, config: cfg.RunConfig) -> "Strategy":
        """The Strategy of a whole RunConfig (what tfdist.run trains with)."""
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return cls(**fields)

    # ------------------------------------------------------------------ what the mode is
    @property
    def num_replicas_in_sync(self) -> int:
        return self.parallel.num_replicas

    @property
    def is_chief(self) -> bool:
        """True in the process that writes files (worker 0, or the only process)."""
        return self.parallel.is_chief

    @property
    def devices(self):
        return list(self.parallel.devices)

    def scope(self):
        """Where the model is built and compiled: the tf.distribute strategy's scope
        (variables mirrored), and a no-op for dtensor and pipeline (tfdist shards or
        places the built model when training starts)."""
        return self.parallel.scope()

    # ------------------------------------------------------------------ Keras' calls
    def fit(self, model, x=None, y=None, batch_size: Optional[int] = None, epochs: int = 1,
            verbose="auto", callbacks=None, validation_data=None, shuffle: bool = True,
            sample_weight=None, steps_per_epoch: Optional[int] = None,
            validation_freq: int = 1):
        """Keras' `model.fit`, in this mode; returns the keras.callbacks.History.

        batch_size is the GLOBAL batch (split over every replica and worker); a
        tf.data.Dataset given without it is taken as batched, as Keras does, its
        batch size being the global batch. Every step is a full global batch
        (the remainder of an epoch is not trained on), so each step is exactly the
        one-device step. shuffle: arrays and unbatched datasets are shuffled by
        tfdist's seeded order before sharding (shuffle=False keeps the user's order)."""
        from tfdist.train.loop import TrainPlan
        data = _Data.of(x, y, sample_weight, batch_size, shuffle, "training data")
        config = self._config_for(data.global_batch_size, data.shuffle)
        validation = self._validation(validation_data, config, data.global_batch_size)
        loop = self._loop(model, config, data.sample_batch(config))
        steps_per_epoch = steps_per_epoch or data.steps_per_epoch(config)
        plan = TrainPlan(
            train_dataset_fn=lambda start: data.train_dataset_fn(config, start),
            steps_per_epoch=steps_per_epoch, epochs=epochs, total_steps=epochs * steps_per_epoch,
            validation=validation, validation_freq=validation_freq,
            callbacks=tuple(_redirect_files(callbacks or [], self.parallel)),
            verbose=_verbosity(verbose))
        with self._calling():
            result = loop.run(plan)
        self.last_result = result
        return result.history

    def evaluate(self, model, x=None, y=None, batch_size: Optional[int] = None,
                 sample_weight=None, verbose="auto", return_dict: bool = False):
        """Keras' `model.evaluate`: every example once; the loss and metrics, as a list
        (or a scalar without metrics) or, with return_dict, a dict."""
        data = _Data.of(x, y, sample_weight, batch_size, False, "evaluation data")
        config = self._config_for(data.global_batch_size, False)
        loop = self._loop(model, config, data.sample_batch(config))
        with self._calling():
            logs = loop.evaluate(data.eval_data(config))
        if return_dict:
            return logs
        values = [logs["loss"]] + [v for k, v in logs.items() if k != "loss"]
        return values[0] if len(values) == 1 else values

    def predict(self, model, x, batch_size: Optional[int] = None, verbose="auto"):
        """Keras' `model.predict`: the model's outputs for every example of x, as NumPy.
        Every process predicts every example (predictions need no gradient sum)."""
        import numpy as np
        import tensorflow as tf
        data = _Data.of(_with_dummy_labels(x), None, None, batch_size, False,
                        "prediction inputs", features_only=True)
        predict_step = self._predict_step(model)
        outputs = [predict_step(batch) for batch in data.feature_batches()]
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
        trained = self._adopted.get(id(model), (model, None))[0]
        return self.parallel.replica_models(trained)

    def close(self) -> None:
        """Ends the mode. After calls that all succeeded, the processes that leave together
        are told so first (parallel.finish: the pipeline's serving workers then exit 0, not
        3 as after a failure); then its resources go."""
        try:
            if not self._failed:
                with self.parallel.translate_failures():
                    self.parallel.finish()
        finally:
            self.parallel.close()

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

    def _validation(self, validation_data, config, global_batch_size):
        if validation_data is None:
            return None
        import tensorflow as tf
        # A Dataset comes batched, as Keras takes it; its examples are evaluated in
        # global batches of the training's size either way.
        batch_size = None if isinstance(validation_data, tf.data.Dataset) else global_batch_size
        data = _Data.of(validation_data, None, None, batch_size, False, "validation_data",
                        split_tuple=True)
        return data.eval_data(config)

    def _loop(self, model, config, sample_batch):
        from tfdist.train.loop import TrainingLoop
        train_model, optimizer = self.prepare(model, sample_batch)
        return TrainingLoop(config, self.parallel, model, train_model, optimizer,
                            self.parallel.write_dir(config.model_dir))

    def prepare(self, model, sample_batch):
        """The first time a model is trained here: built in scope, metrics built on the
        host, then handed to the mode (which may shard or place it)."""
        from tfdist.train import metrics
        if id(model) in self._adopted:
            return self._adopted[id(model)]
        _require_keras_model(model)
        if not model.built:
            from tfdist.train import step as step_math
            x, _, _ = step_math.split_batch(sample_batch)
            with self.parallel.scope():
                model(step_math.first_example(x), training=False)
        from tfdist.parallel.base import require_compiled
        from tfdist.train import checks
        require_compiled(model)
        checks.check_model_on_example(model, sample_batch)
        metrics.build_metrics(model, sample_batch)
        self._adopted[id(model)] = self.parallel.adopt(model)
        return self._adopted[id(model)]

    def _predict_step(self, model):
        """One traced predict function per model and state (kept: predict is called often)."""
        import tensorflow as tf
        key = (id(model), id(model) in self._adopted)
        if key not in self._predict_steps:
            if key[1]:   # trained here: predict where the weights live
                step = self.parallel.make_predict_step(model, self._adopted[id(model)][0])
            else:        # an ordinary model: on the default device
                step = tf.function(lambda batch: model(batch, training=False),
                                   reduce_retracing=True)
            self._predict_steps[key] = step
        return self._predict_steps[key]

    def _trained(self, model):
        """The user's model holding the trained weights."""
        if id(model) in self._adopted:
            self.parallel.sync_to_user_model(model, self._adopted[id(model)][0])
        return model


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
    import os
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
            return cls(user.as_source(x, cfg.DataConfig()), None,
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
        return size // config.global_batch_size

    def train_dataset_fn(self, config, start_step: int):
        from tfdist.data import pipeline, user
        if self.source is None:
            return user.as_dataset_fns(self.dataset_fn, config.global_batch_size,
                                       start_step=start_step).train
        return pipeline.train_dataset_fn(self.source, config.global_batch_size, config.seed,
                                         config.data, start_step)

    def eval_data(self, config):
        from tfdist.data import pipeline, user
        from tfdist.train.loop import EvalData
        require(self.source is not None,
                "evaluation on a dataset_fn(input_context) is not supported yet; give arrays "
                "or a tf.data.Dataset (every example is then evaluated exactly once).")
        test = self.source if self.named else user.UserSource(
            {"test": self.source.examples("train")}, "evaluation")
        return EvalData(pipeline.eval_dataset_fn(test, config.global_batch_size, config.data),
                        pipeline.eval_steps(test, config.global_batch_size),
                        test.info.size("test"))

    def sample_batch(self, config):
        """One small batch on the host: builds an unbuilt model and the metrics."""
        if self.source is None:
            import tensorflow as tf
            return next(iter(self.dataset_fn(tf.distribute.InputContext()).take(1)))
        return next(iter(self.source.examples("train").batch(1).take(1)))

    def feature_batches(self):
        """The features of every example once, in order, in batches (for predict)."""
        dataset = self.source.examples("train").batch(self.global_batch_size)
        for batch in dataset:
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
