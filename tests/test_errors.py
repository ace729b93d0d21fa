"""Bad input gets one clear paragraph before any training, never a stack trace."""

import re

import pytest

from helpers import run_cli, small_config
from tfdist import config as cfg
from tfdist.errors import UsageError
from tfdist.registry import Registry
from tfdist.train import optimizers, runner


@pytest.mark.parametrize("overrides,expected", [
    (dict(strategy="mirorred"), "Unknown strategy 'mirorred'. Valid strategy names: default"),
    (dict(optimizer="lambda"), "Unknown --optimizer 'lambda'. Valid choices: adadelta, "
                               "adafactor, adagrad, adam, adamax, adamw, ftrl, lamb, lion, "
                               "momentum, muon, nadam, rmsprop, sgd"),
    (dict(global_batch_size=0), "--global_batch_size must be > 0, got 0"),
    (dict(train_steps=-5), "--train_steps must be >= 0, got -5"),
    (dict(learning_rate=-0.1), "--learning_rate must be > 0, got -0.1"),
    (dict(train_steps=5, epochs=2), "not both"),
    (dict(cross_device_ops="ring"), "Valid choices: auto, nccl"),
    (dict(mixed_precision="fp8"), "Valid choices: mixed_bfloat16, mixed_float16"),
    (dict(profile_steps=(5, 2)), "START <= STOP"),
])
def test_bad_run_config(overrides, expected):
    with pytest.raises(UsageError, match=re.escape(expected)):
        small_config(**overrides)


@pytest.mark.parametrize("factory,expected", [
    (lambda: cfg.ModelConfig(name="vit"), "Unknown model 'vit'. Valid model names: cnn, mlp"),
    (lambda: cfg.ModelConfig(name="transformer", d_model=30, num_heads=4),
     r"--d_model \(30\) must be divisible by --num_heads \(4\)"),
    (lambda: cfg.DataConfig(name="digit"), "Unknown dataset 'digit'.*Did you mean 'digits'"),
    (lambda: cfg.DataConfig(name="text", seq_len=0), "--seq_len must be > 0, got 0"),
    (lambda: cfg.parse_ints("100,x", "hidden_sizes"), "comma-separated integers, got '100,x'"),
])
def test_bad_model_and_data_config(factory, expected):
    with pytest.raises(UsageError, match=expected):
        factory()


def test_unwritable_model_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(UsageError, match="--model_dir .* is not a writable directory"):
        small_config(model_dir=str(blocker / "run"))


def test_batch_not_divisible_by_replicas_names_both_numbers():
    with pytest.raises(UsageError, match=r"--global_batch_size=30 is not divisible by the 4 "
                                         r"replicas of strategy 'mirrored'"):
        runner.run(small_config(strategy="mirrored", simulate_devices=4, global_batch_size=30))


def test_more_simulated_devices_than_initialised_is_an_error():
    with pytest.raises(UsageError, match="Cannot simulate 8 CPU devices: TensorFlow already "
                                         "initialised its devices with 4"):
        runner.run(small_config(strategy="mirrored", simulate_devices=8))


def test_nccl_on_cpus_is_an_error():
    with pytest.raises(UsageError, match="--cross_device_ops=nccl needs GPUs"):
        runner.run(small_config(strategy="mirrored", simulate_devices=2,
                                cross_device_ops="nccl"))


def test_optimizer_choices_match_the_registry():
    assert set(cfg.OPTIMIZERS) == set(optimizers.OPTIMIZERS.names())


def test_registry_rejects_duplicates_and_lists_names():
    registry = Registry("widget", {"a": len})
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a", len)
    registry.register("b")(str)
    assert registry.names() == ["a", "b"] and registry.get("b") is str


@pytest.mark.parametrize("args,expected", [
    (["--strategy=bogus"], "Unknown strategy 'bogus'"),
    (["--dataset=tfds:mnist", "--data_dir={tmp}"], "mnist"),
    (["--model=mlp", "--global_batch_size=63", "--simulate_devices=2"],
     "--global_batch_size=63 is not divisible by the 2 replicas"),
])
def test_cli_prints_one_paragraph_and_exits_2(args, expected, tmp_path):
    result = run_cli([a.format(tmp=tmp_path) for a in args])
    assert result.returncode == 2, result.stderr[-2000:]
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
