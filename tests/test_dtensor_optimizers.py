"""--strategy=dtensor's optimizer rules (tfdist/parallel/dtensor/update.py) against Keras' own.

Each config trains a small model with an embedding (sparse gradients, tokens
repeated in every batch) for STEPS steps twice from the same weights and
batches: on one device with Keras' `optimizer.apply`, and on the mesh
batch=2,model=2 (embedding, first dense layer and the second one's kernel
sharded on `model`) with tfdist's DTensor step and update.apply. Compared:
per-step losses, final weights and every optimizer variable (iterations,
learning rate, slots), 1e-5 relative. Real DTensor on the 4 simulated CPUs.

Also here: tfdist/train/clipping.py against Keras' own clipping on one
device, each refusal's message, and the canary for the private Keras API
update.py reads.
"""

import dataclasses
import json
import os
from typing import Callable, List

import numpy as np
import pytest

from tfdist.errors import UsageError
from tfdist.testing import equivalence

pytestmark = pytest.mark.dtensor  # the DTensor pytest process (tests/conftest.py DTENSOR)

STEPS = 6
BATCH = 8
SEQ, VOCAB, CLASSES = 4, 12, 4
SPECS = {  # path -> layout; unnamed paths replicated
    "embed/embeddings": ["unsharded", "model"],
    "fc_in/kernel": ["unsharded", "model"], "fc_in/bias": ["model"],
    "fc_out/kernel": ["model", "unsharded"],
}
REPORT = os.environ.get("TFDIST_DTENSOR_REPORT")  # optional: append worst errors as JSON lines


def build_model(constrained: bool = False):
    """With `constrained`, fc_out's kernel (sharded on its first axis) has a MaxNorm over
    that axis, and head's bias is NonNeg: Keras applies constraints after the update."""
    import keras
    keras.utils.set_random_seed(11)
    tokens = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8, name="embed")(tokens)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="tanh", name="fc_in")(x)
    x = keras.layers.Dense(8, activation="tanh", name="fc_out",
                           kernel_constraint=keras.constraints.MaxNorm(0.9) if constrained
                           else None)(x)
    head = keras.layers.Dense(CLASSES, name="head",
                              bias_constraint=keras.constraints.NonNeg() if constrained else None)
    return keras.Model(tokens, head(x))


def batches():
    rng = np.random.default_rng(3)
    return [(rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32"),
             rng.integers(0, CLASSES, (BATCH,)).astype("int32")) for _ in range(STEPS)]


@dataclasses.dataclass
class Run:
    losses: List[float]
    weights: List[np.ndarray]
    optimizer_variables: List[np.ndarray]


def loss_fn(model, x, y):
    """Cross-entropy summed over the batch / BATCH (on the mesh a DTensor reduction)."""
    import keras
    import tensorflow as tf
    per_example = keras.losses.sparse_categorical_crossentropy(
        y, model(x, training=True), from_logits=True)
    return tf.reduce_sum(per_example) / BATCH


def train_one_device(make_optimizer, initial, model_fn=build_model) -> Run:
    """Keras' own optimizer.apply, in a tf.function, on plain variables."""
    import tensorflow as tf
    model = model_fn()
    model.set_weights(initial)
    optimizer = make_optimizer(model)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, y)
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    losses = [float(step(x, y)) for x, y in batches()]
    return Run(losses, model.get_weights(), [v.numpy() for v in optimizer.variables])


def mesh():
    from tfdist import devices
    from tfdist.parallel.dtensor import mesh as mesh_lib
    return mesh_lib.build_local_mesh([("batch", 2), ("model", 2)], devices.configure(4))


def sharded_model(initial, the_mesh, model_fn=build_model):
    from tfdist.parallel.dtensor import sharding
    model = model_fn()
    model.set_weights(initial)
    specs = {v.path: SPECS.get(v.path, ["unsharded"] * len(v.shape)) for v in model.variables}
    return model, sharding.shard_model(model, specs, the_mesh)


def make_sharded_step(model, optimizer, slots):
    """A DTensor train step of this file's own (the loss and gradients inline, not a
    nested tf.function, as tfdist's: see update.py), so only update.apply is under test."""
    import tensorflow as tf
    from tfdist.parallel.dtensor import sharding, update
    variables = model.trainable_variables
    layouts = [sharding.layout_of(v) for v in variables]

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, y)
        update.apply(optimizer, slots, tape.gradient(loss, variables), variables, layouts)
        return loss

    return step


