"""`tfdist.run(config)`: one run, from devices to the results JSON.

The order matters: devices are configured first (TensorFlow allows it only
before initialisation), then the batch is checked against the replica count,
then the dataset is resolved (a missing dataset fails before any model is built),
and only then are model and optimizer created inside the mode's scope.
"""

import json
import logging
import math
import os

import keras

from typing import Optional

from tfdist import data, models, parallel as parallel_lib, user_code
from tfdist.errors import UsageError, require
from tfdist.config import DEFAULT_EPOCHS, RunConfig
from tfdist.train import model_dir_lock, optimizers, progress
from tfdist.data import pipeline
from tfdist.train.loop import EvalData, TrainingLoop, TrainPlan

log = logging.getLogger("tfdist")


def resolve_steps(config: RunConfig, source) -> int:
    """--train_steps wins; else --epochs (default DEFAULT_EPOCHS) of full global batches."""
    if config.train_steps:
        return config.train_steps
    epochs = config.epochs or DEFAULT_EPOCHS
    steps_per_epoch = max(1, source.info.size("train") // config.global_batch_size)
    return epochs * steps_per_epoch


REGISTRY_METRICS = ("accuracy",)


def registry_loss():
    """What every registry model trains with: its outputs are logits."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build_model(config: RunConfig, parallel, info):
    """The --model (a registry name, or a user's MODULE:FUNCTION), compiled with --loss,
    --metrics and --optimizer as a user would compile it, in the mode's scope. Same
    seed, same initial weights, in every mode: the RNG is reset right before."""
    keras.utils.set_random_seed(config.seed)
    user = user_code.is_user_code_spec(config.model.name)
    with parallel.scope():
        model = (user_code.build_user_model(config.model.name) if user
                 else models.build_model(info, config.model))
        model.compile(optimizer=optimizers.build_optimizer(
                          config.optimizer, config.learning_rate, config.mixed_precision),
                      loss=compiled_loss(config, user), metrics=compiled_metrics(config, user))
    return model


def compiled_loss(config: RunConfig, user_model: bool):
    """--loss by Keras identifier; the registry models' default (their outputs are
    logits); a user's model has no default (its outputs are the user's)."""
    if config.loss is None:
        require(not user_model,
                f"--model={config.model.name} is your own model: give --loss (a Keras loss "
                f"identifier, e.g. sparse_categorical_crossentropy, mse, binary_crossentropy).")
        return registry_loss()
    try:
        return keras.losses.get(config.loss)
    except (ValueError, TypeError):
        raise UsageError(f"Unknown --loss {config.loss!r}: not a Keras loss identifier "
                         f"(e.g. sparse_categorical_crossentropy, categorical_crossentropy, "
                         f"binary_crossentropy, mse, mae, huber).") from None


def compiled_metrics(config: RunConfig, user_model: bool):
    if config.metrics is None:
        return [] if user_model else list(REGISTRY_METRICS)
    for name in config.metrics:
        try:
            keras.metrics.get(name)
        except (ValueError, TypeError):
            raise UsageError(f"Unknown --metrics entry {name!r}: not a Keras metric "
                             f"identifier (e.g. accuracy, mae, mse, auc, precision).") from None
    return list(config.metrics)


def save_outputs(config: RunConfig, strategy, model) -> None:
    """--save_model and --export_dir from the trained model (every process takes part
    in gathering the weights; the chief writes)."""
    if config.save_model:
        strategy.save(model, config.save_model)
        log.info("saved the trained model to %s", config.save_model)
    if config.export_dir:
        strategy.export(model, config.export_dir)
        log.info("exported a SavedModel to %s", config.export_dir)


def build_model_and_optimizer(config: RunConfig, parallel, info):
    """(the model the steps train, its optimizer) for --model, with --remat applied to
    it (what Strategy.prepare does for a user's model; this path skips prepare)."""
    from tfdist.train import remat
    model, optimizer = parallel.adopt(build_model(config, parallel, info))
    remat.apply(model, config.remat, config.remat_layers, config.remat_threshold,
                where=f"{parallel.name}: ")
    return model, optimizer


def train_plan(config: RunConfig, source, steps: int, callbacks=()) -> TrainPlan:
    """The registry run as a fit: epochs of the training split, one validation (the
    test split) at the end, or every --eval_every steps."""
    steps_per_epoch = max(1, source.info.size("train") // config.global_batch_size)
    return TrainPlan(
        train_dataset_fn=lambda start_step: pipeline.train_dataset_fn(
            source, config.global_batch_size, config.seed, config.data, start_step),
        steps_per_epoch=steps_per_epoch, epochs=math.ceil(steps / steps_per_epoch),
        total_steps=steps, validation=eval_data(config, source),
        validation_freq=math.ceil(steps / steps_per_epoch), callbacks=tuple(callbacks),
        progress=True)


def sample_batch(dataset_fn):
    """One batch of a dataset_fn's data, read on the host (one input pipeline)."""
    import tensorflow as tf
    return next(iter(dataset_fn(tf.distribute.InputContext()).take(1)))


def eval_data(config: RunConfig, source) -> Optional[EvalData]:
    """The test split, every example once (None when the data has no test split)."""
    if not source.info.has_split("test"):
        return None
    return EvalData(pipeline.eval_dataset_fn(source, config.global_batch_size, config.data),
                    pipeline.eval_steps(source, config.global_batch_size),
                    source.info.size("test"))


def train(config, parallel, source, model, optimizer, steps, user_model=None):
    """Trains `model` (what parallel.adopt returned for `user_model`, by default itself)."""
    user_model = model if user_model is None else user_model
    if config.trainer == "fit":
        from tfdist.train import fit
        return fit.train_with_fit(config, parallel, source, model, optimizer, steps,
                                  eval_data(config, source))
    loop = TrainingLoop(config, parallel, user_model, model, optimizer,
                        parallel.write_dir(config.model_dir))
    return loop.run(train_plan(config, source, steps))


def results_dict(config, parallel, steps, loop_result, model, optimizer) -> dict:
    results = {
        "strategy": config.strategy,
        "num_replicas": parallel.num_replicas,
        "devices": parallel.devices,
        "model": config.model.name,
        "dataset": config.data.name,
        "optimizer": config.optimizer,
        "global_batch_size": config.global_batch_size,
        "seed": config.seed,
        "steps": steps,
        "start_step": loop_result.start_step,   # losses[i] is step start_step + i + 1
        "losses": loop_result.losses,
        "final_loss": loop_result.losses[-1] if loop_result.losses else None,
        "eval_loss": loop_result.eval_loss,
        "eval_accuracy": loop_result.eval_accuracy,
        "train_metrics": _json_scalars(loop_result.train_metrics),
        "eval_metrics": _json_scalars(loop_result.eval_metrics),
        "examples_per_sec": loop_result.examples_per_sec,
        "train_seconds": loop_result.train_seconds,
        "param_bytes_per_device": parallel.param_bytes_per_device(model, optimizer),
    }
    gradient_bytes = parallel.gradient_bytes_per_device(model)
    if gradient_bytes is not None:
        results["gradient_bytes_per_device"] = gradient_bytes
    return results


def _json_scalars(logs: dict) -> dict:
    return {name: value for name, value in logs.items() if isinstance(value, float)}


def write_results(path: str, results: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2)
    os.replace(tmp, path)  # readers never see a half-written file


def run(config: RunConfig, return_model: bool = False):
    """Trains per `config` and returns the results dict (and the model if asked).

    First, before any device or model exists: a one-process mode in a cluster of
    several workers is refused, and the process that writes --model_dir locks it
    for the whole run (released on errors too)."""
    progress.ensure_logging()
    parallel_lib.spanned_cluster(config.strategy)
    with model_dir_lock.hold_for(config):
        return _run(config, return_model)


def _run(config: RunConfig, return_model: bool):
    from tfdist.api import Strategy
    strategy = Strategy.from_config(config)   # the public API's object: one code path
    parallel = strategy.parallel
    parallel.validate_global_batch(config.global_batch_size)
    source = data.get_source(config.data)
    keras.mixed_precision.set_dtype_policy(config.mixed_precision or "float32")
    user_model = build_model(config, parallel, source.info)
    validation = eval_data(config, source)
    model, optimizer = strategy.prepare(user_model, sample_batch(
        validation.dataset_fn if validation else train_plan(config, source, 1).train_dataset_fn(0)))
    steps = resolve_steps(config, source)
    log.info("strategy %s: %d replica(s) on %s; %s on %s, %d steps of %d examples",
             parallel.name, parallel.num_replicas, ", ".join(parallel.devices),
             config.model.name, config.data.name, steps, config.global_batch_size)
    try:
        with parallel.translate_failures():
            loop_result = train(config, parallel, source, model, optimizer, steps, user_model)
        results = results_dict(config, parallel, steps, loop_result, model, optimizer)
        if config.results_json and parallel.is_chief:
            write_results(config.results_json, results)
        with parallel.translate_failures():
            save_outputs(config, strategy, user_model)
        with parallel.translate_failures():
            parallel.finish()
    finally:
        parallel.close()  # also on preemption or a peer failure: no scratch dirs left
    return (results, model) if return_model else results
