"""A multi-worker test worker: the keras-io-shaped models of tests/keras_io_models.py
through the public API under multi_worker_mirrored, one launch for several cases.

    python tests/workers/keras_io_cases.py COLLECTIVE CASES OUT_DIR [OPTION=INT ...]

CASES is "model:optimizer,..."; every worker writes OUT_DIR/MODEL_OPTIMIZER.rankR.json
(per-step losses, the logs its callbacks saw) and .npz (final weights, then the frozen variables' initial values).
"""

import json
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
sys.path.insert(0, os.path.dirname(TESTS))

import keras_io_models  # noqa: E402
from tfdist.testing import equivalence  # noqa: E402


def main(collective: str, cases: str, out_dir: str, *options: str) -> None:
    """`options`: further tfdist.Strategy options as NAME=VALUE (accumulation_steps=4, remat=full)."""
    import keras
    import tfdist
    rank = os.environ.get("TFDIST_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
    extra = {name: int(value) if value.isdigit() else value
             for name, value in (o.split("=") for o in options)}
    strategy = tfdist.Strategy("multi_worker_mirrored", collective=collective, seed=0,
                               simulate_devices=0, **extra)
    for case in cases.split(","):
        name, optimizer = case.split(":")
        build, x, y, fit_kwargs = keras_io_models.case(name, optimizer)
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = build()
        initial_frozen = [np.array(v.numpy()) for v in keras_io_models.frozen_variables(model)]
        recorder = equivalence.LogRecorder()
        strategy.fit(model, x, y, verbose=0, callbacks=[recorder], **fit_kwargs)
        stem = os.path.join(out_dir, f"{name}_{optimizer}.rank{rank}")
        with open(stem + ".json", "w") as f:
            json.dump({"losses": strategy.last_result.losses, "batch_logs": recorder.batch_logs,
                       "epoch_logs": recorder.epoch_logs,
                       "frozen_count": len(initial_frozen)}, f, default=float)
        np.savez(stem + ".npz", *model.get_weights(), *initial_frozen)
    strategy.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