def pack_batch(x, y, the_mesh):
    from tensorflow.experimental import dtensor
    from tfdist.parallel.dtensor import sharding
    return (sharding.pack(x, dtensor.Layout.batch_sharded(the_mesh, "batch", 2)),
            sharding.pack(y, dtensor.Layout.batch_sharded(the_mesh, "batch", 1)))


def train_on_mesh(make_optimizer, initial, model_fn=build_model) -> Run:
    """update.apply on batch=2,model=2."""
    from tensorflow.experimental import dtensor
    from tfdist.parallel.dtensor import sharding
    the_mesh = mesh()
    model, layouts = sharded_model(initial, the_mesh, model_fn)
    assert [s for _, s in sharding.shard_shapes(model.get_layer("fc_in").kernel)] == [(32, 8)] * 4
    optimizer, slots = sharding.build_sharded_optimizer(lambda: make_optimizer(model), model,
                                                        layouts, the_mesh)
    step = make_sharded_step(model, optimizer, slots)
    losses = [float(dtensor.unpack(step(*pack_batch(x, y, the_mesh)))[0])
              for x, y in batches()]
    return Run(losses, model.get_weights(), [v.numpy() for v in optimizer.variables])


def worst_relative_error(reference: List[np.ndarray], got: List[np.ndarray]) -> float:
    return max(float(np.linalg.norm(np.asarray(g, "float64") - np.asarray(r, "float64"))
                     / max(np.linalg.norm(np.asarray(r, "float64")), 1e-12))
               for r, g in zip(reference, got))


def compare(label, reference: Run, got: Run) -> dict:
    """Asserts losses, weights and optimizer variables within 1e-5; returns the worst errors."""
    for name in ("losses", "weights", "optimizer_variables"):
        ref, candidate = getattr(reference, name), getattr(got, name)
        assert len(ref) > 0 and len(ref) == len(candidate), (name, len(ref), len(candidate))
    ref = equivalence.Record("one device", reference.losses, reference.weights)
    candidate = equivalence.Record(f"dtensor {label}", got.losses, got.weights)
    equivalence.assert_equivalent(ref, candidate)
    slot_problems = equivalence.weight_mismatches(
        equivalence.Record("one device", [], [np.asarray(v, "float64")
                                               for v in reference.optimizer_variables]),
        equivalence.Record(f"dtensor {label}", [], [np.asarray(v, "float64")
                                                    for v in got.optimizer_variables]))
    assert not slot_problems, slot_problems
    errors = {"config": label,
              "max_rel_loss_error": equivalence.max_relative_loss_error(ref, candidate),
              "max_rel_weight_error": worst_relative_error(reference.weights, got.weights),
              "max_rel_slot_error": worst_relative_error(reference.optimizer_variables,
                                                         got.optimizer_variables)}
    print(json.dumps(errors))
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(errors) + "\n")
    return errors


# ---- the configs: name -> optimizer builder (given the model it will train) ------------

def cosine_with_warmup():
    import keras
    return keras.optimizers.schedules.CosineDecay(
        1e-3, decay_steps=STEPS, alpha=0.1, warmup_target=0.02, warmup_steps=2)


def exclude_bias_and_embedding(model):
    import keras
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    # var_list after sharding (the builder runs on the sharded model), names too.
    optimizer.exclude_from_weight_decay(var_list=[model.get_layer("embed").embeddings],
                                        var_names=["bias"])
    return optimizer


