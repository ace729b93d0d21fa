"""Dataset registry. `get_source(config)` returns a DatasetSource for a DataConfig.

`tfds:NAME` is resolved by prefix; every other name must be registered here.
"""

from tfdist.registry import Registry

DATASETS = Registry("dataset", {
    "digits": "tfdist.data.digits:make_source",
    "text": "tfdist.data.text:make_source",
    "synthetic": "tfdist.data.synthetic:make_source",
})
TFDS_PREFIX = "tfds:"


def validate_name(name: str) -> str:
    if name.startswith(TFDS_PREFIX) and len(name) > len(TFDS_PREFIX):
        return name
    try:
        return DATASETS.validate(name)
    except Exception as error:
        raise type(error)(f"{error} Any tensorflow-datasets dataset is also "
                          f"available as '{TFDS_PREFIX}NAME' when its data is prepared.")


def get_source(config):
    """Builds the DatasetSource for a tfdist.config.DataConfig."""
    name = validate_name(config.name)
    if name.startswith(TFDS_PREFIX):
        from tfdist.data import tfds_any
        return tfds_any.make_source(config)
    return DATASETS.get(name)(config)
