"""Exact resume in every mode: train to step 10, stop, rerun to 20; compare with 20 straight.

In-process (the modes' own equivalence tests cover the numbers against `default`);
here each mode is compared with itself, uninterrupted, to 1e-6.
"""

import pytest

from helpers import small_config
from tfdist.config import DataConfig, ModelConfig
from tfdist.testing import equivalence

MODES = {
    "default": dict(strategy="default"),
    "mirrored": dict(strategy="mirrored", simulate_devices=2),
    "dtensor": dict(strategy="dtensor", simulate_devices=4, mesh="batch=2,model=2",
                    layout="megatron"),
    "pipeline": dict(strategy="pipeline", simulate_devices=2, pipeline_stages=2,
                     microbatches=2),
    "pipeline_hybrid": dict(strategy="pipeline", simulate_devices=4, pipeline_stages=2,
                            microbatches=2),
}


def config(mode, model_dir, steps):
    return small_config(model=ModelConfig(name="mlp"), data=DataConfig(name="digits"),
                        optimizer="adam", train_steps=steps, model_dir=str(model_dir),
                        checkpoint_every=5, **MODES[mode])


def mode_param(mode):
    # The DTensor mode runs in the DTensor process (conftest.DTENSOR says why).
    return pytest.param(mode, marks=pytest.mark.dtensor) if mode == "dtensor" else mode


@pytest.mark.parametrize("mode", [mode_param(mode) for mode in MODES])
def test_stop_and_rerun_continues_exactly(mode, tmp_path):
    straight = equivalence.train(config(mode, tmp_path / "straight", 20), "uninterrupted")
    equivalence.train(config(mode, tmp_path / "split", 10), "first half")
    resumed = equivalence.train(config(mode, tmp_path / "split", 20), "resumed")
    tail = equivalence.Record("uninterrupted", straight.losses[10:], straight.weights)
    assert len(resumed.losses) == 10
    equivalence.assert_equivalent(tail, resumed, rtol=1e-6)


@pytest.mark.parametrize("first,second", [
    (dict(simulate_devices=4, pipeline_stages=2), dict(simulate_devices=4, pipeline_stages=4)),
    (dict(simulate_devices=2, pipeline_stages=2), dict(simulate_devices=4, pipeline_stages=2)),
    (dict(simulate_devices=4, pipeline_stages=4), dict(simulate_devices=2, pipeline_stages=2)),
], ids=["2 stages x 2 replicas -> 4 stages", "1 replica -> 2 replicas", "4 stages -> 2 stages"])
def test_a_pipeline_checkpoint_restores_onto_another_layout(first, second, tmp_path):
    """Saved with one stage and replica count, resumed with another:
    the run continues as the uninterrupted one (1e-5: other layouts, same math)."""
    def run(layout, model_dir, steps, label):
        fields = dict(strategy="pipeline", microbatches=2, **layout)
        return equivalence.train(small_config(
            model=ModelConfig(name="mlp"), data=DataConfig(name="digits"), optimizer="adam",
            train_steps=steps, model_dir=str(model_dir), checkpoint_every=5, **fields), label)

    straight = run(first, tmp_path / "straight", 20, "uninterrupted")
    run(first, tmp_path / "split", 10, "first half")
    resumed = run(second, tmp_path / "split", 20, "resumed on another layout")
    assert len(resumed.losses) == 10
    equivalence.assert_equivalent(
        equivalence.Record("uninterrupted", straight.losses[10:], straight.weights), resumed)


def test_the_host_copy_saves_what_the_stages_would_and_gives_it_back(tmp_path):
    """The pipeline across workers saves a copy on worker 0's host (pipeline/checkpoint.py
    HostCopy, against a TensorFlow leak): same keys and values as the stages' own save, so
    its checkpoints restore onto any layout; give() puts the values back into replica 0."""
    import numpy as np
    import tensorflow as tf
    from tfdist import data, parallel as parallel_lib
    from tfdist.parallel.pipeline import checkpoint as pipeline_checkpoint
    from tfdist.train import runner
    config = small_config(strategy="pipeline", simulate_devices=4, pipeline_stages=2,
                          microbatches=2, model=ModelConfig(name="mlp"), optimizer="adam")
    parallel = parallel_lib.build_parallelism(config)
    model, optimizer = runner.build_model_and_optimizer(
        config, parallel, data.get_source(config.data).info)
    replica = parallel.replicas[0]
    for stage in replica.stages:   # distinct, nonzero values everywhere, slots included
        for variable in list(stage.variables) + list(stage.optimizer.variables):
            dtype = tf.as_dtype(variable.dtype)
            variable.assign(tf.random.uniform(variable.shape, 1, 2, seed=1, dtype=dtype)
                            if dtype.is_floating else tf.ones(variable.shape, dtype) * 3)
    host = pipeline_checkpoint.HostCopy(parallel.replicas, "/cpu:0")
    host.take()
    saved = {}
    for name, objects in (("stages", parallel.checkpoint_objects(model, optimizer)),
                          ("host", host.objects())):
        path = tf.train.Checkpoint(**objects).write(str(tmp_path / name / "ckpt"))
        saved[name] = {key: tf.train.load_variable(path, key)
                       for key, _ in tf.train.list_variables(path) if "OBJECT_GRAPH" not in key}
    assert sorted(saved["host"]) == sorted(saved["stages"]) and len(saved["host"]) > 10
    for key, value in saved["stages"].items():
        np.testing.assert_array_equal(saved["host"][key], value, err_msg=key)
    before = [v.numpy() for v in replica.model.weights]
    for variable in replica.model.weights:
        variable.assign(tf.zeros_like(variable))
    host.give()
    for got, want in zip(replica.model.weights, before):
        np.testing.assert_array_equal(got.numpy(), want)
