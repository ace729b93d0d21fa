"""Keras 3's gradient clipping, as a function of a gradient list.

Why it exists: Keras clips inside `optimizer.apply`, on the gradients that one
optimizer sees. A pipeline stage's optimizer sees only its stage's gradients,
so its `global_clipnorm` would take the norm of one stage; and --strategy=dtensor
updates variables with its own rules (tfdist/parallel/dtensor/update.py). Both
call `clip_like_keras` on the whole model's gradient list instead, then update
with optimizers whose own clipping is off (`unclipped_copy` to build them,
or `clipping_disabled` around the trace).

Exact, not approximate: the same operations as Keras 3.15's
`BaseOptimizer._clip_gradients` on the TensorFlow backend, including how each
treats a tf.IndexedSlices gradient (an embedding's), which is not how it
treats the dense sum of the same slices:
- clipnorm: `tf.clip_by_norm` per gradient (what Keras' TF optimizer calls);
  for IndexedSlices the norm is over the slice values, before duplicate rows
  are summed, and the result stays IndexedSlices.
- clipvalue: `tf.clip_by_value`, slice by slice for IndexedSlices (duplicate
  rows are clipped before they are summed); stays IndexedSlices.
- global_clipnorm: norm from `keras.ops.square` / `keras.ops.sum` (squares each
  slice, then sums), scaled by `gradient * scale`, which turns an IndexedSlices
  into a dense tensor (TF's `*` densifies), as Keras' does.
Under DTensor the gradients are the full logical gradients, so every sum here
is over the whole tensor (DTensor inserts the all-reduce over its shards): the
norm is the global norm.
"""

import contextlib
from typing import Iterable, List, Optional

import keras
import tensorflow as tf

CLIP_OPTIONS = ("clipnorm", "clipvalue", "global_clipnorm")


def clip_like_keras(grads: Iterable, optimizer) -> List[Optional[tf.Tensor]]:
    """`grads` clipped as `optimizer.apply` would clip them; None entries kept in place.

    Reads `optimizer.clipnorm`, `.global_clipnorm` and `.clipvalue` in Keras'
    order of precedence (Keras allows only one of them to be set).
    """
    grads = list(grads)
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        return [None if g is None else tf.clip_by_norm(g, optimizer.clipnorm) for g in grads]
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        return clip_by_global_norm(grads, optimizer.global_clipnorm)
    if optimizer.clipvalue and optimizer.clipvalue > 0:
        limit = optimizer.clipvalue
        return [None if g is None else tf.clip_by_value(g, -limit, limit) for g in grads]
    return grads


def global_norm(grads: Iterable) -> tf.Tensor:
    """sqrt of the sum of every gradient's squared entries (IndexedSlices: squared slices)."""
    squared = [keras.ops.sum(keras.ops.square(g)) for g in grads if g is not None]
    return keras.ops.sqrt(keras.ops.sum(keras.ops.stack(squared)))


def clip_by_global_norm(grads: Iterable, clip_norm: float) -> List[Optional[tf.Tensor]]:
    """Every gradient times min(1, clip_norm / global norm); NaN everywhere if the norm is not finite."""
    grads = list(grads)
    norm = global_norm(grads)
    scale = clip_norm * keras.ops.minimum(1.0 / norm, 1.0 / clip_norm)
    # Adding (norm - norm) is Keras' way to make a non-finite norm poison the scale.
    scale = scale + (norm - norm)
    return [None if g is None else g * scale for g in grads]


def unclipped_copy(optimizer):
    """A new optimizer of the same class and config, its clipping options None.

    For the pipeline's stage optimizers (each built from the user's config):
    they then apply gradients that clip_like_keras has already clipped on the
    global gradient, whenever their step is traced.
    """
    config = optimizer.get_config()
    config.update({name: None for name in CLIP_OPTIONS})
    return type(optimizer).from_config(config)


@contextlib.contextmanager
def clipping_disabled(optimizers: Iterable):
    """Within: the optimizers' clipnorm / clipvalue / global_clipnorm are None (then restored).

    For a caller that has already clipped with `clip_like_keras` and applies
    the clipped gradients with Keras' own `optimizer.apply` (which would clip
    again). Tracing a tf.function inside is enough: Keras reads the options in
    Python, at trace time.
    """
    optimizers = list(optimizers)
    saved = [{name: getattr(o, name) for name in CLIP_OPTIONS} for o in optimizers]
    try:
        for optimizer in optimizers:
            for name in CLIP_OPTIONS:
                setattr(optimizer, name, None)
        yield
    finally:
        for optimizer, options in zip(optimizers, saved):
            for name, value in options.items():
                setattr(optimizer, name, value)
