"""Shared test helpers: small configs and running the CLI in a subprocess."""

import os
import subprocess
import sys

from tfdist.config import DataConfig, ModelConfig, RunConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_config(**overrides) -> RunConfig:
    """A fast mlp-on-digits config; keyword arguments override any field."""
    fields = dict(strategy="default", simulate_devices=4, model=ModelConfig(name="mlp"),
                  data=DataConfig(name="digits"), optimizer="adam", global_batch_size=32,
                  train_steps=10, seed=1, log_every=5)
    fields.update(overrides)
    return RunConfig(**fields)


def from_json_overrides(overrides: dict) -> dict:
    """RunConfig overrides from JSON-friendly ones: "model" is a model name (with the
    tests' small cnn filters) or a dict of ModelConfig fields, "data" a dict of
    DataConfig fields (the multi-worker tests send configs to their workers so)."""
    overrides = dict(overrides)
    model = overrides.pop("model")
    if isinstance(model, dict):   # JSON has lists where ModelConfig has tuples
        model = {k: tuple(v) if isinstance(v, list) else v for k, v in model.items()}
    overrides["model"] = (ModelConfig(**model) if isinstance(model, dict)
                          else ModelConfig(name=model, filters=(8, 16)))
    if "data" in overrides:
        overrides["data"] = DataConfig(**overrides["data"])
    return overrides


def run_cli(args, timeout=120, env=None):
    """Runs `python -m experiments.train ARGS` from the repo; returns CompletedProcess."""
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO, **(env or {}))
    return subprocess.run([sys.executable, "-m", "experiments.train", *args], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=timeout)