def _configs():
    import keras
    o, s = keras.optimizers, keras.optimizers.schedules
    return {
        "sgd": lambda m: o.SGD(0.1),
        "sgd_nesterov_wd": lambda m: o.SGD(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        "sgd_momentum_exponential_decay": lambda m: o.SGD(
            s.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5), momentum=0.8),
        "adam": lambda m: o.Adam(0.01),
        "adam_wd": lambda m: o.Adam(0.01, weight_decay=0.05),
        "adamw_cosine_warmup": lambda m: o.AdamW(cosine_with_warmup(), weight_decay=0.05),
        "adamw_exclude_from_weight_decay": exclude_bias_and_embedding,
        "adam_amsgrad": lambda m: o.Adam(0.01, amsgrad=True),
        "adamw_amsgrad_clipvalue": lambda m: o.AdamW(0.01, amsgrad=True, clipvalue=0.005),
        "rmsprop": lambda m: o.RMSprop(0.01),
        "rmsprop_momentum": lambda m: o.RMSprop(0.01, rho=0.8, momentum=0.5),
        "rmsprop_centered_momentum_wd": lambda m: o.RMSprop(
            0.01, rho=0.9, momentum=0.5, centered=True, weight_decay=0.02),
        "rmsprop_centered": lambda m: o.RMSprop(0.01, centered=True),
        "adagrad": lambda m: o.Adagrad(0.05, initial_accumulator_value=0.2, epsilon=1e-6),
        "adagrad_wd_cosine": lambda m: o.Adagrad(s.CosineDecay(0.05, STEPS), weight_decay=0.01),
        "sgd_momentum_global_clipnorm": lambda m: o.SGD(0.1, momentum=0.9, global_clipnorm=0.05),
        "adam_clipnorm": lambda m: o.Adam(0.01, clipnorm=0.02),
        "adam_global_clipnorm": lambda m: o.Adam(0.01, global_clipnorm=0.05),
        "rmsprop_clipvalue": lambda m: o.RMSprop(0.01, clipvalue=0.005),
    }


CONFIGS = ["sgd", "sgd_nesterov_wd", "sgd_momentum_exponential_decay", "adam", "adam_wd",
           "adamw_cosine_warmup", "adamw_exclude_from_weight_decay", "adam_amsgrad",
           "adamw_amsgrad_clipvalue", "rmsprop",
           "rmsprop_momentum", "rmsprop_centered_momentum_wd", "rmsprop_centered", "adagrad",
           "adagrad_wd_cosine", "sgd_momentum_global_clipnorm", "adam_clipnorm",
           "adam_global_clipnorm", "rmsprop_clipvalue"]


def initial_weights():
    return build_model().get_weights()


@pytest.mark.parametrize("config", CONFIGS)
def test_dtensor_update_matches_keras_on_one_device(config):
    make_optimizer = _configs()[config]
    initial = initial_weights()
    reference = train_one_device(make_optimizer, initial)
    got = train_on_mesh(make_optimizer, initial)
    compare(config, reference, got)
    assert reference.losses[-1] != reference.losses[0]  # it trained


@pytest.mark.parametrize("config", ["sgd_nesterov_wd", "adam"])
def test_constraints_are_applied_after_the_update_as_keras_does(config):
    model_fn = lambda: build_model(constrained=True)
    initial = model_fn().get_weights()
    reference = train_one_device(_configs()[config], initial, model_fn)
    unconstrained = train_one_device(_configs()[config], initial)
    assert abs(reference.losses[-1] - unconstrained.losses[-1]) > 1e-4  # they bite
    compare(f"{config}_constrained", reference,
            train_on_mesh(_configs()[config], initial, model_fn))


def test_configs_list_is_complete():
    assert sorted(CONFIGS) == sorted(_configs())


def test_the_embedding_gradient_is_sparse_and_tokens_repeat():
    """The configs above test the sparse path only if the gradient is IndexedSlices and
    a token occurs more than once in a batch (else squares-before-sums is not tested)."""
    import tensorflow as tf
    model = build_model()
    x, y = batches()[0]
    with tf.GradientTape() as tape:
        loss = loss_fn(model, x, y)
    grad = tape.gradient(loss, model.get_layer("embed").embeddings)
    assert isinstance(grad, tf.IndexedSlices)
    assert len(np.unique(x)) < x.size


def test_clipping_options_change_the_run():
    """The clip thresholds above are small enough to clip: unclipped runs differ."""
    import keras
    initial = initial_weights()
    for clipped, plain in [(lambda m: keras.optimizers.Adam(0.01, clipnorm=0.02),
                            lambda m: keras.optimizers.Adam(0.01)),
                           (lambda m: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.05),
                            lambda m: keras.optimizers.SGD(0.1, momentum=0.9)),
                           (lambda m: keras.optimizers.RMSprop(0.01, clipvalue=0.005),
                            lambda m: keras.optimizers.RMSprop(0.01))]:
        a, b = train_one_device(clipped, initial), train_one_device(plain, initial)
        assert abs(a.losses[-1] - b.losses[-1]) > 1e-4 * abs(b.losses[-1])


# ---- clipping.py against Keras' own clipping, on one device ----------------------------

