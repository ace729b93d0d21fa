"""Dataset registry. `get_source(config)` returns a DatasetSource for a DataConfig.

Names are resolved in this order: 'tfds:NAME' (tensorflow-datasets, by prefix),
'MODULE:FUNCTION' (user code returning (train, test), see tfdist.user_code), then
the registered names. Users' own tf.data Datasets, arrays and dataset_fns enter
through tfdist.data.user (as_dataset_fns, source_from_user_data).
"""

from tfdist.registry import Registry
from tfdist.user_code import is_user_code_spec, split_spec

DATASETS = Registry("dataset", {
    "digits": "tfdist.data.digits:make_source",
    "text": "tfdist.data.text:make_source",
    "synthetic": "tfdist.data.synthetic:make_source",
})
TFDS_PREFIX = "tfds:"


def validate_name(name: str) -> str:
    """Checks a dataset name's form; nothing is imported or read (that is get_source's)."""
    if name.startswith(TFDS_PREFIX) and len(name) > len(TFDS_PREFIX):
        return name
    if is_user_code_spec(name):
        split_spec(name, "--dataset")
        return name
    try:
        return DATASETS.validate(name)
    except Exception as error:
        raise type(error)(f"{error} Any tensorflow-datasets dataset is also "
                          f"available as '{TFDS_PREFIX}NAME' when its data is prepared, "
                          f"and your own as 'MODULE:FUNCTION' (FUNCTION() returns "
                          f"(train, test)).")


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
    from tfdist import user_code
    from tfdist.data import user
    train, test = user_code.load_user_datasets(spec)
    return user.source_from_user_data(train, test, name=spec)


def as_dataset_fns(*args, **kwargs):
    """tfdist.data.user.as_dataset_fns (imported lazily: it needs TensorFlow)."""
    from tfdist.data import user
    return user.as_dataset_fns(*args, **kwargs)
