"""Conformance: Keras models tfdist did not write, in every mode, against one device.

    python -m benchmarks --suite=conformance [--models=a,b] [--modes=x,y]
    python -m benchmarks.conformance --models=text_transformer --modes=mirrored

The corpus (conformance_models.ZOO: keras.applications, keras-hub, keras-io
reproductions) x the modes (MODES below). Each cell trains the model 8 steps at a
global batch of 8, once with Adam and once with SGD (its gradient clipped to a global
norm of 1), through tfdist's public API
(tfdist.Strategy(...).fit, or Keras' own model.fit under keras.distribution with
tfdist.enable_keras_distribution()), and compares it with plain Keras on one device
(model.train_on_batch on the same 8 batches, same seed, random layers at rate 0).
A cell lands in exactly one of:
  exact            per-step losses and every replica's final weights within 1e-5 relative
                   (tfdist.testing.equivalence's definitions), for both optimizers;
  refused          tfdist raised a UsageError before the first step (message recorded);
  announced        not exact, but before the first step a warning named a layer of the
                   model (the warning recorded; whether it says why is for the reader);
  SILENT MISMATCH  anything else: not exact and unannounced, any other exception (a
                   TensorFlow error, a UsageError after training started), a timeout.
A cell's verdict is the worse of its two optimizers' (SILENT > announced > refused > exact).
A model that float32 rounding alone moves past 1e-5 (its noise floor: plain Keras from
initial weights scaled by 1 + 1e-7, their exact zeros set to +-1e-7) has its cells trained
and judged in float64.
Separately, each model with random layers (Dropout, random augmentation...) at their real
rates trains 1 step in --random_check modes: every such layer must be named in a warning.

Process layout: TensorFlow fixes its devices at start-up, DTensor and tf.distribute must
not share a process (tests/conftest.py), and keras.distribution must see the devices a
user's program would (a dtensor run before it in the process changes what
keras.distribution.list_devices returns), so per model: one `local` process (4 simulated
CPUs: the reference, default, mirrored, pipeline), one `dtensor` process, one
`keras_distribution` process (tfdist.enable_keras_distribution(simulate_devices=4)), and
one `tfdist launch --workers 2` for both collectives. Each cell has a fixed timeout
(--cell_timeout, whatever the steps); a process that dies or times out leaves its
missing cells SILENT MISMATCH with the tail of its log. Output: conformance.json and
conformance.md in --out_dir; exit status 1 when any cell is a silent mismatch or a random
layer went unwarned.
"""

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Dict, List, Optional

import numpy as np

from benchmarks import conformance_models as zoo
from tfdist.testing import equivalence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8
GLOBAL_BATCH = 8
SEED = 0
RTOL = equivalence.RTOL
OPTIMIZERS = ("adam", "sgd")
EXACT, REFUSED, ANNOUNCED, SILENT = "exact", "refused", "announced", "SILENT MISMATCH"
SEVERITY = (EXACT, REFUSED, ANNOUNCED, SILENT)     # a cell takes its worst optimizer's
GROUPS = ("local", "dtensor", "keras_distribution", "multi_worker")   # local first: the reference
SIMULATED_CPUS = 4
REFERENCE = "keras"                                # plain Keras on one device
# The same, from initial weights moved by about one float32 rounding (`perturbed`): how
# far rounding alone moves this model in 8 steps. Past RTOL, no split of the batch can
# be held to RTOL (a deep BatchNormalization net at random init amplifies 1e-7 to 1e-4
# in its forward pass alone), so a cell's mismatch there says nothing about the mode.
NOISE_FLOOR, NOISE = "keras_perturbed", 1e-7
# Such a model's cells run in float64 instead, against plain Keras on one device in
# float64: there rounding moves it by 1e-16 x the same amplification, far below RTOL,
# so a mismatch is the mode's math again (the float32 floor stays in the table). The
# reference for a float64 model:
REFERENCE64 = "keras_float64"
FLOAT32, FLOAT64 = "float32", "float64"
TFDIST_DIR = os.path.join(REPO, "tfdist") + os.sep


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    group: str        # which process runs it (GROUPS)
    title: str        # the table's column heading
    options: dict     # tfdist.Strategy options; or keras_distribution=data/model


MODES: Dict[str, Mode] = {m.name: m for m in (
    Mode("default", "local", "default (1 device)", dict(strategy="default")),
    Mode("mirrored", "local", "mirrored x2", dict(strategy="mirrored", simulate_devices=2)),
    Mode("multi_worker_auto", "multi_worker", "2 workers auto",
         dict(strategy="multi_worker_mirrored", collective="auto", simulate_devices=0)),
    Mode("multi_worker_shm", "multi_worker", "2 workers shm",
         dict(strategy="multi_worker_mirrored", collective="shm", simulate_devices=0)),
    Mode("dtensor_auto", "dtensor", "dtensor model=2 auto",
         dict(strategy="dtensor", simulate_devices=2, mesh="batch=1,model=2", layout="auto")),
    Mode("keras_data_parallel", "keras_distribution", "keras DataParallel x4",
         dict(keras_distribution="data")),
    Mode("keras_model_parallel", "keras_distribution", "keras ModelParallel 2x2",
         dict(keras_distribution="model")),
    Mode("pipeline", "local", "pipeline 2x4",
         dict(strategy="pipeline", simulate_devices=2, pipeline_stages=2, microbatches=4)),
    Mode("pipeline_2x2", "local", "pipeline 2 stages x 2 replicas",
         dict(strategy="pipeline", simulate_devices=4, pipeline_stages=2, microbatches=2)),
    Mode("dtensor_2x2", "dtensor", "dtensor batch=2,model=2 auto",
         dict(strategy="dtensor", simulate_devices=4, mesh="batch=2,model=2", layout="auto")),
)}
# Workers wait this long for a peer (default 300 s): a worker whose cell failed must not
# hold the other for 5 minutes. Both trace the same step side by side, so a healthy peer
# is late by the difference between their traces, seconds here.
WORKER_COLLECTIVE_TIMEOUT = 120


# =============================================================== inside a training process