def gradients_and_variables():
    """A dense gradient and an IndexedSlices one with a repeated row, and their variables."""
    import keras
    import tensorflow as tf
    dense = tf.constant([[0.3, -0.4], [1.2, 0.5]])
    sparse = tf.IndexedSlices(tf.constant([[1.0, -2.0], [3.0, 0.5], [-0.7, 0.2]]),
                              tf.constant([2, 0, 2]), tf.constant([3, 2]))
    variables = [keras.Variable(np.ones((2, 2), "float32"), name="dense"),
                 keras.Variable(np.full((3, 2), 0.5, "float32"), name="table")]
    return [dense, sparse], variables


@pytest.mark.parametrize("option", [dict(clipnorm=0.5), dict(global_clipnorm=0.7),
                                    dict(clipvalue=0.25)])
@pytest.mark.parametrize("optimizer_name", ["SGD", "Adam"])
def test_clip_like_keras_then_unclipped_apply_equals_keras_apply(option, optimizer_name):
    """Keras clipping inside apply == clip_like_keras, then apply with clipping disabled;
    Adam too, because it tells a dense gradient from IndexedSlices (squares)."""
    import keras
    from tfdist.train import clipping
    grads, keras_vars = gradients_and_variables()
    _, our_vars = gradients_and_variables()
    make = getattr(keras.optimizers, optimizer_name)
    keras_opt, our_opt = make(0.1, **option), make(0.1, **option)
    clipped = clipping.clip_like_keras(grads, our_opt)
    assert any(not np.allclose(np.asarray(tf_dense(c)), np.asarray(tf_dense(g)))
               for c, g in zip(clipped, grads))  # it clipped something
    for _ in range(2):
        keras_opt.apply(grads, keras_vars)
        with clipping.clipping_disabled([our_opt]):
            our_opt.apply(clipped, our_vars)
    assert getattr(our_opt, next(iter(option))) == next(iter(option.values()))  # restored
    for ours, theirs in zip(our_vars + our_opt.variables, keras_vars + keras_opt.variables):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6, atol=0)


def tf_dense(g):
    import tensorflow as tf
    return tf.convert_to_tensor(g)


def test_clip_like_keras_keeps_none_and_passes_through_without_options():
    import keras
    from tfdist.train import clipping
    grads, _ = gradients_and_variables()
    assert clipping.clip_like_keras([None, grads[0]], keras.optimizers.SGD(0.1,
                                                                           clipnorm=1.0))[0] is None
    unclipped = clipping.clip_like_keras(grads, keras.optimizers.SGD(0.1))
    assert unclipped[0] is grads[0] and unclipped[1] is grads[1]


def test_global_clipnorm_over_stages_equals_one_optimizer_over_all():
    """The pipeline's use: two stage optimizers, each seeing half the gradients, clip on
    the global norm (clip_like_keras over both halves) == one optimizer over all."""
    import keras
    from tfdist.train import clipping
    grads, whole_vars = gradients_and_variables()
    _, stage_vars = gradients_and_variables()
    whole = keras.optimizers.Adam(0.1, global_clipnorm=0.7)
    stages = [keras.optimizers.Adam(0.1, global_clipnorm=0.7) for _ in range(2)]
    whole.apply(grads, whole_vars)
    clipped = clipping.clip_like_keras(grads, stages[0])
    with clipping.clipping_disabled(stages):
        for stage, grad, variable in zip(stages, clipped, stage_vars):
            stage.apply([grad], [variable])
    for ours, theirs in zip(stage_vars, whole_vars):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6, atol=0)


def test_unclipped_copy_keeps_everything_but_clipping():
    import keras
    from tfdist.train import clipping
    schedule = keras.optimizers.schedules.CosineDecay(0.1, 10)
    original = keras.optimizers.AdamW(schedule, weight_decay=0.02, global_clipnorm=0.7)
    copy = clipping.unclipped_copy(original)
    assert type(copy) is keras.optimizers.AdamW and copy is not original
    assert (copy.clipnorm, copy.clipvalue, copy.global_clipnorm) == (None, None, None)
    assert original.global_clipnorm == 0.7
    expected = {**original.get_config(), "global_clipnorm": None, "name": copy.name}
    assert copy.get_config() == expected


# ---- refusals: UsageError before training, naming what is supported ---------------------

SUPPORTED_LIST = "SGD (momentum, nesterov), Adam, AdamW, RMSprop, Adagrad"


