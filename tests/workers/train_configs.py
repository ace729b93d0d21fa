"""A multi-worker test worker: trains several configs in one process, one launch.

    python tests/workers/train_configs.py CONFIGS_JSON OUT_DIR

CONFIGS_JSON maps a name to RunConfig overrides (optimizer/trainer...; "model" is
a model name or a dict of ModelConfig fields, "data" a dict of DataConfig fields);
each is trained under multi_worker_mirrored (TensorFlow allows one such strategy
per process, which tfdist reuses), the chief writes OUT_DIR/NAME.json, and every
worker writes its final weights to OUT_DIR/NAME.rankR.npz.
One launch pays TensorFlow's import once for all configs.
"""

import json
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers import from_json_overrides, small_config  # noqa: E402
from tfdist.train import runner  # noqa: E402


def worker_rank() -> str:
    """tfdist launch's TFDIST_RANK, or the rank an MPI launcher gave (--collective=mpi)."""
    for name in ("TFDIST_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if name in os.environ:
            return os.environ[name]
    raise RuntimeError("no rank variable: start this under tfdist launch or an MPI launcher")


def main(configs_json: str, out_dir: str) -> None:
    simulate = int(os.environ.get("TFDIST_SIMULATE_DEVICES", "0"))
    for name, overrides in json.loads(configs_json).items():
        config = small_config(strategy="multi_worker_mirrored", simulate_devices=simulate,
                              results_json=os.path.join(out_dir, f"{name}.json"),
                              **from_json_overrides(overrides))
        _, model = runner.run(config, return_model=True)
        rank = worker_rank()
        np.savez(os.path.join(out_dir, f"{name}.rank{rank}.npz"), *model.get_weights())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