class WarningCapture(logging.Handler):
    """Every warning logged (WARNING and up, on tfdist's logger, which does not propagate,
    and on the root logger) or raised with warnings.warn while a cell runs, in order."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: List[str] = []
        self._seen = set()

    def emit(self, record):
        if id(record) not in self._seen:     # a record can reach both loggers
            self._seen.add(id(record))
            self.messages.append(f"[{record.name}] {record.getMessage()}")

    def _show_warning(self, message, category, filename, *args, **kwargs):
        source = "tfdist" if os.path.abspath(filename).startswith(TFDIST_DIR) else "python"
        self.messages.append(f"[{source} {category.__name__}] {message}")

    def __enter__(self):
        for name in ("tfdist", ""):
            logging.getLogger(name).addHandler(self)
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show_warning
        return self

    def __exit__(self, *exc):
        self._catcher.__exit__(*exc)
        for name in ("tfdist", ""):
            logging.getLogger(name).removeHandler(self)
        return False


def step_marker(capture: WarningCapture):
    """A Keras callback counting finished steps and noting how many warnings came before
    the first step began (those are the ones a user saw before training)."""
    import keras

    class StepMarker(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps_done, self.warnings_before_training = 0, None

        def on_train_batch_begin(self, batch, logs=None):
            if self.warnings_before_training is None:
                self.warnings_before_training = len(capture.messages)

        def on_train_batch_end(self, batch, logs=None):
            self.steps_done += 1

    return StepMarker()


def fresh_keras_state():
    """Keras' global state cleared, so every build in every process names its layers the
    same (dense, dense_1, ...): variable paths then agree across the runs compared."""
    import keras
    keras.backend.clear_session(free_memory=False)


def make_optimizer(name: str):
    import keras
    # SGD's gradient clipped by its global norm: plain SGD on a deep BatchNormalization
    # net at random init is chaotic even in float64 (its exploding gradients make O(1)
    # steps: MobileNetV2 multiplied a 1e-15 difference by ~30 a step, to 2e-2 at step
    # 8), which no comparison can judge; clipped, its float64 floor is 3e-13. Clipping
    # is also what the per-replica clipping defect (issue 37) needed covered everywhere.
    return {"adam": lambda: keras.optimizers.Adam(1e-3),
            "sgd": lambda: keras.optimizers.SGD(0.01, global_clipnorm=1.0)}[name]()


def compiled_builder(spec: zoo.ZooModel, optimizer: str, random_layers: bool = False,
                     precision: str = FLOAT32):
    def build_and_compile():
        with equivalence.dtype_policy(precision):
            model = spec.build(random_layers)
        model.compile(optimizer=make_optimizer(optimizer), loss=spec.loss())
        return model
    return build_and_compile


def cell_data(spec: zoo.ZooModel, steps: int, precision: str = FLOAT32):
    """(x, y) of `steps` global batches; float arrays in `precision`."""
    import keras
    x, y = spec.data(steps * GLOBAL_BATCH, SEED)
    if precision == FLOAT32:
        return x, y
    widen = lambda a: a.astype(precision) if np.asarray(a).dtype.kind == "f" else a
    return keras.tree.map_structure(widen, x), keras.tree.map_structure(widen, y)


def all_layers(model) -> list:
    """Every layer inside `model`, nested ones included (a custom layer's attributes, a
    Sequential's layers, a keras-hub backbone's blocks), each once."""
    import keras
    found, pending, seen = [], [model], set()
    while pending:
        layer = pending.pop(0)
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if layer is not model:
            found.append(layer)
        children = list(getattr(layer, "layers", []) if isinstance(layer, keras.Model) else [])
        for value in vars(layer).values():
            values = value if isinstance(value, (list, tuple)) else [value]
            children += [v for v in values if isinstance(v, keras.layers.Layer)]
        pending.extend(children)
    return found


def random_layer_names(model) -> List[str]:
    """Layers that draw random numbers in training: those holding a SeedGenerator, except
    where every rate that draws is 0 (tfdist.train.guarantee.switched_off: Keras' recurrent
    cells hold one whatever their rates and draw only for dropout or recurrent_dropout;
    keras-io's LSTM models, which use no dropout, were listed as random)."""
    import keras
    from tfdist.train import guarantee
    return [layer.name for layer in all_layers(model)
            if any(isinstance(v, keras.random.SeedGenerator) for v in vars(layer).values())
            and not guarantee.switched_off(layer)]


def probe(spec: zoo.ZooModel, random_layers: bool = False):
    """The model as every run of this process builds it (same names, same seed), built:
    a subclassed model gets its weights at its first call."""
    import keras
    fresh_keras_state()
    keras.utils.set_random_seed(SEED)
    model = spec.build(random_layers)
    if not model.built:
        model(batches(spec.data(1, SEED)[0], 1)[0])
    return model


def batches(tree, steps: int):
    """The `steps` global batches of a NumPy structure, in order."""
    import keras
    return [keras.tree.map_structure(lambda a: a[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH], tree)
            for k in range(steps)]


def train_reference(spec, optimizer, callbacks, steps=STEPS, perturbation=0.0,
                    precision=FLOAT32):
    """Plain Keras on one device: train_on_batch over the same global batches (each call's
    loss is exactly that step's, unlike fit's running mean); the initial weights moved
    by `perturbation` (see `perturbed`)."""
    import keras
    x, y = cell_data(spec, steps, precision)
    fresh_keras_state()
    keras.utils.set_random_seed(SEED)
    model = compiled_builder(spec, optimizer, precision=precision)()
    if perturbation:
        if not model.built:
            model(batches(x, 1)[0])
        model.set_weights([perturbed(w, perturbation) for w in model.get_weights()])
    losses = []
    for xb, yb in zip(batches(x, steps), batches(y, steps)):
        losses.append(float(model.train_on_batch(xb, yb, return_dict=True)["loss"]))
        callbacks[0].steps_done += 1
    return losses, {"one device": model.get_weights()}


def perturbed(weight: np.ndarray, size: float) -> np.ndarray:
    """A float weight scaled by 1 + size, its exact zeros set to +-size (fixed signs).

    Why the zeros: a bias that BatchNormalization cancels starts at 0 and holds only
    rounding noise (its true gradient is 0), noise that differs in any other order of
    the same sums, and a float32 net can be sensitive to it where no scaling reaches
    (BatchNormalization undoes a kernel's scale). keras-io's Xception-like net under SGD:
    its first conv bias at 1e-7 instead of 0 moves plain Keras' losses by 1.8e-4 in 8
    steps, the very errors its float32 mirrored run showed (identical to 2 digits), while
    every weight scaled by 1 + 1e-7 moved them by 2.4e-7."""
    if weight.dtype.kind != "f":
        return weight
    signs = np.where(np.arange(weight.size).reshape(weight.shape) % 2 == 0, 1.0, -1.0)
    moved = np.where(weight == 0, size * signs, weight * (1 + size))
    return moved.astype(weight.dtype)


def train_tfdist(spec, mode, optimizer, callbacks, random_layers=False, steps=STEPS,
                 precision=FLOAT32):
    """tfdist.Strategy(...).fit through tfdist.testing.equivalence.train_keras."""
    options = dict(mode.options)
    strategy = options.pop("strategy")
    if strategy == "multi_worker_mirrored":
        options["collective_timeout"] = WORKER_COLLECTIVE_TIMEOUT
    x, y = cell_data(spec, steps, precision)
    fresh_keras_state()
    run = equivalence.train_keras(
        strategy, compiled_builder(spec, optimizer, random_layers, precision), x, y, seed=SEED,
        fit_kwargs=dict(batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, callbacks=callbacks),
        label=mode.name, **options)
    return list(run.losses), run.replica_weights


def train_keras_distribution(spec, mode, optimizer, callbacks, random_layers=False,
                             steps=STEPS, precision=FLOAT32):
    """Keras' own model.fit under keras.distribution (tfdist routes it)."""
    import keras
    from tfdist import keras_distribution
    x, y = cell_data(spec, steps, precision)
    distribution = make_distribution(spec, mode.options["keras_distribution"])
    fresh_keras_state()        # before set_distribution: clear_session forgets it
    keras.distribution.set_distribution(distribution)
    try:
        keras.utils.set_random_seed(SEED)
        model = compiled_builder(spec, optimizer, random_layers, precision)()
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)
        losses = keras_distribution.strategy_for(distribution).last_result.losses
        return list(losses), {"model": model.get_weights()}
    finally:
        keras.distribution.set_distribution(None)


