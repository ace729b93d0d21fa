"""`tfdist.run(config)`: one run, from devices to the results JSON.

The order matters: devices are configured first (TensorFlow allows it only
before initialisation), then the batch is checked against the replica count,
then the dataset is resolved (a missing dataset fails before any model is built),
and only then are model and optimizer created inside the mode's scope.
"""

import json
import logging
import os

import keras

from tfdist import data, models, parallel as parallel_lib
from tfdist.config import DEFAULT_EPOCHS, RunConfig
from tfdist.train import model_dir_lock, optimizers, progress
from tfdist.train.loop import TrainingLoop

log = logging.getLogger("tfdist")


def resolve_steps(config: RunConfig, source) -> int:
    """--train_steps wins; else --epochs (default DEFAULT_EPOCHS) of full global batches."""
    if config.train_steps:
        return config.train_steps
    epochs = config.epochs or DEFAULT_EPOCHS
    steps_per_epoch = max(1, source.info.size("train") // config.global_batch_size)
    return epochs * steps_per_epoch


def build_model_and_optimizer(config: RunConfig, parallel, info):
    """Same seed, same initial weights, in every mode: the RNG is reset right before."""
    keras.utils.set_random_seed(config.seed)
    return parallel.build_model_and_optimizer(
        lambda: models.build_model(info, config.model),
        lambda: optimizers.build_optimizer(config.optimizer, config.learning_rate,
                                           config.mixed_precision))


def train(config, parallel, source, model, optimizer, steps):
    if config.trainer == "fit":
        from tfdist.train import fit
        return fit.train_with_fit(config, parallel, source, model, optimizer, steps)
    loop = TrainingLoop(config, parallel, source, model, optimizer,
                        parallel.write_dir(config.model_dir))
    return loop.run(steps)


def results_dict(config, parallel, steps, loop_result, model, optimizer) -> dict:
    return {
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
        "examples_per_sec": loop_result.examples_per_sec,
        "train_seconds": loop_result.train_seconds,
        "param_bytes_per_device": parallel.param_bytes_per_device(model, optimizer),
    }


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
    parallel = parallel_lib.build_parallelism(config)
    parallel.validate_global_batch(config.global_batch_size)
    source = data.get_source(config.data)
    keras.mixed_precision.set_dtype_policy(config.mixed_precision or "float32")
    model, optimizer = build_model_and_optimizer(config, parallel, source.info)
    steps = resolve_steps(config, source)
    log.info("strategy %s: %d replica(s) on %s; %s on %s, %d steps of %d examples",
             parallel.name, parallel.num_replicas, ", ".join(parallel.devices),
             config.model.name, config.data.name, steps, config.global_batch_size)
    try:
        with parallel.translate_failures():
            loop_result = train(config, parallel, source, model, optimizer, steps)
        results = results_dict(config, parallel, steps, loop_result, model, optimizer)
        if config.results_json and parallel.is_chief:
            write_results(config.results_json, results)
        with parallel.translate_failures():
            parallel.finish()
    finally:
        parallel.close()  # also on preemption or a peer failure: no scratch dirs left
    return (results, model) if return_model else results
