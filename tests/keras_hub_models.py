"""keras-hub backbones as tfdist registry models, for tests/test_dtensor_keras_hub.py.

A third-party model not written here: a keras-hub backbone built from a tiny
config with random weights (nothing downloaded), with a language-model head
through the backbone's own tied embedding (`token_embedding(h, reverse=True)`,
as keras-hub's CausalLM models do), so (batch, seq) int32 token ids -> logits
(batch, seq, vocab) that tfdist's sparse cross-entropy from logits trains on
next-token labels (the `text` dataset: 256 byte values).

The sizes come from tfdist's ModelConfig (d_model, num_heads, d_ff, num_layers)
so one RunConfig describes the run. Dropout is 0: the equivalence guarantee
does not cover stochastic layers.

Today this goes through the registry (tfdist.models.MODELS) and tfdist.run;
when the public API (tfdist/api.py) lands, `build_lm` is the user's model.
"""

import keras

from tfdist import models

BACKBONES = {"gemma": "GemmaBackbone", "llama": "LlamaBackbone"}
REGISTERED = {kind: f"keras_hub_{kind}" for kind in BACKBONES}


def backbone_class(kind: str):
    import keras_hub
    return getattr(keras_hub.models, BACKBONES[kind])


def build_backbone(kind: str, vocabulary_size: int, config):
    """A tiny backbone: every head count divides model=2, the hidden size batch=2."""
    common = dict(vocabulary_size=vocabulary_size, num_layers=config.num_layers,
                  num_query_heads=config.num_heads, num_key_value_heads=config.num_heads,
                  hidden_dim=config.d_model, intermediate_dim=config.d_ff, dtype="float32")
    if kind == "gemma":
        return backbone_class(kind)(head_dim=config.d_model // config.num_heads, dropout=0,
                                    **common)
    return backbone_class(kind)(dropout=0, **common)


def build_lm(kind: str, info, config) -> keras.Model:
    """Token ids (batch, seq_len) -> logits through the backbone's tied embedding."""
    backbone = build_backbone(kind, info.num_classes, config)
    token_ids = keras.Input(info.input_shape, dtype="int32", name="token_ids")
    hidden = backbone({"token_ids": token_ids,
                       "padding_mask": keras.ops.ones_like(token_ids)})
    logits = backbone.token_embedding(hidden, reverse=True)
    return keras.Model(token_ids, logits, name=f"{kind}_lm")


def register() -> None:
    """Registers keras_hub_gemma and keras_hub_llama in tfdist.models.MODELS (once)."""
    for kind, name in REGISTERED.items():
        if name not in models.MODELS:
            models.MODELS.register(name, lambda info, config, kind=kind: build_lm(kind, info,
                                                                                 config))


# Zero-argument builders, for `--model=MODULE:FUNCTION` (FUNCTION() returns an uncompiled
# Keras model) and the public API: the `text` dataset's vocabulary, --seq_len=16, and
# the tests' sizes.
TEXT_VOCABULARY, TEXT_SEQ_LEN = 256, 16


def _text_info():
    import types
    return types.SimpleNamespace(num_classes=TEXT_VOCABULARY, input_shape=(TEXT_SEQ_LEN,))


def _tiny_config():
    import types
    return types.SimpleNamespace(num_layers=2, d_model=32, num_heads=2, d_ff=64)


def gemma_lm() -> keras.Model:
    return build_lm("gemma", _text_info(), _tiny_config())


def llama_lm() -> keras.Model:
    return build_lm("llama", _text_info(), _tiny_config())
