"""The equivalence harness: train one config in two modes, compare number for number.

Every parallel mode is held to this: per-step losses and final weights within
`rtol` (1e-5, float32) of the single-device `default` run with the same seed and
global batch. Weights are compared per variable by relative norm,
||candidate - reference|| / ||reference||, which is robust to entries near 0; a
variable whose values all ended near 0 passes with every difference within ATOL.
"""

import contextlib
import dataclasses
import json
import os
from typing import List, Optional, Sequence

import numpy as np

RTOL = 1e-5
# A variable whose final values are near 0 (a bias that ended at 0.02, say) is held to
# an absolute bound instead: float32 keeps ~7 digits of the O(lr * grad) updates that
# built it, not of its own small value (measured: out/bias 0.024 differed by 2.6e-7 after
# 16 steps on a mesh, 1.06e-5 relative, while every kernel was within 2.5e-7 relative).
ATOL = 1e-6
# Optional: each comparison appends its largest error as a JSON line to this file, so one
# run of the tests yields the figures that issue notes and the docs quote.
REPORT_FILE = "TFDIST_EQUIVALENCE_REPORT"


@dataclasses.dataclass
class Record:
    label: str
    losses: List[float]
    weights: Optional[List[np.ndarray]]  # None: this record has no weights to compare


def train(config, label: str = None) -> Record:
    """Runs `config` in this process and records its losses and final weights."""
    from tfdist.train import runner
    results, model = runner.run(config, return_model=True)
    return Record(label or config.strategy, results["losses"], model.get_weights())


def from_results_json(path: str, label: str = None, weights: str = None) -> Record:
    """A Record of a run launched elsewhere: its results JSON's losses and, if
    `weights` names an .npz of its final weights (np.savez(path, *model.get_weights()),
    as tests/workers/train_configs.py writes per rank), those weights. Without one the
    record has weights=None, which weight_mismatches refuses rather than passing."""
    with open(path) as f:
        results = json.load(f)
    return Record(label or results["strategy"], results["losses"],
                  load_weights(weights) if weights else None)


