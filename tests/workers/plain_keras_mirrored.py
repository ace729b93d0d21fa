"""Keras' own fit of a keras-io-shaped model on one device and under
tf.distribute.MirroredStrategy on 2 CPUs (no tfdist), in a process of its own: a raw
MirroredStrategy's collective keys would collide with other raw strategies of a shared
test process. Prints JSON: the last logged loss's relative error and each embedding
table's relative weight error.

    python tests/workers/plain_keras_mirrored.py MODEL:OPTIMIZER
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
sys.path.insert(0, os.path.dirname(TESTS))


def fit(strategy, case):
    import keras
    import keras_io_models
    build, x, y, fit_kwargs = keras_io_models.case(*case.split(":"))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build()
    losses = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"])))
    model.fit(x, y, callbacks=[callback], verbose=0, **fit_kwargs)
    return losses, [(v.path, v.numpy()) for v in model.weights]


def main(case: str) -> None:
    from tfdist import devices
    devices.simulate_cpus(2)
    import tensorflow as tf
    from tfdist.testing import equivalence
    one_losses, one_weights = fit(tf.distribute.get_strategy(), case)
    two_losses, two_weights = fit(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), case)
    errors = {path.split("/")[-2]: equivalence.relative_error(two[1], one)
              for (path, one), two in zip(one_weights, two_weights) if "embedding" in path}
    print(json.dumps({"steps": len(one_losses),
                      "loss_error": abs(two_losses[-1] - one_losses[-1]) / abs(one_losses[-1]),
                      "embedding_errors": errors}))


if __name__ == "__main__":
    main(sys.argv[1])
