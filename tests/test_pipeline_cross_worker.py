"""--strategy=pipeline with its stages in different worker processes (`tfdist launch`).

Real processes on loopback, TensorFlow's distributed runtime between them: worker 0
drives, the others serve their stages (tfdist/parallel/pipeline/cluster.py).
Equivalence, per-step losses and EVERY replica's every stage (as read from the
worker that holds it) within 1e-5 relative of one device:
- 2 workers, 2 stages: every schedule (interleaved_1f1b with V=2), M in {1, 4, 8},
  the mlp and the transformer (an embedding: sparse gradients), sgd and adam, each
  at least once, and the transformer's blocks recomputed (--remat=full) against one
  device without recomputation (8 configs: the suite covers each value, not their product);
- 4 workers: 4 stages under 1f1b and zero_bubble, and 2 stages x 2 replicas (one
  pipeline per worker pair) under gpipe and interleaved_1f1b;
- 2 workers x 2 local devices: 2 stages x 2 in-node replicas (the hybrid).
The whole product (132 configs, about 15 min) is outside the suite, in
tests/pipeline_full_product.py: python -m pytest tests/pipeline_full_product.py.
param_bytes_per_device names each stage's device with its task; both steps return their
loss on worker 0 (schedule.summed_on). Bad input: stages
that do not divide the workers, workers with different numbers of devices.
"""

import functools
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, from_json_overrides, small_config
from tfdist.testing import equivalence

STEPS = 12
TRANSFORMER = dict(model=dict(name="transformer", num_layers=2, d_model=32, num_heads=4,
                              d_ff=64), data=dict(name="text", seq_len=16))


def mlp(optimizer, **fields):
    return dict(model="mlp", optimizer=optimizer, **fields)


def transformer(optimizer, **fields):
    return dict(TRANSFORMER, optimizer=optimizer, **fields)


def named(configs):
    def name(c):
        model = c["model"] if isinstance(c["model"], str) else c["model"]["name"]
        return (f"{model}_{c['optimizer']}_S{c['pipeline_stages']}_M{c['microbatches']}_"
                f"{c['pipeline_schedule']}" + (f"_V{c['virtual_stages']}" if "virtual_stages" in c else "")
                + (f"_remat_{c['remat']}" if "remat" in c else ""))
    return {name(c): dict(c, train_steps=STEPS) for c in configs}


INTERLEAVED = dict(pipeline_schedule="interleaved_1f1b", virtual_stages=2)
TWO_WORKERS = named([   # every schedule, M in {1, 4, 8}, both models and optimizers
    mlp("sgd", pipeline_stages=2, microbatches=1, pipeline_schedule="gpipe"),
    mlp("adam", pipeline_stages=2, microbatches=8, pipeline_schedule="1f1b"),
    mlp("sgd", pipeline_stages=2, microbatches=4, pipeline_schedule="zero_bubble"),
    mlp("adam", pipeline_stages=2, microbatches=8, **INTERLEAVED),   # M a multiple of S
    transformer("adam", pipeline_stages=2, microbatches=4, pipeline_schedule="gpipe"),
    transformer("sgd", pipeline_stages=2, microbatches=4, pipeline_schedule="zero_bubble"),
    transformer("sgd", pipeline_stages=2, microbatches=4, **INTERLEAVED),
    # activation recomputation (tfdist/train/remat.py) of the blocks on the stage workers
    transformer("adam", pipeline_stages=2, microbatches=4, pipeline_schedule="1f1b",
                remat="full")])
FOUR_WORKERS = named([
    mlp("sgd", pipeline_stages=4, microbatches=8, pipeline_schedule="1f1b"),
    transformer("adam", pipeline_stages=4, microbatches=4, pipeline_schedule="1f1b"),
    mlp("adam", pipeline_stages=4, microbatches=8, pipeline_schedule="zero_bubble"),
    mlp("adam", pipeline_stages=2, microbatches=4, pipeline_schedule="gpipe"),      # 2 x 2 replicas
    mlp("sgd", pipeline_stages=2, microbatches=4, **INTERLEAVED),                     # 2 x 2 replicas
])
IN_NODE_REPLICAS = named([
    mlp("adam", pipeline_stages=2, microbatches=4, pipeline_schedule="gpipe"),
    transformer("adam", pipeline_stages=2, microbatches=4, pipeline_schedule="1f1b"),
])


