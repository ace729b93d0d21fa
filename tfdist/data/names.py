"""Dataset names: the registry of built-in datasets and the forms a name takes, checked
without importing anything (tfdist.config validates --dataset with it)."""

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