def make_distribution(spec, kind: str):
    import keras
    if kind == "data":      # as users write it: every device
        return keras.distribution.DataParallel()
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                         devices=keras.distribution.list_devices())
    return keras.distribution.ModelParallel(layout_map=model_parallel_layout(spec, mesh),
                                            batch_dim_name="batch")


def model_parallel_layout(spec, mesh):
    """What a user hands ModelParallel: the library's own layout map when the model comes
    with one (keras-hub's Backbone.get_layout_map), else the Keras distribution guide's
    pattern applied to every Dense layer: kernel columns and bias over `model`, where the
    column count divides by the axis."""
    import keras
    model = probe(spec)
    backbone = getattr(model, "backbone", None)
    if backbone is not None and hasattr(type(backbone), "get_layout_map"):
        return type(backbone).get_layout_map(mesh)
    layout_map = keras.distribution.LayoutMap(mesh)
    model_size = dict(zip(mesh.axis_names, mesh.shape))["model"]
    for layer in all_layers(model):
        if isinstance(layer, keras.layers.Dense) and layer.built and \
                layer.kernel.shape[-1] % model_size == 0:
            layout_map[re.escape(layer.kernel.path)] = (None, "model")
            if layer.bias is not None:
                layout_map[re.escape(layer.bias.path)] = ("model",)
    return layout_map


def trainer_for(mode_name: str):
    if mode_name in (REFERENCE, NOISE_FLOOR, REFERENCE64):
        perturbation = NOISE if mode_name == NOISE_FLOOR else 0.0
        return lambda spec, mode, optimizer, callbacks, random_layers, steps, precision: \
            train_reference(spec, optimizer, callbacks, steps, perturbation,
                            FLOAT64 if mode_name == REFERENCE64 else FLOAT32)
    if "keras_distribution" in MODES[mode_name].options:
        return train_keras_distribution
    return train_tfdist


def run_cell(spec, mode_name: str, optimizer: str, random_layers=False, steps=STEPS,
             precision: str = FLOAT32) -> tuple:
    """Trains one cell here, in `precision`; returns (record, replica weights). Never
    raises: an exception is part of the record (its type, message and whether a step
    had run)."""
    mode = MODES.get(mode_name)
    capture = WarningCapture()
    marker = step_marker(capture)
    started = time.time()
    losses, weights, error = [], {}, None
    with capture, keras_floatx(precision):
        try:
            losses, weights = trainer_for(mode_name)(spec, mode, optimizer, [marker],
                                                     random_layers=random_layers, steps=steps,
                                                     precision=precision)
        except Exception as exception:   # the record says what it was
            error = describe_exception(exception)
    before = marker.warnings_before_training
    record = dict(model=spec.name, mode=mode_name, optimizer=optimizer, precision=precision,
                  losses=losses,
                  replicas=list(weights), steps_done=marker.steps_done, error=error,
                  warnings_before_training=capture.messages[:before] if before is not None
                  else list(capture.messages),
                  warnings=list(capture.messages), seconds=round(time.time() - started, 1))
    return record, weights


@contextlib.contextmanager
def keras_floatx(precision: str):
    """Keras' floatx for one cell: the dtype NumPy floats become in fit and
    train_on_batch (in float32 a float64 model's inputs would be rounded, on some paths
    and not others)."""
    import keras
    previous = keras.config.floatx()
    keras.config.set_floatx(precision)
    try:
        yield
    finally:
        keras.config.set_floatx(previous)


def describe_exception(exception) -> dict:
    from tfdist.errors import UsageError
    kind = type(exception)
    return dict(type=f"{kind.__module__}.{kind.__qualname__}", message=str(exception),
                usage_error=isinstance(exception, UsageError))


def cell_stem(work_dir, model, mode, optimizer, rank=None):
    suffix = f".rank{rank}" if rank is not None else ""
    return os.path.join(work_dir, model, f"{mode}.{optimizer}{suffix}")


