"""Dataset registry. `get_source(config)` returns a DatasetSource for a DataConfig.

Names are resolved in this order: 'tfds:NAME' (tensorflow-datasets, by prefix),
'MODULE:FUNCTION' (user code returning (train, test), see tfdist.user_code), then
the registered names. Users' own tf.data Datasets, arrays and dataset_fns enter
through tfdist.data.user (as_dataset_fns, source_from_user_data). The names themselves
live in tfdist.data.names.
"""

import dataclasses

from tfdist.data.names import DATASETS, TFDS_PREFIX, validate_name
from tfdist.user_code import is_user_code_spec


def get_source(config):
    """Builds the DatasetSource for a tfdist.config.DataConfig."""
    name = validate_name(config.name)
    if name.startswith(TFDS_PREFIX):
        from tfdist.data import tfds_any
        return tfds_any.make_source(config)
    if is_user_code_spec(name):
        return user_code_source(name)
    return DATASETS.get(name)(config)


def user_code_source(spec: str):
    """The source of --dataset=MODULE:FUNCTION: FUNCTION() returns (train, test)."""
    from tfdist.data import user
    train, test = user.load_user_datasets(spec)
    return user.source_from_user_data(train, test, name=spec)


def as_source(data, data_config):
    """A DatasetSource for a name (registered, tfds:NAME or MODULE:FUNCTION, read with
    data_config's options), or for a source, a tf.data.Dataset or arrays (tfdist.data.user)."""
    from tfdist.data import user
    if isinstance(data, str):
        return get_source(dataclasses.replace(data_config, name=data))
    return user.as_source(data)


def as_dataset_fns(data, global_batch_size: int, seed: int = 0, data_config=None, **kwargs):
    """tfdist.data.user.as_dataset_fns, for a dataset name too (imported lazily: it needs
    TensorFlow)."""
    from tfdist.data import user
    if isinstance(data, str):
        data = as_source(data, data_config or user.default_data_config())
    return user.as_dataset_fns(data, global_batch_size, seed, data_config, **kwargs)