def launch(workers, devices_per_worker, command, timeout=900, **env_overrides):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", **env_overrides)
    return subprocess.run([sys.executable, "-m", "tfdist.launch", "--workers", str(workers),
                           "--devices_per_worker", str(devices_per_worker), "--", *command],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@functools.lru_cache(maxsize=None)
def reference(model_key: str):
    """One device: per-step losses and {variable path: value}."""
    overrides = json.loads(model_key)
    config = small_config(strategy="default", simulate_devices=0, **from_json_overrides(
        {k: v for k, v in overrides.items()
         if not k.startswith(("pipeline", "micro", "virtual", "remat"))}))   # one device, plain
    from tfdist.train import runner
    results, model = runner.run(config, return_model=True)
    return results["losses"], {v.path: v.numpy() for v in model.weights}


def check_run(out_dir, name, config, workers, devices_per_worker):
    record = json.loads((out_dir / f"{name}.json").read_text())
    stages, replicas = config["pipeline_stages"], workers // config["pipeline_stages"] * devices_per_worker
    chunks = stages * config.get("virtual_stages", 1)   # interleaved: chunk c on stage c mod S
    assert record["num_replicas"] == replicas and len(record["losses"]) == STEPS
    losses, by_path = reference(json.dumps(config, sort_keys=True))
    assert not equivalence.loss_mismatches(equivalence.Record("default", losses, None),
                                           equivalence.Record(name, record["losses"], None))
    assert sorted(record["stages"]) == sorted(f"{r},{k}" for r in range(replicas)
                                              for k in range(chunks))
    for r in range(replicas):
        held = sorted(p for k in range(chunks) for p in record["stages"][f"{r},{k}"]["paths"])
        assert held == sorted(by_path), f"{name}: replica {r}'s stages hold {held}"
    for key, stage in record["stages"].items():
        r, k = map(int, key.split(","))
        task = (r // devices_per_worker) * stages + k % stages
        assert stage["device"] == (f"/job:worker/replica:0/task:{task}/device:CPU:"
                                   f"{r % devices_per_worker}"), (key, stage["device"])
        if not stage["paths"]:
            continue
        got = equivalence.load_weights(out_dir / f"{name}.r{r}.s{k}.npz")
        mismatches = equivalence.weight_mismatches(
            equivalence.Record("default", [], [by_path[p] for p in stage["paths"]]),
            equivalence.Record(f"{name} replica {r} stage {k}", [], got))
        assert not mismatches, mismatches
    tasks = {device.split("/device:")[0] for device in record["param_bytes_per_device"]}
    assert tasks == {f"/job:worker/replica:0/task:{t}" for t in range(workers)}, tasks
    # On worker 0, not on the last stage's worker, which keeps ~3 KB of every result it
    # holds (schedule.summed_on); with one loss the sum was that worker's own tensor.
    assert record["loss_devices"] == {kind: "/job:worker/replica:0/task:0/device:CPU:0"
                                      for kind in ("train", "eval")}, record["loss_devices"]


@pytest.mark.parametrize("workers,devices_per_worker,configs", [
    (2, 1, TWO_WORKERS), (4, 1, FOUR_WORKERS), (2, 2, IN_NODE_REPLICAS)],
    ids=["2 workers", "4 workers", "2 workers x 2 devices"])
def test_stages_in_different_workers_train_like_one_device(workers, devices_per_worker,
                                                           configs, tmp_path):
    # The 2-worker launch runs as the overlap benchmark does, on one inter-op thread, which
    # every worker must raise to 2 (a stage hands its tensors over on that pool).
    one_thread = {"TF_NUM_INTEROP_THREADS": "1"} if workers == 2 and devices_per_worker == 1 else {}
    result = launch(workers, devices_per_worker, [sys.executable, "tests/workers/pipeline_configs.py",
                                                  json.dumps(configs), str(tmp_path)], **one_thread)
    # 0 from the launcher: every worker exited 0, the serving ones with worker 0's status.
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(configs) >= 2
    if any("remat" in config for config in configs.values()):
        # Said as a warning (what is left out), so it shows without an INFO log level.
        assert ("pipeline: --remat=full leaves out, to stay exact: embedding"
                in result.stdout + result.stderr), result.stderr[-3000:]
    for name, config in configs.items():
        check_run(tmp_path, name, config, workers, devices_per_worker)
    for rank in range(workers if one_thread else 0):
        assert (f"worker {rank} of 2: 1 inter-op thread(s) raised to 2" in result.stderr), \
            result.stderr[-3000:]


@pytest.mark.parametrize("configured,used", [(1, 2), (2, 2), (6, 6), (0, 0)])
def test_a_stage_process_gets_a_second_inter_op_thread(configured, used):
    """0 is TensorFlow's default (a thread per core) and stays so."""
    from tfdist.parallel.pipeline import cluster as cross_worker
    assert cross_worker.stage_inter_op_threads(configured) == used
    assert cross_worker.server_config(1).inter_op_parallelism_threads >= 0


def test_stages_that_do_not_divide_the_workers_are_refused(tmp_path):
    result = launch(2, 1, [sys.executable, "-m", "experiments.train", "--strategy=pipeline",
                           "--pipeline_stages=4", "--microbatches=4", "--model=mlp",
                           "--train_steps=3"], timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--pipeline_stages=4 does not divide the 2 workers of this cluster" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("make", ["open to others", "a symbolic link"])
def test_a_private_dir_others_can_use_is_refused(make, tmp_path, monkeypatch):
    """Worker 0 and the serving workers exchange files in TMPDIR/tfdist-UID: one that
    another user could write to, or a link to elsewhere, is refused by name."""
    import tempfile
    from tfdist.errors import UsageError
    from tfdist.parallel.pipeline import cluster as cross_worker
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = tmp_path / f"tfdist-{os.getuid()}"
    if make == "open to others":
        path.mkdir()
        path.chmod(0o777)
    else:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UsageError, match="must be a directory of uid"):
        cross_worker.ensure_private_dir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "fresh"))
    (tmp_path / "fresh").mkdir()
    made = cross_worker.ensure_private_dir()   # a fresh one is made 0700
    assert os.stat(made).st_mode & 0o777 == 0o700