def save_cell(stem: str, record: dict, weights: dict) -> None:
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    arrays = {f"r{r}_w{i}": np.asarray(w) for r, replica in enumerate(weights.values())
              for i, w in enumerate(replica)}
    np.savez(stem + ".npz", **arrays)
    with open(stem + ".json", "w") as f:
        json.dump(record, f, default=float)


def load_weights(stem: str, replicas: int) -> List[List[np.ndarray]]:
    with np.load(stem + ".npz") as saved:
        return [[saved[f"r{r}_w{i}"] for i in range(sum(1 for k in saved.files
                                                         if k.startswith(f"r{r}_")))]
                for r in range(replicas)]


def check_random_layers(spec, mode_name: str) -> dict:
    """1 step with random layers at their real rates: was each named in a warning?"""
    names = random_layer_names(probe(spec, random_layers=True))
    result = dict(model=spec.name, mode=mode_name, random_layers=names)
    if not names:
        return dict(result, verdict="no random layers")
    record, _ = run_cell(spec, mode_name, "adam", random_layers=True, steps=1)
    told = [m for m in record["warnings_before_training"] if from_tfdist(m)]
    missing = [n for n in names if not any(mentions(m, n) for m in told)]
    if record["error"] and record["steps_done"] == 0 and record["error"]["usage_error"]:
        verdict = "refused"
    elif record["error"]:
        verdict = "crashed"
    else:
        verdict = "warned" if not missing else "NOT WARNED"
    return dict(result, verdict=verdict, missing=missing, error=record["error"],
                warnings=[m for m in told if any(mentions(m, n) for n in names)])


def mentions(message: str, layer_name: str) -> bool:
    """Whether a message names the layer (as a whole word: `dense` is not `dense_1`)."""
    return re.search(rf"(?<![\w]){re.escape(layer_name)}(?![\w])", message) is not None


def run_group(args) -> None:
    """One process's cells for one model, each saved as it finishes (a crash later in the
    process keeps the cells before it)."""
    rank = os.environ.get("TFDIST_RANK")
    if args.run_group != "multi_worker":
        simulate_devices(args.run_group)
    spec = zoo.ZOO[args.model]
    optimizers = split(args.optimizers)

    def run_cells(modes, precision=FLOAT32):
        for mode in modes:
            for optimizer in optimizers:
                record, weights = run_cell(spec, mode, optimizer, precision=precision)
                save_cell(cell_stem(args.work_dir, spec.name, mode, optimizer, rank), record,
                          weights)
                print(f"CELL {spec.name} {mode} {optimizer} {precision} "
                      f"{cell_status(record)} {record['seconds']}s", flush=True)

    if args.run_group == "local":   # first: the references, and the precision they decide
        run_cells([REFERENCE, NOISE_FLOOR])
        precision = choose_precision(args.work_dir, spec.name, optimizers)
        save_model_facts(spec, args.work_dir, precision)
        if precision == FLOAT64:
            run_cells([REFERENCE64], FLOAT64)
    else:
        precision = model_facts(args.work_dir, spec.name).get("precision", FLOAT32)
    run_cells(split(args.modes), precision)
    for mode in split(args.random_check):
        if rank in (None, "0") or MODES[mode].group == "multi_worker":
            result = check_random_layers(spec, mode)
            if rank in (None, "0"):
                path = os.path.join(args.work_dir, spec.name, f"random.{mode}.json")
                with open(path, "w") as f:
                    json.dump(result, f)
                print(f"RANDOM {spec.name} {mode} {result['verdict']}", flush=True)


def facts_of(model) -> dict:
    """Layer names (to recognise an announcement) and variable paths (to name a variable)."""
    return dict(layers=[layer.name for layer in all_layers(model)],
                paths=[v.path for v in model.weights], parameters=int(model.count_params()))


def simulate_devices(group: str) -> None:
    """4 simulated CPUs, and TensorFlow's devices initialised now: otherwise the first
    mode's own simulate_devices=2 would still be granted, and a later mode's 4 refused."""
    import tensorflow as tf
    if group == "keras_distribution":
        import tfdist
        tfdist.enable_keras_distribution(simulate_devices=SIMULATED_CPUS)
    else:
        from tfdist import devices
        devices.simulate_cpus(SIMULATED_CPUS)
    assert len(tf.config.list_logical_devices("CPU")) == SIMULATED_CPUS


def choose_precision(work_dir, model, optimizers) -> str:
    """float64 when plain Keras' own float32 training is moved past RTOL by a 1e-7
    perturbation of its initial weights (NOISE_FLOOR) with any optimizer, else float32."""
    floors = [noise_floor(work_dir, model, o, load_cell(work_dir, model, REFERENCE, o))
              for o in optimizers]
    return FLOAT64 if any(f is not None and f > RTOL for f in floors) else FLOAT32


def save_model_facts(spec, work_dir, precision: str = FLOAT32) -> None:
    facts = dict(facts_of(probe(spec)), precision=precision)
    os.makedirs(os.path.join(work_dir, spec.name), exist_ok=True)
    with open(os.path.join(work_dir, spec.name, "model.json"), "w") as f:
        json.dump(facts, f)


def cell_status(record) -> str:
    if record["error"]:
        return f"raised {record['error']['type'].rsplit('.', 1)[-1]} after " \
               f"{record['steps_done']} step(s)"
    return f"trained {len(record['losses'])} step(s)"


