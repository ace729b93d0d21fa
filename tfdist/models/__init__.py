"""Keras 3 model registry. Every builder returns a built model that outputs logits."""

from tfdist.registry import Registry

MODELS = Registry("model", {
    "mlp": "tfdist.models.mlp:build",
    "cnn": "tfdist.models.cnn:build",
    "resnet": "tfdist.models.resnet:build",
    "transformer": "tfdist.models.transformer:build",
})


def build_model(info, config):
    """Builds model `config.name` for a dataset's DatasetInfo and a ModelConfig."""
    return MODELS.get(config.name)(info, config)
