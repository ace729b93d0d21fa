"""A multi-worker test worker: users' own models (tests/user_models.py) through the
public API, under multi_worker_mirrored, one launch for several cases.

    python tests/workers/keras_api_cases.py COLLECTIVE CASES OUT_DIR

COLLECTIVE "pipeline" trains --strategy=pipeline instead, a stage in each of 2 workers
(only worker 0 returns from tfdist.Strategy and writes files).

CASES is "name:optimizer,..." (see user_models.CASES). For each case every worker
writes OUT_DIR/CASE.rankR.json (per-step losses, the logs its callbacks saw, the
epoch EarlyStopping stopped at) and OUT_DIR/CASE.rankR.npz (its final weights).
The last case also runs Keras' file-writing callbacks into OUT_DIR/files (only the
chief may leave files there) and saves the model (the chief writes it).
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
from tfdist.testing import equivalence  # noqa: E402


def main(collective: str, cases: str, out_dir: str) -> None:
    import keras
    import tfdist
    rank = os.environ.get("TFDIST_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))   # tfdist launch, or mpirun
    if collective == "pipeline":   # a stage per worker; worker 1 serves its stage, never returns
        strategy = tfdist.Strategy("pipeline", pipeline_stages=2, microbatches=2, seed=0,
                                   simulate_devices=0)
    else:
        strategy = tfdist.Strategy("multi_worker_mirrored", collective=collective, seed=0,
                                   simulate_devices=0)
    names = cases.split(",")
    for index, case in enumerate(names):
        name, optimizer = case.split(":")
        build, x, y, fit_kwargs = user_models.case(name, optimizer)
        last = index == len(names) - 1
        if last:
            fit_kwargs["epochs"] = user_models.CALLBACK_EPOCHS
        recorder = equivalence.LogRecorder()
        # The recorder last, as equivalence.train_keras puts it (ReduceLROnPlateau adds
        # learning_rate to the epoch logs that callbacks after it see).
        callbacks = (user_models.file_callbacks(os.path.join(out_dir, "files"))
                     if last else []) + [recorder]
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = build()
        history = strategy.fit(model, x, y, verbose=0, callbacks=callbacks, **fit_kwargs)
        record = {"losses": strategy.last_result.losses, "batch_logs": recorder.batch_logs,
                  "epoch_logs": recorder.epoch_logs, "epochs": len(history.epoch),
                  "learning_rate": float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))}
        with open(os.path.join(out_dir, f"{name}_{optimizer}.rank{rank}.json"), "w") as f:
            json.dump(record, f, default=float)
        np.savez(os.path.join(out_dir, f"{name}_{optimizer}.rank{rank}.npz"),
                 *model.get_weights())
        if last:
            strategy.save(model, os.path.join(out_dir, "files", "final.keras"))
            head = {k: v[:16] for k, v in x.items()} if isinstance(x, dict) else x[:16]
            np.save(os.path.join(out_dir, f"predictions.rank{rank}.npy"),
                    strategy.predict(model, head))
    strategy.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
