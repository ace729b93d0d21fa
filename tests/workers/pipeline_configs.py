"""A cross-worker pipeline test worker: trains several configs in one launch.

    tfdist launch --workers W [--devices_per_worker D] -- \
        python tests/workers/pipeline_configs.py CONFIGS_JSON OUT_DIR

Worker 0 drives every config (as tfdist.run does, keeping the mode object), the other
workers serve their stages until worker 0 ends. For each config NAME worker 0 writes
OUT_DIR/NAME.json (per-step losses, param_bytes_per_device, the stage devices, where the
train and eval steps returned their loss) and,
for every replica r and stage k, OUT_DIR/NAME.r{r}.s{k}.npz with that stage's
variables as read from the worker that holds them, plus their paths in the json.
"""

import json
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers import from_json_overrides, small_config  # noqa: E402
from tfdist import data, parallel as parallel_lib  # noqa: E402
from tfdist.train import runner  # noqa: E402


def recording_loss_devices(parallel, devices: dict) -> None:
    """The mode's train and eval steps, each recording in `devices` where the first loss it
    returned lives (the runtime's placement, read from the real result)."""
    for kind in ("train", "eval"):
        make = getattr(parallel, f"make_{kind}_step")

        def make_recording(*args, _make=make, _kind=kind, **kwargs):
            step = _make(*args, **kwargs)

            def recorded(iterator):
                loss = step(iterator)
                devices.setdefault(_kind, loss.device)
                return loss
            return recorded
        setattr(parallel, f"make_{kind}_step", make_recording)


def train(config):
    import keras
    keras.mixed_precision.set_dtype_policy("float32")
    parallel = parallel_lib.build_parallelism(config)   # a serving worker never returns
    parallel.loss_devices = {}
    recording_loss_devices(parallel, parallel.loss_devices)
    parallel.validate_global_batch(config.global_batch_size)
    source = data.get_source(config.data)
    model, optimizer = runner.build_model_and_optimizer(config, parallel, source.info)
    try:
        losses = runner.train(config, parallel, source, model, optimizer,
                              runner.resolve_steps(config, source)).losses
        parallel.finish()
        return parallel, model, optimizer, losses
    finally:
        parallel.close()


def main(configs_json: str, out_dir: str) -> None:
    simulate = int(os.environ.get("TFDIST_SIMULATE_DEVICES", "0"))
    for name, overrides in json.loads(configs_json).items():
        config = small_config(strategy="pipeline", simulate_devices=simulate,
                              **from_json_overrides(overrides))
        parallel, model, optimizer, losses = train(config)
        stages = {}
        for r, replica in enumerate(parallel.replicas):
            for stage in replica.stages:
                np.savez(os.path.join(out_dir, f"{name}.r{r}.s{stage.index}.npz"),
                         *[v.numpy() for v in stage.variables])
                stages[f"{r},{stage.index}"] = {"device": stage.device,
                                                "paths": [v.path for v in stage.variables]}
        record = {"losses": losses, "stages": stages, "paths": [v.path for v in model.weights],
                  "param_bytes_per_device": parallel.param_bytes_per_device(model, optimizer),
                  "num_replicas": parallel.num_replicas, "loss_devices": parallel.loss_devices}
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