def split(text: Optional[str]) -> List[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def train_here(model: str, mode: str, optimizer: str) -> tuple:
    """(record, [replica weights]) of one run in this process (the test suite's fast
    subset: its process already has the simulated CPUs the mode needs)."""
    record, weights = run_cell(zoo.ZOO[model], mode, optimizer)
    return record, list(weights.values())


def judge_here(model: str, reference: tuple, candidate: tuple) -> dict:
    """A run of train_here judged against the reference's (train_here(model, REFERENCE, ...))."""
    assert not reference[0]["error"], f"plain Keras failed on {model}: {reference[0]['error']}"
    return judge(reference, candidate, facts_of(probe(zoo.ZOO[model])),
                 dict(status="in process", log=""))


def from_tfdist(message: str) -> bool:
    """A warning tfdist gave (its loggers, or warnings.warn from its files): only those
    count as an announcement; Keras' own warnings may name layers for other reasons."""
    return message.startswith("[tfdist")


# ============================================================ the orchestrating process

def group_command(group: str, model: str, modes, random_modes, optimizers, work_dir) -> list:
    inner = [sys.executable, "-m", "benchmarks.conformance", f"--run_group={group}",
             f"--model={model}", f"--modes={','.join(modes)}",
             f"--random_check={','.join(random_modes)}", f"--optimizers={','.join(optimizers)}",
             f"--work_dir={work_dir}"]
    if group == "multi_worker":
        return [sys.executable, "-m", "tfdist.launch", "--workers", "2", "--", *inner]
    return inner


def run_process(command: list, log_path: str, timeout: float) -> dict:
    """Runs one group, its output to log_path and its CELL/RANDOM lines echoed as progress.
    `timeout` is per cell, not per process (a process trains up to a dozen cells, and
    the largest models take minutes each): past `timeout` seconds without a finished
    cell, its process group gets SIGTERM, then SIGKILL."""
    import threading
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    started = time.time()
    progress = [started]     # when the last cell finished (copy_output updates it)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        echo = threading.Thread(target=copy_output, args=(process.stdout, log, progress),
                                daemon=True)
        echo.start()
        status = None
        while status is None:
            try:
                status = process.wait(5)
            except subprocess.TimeoutExpired:
                if time.time() - progress[0] > timeout:
                    end_process_group(process)
                    status = f"no cell finished in {timeout:.0f} s: ended"
        echo.join(10)
    return dict(status=status, seconds=round(time.time() - started, 1), log=log_path)


def copy_output(stream, log, progress) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        if line.startswith(("CELL ", "RANDOM ")) or "] CELL " in line or "] RANDOM " in line:
            progress[0] = time.time()
            print("    " + line.rstrip(), flush=True)


def end_process_group(process, grace: float = 30) -> None:
    """SIGTERM first: `tfdist launch` forwards it to its workers (their own groups)."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        try:
            process.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def log_tail(path: str, lines: int = 12) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).strip()
    except OSError:
        return ""


# ---------------------------------------------------------------------- judging a cell

def load_cell(work_dir, model, mode, optimizer, rank=None):
    """(record, [replica weights]) of a cell, or None when it left no record."""
    stem = cell_stem(work_dir, model, mode, optimizer, rank)
    if not os.path.exists(stem + ".json"):
        return None
    with open(stem + ".json") as f:
        record = json.load(f)
    return record, load_weights(stem, len(record["replicas"]))


def ranks_of(mode: str):
    return [0, 1] if MODES[mode].group == "multi_worker" else [None]


def judge(reference, candidate, facts, outcome) -> dict:
    """One optimizer's verdict for one process (or rank) against the reference; `facts`
    (save_model_facts) has the model's layer names and variable paths."""
    if candidate is None:
        return dict(verdict=SILENT, message=f"no result: the process ended ({outcome['status']})"
                    f"; log tail:\n{log_tail(outcome['log'])}", error=None)
    record, replicas = candidate
    if record["error"]:
        error = record["error"]
        if error["usage_error"] and record["steps_done"] == 0:
            return dict(verdict=REFUSED, message=error["message"], error=None)
        return dict(verdict=SILENT, message=f"{error['type']} after {record['steps_done']} "
                    f"step(s): {error['message']}", error=None)
    problems, errors = differences(reference, record, replicas)
    if not problems:
        return dict(verdict=EXACT, message=None, error=max(errors))
    told = [m for m in record["warnings_before_training"]
            if from_tfdist(m) and any(mentions(m, name) for name in facts.get("layers", []))]
    verdict = ANNOUNCED if told else SILENT
    message = "\n".join(told) if told else "not exact, no warning named a layer: " + \
        "; ".join(with_paths(problems[:4], facts.get("paths", [])))
    return dict(verdict=verdict, message=message, error=max(errors))


def differences(reference, record, replicas):
    """(problems, errors): equivalence's loss and per-variable weight checks, and the
    largest relative errors they measured."""
    ref_record, ref_weights = reference
    ref = equivalence.Record("one device", ref_record["losses"], ref_weights[0])
    problems, errors = [], []
    candidate = equivalence.Record(record["mode"], record["losses"], None)
    problems += equivalence.loss_mismatches(ref, candidate)
    if len(ref.losses) == len(candidate.losses) and ref.losses:
        errors.append(equivalence.max_relative_loss_error(ref, candidate))
    else:
        errors.append(float("inf"))
    for label, weights in zip(record["replicas"], replicas):
        found = equivalence.weight_mismatches(ref, equivalence.Record(label, [], weights))
        problems += [f"{label}: {p}" for p in found]
        if len(weights) == len(ref.weights):
            errors += [weight_error(g, r) for g, r in zip(weights, ref.weights)
                       if np.shape(g) == np.shape(r)]
    return problems, errors


def with_paths(problems, paths) -> list:
    """equivalence's "weight 5 (2, 32): ..." with the variable's path after its index."""
    def name(match):
        index = int(match.group(1))
        return f"weight {index} {paths[index]}" if index < len(paths) else match.group(0)
    return [re.sub(r"weight (\d+)", name, problem, count=1) for problem in problems]


