"""multi_worker_mirrored over real processes on loopback, started by `tfdist launch`.

Equivalence: 2 workers x 1 device (over --collective=auto, =tcp and =shm) and 2
workers x 2 simulated devices (TF's collectives) give the per-step losses of the
single-process `default` run (1e-5 relative), and every worker's final weights,
for mlp, cnn and the transformer (an embedding: sparse gradients) with sgd, adam
and adamw (every pair over auto; over tcp and shm each model and each optimizer
once), with tfdist's loop and with Keras fit; with tfdist's own all-reduces the
two workers end with bitwise the same weights.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, from_json_overrides, run_cli, small_config
from tfdist.testing import equivalence

TRANSFORMER = dict(model=dict(name="transformer", num_layers=1, d_model=32, num_heads=4,
                              d_ff=64), data=dict(name="text", seq_len=16))
CONFIGS = {f"{model}_{optimizer}": dict(model=model, optimizer=optimizer)
           for model in ("mlp", "cnn") for optimizer in ("sgd", "adam", "adamw")}
CONFIGS.update({f"transformer_{optimizer}": dict(TRANSFORMER, optimizer=optimizer)
                for optimizer in ("sgd", "adam", "adamw")})   # an embedding: sparse gradients
CONFIGS["mlp_adam_fit"] = dict(model="mlp", optimizer="adam", trainer="fit")
# The 2 x 2 launch (TF's collectives only) keeps one config per model and the fit path.
TWO_DEVICE_CONFIGS = ("mlp_sgd", "cnn_adam", "transformer_adam", "mlp_adam_fit")
STEPS = 20


def launch(args, timeout=600):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "tfdist.launch", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def reference(name):
    overrides = from_json_overrides(dict(CONFIGS[name], trainer="loop"))
    return equivalence.train(small_config(train_steps=STEPS, **overrides), name)


@pytest.fixture(scope="module")
def references():
    return {name: reference(name) for name in CONFIGS}


# tfdist's own sums (tcp, shm) take one config per model, each optimizer once: the
# all-reduce sums gradients before the optimizer sees them, so the optimizer is not a
# dimension of the collective; TF's (auto) keeps every model x optimizer.
OWN_SUM_CONFIGS = ("mlp_sgd", "cnn_adam", "transformer_adamw")


def launched_configs(devices_per_worker, collectives):
    """Keras fit keeps TF's collectives (auto); tcp and shm run tfdist's loop."""
    def names(collective):
        if devices_per_worker == 2:
            return TWO_DEVICE_CONFIGS
        return CONFIGS if collective == "auto" else OWN_SUM_CONFIGS
    return {f"{name}@{collective}": dict(CONFIGS[name], train_steps=STEPS, collective=collective)
            for collective in collectives for name in names(collective)}


@pytest.mark.parametrize("devices_per_worker,collectives",
                         [(1, ("auto", "tcp", "shm")), (2, ("auto",))])
def test_two_workers_match_default(devices_per_worker, collectives, references, tmp_path):
    """Every config over every collective, each launch training all its configs in one
    pair of processes: per-step losses, and EVERY worker's final weights, against one
    device; with tfdist's own sums (tcp, shm) the workers are bitwise equal."""
    configs = launched_configs(devices_per_worker, collectives)
    result = launch(["--workers", "2", "--devices_per_worker", str(devices_per_worker), "--",
                     sys.executable, "tests/workers/train_configs.py", json.dumps(configs),
                     str(tmp_path)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(configs) >= 4
    for run_name in configs:
        name = run_name.split("@")[0]
        results = json.loads((tmp_path / f"{run_name}.json").read_text())
        assert results["num_replicas"] == 2 * devices_per_worker
        weights = [equivalence.load_weights(tmp_path / f"{run_name}.rank{rank}.npz")
                   for rank in (0, 1)]
        for rank, rank_weights in enumerate(weights):
            candidate = equivalence.Record(f"2 workers x{devices_per_worker} {run_name} "
                                           f"rank {rank}", results["losses"], rank_weights)
            equivalence.assert_equivalent(references[name], candidate)
        if not run_name.endswith("@auto"):  # tfdist's sums: one worker sums each chunk
            bitwise = equivalence.weight_mismatches(
                equivalence.Record("rank 0", [], weights[0]),
                equivalence.Record(f"rank 1 {run_name}", [], weights[1]), rtol=0)
            assert not bitwise, bitwise


def test_cli_contract_launch_of_experiments_train(tmp_path):
    """The documented command, end to end, against `default` from the same CLI."""
    flags = ["--model=mlp", "--optimizer=sgd", "--train_steps=20", "--global_batch_size=32",
             "--seed=5"]
    single = run_cli(["--strategy=default", f"--results_json={tmp_path}/d.json", *flags])
    assert single.returncode == 0, single.stderr[-2000:]
    multi = launch(["--workers", "2", "--", sys.executable, "-m", "experiments.train",
                    "--strategy=multi_worker_mirrored", f"--results_json={tmp_path}/m.json",
                    f"--model_dir={tmp_path}/run", *flags])
    assert multi.returncode == 0, multi.stdout[-3000:]
    reference = equivalence.from_results_json(f"{tmp_path}/d.json")
    candidate = equivalence.from_results_json(f"{tmp_path}/m.json")
    assert not equivalence.loss_mismatches(reference, candidate)
    assert "[worker 1]" in multi.stdout and "[worker 0]" in multi.stdout
    # Chief-only side effects: one checkpoint list and one TensorBoard events file
    # per writer, from worker 0 alone (the other worker's scratch dirs are gone).
    assert {"checkpoints.json", "run.json", "eval", "train"} <= set(os.listdir(tmp_path / "run"))
    assert len(os.listdir(tmp_path / "run" / "train")) == 1
