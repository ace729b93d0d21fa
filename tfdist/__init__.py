"""tfdist: distributed training for Keras 3 on TensorFlow, proven equal to one device.

Your own Keras model (tfdist.api):

    import tfdist
    strategy = tfdist.Strategy("mirrored", simulate_devices=2)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    strategy.fit(model, x, y, batch_size=64, epochs=3)

A registry model from a config (what `python -m experiments.train` runs):

    results = tfdist.run(tfdist.RunConfig(strategy="mirrored", simulate_devices=2))

Importing tfdist is cheap; TensorFlow is imported when a run starts. Imported before
Keras, tfdist defers the Keras modules training never uses (tfdist.lazy_keras) and filters
TensorFlow's C++ start-up lines out of stderr (tfdist.quiet; TFDIST_TF_LOGS=1 shows them).
"""

from tfdist import lazy_keras, quiet

lazy_keras.defer_unused_keras_modules()
quiet.filter_tensorflow_startup()

from tfdist.config import DataConfig, ModelConfig, RunConfig
from tfdist.errors import UsageError
from tfdist.api import Strategy

__version__ = "0.1.0"


def enable_keras_distribution(**options):
    """Makes keras.distribution (DataParallel, ModelParallel, LayoutMap, ...) work on the
    TensorFlow backend; options (simulate_devices=N) and the rest: tfdist.keras_distribution."""
    from tfdist import keras_distribution
    return keras_distribution.enable(**options)


def run(config: RunConfig, **kwargs):
    """Trains according to `config`; see tfdist.train.runner.run.

    Before TensorFlow is imported: a one-process mode under a multi-worker cluster
    is refused, and the process that writes --model_dir locks it."""
    from tfdist import parallel
    from tfdist.train import model_dir_lock
    parallel.spanned_cluster(config.strategy)
    with model_dir_lock.hold_for(config):
        from tfdist.train import runner
        return runner.run(config, **kwargs)


__all__ = ["Strategy", "enable_keras_distribution", "run", "RunConfig", "ModelConfig", "DataConfig", "UsageError", "__version__"]
