"""--strategy=dtensor across 2 processes x 2 simulated CPUs (mesh batch=2,model=2).

Started the way a user would: `tfdist launch --workers 2 --devices_per_worker 2
--dtensor -- python ... --strategy=dtensor ...` with experiments.train's flags
(tests/workers/dtensor_client.py builds the config as experiments.train does and
also writes each client's final weights). Each client holds one batch shard (two
model shards; the transformer at --zero_stage=3 also shards every parameter and its
Adam state over the two clients); the per-step losses must be the single-process `default` run's
within 1e-5 relative, and EVERY client's final weights too.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO
from tfdist.config import DataConfig, ModelConfig, RunConfig
from tfdist.testing import equivalence

STEPS = 20
CASES = {
    "mlp_momentum": (["--model=mlp", "--dataset=digits", "--optimizer=momentum"],
                     ModelConfig(name="mlp"), DataConfig(name="digits"), "momentum"),
    "transformer_adam": (["--model=transformer", "--num_layers=2", "--d_model=32",
                          "--num_heads=4", "--d_ff=64", "--dataset=text", "--seq_len=16",
                          "--optimizer=adam", "--zero_stage=3"],   # FSDP x TP across workers
                         ModelConfig(name="transformer", num_layers=2, d_model=32, num_heads=4,
                                     d_ff=64),
                         DataConfig(name="text", seq_len=16), "adam"),
}


def launch(args, timeout=300):
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "tfdist.launch", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_clients_match_default(case, tmp_path):
    flags, model, data, optimizer = CASES[case]
    reference = equivalence.train(RunConfig(
        strategy="default", simulate_devices=4, model=model, data=data, optimizer=optimizer,
        global_batch_size=32, train_steps=STEPS, seed=7, log_every=STEPS), "default")
    path = tmp_path / "results.json"
    result = launch(["--workers", "2", "--devices_per_worker", "2", "--dtensor", "--",
                     sys.executable, "tests/workers/dtensor_client.py",
                     f"--weights_prefix={tmp_path / 'weights'}", "--strategy=dtensor",
                     "--mesh=batch=2,model=2", "--layout=megatron", "--global_batch_size=32",
                     f"--train_steps={STEPS}", "--seed=7", f"--results_json={path}", *flags])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(path.read_text())
    for client in (0, 1):
        candidate = equivalence.from_results_json(
            path, f"dtensor 2 clients {case}, client {client}",
            weights=tmp_path / f"weights.client{client}.npz")
        equivalence.assert_equivalent(reference, candidate)
    assert results["num_replicas"] == 2
    if "--zero_stage=3" in flags:   # the stage ran, not only parsed
        assert "zero stage 3 over batch=2 shards" in result.stdout + result.stderr
    # the chief reports its own two devices' shards
    assert len(results["param_bytes_per_device"]) == 2
    assert len(set(results["param_bytes_per_device"].values())) == 1
