"""Train my_model.py's model in any tfdist mode with the public API.

    python examples/keras_api/train.py mirrored            # 2 simulated CPUs on a laptop
    python examples/keras_api/train.py pipeline            # 2 stages x 2 micro-batches
    python examples/keras_api/train.py dtensor             # batch=2,model=2, a user layout
    python examples/keras_api/train.py default             # one device, the reference
    tfdist launch --workers 2 -- python examples/keras_api/train.py multi_worker_mirrored

What each mode adds to plain Keras code is the MODES entry and `strategy.` in front
of fit / evaluate / predict / save.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402

import tfdist  # noqa: E402
from my_model import compile_model, make_data, make_model  # noqa: E402

MODES = {
    "default": {},
    "one_device": {},
    "mirrored": dict(simulate_devices=2),
    "multi_worker_mirrored": dict(collective="auto"),        # under tfdist launch / Slurm
    "dtensor": dict(simulate_devices=4, mesh="batch=2,model=2", layout={
        # the user's own layout map: regex over variable paths -> Keras axes
        ".*hidden/kernel": (None, "model"), ".*hidden/bias": ("model",),
        ".*hidden2/kernel": ("model", None)}),
    "pipeline": dict(simulate_devices=2, pipeline_stages=2, microbatches=2),
}


def main(mode: str = "mirrored", out_dir: str = "/tmp/tfdist_example") -> None:
    strategy = tfdist.Strategy(mode, **MODES[mode])
    x, y, weights = make_data()
    val_x, val_y, _ = make_data(256, seed=1)
    keras.utils.set_random_seed(0)   # the same initial weights in every mode
    with strategy.scope():
        model = compile_model(make_model())
    history = strategy.fit(model, x, y, sample_weight=weights, batch_size=64, epochs=3,
                           validation_data=(val_x, val_y), verbose=2 if strategy.is_chief else 0,
                           callbacks=[keras.callbacks.CSVLogger(os.path.join(out_dir, "log.csv"))])
    print("history:", {k: round(v[-1], 4) for k, v in history.history.items()})
    print("evaluate:", strategy.evaluate(model, val_x, val_y, batch_size=64, return_dict=True))
    print("predict:", strategy.predict(model, {k: v[:3] for k, v in val_x.items()}).ravel())
    strategy.save(model, os.path.join(out_dir, f"{mode}.keras"))   # plain Keras loads it


if __name__ == "__main__":
    os.makedirs(sys.argv[2] if len(sys.argv) > 2 else "/tmp/tfdist_example", exist_ok=True)
    main(*sys.argv[1:])