def refused(optimizer):
    """The message build_sharded_optimizer (before any step) raises for `optimizer`."""
    from tfdist.parallel.dtensor import sharding
    the_mesh = mesh()
    model, layouts = sharded_model(initial_weights(), the_mesh)
    with pytest.raises(UsageError) as error:
        sharding.build_sharded_optimizer(lambda: optimizer, model, layouts, the_mesh)
    message = str(error.value)
    assert "\n" not in message and SUPPORTED_LIST in message
    return message


@pytest.mark.parametrize("name", ["Nadam", "Lion", "Adamax", "Ftrl", "Adadelta"])
def test_other_keras_optimizers_are_refused(name):
    import keras
    message = refused(getattr(keras.optimizers, name)(0.01))
    assert f"got {name}." in message


def test_subclass_is_refused():
    import keras

    class MySGD(keras.optimizers.SGD):
        pass

    assert "got MySGD." in refused(MySGD(0.1))


def test_loss_scale_optimizer_is_refused():
    import keras
    assert "got LossScaleOptimizer." in refused(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))


@pytest.mark.parametrize("name,option,value", [
    ("SGD", "use_ema", True), ("AdamW", "use_ema", True),
    ("RMSprop", "gradient_accumulation_steps", 2), ("Adagrad", "loss_scale_factor", 128.0),
])
def test_unsupported_options_are_refused(name, option, value):
    import keras
    message = refused(getattr(keras.optimizers, name)(0.01, **{option: value}))
    assert f"got {name}({option}={value!r})" in message and f"without {option}." in message


def test_stale_weight_decay_var_list_is_refused_before_training():
    """exclude_from_weight_decay(var_list=...) with the variables of before sharding: Keras
    would decay them silently (their storage id changed), so building is refused."""
    import keras
    from tfdist.parallel.dtensor import sharding
    the_mesh = mesh()
    model = build_model()
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_list=[model.get_layer("head").kernel])
    specs = {v.path: SPECS.get(v.path, ["unsharded"] * len(v.shape)) for v in model.variables}
    layouts = sharding.shard_model(model, specs, the_mesh)
    with pytest.raises(UsageError, match=r"1 of the 1 variables given to AdamW\."
                                         r"exclude_from_weight_decay\(var_list=\.\.\.\)"):
        sharding.build_sharded_optimizer(lambda: optimizer, model, layouts, the_mesh)
    assert not optimizer.built


def test_overwrite_with_gradient_is_refused():
    import keras
    import tensorflow as tf
    from tfdist.parallel.dtensor import update
    variable = keras.Variable(np.ones(2, "float32"), name="scale")
    variable.overwrite_with_gradient = True
    with pytest.raises(UsageError, match=r"overwrite_with_gradient=True.*'scale'"):
        update.apply(keras.optimizers.SGD(0.1), {}, [tf.ones(2)], [variable], [None])


# ---- canary: the private Keras API update.py reads --------------------------------------

def test_keras_weight_decay_decision_canary():
    """update._decays calls Keras' private `optimizer._use_weight_decay(storage)` and
    update._check_weight_decay_exclusions reads `_exclude_from_weight_decay` and
    `_var_key` (exclude_from_weight_decay has no public getter, keras-team/keras#16274).
    Fails if Keras renames them, changes what they key on, or if a sharded variable's
    storage stops carrying its name (var_names match the storage's name)."""
    import keras
    from tfdist.parallel.dtensor import sharding
    the_mesh = mesh()
    model = build_model()
    names_before = {v.path: v.value.name for v in model.variables}
    specs = {v.path: SPECS.get(v.path, ["unsharded"] * len(v.shape)) for v in model.variables}
    sharding.shard_model(model, specs, the_mesh)
    assert {v.path: v.value.name for v in model.variables} == names_before
    embeddings = model.get_layer("embed").embeddings
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_list=[embeddings], var_names=["bias"])
    assert optimizer._exclude_from_weight_decay == {optimizer._var_key(embeddings)}
    decisions = {v.path: optimizer._use_weight_decay(v.value) for v in model.trainable_variables}
    assert decisions == {"embed/embeddings": False, "fc_in/kernel": True, "fc_in/bias": False,
                         "fc_out/kernel": True, "fc_out/bias": False, "head/kernel": True,
                         "head/bias": False}
