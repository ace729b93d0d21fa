"""A multi-worker test worker: Keras' own model.fit / evaluate / predict on a model built
in a tfdist.Strategy("multi_worker_mirrored") scope (plain Keras 3 fails there with
"Attempt to convert a value (PerReplica...)"), with Keras' arguments.

    python tests/workers/keras_calls_worker.py OUT_DIR

Writes OUT_DIR/rankR.json (History, evaluate, tfdist's per-step losses), rankR.npz
(final weights) and predictionsR.npy; then calls model.fit with a batch_size the 2
replicas cannot split, which must end the process with tfdist's usage-error status (2)
and one paragraph, before any step. tests/test_keras_api_multi_worker.py compares the
files with plain Keras on one device (build and FIT below).
"""

import json
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
sys.path.insert(0, os.path.dirname(TESTS))

import user_models  # noqa: E402

FIT = dict(batch_size=32, epochs=2, shuffle=False, validation_split=0.25,
           class_weight={0: 2.0, 3: 0.5}, verbose=0)


def build():
    import keras
    keras.utils.set_random_seed(0)
    model = user_models.softmax_classifier()
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def data():
    x, y, _ = user_models.classification_arrays(256)
    return x, y


def main(out_dir: str) -> None:
    import tfdist
    rank = os.environ["TFDIST_RANK"]
    strategy = tfdist.Strategy("multi_worker_mirrored", seed=0, simulate_devices=0)
    x, y = data()
    with strategy.scope():
        model = build()
    history = model.fit(x, y, **FIT)   # Keras' own call: routed to strategy.fit
    record = {"history": history.history, "epoch": history.epoch,
              "losses": strategy.last_result.losses,
              "evaluate": model.evaluate(x, y, verbose=0)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f, default=float)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), *model.get_weights())
    np.save(os.path.join(out_dir, f"predictions{rank}.npy"), model.predict(x[:16], verbose=0))
    model.fit(x, y, batch_size=127, verbose=0)   # refused: exit 2, one paragraph
    print("unreachable: the bad batch_size was not refused", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
