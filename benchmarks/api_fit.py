"""The public API's fit (a user's compiled model and NumPy data) against tfdist's loop
as `python -m experiments.train` drives it (a registry config), same model, same
mode, side by side: mirrored x2 and 2 workers over --collective=shm.

Both train the throughput suite's MLP (784-1024-1024-10, global batch 512, SGD,
accuracy as the metric) on 16384 synthetic examples, every process on one thread;
contenders alternate trial by trial and the medians' ratio is reported.

    python -m benchmarks --suite=api_fit
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.throughput import ONE_THREAD, TRAIN_FLAGS

MODES = {
    "mirrored x2": (1, ["--strategy=mirrored", "--simulate_devices=2"]),
    "2 workers, shm": (2, ["--strategy=multi_worker_mirrored", "--collective=shm"]),
}


def _run(workers: int, command, results: str) -> float:
    if workers > 1:
        command = [sys.executable, "-m", "tfdist.launch", "--workers", str(workers), "--",
                   *command]
    subprocess.run(command, env=dict(os.environ, **ONE_THREAD), check=True,
                   capture_output=True, text=True, timeout=1800)
    with open(results) as f:
        return json.load(f)["examples_per_sec"]


def loop_rate(mode: str, steps: int) -> float:
    workers, flags = MODES[mode]
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "r.json")
        return _run(workers, [sys.executable, "-m", "experiments.train",
                              f"--train_steps={steps}", f"--results_json={results}",
                              "--metrics=accuracy", *TRAIN_FLAGS, *flags], results)


def api_rate(mode: str, steps: int) -> float:
    workers, flags = MODES[mode]
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "r.json")
        return _run(workers, [sys.executable, "-m", "benchmarks.api_fit", str(steps),
                              results, *flags], results)


def compare(steps: int = 300, trials: int = 3):
    rows = []
    for mode in MODES:
        rates = {"loop": [], "api": []}
        for _ in range(trials):
            rates["loop"].append(loop_rate(mode, steps))
            rates["api"].append(api_rate(mode, steps))
        loop, api = (statistics.median(rates[k]) for k in ("loop", "api"))
        rows.append({"mode": mode, "loop_examples_per_sec": round(loop, 1),
                     "api_fit_examples_per_sec": round(api, 1),
                     "ratio_api_over_loop": round(api / loop, 3),
                     "loop_trials": " ".join(f"{x:.0f}" for x in rates["loop"]),
                     "api_trials": " ".join(f"{x:.0f}" for x in rates["api"])})
    return rows


def _flag(flags, name, default=None):
    for flag in flags:
        if flag.startswith(f"--{name}="):
            return flag.split("=", 1)[1]
    return default


def main(steps: str, results: str, *flags) -> None:
    """One contender: the registry MLP as a user would build and compile it, fit on
    the synthetic source's examples as NumPy arrays, through tfdist.Strategy."""
    import keras
    import numpy as np
    import tfdist
    from tfdist import config as cfg, data, models
    options = {"simulate_devices": int(_flag(flags, "simulate_devices", 0))}
    if _flag(flags, "collective"):
        options["collective"] = _flag(flags, "collective")
    strategy = tfdist.Strategy(_flag(flags, "strategy"), **options)
    source = data.get_source(cfg.DataConfig(name="synthetic", synthetic_shape=(784,),
                                            synthetic_examples=16384))
    x, y = (np.concatenate(part) for part in zip(*source.examples("train").batch(4096)
                                                  .as_numpy_iterator()))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = models.build_model(source.info, cfg.ModelConfig(name="mlp",
                                                                 hidden_sizes=(1024, 1024)))
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    per_epoch = len(y) // 512
    strategy.fit(model, x, y, batch_size=512, epochs=-(-int(steps) // per_epoch),
                 steps_per_epoch=per_epoch, verbose=0)
    if strategy.is_chief:
        with open(results, "w") as f:
            json.dump({"examples_per_sec": strategy.last_result.examples_per_sec}, f)
    strategy.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