def load_weights(npz_path: str) -> List[np.ndarray]:
    """The list of arrays np.savez(npz_path, *arrays) wrote, in order."""
    with np.load(npz_path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def loss_mismatches(reference: Record, candidate: Record, rtol: float = RTOL) -> List[str]:
    if len(reference.losses) != len(candidate.losses):
        return [f"{candidate.label} ran {len(candidate.losses)} steps, "
                f"{reference.label} ran {len(reference.losses)}"]
    if not reference.losses:  # equal on no steps is not a comparison
        return [f"{candidate.label} and {reference.label} have no losses to compare"]
    out, errors = [], []
    for step, (ref, got) in enumerate(zip(reference.losses, candidate.losses), start=1):
        error = abs(got - ref) / max(abs(ref), 1e-12)
        errors.append(error)
        if not error <= rtol:  # also NaN
            out.append(f"step {step}: loss {got!r} vs {ref!r} (relative error {error:.2e})")
    _report(reference, candidate, steps=len(errors), max_loss_error=max(errors))
    return out


def relative_error(got, ref) -> float:
    """||got - ref|| / ||ref||, in float64."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-12))


def closer_to_exact(got, ref, exact, rtol: float = RTOL) -> bool:
    """Whether `got` is within rtol of `exact` (the same training in float64) and at least
    as close to it as the float32 reference `ref`: then what separates got from ref is the
    reference's own rounding, not a defect of the mode (see weight_mismatches)."""
    if exact is None or np.shape(exact) != np.shape(got):
        return False
    to_exact = relative_error(got, exact)
    return to_exact <= rtol and to_exact <= relative_error(ref, exact)


def weight_mismatches(reference: Record, candidate: Record, rtol: float = RTOL,
                      exact: Optional[List[np.ndarray]] = None,
                      skip: Sequence[int] = ()) -> List[str]:
    """Per variable: same shape, then relative norm within `rtol`. A record without
    weights is a ValueError (the caller compared nothing); different counts, or none
    at all, are mismatches.

    `exact`, when given, is the reference's training in float64 (same initial weights):
    a variable farther than rtol from the reference still matches if it is within rtol
    of the float64 values and no farther from them than the reference is. Why: the
    one-device float32 run is itself not exact. Adam divides each gradient by its own
    running magnitude, so where gradients are small (a zero-initialised norm scale)
    float32's rounding in another order of operations can grow past 1e-5, and which run
    lands nearer the exact values is then a matter of order, not of correctness.

    `skip`: indices of variables not compared (announced as not covered)."""
    for record in (reference, candidate):
        if record.weights is None:
            raise ValueError(f"record {record.label!r} has no weights (from_results_json "
                             f"without weights=?): cannot compare weights")
    if exact is not None and len(exact) != len(reference.weights):
        raise ValueError(f"the float64 run has {len(exact)} weights, {reference.label!r} has "
                         f"{len(reference.weights)}: it is not the same model")
    if len(reference.weights) != len(candidate.weights):
        return [f"{candidate.label} has {len(candidate.weights)} weights, "
                f"{reference.label} has {len(reference.weights)}"]
    if not reference.weights:
        return [f"{candidate.label} and {reference.label} have no weights to compare"]
    out, errors = [], []
    for index, (ref, got) in enumerate(zip(reference.weights, candidate.weights)):
        if index in skip:
            continue
        ref, got = np.asarray(ref), np.asarray(got)
        if ref.shape != got.shape:  # before any arithmetic: numpy would broadcast
            out.append(f"weight {index}: shape {got.shape} vs {ref.shape}")
            continue
        error = relative_error(got, ref)
        largest = float(np.max(np.abs(got - ref))) if ref.size else 0.0
        errors.append(float(error))
        exact_value = exact[index] if exact is not None else None
        if not (error <= rtol or largest <= ATOL  # also NaN
                or closer_to_exact(got, ref, exact_value, rtol)):
            out.append(f"weight {index} {ref.shape}: relative error {error:.2e}, largest "
                       f"difference {largest:.1e}")
    _report(reference, candidate, weights=len(errors), max_weight_error=max(errors, default=None))
    return out


def _report(reference: Record, candidate: Record, **figures) -> None:
    """Appends one comparison's figures to $TFDIST_EQUIVALENCE_REPORT, when it is set."""
    path = os.environ.get(REPORT_FILE)
    if path:
        line = json.dumps(dict(candidate=candidate.label, reference=reference.label,
                               **figures), default=float) + "\n"
        with open(path, "a") as f:   # one short append: processes may share the file
            f.write(line)


def max_relative_loss_error(reference: Record, candidate: Record) -> float:
    if len(reference.losses) != len(candidate.losses) or not reference.losses:
        raise ValueError(f"{candidate.label} has {len(candidate.losses)} losses, "
                         f"{reference.label} {len(reference.losses)}: no step-by-step error")
    return max(abs(g - r) / max(abs(r), 1e-12)
               for r, g in zip(reference.losses, candidate.losses))


def assert_equivalent(reference: Record, candidate: Record, rtol: float = RTOL) -> None:
    problems = loss_mismatches(reference, candidate, rtol)
    problems += weight_mismatches(reference, candidate, rtol)
    assert not problems, (f"{candidate.label} differs from {reference.label} beyond "
                          f"rtol={rtol}:\n  " + "\n  ".join(problems[:10]))


# ----------------------------------------------------------------- a user's own Keras model

class LogRecorder:
    """A Keras callback keeping every train batch's and epoch's logs (what a user's own
    callback sees), so two modes' logs can be compared key by key; given
    `weights_fn`, also the weights after each step (up to STEP_WEIGHT_BYTES), to tell
    which variable's update differed first."""

    def __new__(cls, weights_fn=None):
        import keras

        class _Recorder(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.batch_logs, self.epoch_logs, self.step_weights = [], [], []
                self._bytes = 0

            def on_train_batch_end(self, batch, logs=None):
                self.batch_logs.append(dict(logs or {}))
                if weights_fn is not None and self._bytes < STEP_WEIGHT_BYTES:
                    weights = weights_fn()
                    self._bytes += sum(w.nbytes for w in weights)
                    self.step_weights.append(weights)

            def on_epoch_end(self, epoch, logs=None):
                self.epoch_logs.append(dict(logs or {}))

        return _Recorder()


# Per-step weights kept by train_keras, to name the first variable that differs: enough
# for every step of a small model, the first steps of a larger one.
STEP_WEIGHT_BYTES = 256 * 2 ** 20


@dataclasses.dataclass
class KerasRun:
    """One mode's training of a user's model: per-step losses, every replica's weights
    (label -> arrays), the variable paths, and the logs its callbacks saw."""
    label: str
    losses: List[float]
    replica_weights: dict
    paths: List[str]
    batch_logs: List[dict]
    epoch_logs: List[dict]
    stochastic_layers: List[str]
    # Paths tfdist announced before training as not one device's in any split (a bias
    # that BatchNormalization cancels: tfdist/train/guarantee.py); listed, not compared.
    not_covered: List[str] = dataclasses.field(default_factory=list)
    step_weights: List[list] = dataclasses.field(default_factory=list)  # first replica's

    def record(self, replica: str = None) -> Record:
        replica = replica or next(iter(self.replica_weights))
        return Record(f"{self.label} {replica}", self.losses, self.replica_weights[replica])


def stochastic_layers(model) -> List[str]:
    """Layers that draw random numbers while training (Dropout, GaussianNoise, random
    augmentation...) at a non-zero rate: tfdist's guarantee does not cover them, a mode
    draws its random numbers per replica or per shard (tfdist/train/guarantee.py)."""
    from tfdist.train import guarantee
    return guarantee.stochastic_layers(model)


@contextlib.contextmanager
def dtype_policy(name: str):
    """Keras' global dtype policy `name` ("float64", ...) for the layers built inside; the
    previous one after. The policy, not floatx: Keras fixes its global policy from floatx
    at the first layer a process builds, and set_floatx does not change it after that
    (each layer keeps the policy it was made with)."""
    import keras
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def train_keras(strategy: str, build_and_compile, x, y=None, *, seed: int = 0,
                fit_kwargs=None, label: str = None, **strategy_options) -> KerasRun:
    """Trains `build_and_compile()`'s model (built in the strategy's scope, RNG seeded
    first) with strategy.fit(model, x, y, **fit_kwargs), recording what to compare."""
    import keras
    import tfdist
    from tfdist.train import guarantee
    tf_strategy = tfdist.Strategy(strategy, seed=seed, **strategy_options)
    keras.utils.set_random_seed(seed)
    with tf_strategy.scope():
        model = build_and_compile()
    recorder = LogRecorder(lambda: next(iter(
        tf_strategy.replica_models(model).values())).get_weights())
    kwargs = dict(fit_kwargs or {})
    kwargs["callbacks"] = list(kwargs.get("callbacks", [])) + [recorder]
    kwargs.setdefault("verbose", 0)
    try:
        tf_strategy.fit(model, x, y, **kwargs)
        replicas = tf_strategy.replica_models(model)
        run = KerasRun(label or strategy, list(tf_strategy.last_result.losses),
                       {name: m.get_weights() for name, m in replicas.items()},
                       [v.path for v in model.weights], recorder.batch_logs,
                       recorder.epoch_logs, stochastic_layers(model),
                       guarantee.not_covered(model), recorder.step_weights)
    finally:
        tf_strategy.close()
    return run


def log_mismatches(reference: KerasRun, candidate: KerasRun, rtol: float = RTOL) -> List[str]:
    """The logs every callback saw, batch by batch and epoch by epoch: same keys, values
    within rtol."""
    out = []
    for kind in ("batch_logs", "epoch_logs"):
        ref_logs, got_logs = getattr(reference, kind), getattr(candidate, kind)
        if len(ref_logs) != len(got_logs) or not ref_logs:
            out.append(f"{kind}: {len(got_logs)} vs {len(ref_logs)} entries")
            continue
        for index, (ref, got) in enumerate(zip(ref_logs, got_logs)):
            if sorted(ref) != sorted(got):
                out.append(f"{kind}[{index}] keys {sorted(got)} vs {sorted(ref)}")
                continue
            for key in ref:
                error = abs(float(got[key]) - float(ref[key])) / max(abs(float(ref[key])), 1e-12)
                if not error <= rtol:
                    out.append(f"{kind}[{index}] {key}: {got[key]!r} vs {ref[key]!r} "
                               f"({error:.2e})")
    return out


@dataclasses.dataclass
class Report:
    """What check_equivalence found; `problems` empty means equivalent."""
    strategy: str
    problems: List[str]
    first_step: Optional[int]           # first step whose loss differs, else None
    first_variable: Optional[str]       # first variable (path) whose final value differs
    max_loss_error: float
    stochastic_layers: List[str]
    not_covered: List[str] = dataclasses.field(default_factory=list)

    @property
    def equivalent(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        if self.stochastic_layers:
            head = (f"Not covered: the model draws random numbers in "
                    f"{', '.join(self.stochastic_layers)}; tfdist's modes draw them per "
                    f"replica or shard, so no mode is step-for-step equal to one device. "
                    f"Check with those layers disabled (e.g. rate=0).\n")
        else:
            head = ""
        if self.not_covered:
            head += (f"Not compared, announced before training: {', '.join(self.not_covered)} "
                     f"(a bias that BatchNormalization cancels: no split trains it to one "
                     f"device's values, see tfdist/train/guarantee.py).\n")
        if self.equivalent:
            return (head + f"{self.strategy} trains like one device: every step's loss within "
                    f"{self.max_loss_error:.1e} relative, final weights and logs within 1e-5.")
        where = []
        if self.first_step is not None:
            where.append(f"first at step {self.first_step}")
        if self.first_variable is not None:
            where.append(f"first variable {self.first_variable}")
        return (head + f"{self.strategy} differs from one device ({'; '.join(where) or 'see'}"
                f" below):\n  " + "\n  ".join(self.problems[:12]))


def check_equivalence(build_and_compile, x, y=None, *, strategy: str, seed: int = 0,
                      rtol: float = RTOL, fit_kwargs=None, **strategy_options) -> Report:
    """Trains the user's model on one device and in `strategy`, and compares per-step
    losses, every replica's final weights and the callbacks' logs.

        report = tfdist.testing.check_equivalence(make_model, x, y, strategy="mirrored",
                                                  simulate_devices=2,
                                                  fit_kwargs=dict(batch_size=64, epochs=1))
        print(report)          # which step and which variable diverge first, if any
    """
    reference = train_keras("default", build_and_compile, x, y, seed=seed,
                            fit_kwargs=fit_kwargs)
    candidate = train_keras(strategy, build_and_compile, x, y, seed=seed,
                            fit_kwargs=fit_kwargs, **strategy_options)
    return compare_runs(reference, candidate, rtol)


def compare_runs(reference: KerasRun, candidate: KerasRun, rtol: float = RTOL,
                 exact: Optional[KerasRun] = None) -> Report:
    """`exact`: the reference's training in float64 from the same initial weights, to
    arbitrate variables on which the float32 reference is itself off (weight_mismatches).
    Variables the reference run announced as not covered are listed, not compared."""
    ref_record = reference.record()
    problems = loss_mismatches(ref_record, candidate.record(), rtol)
    first_step = _first_step(problems)
    first_variable = None
    exact_weights = exact.record().weights if exact is not None else None
    skip = [i for i, path in enumerate(reference.paths) if path in set(reference.not_covered)]
    for replica, weights in candidate.replica_weights.items():
        found = weight_mismatches(ref_record, Record(f"{candidate.label} {replica}",
                                                     candidate.losses, weights), rtol,
                                  exact_weights, skip)
        problems += [f"{replica}: {p}" for p in found]
        if found and first_variable is None:
            first_variable = (first_diverging_variable(reference, candidate, rtol, skip)
                              or _first_variable(found, reference.paths))
    problems += log_mismatches(reference, candidate, rtol)
    error = (max_relative_loss_error(ref_record, candidate.record())
             if len(reference.losses) == len(candidate.losses) and reference.losses else
             float("inf"))
    return Report(candidate.label, problems, first_step, first_variable, error,
                  reference.stochastic_layers, list(reference.not_covered))


def first_diverging_variable(reference: KerasRun, candidate: KerasRun, rtol: float = RTOL,
                             skip: Sequence[int] = ()) -> Optional[str]:
    """The variable whose update differs first: at the first step after which any
    variable is off by more than rtol (and ATOL), the one off the most. None without
    per-step weights in both runs. Final weights cannot tell this: by the end, every
    variable downstream of the first difference differs too, often by more."""
    for ref_weights, got_weights in zip(reference.step_weights, candidate.step_weights):
        errors = [(relative_error(got, ref), index) for index, (ref, got)
                  in enumerate(zip(ref_weights, got_weights))
                  if index not in skip and np.shape(ref) == np.shape(got)
                  and float(np.max(np.abs(np.asarray(got) - ref), initial=0.0)) > ATOL]
        worst = max(errors, default=(0.0, None))
        if worst[0] > rtol:
            return reference.paths[worst[1]]
    return None


def describe_errors(reference: KerasRun, candidate: KerasRun) -> str:
    """The largest per-step relative loss error and per-variable relative weight error
    (over every replica), for test logs and the docs' tables."""
    loss = max_relative_loss_error(reference.record(), candidate.record())
    weight = max(relative_error(g, r) for weights in candidate.replica_weights.values()
                 for r, g in zip(reference.record().weights, weights))
    return f"max loss error {loss:.1e}, max weight error {weight:.1e}"


def _first_step(problems) -> Optional[int]:
    for problem in problems:
        if problem.startswith("step "):
            return int(problem.split(":")[0].split()[1])
    return None


def _first_variable(problems, paths) -> Optional[str]:
    for problem in problems:
        if problem.startswith("weight "):
            index = int(problem.split()[1].rstrip(":"))
            return paths[index] if index < len(paths) else f"weight {index}"
    return None
