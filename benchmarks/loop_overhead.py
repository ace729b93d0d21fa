"""tfdist's loop against the shortest hand-written `strategy.run` loop.

Same model, strategy, data pipeline and step math; the only difference is
tfdist's machinery (Parallelism, progress, metrics, eval bookkeeping). Trials
alternate between the two so machine noise hits both alike; medians are compared.
"""

import statistics
import time

import keras
import tensorflow as tf

from tfdist import data, models, parallel as parallel_lib
from tfdist.data import pipeline
from tfdist.train import optimizers, runner, step as step_math
from tfdist.train.loop import TrainingLoop


def hand_written_examples_per_sec(config, steps: int) -> float:
    """The loop a TF user writes by hand; first step (tracing) is not timed."""
    parallel = parallel_lib.build_parallelism(config)
    strategy = parallel.strategy
    source = data.get_source(config.data)
    keras.utils.set_random_seed(config.seed)
    with strategy.scope():
        model = models.build_model(source.info, config.model)
        optimizer = optimizers.build_optimizer(config.optimizer, config.learning_rate)
        optimizer.build(model.trainable_variables)  # as a careful hand-writer does
    global_batch = config.global_batch_size

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.nn.compute_average_loss(step_math.per_example_loss(y, logits),
                                              global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    @tf.function
    def train_step(iterator):
        losses = strategy.run(replica_step, args=next(iterator))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    dataset_fn = pipeline.train_dataset_fn(source, global_batch, config.seed, config.data)
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    train_step(iterator)
    start = time.perf_counter()
    for _ in range(steps - 1):
        loss = train_step(iterator)
    float(loss)
    return (steps - 1) * global_batch / (time.perf_counter() - start)


def tfdist_examples_per_sec(config, steps: int) -> float:
    parallel = parallel_lib.build_parallelism(config)
    source = data.get_source(config.data)
    model, optimizer = runner.build_model_and_optimizer(config, parallel, source.info)
    loop = TrainingLoop(config, parallel, source, model, optimizer, log_dir=None)
    return loop.run(steps).examples_per_sec


def compare(config, steps: int, trials: int):
    """Returns a row: medians of both loops over alternating trials and their ratio."""
    hand, ours = [], []
    for _ in range(trials):
        hand.append(hand_written_examples_per_sec(config, steps))
        ours.append(tfdist_examples_per_sec(config, steps))
    hand_median, ours_median = statistics.median(hand), statistics.median(ours)
    return {"strategy": config.strategy, "model": config.model.name,
            "dataset": config.data.name, "global_batch_size": config.global_batch_size,
            "steps": steps, "trials": trials,
            "hand_examples_per_sec": round(hand_median, 1),
            "tfdist_examples_per_sec": round(ours_median, 1),
            "ratio": round(ours_median / hand_median, 3)}
