"""Keras modules that training never uses are loaded when first used, not at `import keras`.

Why: Keras 3.15 imports scikit-learn (for keras.wrappers' SKLearnClassifier, which
subclasses sklearn's BaseEstimator at import, pulling in scipy.stats) and
matplotlib.pyplot (for keras.visualization's plot functions) whenever Keras is imported,
and TensorFlow imports Keras. Measured here, `import tfdist, tensorflow, keras` takes 3.59 s of CPU
with them deferred against 5.23 s without (`python -m benchmarks.import_time`),
paid by every worker of every launch and every restart. No upstream issue asks for
these imports to be lazy (searched keras-team/keras, 2026-12).

How: a finder at the front of sys.meta_path (tfdist.import_hooks) finds these modules' specs
with the other finders and wraps their loaders in importlib.util.LazyLoader, so `from keras import
wrappers` binds a module whose code runs on its first attribute access. Nothing else
changes: `keras.wrappers.SKLearnClassifier`, `tf.keras.visualization` and
`from keras.wrappers import SKLearnRegressor` work as before, a moment later. One limit:
before Python 3.12.3 LazyLoader is not thread-safe (cpython gh-114763), so two threads
touching keras.wrappers or keras.visualization for the first time at once may race;
training touches neither, and TFDIST_EAGER_KERAS_IMPORTS=1 avoids it.

Installed by `import tfdist` when Keras is not imported yet (afterwards it could no
longer change anything); TFDIST_EAGER_KERAS_IMPORTS=1 turns it off. The canary
tests/test_upstream_canaries.py::test_keras_still_imports_sklearn_and_pyplot_eagerly fails
when Keras stops importing them eagerly (then this module can go) or when the deferral
stops working.
"""

import importlib.util
import os
import sys

from tfdist import import_hooks

OPT_OUT = "TFDIST_EAGER_KERAS_IMPORTS"
PURPOSE = "load the Keras modules training never uses on first use"
# Keras' public module and its tf.keras alias for each; keras.src.visualization because
# keras.src's own __init__ imports it. Keras and TensorFlow import none of them for training.
DEFERRED = frozenset({
    "keras.wrappers", "keras._tf_keras.keras.wrappers",
    "keras.visualization", "keras._tf_keras.keras.visualization", "keras.src.visualization",
})


def defer_unused_keras_modules() -> bool:
    """Installs the finder once; True if it is installed (Keras not yet imported, no opt-out)."""
    if import_hooks.installed(PURPOSE):
        return True
    if os.environ.get(OPT_OUT) == "1" or "keras" in sys.modules:
        return False
    import_hooks.install(PURPOSE, DEFERRED, importlib.util.LazyLoader)
    return True
