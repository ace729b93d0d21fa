"""tfdist: distributed training for Keras 3 on TensorFlow, proven equal to one device.

    import tfdist
    results = tfdist.run(tfdist.RunConfig(strategy="mirrored", simulate_devices=2))

Importing tfdist is cheap; TensorFlow is imported when a run starts.
"""

from tfdist.config import DataConfig, ModelConfig, RunConfig
from tfdist.errors import UsageError

__version__ = "0.1.0"


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


__all__ = ["run", "RunConfig", "ModelConfig", "DataConfig", "UsageError", "__version__"]