def weight_error(got, ref) -> float:
    """The variable's relative error, or 0 when every entry is within equivalence.ATOL
    (the harness' own rule: a key bias attention never moves holds ~1e-8 of noise, whose
    relative error means nothing)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if ref.size == 0 or np.max(np.abs(got - ref)) <= equivalence.ATOL:
        return 0.0
    return equivalence.relative_error(got, ref)


def judge_cell(work_dir, model, mode, optimizers, facts, outcomes) -> dict:
    """A (model, mode) cell: each optimizer judged on every rank, the worst verdict kept."""
    per_optimizer = {o: judge_optimizer(work_dir, model, mode, o, facts,
                                        outcomes[MODES[mode].group]) for o in optimizers}
    verdicts = [o["verdict"] for o in per_optimizer.values()]
    verdict = None if None in verdicts else max(verdicts, key=SEVERITY.index)
    errors = [o["error"] for o in per_optimizer.values() if o.get("error") is not None]
    ill = any(o.get("ill_conditioned") and o["verdict"] not in (EXACT, REFUSED)
              for o in per_optimizer.values())
    return dict(model=model, mode=mode, verdict=verdict, ill_conditioned=ill,
                worst_error=max(errors) if errors else None, optimizers=per_optimizer)


def judge_optimizer(work_dir, model, mode, optimizer, facts, outcome) -> dict:
    float32_reference = load_cell(work_dir, model, REFERENCE, optimizer)
    in_float64 = facts.get("precision") == FLOAT64
    reference = (load_cell(work_dir, model, REFERENCE64, optimizer) if in_float64
                 else float32_reference)
    if reference is None or reference[0]["error"]:
        return dict(verdict=None, error=None, message=(
            f"no reference: plain Keras failed "
            f"({reference[0]['error'] if reference else 'no record'})"))
    runs = [load_cell(work_dir, model, mode, optimizer, rank) for rank in ranks_of(mode)]
    judged = [judge(reference, run, facts, outcome) for run in runs]
    worst = max(judged, key=lambda j: SEVERITY.index(j["verdict"]))
    seconds = [run[0]["seconds"] for run in runs if run]
    noise = noise_floor(work_dir, model, optimizer, float32_reference)
    return dict(worst, seconds=max(seconds) if seconds else None,
                trained=all(run and not run[0]["error"] for run in runs), noise_floor=noise,
                ill_conditioned=not in_float64 and noise is not None and noise > RTOL)


def noise_floor(work_dir, model, optimizer, reference) -> Optional[float]:
    # `reference`: the float32 REFERENCE cell (None or failed: no floor)
    """The largest per-step relative loss error of the perturbed one-device run
    (NOISE_FLOOR). Losses, not weights: under Adam a variable whose gradient is near 0
    (a zero-initialised bias) moves by about the learning rate's sign, so a systematic
    1e-7 scaling shows there even in a model every mode matches (measured: Simple MNIST
    convnet, 4.4e-6 on the losses, 6.7e-4 on a conv bias, every dtensor cell exact)."""
    perturbed = load_cell(work_dir, model, NOISE_FLOOR, optimizer)
    if perturbed is None or perturbed[0]["error"] or reference is None or reference[0]["error"]:
        return None
    ref = equivalence.Record("one device", reference[0]["losses"], None)
    try:
        return equivalence.max_relative_loss_error(
            ref, equivalence.Record("perturbed", perturbed[0]["losses"], None))
    except ValueError:   # another step count: no step-by-step error
        return None


# ---------------------------------------------------------------------- the whole corpus

def run_corpus(models, modes, random_modes, optimizers, work_dir, timeout, train=True,
               jobs=1) -> dict:
    """Runs every model's processes (`jobs` models at a time; unless `train` is False: then
    the records already in work_dir are judged again), then judges every cell."""
    from concurrent.futures import ThreadPoolExecutor
    started = time.time()

    def outcomes_of(indexed):
        index, model = indexed
        if not train:
            return earlier_outcomes(work_dir, model)
        print(f"[{index}/{len(models)}] {model}", flush=True)
        return run_model(model, modes, random_modes, optimizers, work_dir, timeout)

    with ThreadPoolExecutor(max_workers=jobs) as pool:   # threads only wait on processes
        outcomes = dict(zip(models, pool.map(outcomes_of, enumerate(models, start=1))))
    cells, random_checks, groups = [], [], []
    for model in models:
        groups += [dict(model=model, group=g, **o) for g, o in outcomes[model].items()]
        facts = model_facts(work_dir, model)
        cells += [judge_cell(work_dir, model, mode, optimizers, facts, outcomes[model])
                  for mode in modes]
        random_checks += [random_check_result(work_dir, model, mode, outcomes[model])
                          for mode in random_modes]
    return dict(cells=cells, random_checks=random_checks, groups=groups,
                elapsed_s=round(time.time() - started, 1))


def run_model(model, modes, random_modes, optimizers, work_dir, timeout) -> dict:
    """One model's processes, group by group; returns group -> how its process ended."""
    os.makedirs(os.path.join(work_dir, model), exist_ok=True)
    outcomes = {}
    for group in GROUPS:
        group_modes = [m for m in modes if MODES[m].group == group]
        group_checks = [m for m in random_modes if MODES[m].group == group]
        if group != "local" and not group_modes and not group_checks:
            continue    # the local group always runs: it trains the reference
        print(f"  {model} {group}: "
              f"{', '.join(['reference'] * (group == 'local') + group_modes)}", flush=True)
        command = group_command(group, model, group_modes, group_checks, optimizers, work_dir)
        outcomes[group] = run_process(command, os.path.join(work_dir, model, f"{group}.log"),
                                      timeout)
        print(f"  {model} {group} ended ({outcomes[group]['status']}) after "
              f"{outcomes[group]['seconds']} s", flush=True)
    return outcomes


def earlier_outcomes(work_dir, model) -> dict:
    return {group: dict(status="not rerun (--report_only)", seconds=0.0,
                        log=os.path.join(work_dir, model, f"{group}.log")) for group in GROUPS}


