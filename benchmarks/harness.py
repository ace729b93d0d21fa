"""What several benchmarks share: one built training step and its input, for a config."""

from tfdist import data, parallel as parallel_lib
from tfdist.config import RunConfig
from tfdist.data import pipeline
from tfdist.train import remat, runner


def train_step_and_iterator(config: RunConfig, one_batch: bool = False):
    """(step, iterator) as the training loop builds them; step(iterator) runs one step.

    With `one_batch`, the iterator repeats the first global batch from memory: no
    input pipeline runs beside the steps (its threads allocate on the same device).
    """
    step, iterator, _, _ = train_step_iterator_and_model(config, one_batch)
    return step, iterator


def train_step_iterator_and_model(config: RunConfig, one_batch: bool = False):
    """(step, iterator, the model the step trains, the layers --remat recomputes)."""
    parallel = parallel_lib.build_parallelism(config)
    parallel.validate_global_batch(config.global_batch_size)
    source = data.get_source(config.data)
    model, optimizer = runner.build_model_and_optimizer(config, parallel, source.info)
    recomputed = remat.recomputed_layers(model)
    step = parallel.make_train_step(model, optimizer, config.global_batch_size, False)
    dataset_fn = pipeline.train_dataset_fn(source, config.global_batch_size, config.seed,
                                           config.data)
    if one_batch:
        dataset_fn = _first_batch_repeated(dataset_fn)
    return step, iter(parallel.distribute(dataset_fn)), model, recomputed


def _first_batch_repeated(dataset_fn):
    def first_batch(context):
        return dataset_fn(context).take(1).cache().repeat()
    return first_batch
