r"""How long a preemption's checkpoint takes, to size a grace time: a 100M-parameter model with Adam.

    python examples/slurm/save_time.py                     # 100M parameters, 5 saves
    python examples/slurm/save_time.py --workers=2           # the SIGTERM run as 2 workers
    python examples/slurm/save_time.py --params=1e9 --trials=1

Two figures, both for the model this file builds (Dense layers on the `synthetic`
dataset's 28x28 inputs, as many parameters as --params asks) trained with Adam, so a
checkpoint holds the weights and both Adam slots (3 x params float32) and the step:
- save: tfdist's own Checkpointer.save (tf.train.Checkpoint.write of everything, then
  the atomic pointer file), timed in this process, --trials times, into --dir;
- SIGTERM to exit: `python -m experiments.train --model=examples.slurm.save_time:model`
  (one process, or --workers multi_worker_mirrored processes under `tfdist launch`, each
  of which writes the checkpoint) trains until its second step is logged and gets SIGTERM;
  the time until it has finished the step in flight, saved, and exited 4 is measured.
  That is what a grace time (GraceTime, KillWait, terminationGracePeriodSeconds,
  --signal=...@SECONDS) must cover, plus what your cluster's file system adds.
Run it on the machine and file system your jobs use; --dir on the same storage as your
--model_dir. Nothing here touches a cluster. Prints one line per figure.
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

INPUT_SHAPE, CLASSES = (28, 28, 1), 10   # the `synthetic` dataset's defaults
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def widths(params: float):
    """Hidden layer widths (7 equal layers) whose Dense stack has about `params` parameters."""
    inputs, layers = INPUT_SHAPE[0] * INPUT_SHAPE[1] * INPUT_SHAPE[2], 7
    width = 16
    while _count(inputs, [width + 16] * layers) <= params:
        width += 16
    return [width] * layers


def _count(inputs, hidden):
    sizes = [inputs, *hidden, CLASSES]
    return sum(a * b + b for a, b in zip(sizes, sizes[1:]))


def model():
    """`--model=examples.slurm.save_time:model`: the Dense stack, sized by $TFDIST_SAVE_TIME_PARAMS."""
    import keras
    params = float(os.environ.get("TFDIST_SAVE_TIME_PARAMS", "1e8"))
    layers = [keras.Input(INPUT_SHAPE), keras.layers.Flatten()]
    layers += [keras.layers.Dense(width, activation="relu") for width in widths(params)]
    return keras.Sequential(layers + [keras.layers.Dense(CLASSES, activation="softmax")])


def time_saves(params: float, trials: int, directory: str):
    """Seconds of each tfdist Checkpointer.save, and the checkpoint's bytes on disk."""
    os.environ["TFDIST_SAVE_TIME_PARAMS"] = str(params)
    import keras
    import tensorflow as tf
    from tfdist.train.checkpoint import Checkpointer
    net = model()
    optimizer = keras.optimizers.Adam()
    optimizer.apply([tf.zeros_like(v) for v in net.trainable_variables], net.trainable_variables)
    checkpointer = Checkpointer({"model": net, "optimizer": optimizer}, directory, directory,
                                keep=1, run_fingerprint={})
    seconds = []
    for step in range(1, trials + 1):
        started = time.perf_counter()
        checkpointer.save(step)
        seconds.append(time.perf_counter() - started)
    size = sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
               if name.startswith(f"ckpt-{trials}."))
    return net.count_params(), seconds, size


def training_command(workers: int, directory: str):
    """One process (--strategy=default), or `tfdist launch` of `workers` multi-worker processes
    (it forwards a SIGTERM to each, and exits with their 4). Its --grace_period, the seconds
    it gives them before SIGKILL, is 5 s by default: far less than this model's save."""
    train = [sys.executable, "-m", "experiments.train", "--simulate_devices=0",
             "--model=examples.slurm.save_time:model", "--loss=sparse_categorical_crossentropy",
             "--dataset=synthetic", "--optimizer=adam", "--global_batch_size=32",
             "--train_steps=1000000", "--log_every=1", f"--model_dir={directory}"]
    if workers == 1:
        return train + ["--strategy=default"]
    return [sys.executable, "-m", "tfdist.cli", "launch", f"--workers={workers}", "--grace_period=600", "--",
            *train, "--strategy=multi_worker_mirrored"]


def time_term_to_exit(params: float, workers: int, directory: str, timeout: float = 600):
    """SIGTERM to a training run once it logs its second step; (seconds to exit, exit code,
    the step it saved)."""
    command = training_command(workers, directory)
    env = dict(os.environ, TFDIST_SAVE_TIME_PARAMS=str(params), PYTHONPATH=REPO,
               TF_CPP_MIN_LOG_LEVEL="2")
    log_path = os.path.join(directory + ".log")
    with open(log_path, "w") as log:
        run = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
        while "step 2/" not in open(log_path).read():
            if run.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the training run never logged step 2:\n{open(log_path).read()[-3000:]}")
            time.sleep(0.05)
        signalled = time.monotonic()
        run.send_signal(signal.SIGTERM)
        code = run.wait(timeout)
        seconds = time.monotonic() - signalled
    finally:
        run.kill()
    log = open(log_path).read()
    saved = re.findall(r"saved a checkpoint at step (\d+)", log)
    if code != 4 or not saved:
        raise RuntimeError(f"SIGTERM did not end the run with a checkpoint and exit 4 (exit {code}):\n"
                           f"{log[-3000:]}")
    return seconds, code, int(saved[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e8, help="parameters of the model (1e8)")
    parser.add_argument("--trials", type=int, default=5, help="timed saves (5)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes of the SIGTERM run (1; 2: multi_worker_mirrored, every worker saves)")
    parser.add_argument("--dir", default=None, help="where to write (a fresh temporary directory)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="tfdist-save-time-", dir=args.dir)
    try:
        count, seconds, size = time_saves(args.params, args.trials, os.path.join(root, "saves"))
        print(f"save: {count / 1e6:.1f}M parameters with Adam, checkpoint {size / 1e9:.2f} GB: "
              f"{', '.join(f'{s:.1f}' for s in seconds)} s (tfdist Checkpointer.save, {args.trials} trials)")
        term, code, step = time_term_to_exit(args.params, args.workers, os.path.join(root, "run"))
        print(f"SIGTERM to exit: {term:.1f} s ({args.workers} worker(s), exit {code}, checkpoint at "
              f"step {step}; the step in flight, the save, the exit)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
