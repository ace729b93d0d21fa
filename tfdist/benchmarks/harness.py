"""What several benchmarks share: one built training step and its input, for a config."""

from tfdist import data, parallel as parallel_lib
from tfdist.config import RunConfig
from tfdist.data import pipeline
from tfdist.train import runner


def train_step_and_iterator(config: RunConfig):
    """(step, iterator) as the training loop builds them; step(iterator) runs one step."""
    parallel = parallel_lib.build_parallelism(config)
    parallel.validate_global_batch(config.global_batch_size)
    source = data.get_source(config.data)
    model, optimizer = runner.build_model_and_optimizer(config, parallel, source.info)
    step = parallel.make_train_step(model, optimizer, config.global_batch_size, False)
    dataset_fn = pipeline.train_dataset_fn(source, config.global_batch_size, config.seed,
                                           config.data)
    return step, iter(parallel.distribute(dataset_fn))