def model_facts(work_dir, model) -> dict:
    path = os.path.join(work_dir, model, "model.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def random_check_result(work_dir, model, mode, outcomes) -> dict:
    path = os.path.join(work_dir, model, f"random.{mode}.json")
    if not os.path.exists(path):
        outcome = outcomes.get(MODES[mode].group, {})
        return dict(model=model, mode=mode, verdict="no result",
                    error=dict(message=f"the process ended ({outcome.get('status')})"))
    with open(path) as f:
        return json.load(f)


def summarize(cells, random_checks) -> dict:
    counts = {v: sum(1 for c in cells if c["verdict"] == v) for v in SEVERITY}
    judged = sum(counts.values())
    return dict(cells=len(cells), **counts, no_reference=len(cells) - judged,
                silent_on_ill_conditioned=sum(1 for c in cells if c["verdict"] == SILENT
                                              and c.get("ill_conditioned")),
                exact_share=round(counts[EXACT] / judged, 3) if judged else None,
                random_layers_unwarned=sum(1 for r in random_checks
                                           if r["verdict"] in ("NOT WARNED", "crashed",
                                                               "no result")))


def exit_status(summary) -> int:
    """1: a silent mismatch (or an unwarned random layer, or a model plain Keras could not
    train: then nothing was compared); 0 otherwise."""
    return 1 if (summary[SILENT] or summary["random_layers_unwarned"]
                 or summary["no_reference"]) else 0


# ---------------------------------------------------------------------- the report

def write_report(result: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "conformance.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    text = markdown(result)
    with open(os.path.join(out_dir, "conformance.md"), "w") as f:
        f.write(text)
    return text


def markdown(result: dict) -> str:
    notes = Footnotes()
    lines = header_lines(result) + [""]
    lines += cell_table(result, notes) + [""]
    lines += random_table(result["random_checks"], notes) + [""]
    lines += timing_lines(result) + [""]
    lines += notes.lines()
    return "\n".join(lines) + "\n"


def header_lines(result: dict) -> list:
    s = result["summary"]
    return [
        f"Command: `{result['command']}` (commit {result['commit']}, {result['date']}, "
        f"{result['elapsed_s'] / 60:.1f} min). Each cell: {STEPS} steps at a global batch of "
        f"{GLOBAL_BATCH} with {' and '.join(result['optimizers'])}, against plain Keras on one "
        f"device; exact = per-step losses and final weights within {RTOL:g} relative. The "
        f"number after a verdict is the worst relative error (losses, and variables not "
        f"within {equivalence.ATOL:g} absolute). Noise floor: the worst per-step loss error of "
        f"the same one-device training from initial weights scaled by 1 + {NOISE:g} (its "
        f"exact zeros set to +-{NOISE:g}: a bias BatchNormalization cancels holds rounding "
        f"noise, which another order of the same sums changes); past "
        f"{RTOL:g}, rounding alone moves the model beyond the tolerance in float32, so that "
        f"model's cells (its noise floor marked \"→ float64\") train in float64 and are "
        f"judged against plain Keras on one device in float64, where rounding is 1e-9 of "
        f"float32's and a mismatch is the mode's math again.", "",
        f"**{s['cells']} cells: {s[EXACT]} exact ({percent(s['exact_share'])}), "
        f"{s[REFUSED]} refused, {s[ANNOUNCED]} announced, {s[SILENT]} SILENT MISMATCH**"
        + (f" ({s['silent_on_ill_conditioned']} of them ill-conditioned)"
           if s["silent_on_ill_conditioned"] else "")
        + (f", {s['no_reference']} without a reference" if s["no_reference"] else "")
        + f". Random layers unwarned: {s['random_layers_unwarned']}."]


def percent(share) -> str:
    return "n/a" if share is None else f"{100 * share:.0f}%"


class Footnotes:
    """Each distinct message once, numbered, with the cells that gave it."""

    def __init__(self):
        self.keys, self.where = [], {}

    def ref(self, kind: str, message: str, where: str) -> str:
        key = (kind, message)
        if key not in self.where:
            self.keys.append(key)
            self.where[key] = []
        self.where[key].append(where)
        return f"[{self.keys.index(key) + 1}]"

    def lines(self) -> list:
        out = ["## Messages", ""] if self.keys else []
        for number, key in enumerate(self.keys, start=1):
            kind, message = key
            out += [f"**[{number}] {kind}** ({'; '.join(self.where[key])}):", "", "```",
                    message.strip(), "```", ""]
        return out


def cell_table(result, notes) -> list:
    modes = result["modes"]
    lines = ["| model | source | noise floor | " + " | ".join(MODES[m].title for m in modes)
             + " |", "|---|---|---|" + "---|" * len(modes)]
    by_key = {(c["model"], c["mode"]): c for c in result["cells"]}
    for model in result["models"]:
        spec = zoo.ZOO[model]
        cells = [by_key[(model, mode)] for mode in modes]
        row = [cell_text(cell, notes) for cell in cells]
        lines.append(f"| {model} | {spec.family}: {spec.origin} | {model_noise(cells)} | "
                     + " | ".join(row) + " |")
    return lines


def model_noise(cells) -> str:
    """The model's worst noise floor over the optimizers, bold past RTOL."""
    floors = [o["noise_floor"] for o in cells[0]["optimizers"].values()
              if o.get("noise_floor") is not None] if cells else []
    if not floors:
        return "n/a"
    text = f"{max(floors):.1e}"
    return f"**{text}** → float64" if max(floors) > RTOL else text


def cell_text(cell, notes) -> str:
    verdict = cell["verdict"] or "no reference"
    text = f"**{verdict}**" if verdict in (SILENT, "no reference") else verdict
    if cell["worst_error"] is not None:
        text += f" {cell['worst_error']:.1e}"
    if cell.get("ill_conditioned"):
        text += " (ill-conditioned)"
    refs = []
    for optimizer, judged in cell["optimizers"].items():
        if judged.get("message") and judged["verdict"] != EXACT:
            refs.append(notes.ref(judged["verdict"] or "no reference", judged["message"],
                                  f"{cell['model']} {cell['mode']} {optimizer}"))
    # "[6], [7]", not "[6] [7]": Markdown reads the latter as a reference link (mkdocs fails).
    return " ".join([text, ", ".join(sorted(set(refs), key=refs.index))]).rstrip()


def random_table(checks, notes) -> list:
    if not checks:
        return []
    lines = ["Random layers at their real rates (1 step; a tfdist warning must name each):", "",
             "| model | mode | random layers | verdict |", "|---|---|---|---|"]
    without = sorted({c["model"] for c in checks if c["verdict"] == "no random layers"})
    for check in [c for c in checks if c["verdict"] != "no random layers"]:
        verdict = check["verdict"]
        if check.get("missing"):
            verdict += " (" + ", ".join(check["missing"]) + ")"
        if check.get("error"):
            verdict += " " + notes.ref(check["verdict"], check["error"]["message"],
                                       f"{check['model']} {check['mode']} random layers")
        elif check.get("warnings"):
            verdict += " " + notes.ref("random-layer warning", "\n".join(check["warnings"]),
                                       f"{check['model']} {check['mode']}")
        lines.append(f"| {check['model']} | {check['mode']} | "
                     f"{', '.join(check.get('random_layers', [])) or '-'} | {verdict} |")
    if without:
        lines += ["", f"No random layer at all: {', '.join(without)}."]
    return lines


def timing_lines(result) -> list:
    """Seconds per training (build, trace and 8 steps) by mode, and per process group."""
    lines = ["Seconds per training that ran its 8 steps (one model, one optimizer; build, "
             "trace and steps), by mode:", ""]
    for mode in [REFERENCE] + result["modes"]:
        times = [o["seconds"] for c in result["cells"] if c["mode"] == mode
                 for o in c["optimizers"].values()
                 if o.get("seconds") is not None and o["verdict"] in (EXACT, ANNOUNCED, SILENT)
                 and o.get("trained")]
        if mode == REFERENCE:
            times = result.get("reference_seconds", [])
        if times:
            lines.append(f"- {mode}: median {np.median(times):.1f}, max {max(times):.1f} "
                         f"({len(times)} runs)")
    groups = result["groups"]
    for group in GROUPS:
        walls = [g["seconds"] for g in groups if g["group"] == group]
        if walls:
            lines.append(f"- `{group}` processes: median {np.median(walls):.0f} s, max "
                         f"{max(walls):.0f} s, total {sum(walls) / 60:.1f} min")
    return lines


# ---------------------------------------------------------------------- command line

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="all", help="model names or families "
                        "(keras.applications, keras-hub, keras-io), comma-separated; all")
    parser.add_argument("--modes", default="all", help=f"of {', '.join(MODES)}; all")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--random_check", default="mirrored", help="modes in which models "
                        "with random layers train 1 step at real rates; none to skip")
    parser.add_argument("--cell_timeout", type=float, default=900,
                        help="seconds a process may go without finishing a cell (a training "
                        "of one model, one mode, one optimizer) before it is ended")
    parser.add_argument("--out_dir", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--work_dir", default=None, help="per-cell records (default: a "
                        "temporary directory, kept)")
    parser.add_argument("--list", action="store_true", help="print the corpus and modes")
    parser.add_argument("--jobs", type=int, default=1, help="models run at a time (their "
                        "processes share the cores; verdicts do not depend on timing)")
    parser.add_argument("--report_only", action="store_true", help="judge the records "
                        "already in --work_dir again and rewrite the report; train nothing")
    parser.add_argument("--run_group", choices=GROUPS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def select_models(text: str) -> List[str]:
    from tfdist.errors import UsageError
    if text == "all":
        return list(zoo.ZOO)
    families = {spec.family for spec in zoo.ZOO.values()}
    chosen = []
    for name in split(text):
        if name in families:
            chosen += [m for m, spec in zoo.ZOO.items() if spec.family == name]
        elif name in zoo.ZOO:
            chosen.append(name)
        else:
            raise UsageError(f"--models: unknown model or family {name!r}. Valid: all, "
                             f"{', '.join(sorted(families))}, {', '.join(zoo.ZOO)}.")
    return list(dict.fromkeys(chosen))


def select_modes(text: str, flag: str, allow_none: bool = False) -> List[str]:
    from tfdist.errors import UsageError
    if text == "all":
        return list(MODES)
    if allow_none and text in ("none", ""):
        return []
    unknown = [m for m in split(text) if m not in MODES]
    if unknown or not split(text):
        raise UsageError(f"{flag}: unknown mode(s) {', '.join(unknown) or repr(text)}. "
                         f"Valid: all, {', '.join(MODES)}.")
    return [m for m in MODES if m in split(text)]    # the table's column order


def corpus_listing() -> str:
    lines = [f"{name:24s} {spec.family:20s} {spec.origin}" for name, spec in zoo.ZOO.items()]
    lines += [""] + [f"{m.name:22s} {m.group:13s} {m.title}" for m in MODES.values()]
    return "\n".join(lines)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    from tfdist.errors import UsageError
    args = parse_args(argv)
    if args.run_group:
        run_group(args)
        return 0
    if args.list:
        print(corpus_listing())
        return 0
    try:
        models = select_models(args.models)
        modes = select_modes(args.modes, "--modes")
        random_modes = select_modes(args.random_check, "--random_check", allow_none=True)
        optimizers = split(args.optimizers)
        bad = [o for o in optimizers if o not in OPTIMIZERS]
        if bad or not optimizers:
            raise UsageError(f"--optimizers: {args.optimizers!r}; valid: {', '.join(OPTIMIZERS)}.")
    except UsageError as error:
        print(f"tfdist: error: {error}", file=sys.stderr)
        return 2
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="tfdist-conformance-")
    print(f"conformance: {len(models)} model(s) x {len(modes)} mode(s) x {optimizers}; "
          f"records in {work_dir}", flush=True)
    if args.report_only and not args.work_dir:
        print("tfdist: error: --report_only needs --work_dir (the records to judge).",
              file=sys.stderr)
        return 2
    result = run_corpus(models, modes, random_modes, optimizers, work_dir, args.cell_timeout,
                        train=not args.report_only, jobs=max(1, args.jobs))
    result.update(command="python -m benchmarks.conformance " + " ".join(
        sys.argv[1:] if argv is None else argv), commit=git_commit(),
        date=time.strftime("%Y-%m-%d %H:%M"), models=models, modes=modes,
        optimizers=optimizers, steps=STEPS, global_batch=GLOBAL_BATCH, rtol=RTOL,
        work_dir=work_dir, reference_seconds=reference_seconds(work_dir, models, optimizers))
    result["summary"] = summarize(result["cells"], result["random_checks"])
    print(write_report(result, args.out_dir))
    return exit_status(result["summary"])


def reference_seconds(work_dir, models, optimizers) -> list:
    return [c[0]["seconds"] for m in models for o in optimizers
            for c in [load_cell(work_dir, m, REFERENCE, o)] if c]


if __name__ == "__main__":
    sys.exit(main())
