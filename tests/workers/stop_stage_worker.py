"""A cross-worker pipeline worker whose worker 0 SIGSTOPs worker 1 at an exact point
between steps, for tests/test_pipeline_cross_worker_faults.py.

    TF_CONFIG=... python tests/workers/stop_stage_worker.py WHEN PID_DIR

Each worker writes its pid to PID_DIR/pid.RANK and builds tfdist.Strategy("pipeline")
with --collective_timeout=10; worker 1 then serves its stage. Worker 0 fits a user's
functional model for 3 epochs of 8 steps, with a callback that stops worker 1 WHEN:
- "last_batch": after the last batch of epoch 0, so the next thing worker 0 waits on
  is reading the trained weights back from the stage workers (the epoch's end);
- "epoch_end": in on_epoch_end of epoch 0, so next it sets the stage optimizers'
  learning rate (the next epoch's start).
Neither is inside a training step, whose guard the other stop tests exercise.
"""

import json
import os
import signal
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(TESTS))

WHENS = ("last_batch", "epoch_end")
STEPS_PER_EPOCH = 8


def stopper(when: str, pid_dir: str):
    import keras

    def stop_worker_1():
        with open(os.path.join(pid_dir, "pid.1")) as f:
            pid = int(f.read())
        print(f"stopping worker 1 (pid {pid}) at {when}", flush=True)
        os.kill(pid, signal.SIGSTOP)

    class StopStageWorker(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if when == "last_batch" and batch == STEPS_PER_EPOCH - 1 and not self.done:
                self.done = True
                stop_worker_1()

        def on_epoch_end(self, epoch, logs=None):
            if when == "epoch_end" and epoch == 0:
                stop_worker_1()

    callback = StopStageWorker()
    callback.done = False
    return callback


def main(when: str, pid_dir: str) -> None:
    assert when in WHENS, f"WHEN is one of {WHENS}, got {when!r}"
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with open(os.path.join(pid_dir, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    import keras
    import tfdist
    strategy = tfdist.Strategy("pipeline", pipeline_stages=2, microbatches=2, seed=0,
                               simulate_devices=0, collective_timeout=10)
    with strategy.scope():   # only worker 0 gets here: worker 1 serves its stage
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        hidden = keras.layers.Dense(16, activation="relu")(hidden)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * STEPS_PER_EPOCH, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    strategy.fit(model, x, y, batch_size=32, epochs=3, verbose=0,
                 callbacks=[stopper(when, pid_dir)])
    strategy.close()
    print("worker 0 trained 3 epochs: worker 1 was never waited on while stopped", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
