"""A multi-worker test worker: which TensorFlow collective ops the steps of
multi_worker_mirrored trace, for one --collective.

    python tests/workers/step_collectives.py COLLECTIVE OUT_DIR

Each worker builds the mode, a small regression model, and its train and eval steps
over tfdist's input pipeline and the loop's iterators for a user's arrays; runs each
once (so it is traced) and writes OUT_DIR/ops.rankR.json: for "train" and "eval", the
sorted op types starting with "Collective" in the traced graph and the functions it
calls, and the step's returned loss.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from helpers import small_config  # noqa: E402
from train_configs import worker_rank  # noqa: E402
from tfdist.config import DataConfig  # noqa: E402
from tfdist.data import pipeline, user  # noqa: E402
from tfdist.parallel import multi_worker  # noqa: E402
from tfdist.train import metrics as host_metrics  # noqa: E402
from tfdist.train.loop import EvalData  # noqa: E402

GLOBAL_BATCH = 16


def collective_ops(step, iterator):
    """Op types named Collective* that the guarded step's tf.function traced."""
    graph_def = step.step_fn.get_concrete_function(iterator).graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return sorted({node.op for node in nodes if node.op.startswith("Collective")})


def regression_source():
    """A user's arrays (70 examples: evaluation pads its last global batch) as a source."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(70, 4)).astype("float32")
    examples = user.as_user_dataset((x, x.sum(axis=1, keepdims=True)), "the test's arrays")
    return user.UserSource({"train": examples, "test": examples}, "regression")


def main(collective: str, out_dir: str) -> None:
    config = small_config(strategy="multi_worker_mirrored", simulate_devices=0,
                          collective=collective, global_batch_size=GLOBAL_BATCH)
    parallel = multi_worker.build_multi_worker(config)
    with parallel.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse", metrics=["mae"])
    model, optimizer = parallel.adopt(model)
    source = regression_source()
    evaluation = EvalData(pipeline.eval_dataset_fn(source, GLOBAL_BATCH, DataConfig()),
                          pipeline.eval_steps(source, GLOBAL_BATCH), source.info.size("test"))
    iterators = {   # as the training loop makes them
        "train": lambda: iter(parallel.distribute(
            pipeline.train_dataset_fn(source, GLOBAL_BATCH, 1, DataConfig()))),
        "eval": lambda: evaluation.batches(parallel)}
    host_metrics.build_metrics(model, next(iter(source.examples("train").batch(1))))
    metrics = host_metrics.HostMetrics(model, parallel)   # as the training loop updates them
    steps = {"train": parallel.make_train_step(model, optimizer, GLOBAL_BATCH, False,
                                               on_outputs=metrics.updater()),
             "eval": parallel.make_eval_step(model, on_outputs=metrics.updater(True))}
    record = {}
    for name, step in steps.items():
        iterator = iterators[name]()
        loss = float(step(iterator))
        record[name] = {"ops": collective_ops(step, iterator), "loss": loss}
    with open(os.path.join(out_dir, f"ops.rank{worker_rank()}.json"), "w") as f:
        json.dump(record, f)
    parallel.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
