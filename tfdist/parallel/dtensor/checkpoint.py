"""Sharded checkpoints that restore onto any mesh (or onto one device).

tf.train.Checkpoint handles DVariables natively: DTensor's SaveV2 writes every
variable under its GLOBAL shape (each device contributes its slice), and
RestoreV2 reads into whatever layout the restoring variable has. So a checkpoint
does not record the mesh: saved with model=2, it restores with model=4, or into
an unsharded single-device model, and the values are the same bit for bit
(tests/test_dtensor.py::test_checkpoint_reshards_on_restore). Object names are
Keras' (model / optimizer attributes), as in every other mode, so tfdist's
Checkpointer (tfdist.train.checkpoint) works unchanged through
Parallelism.checkpoint_objects.
"""

import tensorflow as tf


def save(model, optimizer, prefix: str, **extra) -> str:
    """Writes model + optimizer state (every shard) under `prefix`; returns the path."""
    return tf.train.Checkpoint(model=model, optimizer=optimizer, **extra).save(prefix)


def restore(model, optimizer, path: str, **extra):
    """Reads a checkpoint into (possibly differently sharded) model + optimizer."""
    status = tf.train.Checkpoint(model=model, optimizer=optimizer, **extra).restore(path)
    status.assert_existing_objects_matched()
    return status
