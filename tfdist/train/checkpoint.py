"""Checkpoints that resume exactly, survive torn saves, and refuse the wrong run.

What a checkpoint holds: the model and optimizer state (through the mode's
`checkpoint_objects`) and the step. That is the whole training state: the input
order is a pure function of (seed, step) (tfdist.data.pipeline), so the step is
the input pipeline's position, and no random numbers are drawn while training
(no dropout), so there is no RNG state to carry.

Atomic saves: each save writes `ckpt-STEP` with tf.train.Checkpoint.write, and
only then replaces the pointer file `checkpoints.json` (write to a temporary
file, fsync, os.replace). A crash before the replace leaves the pointer naming
the previous, complete checkpoints. On restore the newest listed checkpoint that
loads is used; one that does not (torn or corrupt files) is reported by name and
the one before it is tried. If every listed checkpoint fails, that is an error:
starting from scratch silently would lose the last good state.

`run.json` beside the checkpoints fingerprints the run (model, optimizer,
dataset, batch, seed, variable shapes); resuming with another one is
refused with the first mismatch named.
"""

import dataclasses
import json
import logging
import os
import shutil
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from tfdist.errors import UsageError

log = logging.getLogger("tfdist")
POINTER = "checkpoints.json"
FINGERPRINT = "run.json"
FAILPOINT_ENV = "TFDIST_FAILPOINT"  # tests: "crash_before_commit:STEP" dies mid-save


def fingerprint(config, model) -> Dict:
    """What must be equal for a checkpoint to continue this run exactly (JSON types)."""
    return json.loads(json.dumps({
        "model": dataclasses.asdict(config.model),
        "dataset": config.data.name,
        "optimizer": config.optimizer,
        "global_batch_size": config.global_batch_size,
        "seed": config.seed,
        # No mesh, layout or --zero_stage: DTensor writes every variable under its global
        # shape and restores it into whatever layout the restoring variable has
        # (parallel/dtensor/checkpoint.py), so a run resumes on another mesh or stage.
        # A pipeline checkpoint holds replica 0's model and optimizer state by variable
        # path, so it restores onto any stage or replica count (pipeline/checkpoint.py).
        "pipeline": None,
        "variables": [[v.path, list(v.shape)] for v in model.variables],
    }))


def first_mismatch(saved: Dict, current: Dict) -> Optional[str]:
    for key in current:
        if saved.get(key) != current[key]:
            if key == "variables":
                return _variable_mismatch(saved.get(key) or [], current[key])
            return f"{key}: checkpoint has {saved.get(key)!r}, this run has {current[key]!r}"
    return None


def _variable_mismatch(saved: List, current: List) -> str:
    for (saved_path, saved_shape), (path, shape) in zip(saved, current):
        if (saved_path, saved_shape) != (path, shape):
            return f"variable {path} {shape}: checkpoint has {saved_path} {saved_shape}"
    return f"variable count: checkpoint has {len(saved)}, this run has {len(current)}"


def _atomic_write_json(path: str, value) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def failpoint(name: str, step: int) -> None:
    """Fault injection for tests: dies at NAME:STEP on a launch's first attempt only
    (TFDIST_RESTART_COUNT unset or 0), so a restarted group gets past it."""
    if (os.environ.get(FAILPOINT_ENV) == f"{name}:{step}"
            and os.environ.get("TFDIST_RESTART_COUNT", "0") == "0"):
        os._exit(9)  # as abrupt as SIGKILL: no cleanup, no flush


class Checkpointer:
    """Saves every `every` steps into `directory`, keeping the last `keep`.

    `read_dir` is where restores come from (the chief's directory, for every
    worker); `write_dir` is where this process writes (a scratch directory on
    non-chief workers, removed after each save: TF's multi-worker pattern, where
    every worker must take part in a save but only the chief's copy is kept).
    """

    def __init__(self, objects: Dict, read_dir: str, write_dir: str, keep: int,
                 run_fingerprint: Dict):
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfdist_step")
        self.checkpoint = tf.train.Checkpoint(tfdist_step=self.step, **objects)
        self.read_dir, self.write_dir, self.keep = read_dir, write_dir, keep
        self.run_fingerprint = run_fingerprint

    def _listed(self, directory: str) -> List[str]:
        path = os.path.join(directory, POINTER)
        if not os.path.exists(path):
            return []
        try:
            with open(path) as f:
                return json.load(f)["checkpoints"]
        except (OSError, ValueError, KeyError) as error:
            raise UsageError(f"{path} is unreadable ({error}); it lists the checkpoints of "
                             f"this run. Restore it from a backup, or use a new --model_dir.") \
                from None

    def check_fingerprint(self) -> None:
        path = os.path.join(self.read_dir, FINGERPRINT)
        if not os.path.exists(path):
            return
        with open(path) as f:
            saved = json.load(f)
        mismatch = first_mismatch(saved, self.run_fingerprint)
        if mismatch:
            raise UsageError(f"--model_dir {self.read_dir} holds checkpoints of another run "
                             f"({mismatch}). Use a new --model_dir, or the original settings.")

    def restore(self) -> int:
        """Loads the newest good checkpoint; returns its step (0: none, a fresh run)."""
        self.check_fingerprint()
        listed = self._listed(self.read_dir)
        for name in reversed(listed):
            try:
                self.checkpoint.read(os.path.join(self.read_dir, name)).assert_consumed()
            # A torn or garbled file fails in many ways (seen: IndexError "Read less
            # bytes than requested", DataLossError, ValueError); the previous
            # checkpoint then overwrites every variable, so nothing half-read remains.
            except (tf.errors.OpError, ValueError, AssertionError, IndexError, OSError,
                    RuntimeError) as error:
                log.warning("checkpoint %s is unusable (%s); trying the one before it",
                            os.path.join(self.read_dir, name), str(error).splitlines()[0][:200])
                continue
            log.info("resumed from %s at step %d", os.path.join(self.read_dir, name),
                     int(self.step))
            return int(self.step)
        if listed:
            raise UsageError(f"none of the checkpoints in {self.read_dir} ({', '.join(listed)}) "
                             f"can be loaded. Refusing to start over and lose them: move them "
                             f"away or use a new --model_dir to train from scratch.")
        return 0

    def save(self, step: int) -> None:
        self.step.assign(np.int64(step))   # not a Python int: loop.write_scalars says why
        os.makedirs(self.write_dir, exist_ok=True)
        name = f"ckpt-{step}"
        self.checkpoint.write(os.path.join(self.write_dir, name))
        failpoint("crash_before_commit", step)
        if self.write_dir != self.read_dir:  # a non-chief worker's copy is not kept
            shutil.rmtree(self.write_dir, ignore_errors=True)
            return
        self._commit(name)

    def _commit(self, name: str) -> None:
        listed = [n for n in self._listed(self.write_dir) if n != name] + [name]
        keep, drop = listed[-self.keep:], listed[:-self.keep]
        fingerprint_path = os.path.join(self.write_dir, FINGERPRINT)
        if not os.path.exists(fingerprint_path):
            _atomic_write_json(fingerprint_path, self.run_fingerprint)
        _atomic_write_json(os.path.join(self.write_dir, POINTER), {"checkpoints": keep})
        for old in drop:  # only after the pointer no longer names them
            for path in tf.io.gfile.glob(os.path.join(self.write_dir, old + ".*")):
                tf.io.gfile.remove(path)
