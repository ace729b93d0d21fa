"""A keras-hub language model a pipeline can cut, and its data (tests/test_pipeline_keras_hub.py).

A GemmaBackbone (tiny config, random weights, nothing downloaded) with an
UNTIED Dense head, built flat: keras.Model(backbone.input, head(backbone.output)).
Keras 3 then lists the backbone's own operations as the model's (token_embedding,
the `x * sqrt(hidden_dim)` multiply, decoder_block_0.., final_normalization),
plus the head: no nested model, so every decoder block is a layer the pipeline
can give a stage. The padding mask is a model input read by every block, so it
crosses every cut between blocks with the hidden state.

Why untied: keras-hub's CausalLM heads call `token_embedding` a second time
(reverse=True) to share its matrix, and a layer called twice would belong to two
stages, which the pipeline refuses.
"""

import keras
import numpy as np

VOCABULARY, SEQ_LEN, EXAMPLES, GLOBAL_BATCH = 64, 8, 64, 16


def gemma_backbone(num_layers: int = 2, dtype: str = "float32"):
    import keras_hub
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCABULARY, num_layers=num_layers, num_query_heads=2,
        num_key_value_heads=2, hidden_dim=32, intermediate_dim=64, head_dim=16,
        dropout=0, dtype=dtype)


def gemma_lm(num_layers: int = 2, dtype: str = "float32") -> keras.Model:
    """{"token_ids", "padding_mask"} (batch, seq) -> next-token logits (batch, seq, vocab)."""
    backbone = gemma_backbone(num_layers, dtype)
    logits = keras.layers.Dense(VOCABULARY, name="lm_head", dtype=dtype)(backbone.output)
    return keras.Model(backbone.input, logits, name="gemma_lm")


def float64_gemma_lm(num_layers: int = 2) -> keras.Model:
    """gemma_lm in float64 with the float32 model's initial weights: built right after the
    seed is set, the float32 model draws them exactly as gemma_lm() would."""
    initial = gemma_lm(num_layers).get_weights()
    model = gemma_lm(num_layers, "float64")
    model.set_weights([w.astype("float64") for w in initial])
    return model


def compiled_gemma_lm(optimizer: str, num_layers: int = 2, float64: bool = False):
    """A build_and_compile for tfdist.testing.equivalence.train_keras; float64: the same
    training in float64 from the same initial weights (the exact run that arbitrates)."""
    def build():
        model = float64_gemma_lm(num_layers) if float64 else gemma_lm(num_layers)
        model.compile(optimizer=make_optimizer(optimizer),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["sparse_categorical_accuracy"])
        return model
    return build


def make_optimizer(name: str):
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate=0.1)
    if name == "adam":
        return keras.optimizers.Adam(learning_rate=0.01)
    raise ValueError(f"unknown optimizer {name!r}: sgd or adam")


def token_data(n: int = EXAMPLES, seed: int = 0):
    """({"token_ids", "padding_mask"} int32 (n, seq), next-token labels int32 (n, seq)).

    Sequences are right-padded to random lengths (at least 2 real tokens), so the
    mask is not all ones and really changes the attention."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCABULARY, size=(n, SEQ_LEN + 1)).astype("int32")
    lengths = rng.integers(2, SEQ_LEN + 1, size=n)
    mask = (np.arange(SEQ_LEN)[None, :] < lengths[:, None]).astype("int32")
    token_ids = tokens[:, :-1] * mask
    labels = tokens[:, 1:] * mask
    return {"token_ids": token_ids, "padding_mask": mask}, labels
