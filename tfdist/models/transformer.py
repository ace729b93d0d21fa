"""Decoder-only (GPT-style, pre-LayerNorm) character language model.

Input: (batch, seq_len) int32 tokens. Output: (batch, seq_len, vocab) float32
next-token logits, position t seeing only tokens 0..t (causal mask).

Variable paths (`[v.path for v in model.variables]`), in creation order; the
tensor-parallel presets match these by regex, so they are a stable interface:

    embedding/embeddings                    (vocab, d_model)
    position_embedding/embeddings           (seq_len, d_model)
    block_{i}/attention_norm/gamma, /beta   (d_model,)
    block_{i}/query/kernel, /bias           (d_model, d_model), (d_model,)
    block_{i}/key/kernel                    same, no bias (softmax cancels it)
    block_{i}/value/kernel, /bias           same
    block_{i}/attention_output/kernel, /bias (d_model, d_model), (d_model,)
    block_{i}/mlp_norm/gamma, /beta         (d_model,)
    block_{i}/mlp_fc_in/kernel, /bias       (d_model, d_ff), (d_ff,)
    block_{i}/mlp_fc_out/kernel, /bias      (d_ff, d_model), (d_model,)
    final_norm/gamma, final_norm/beta       (d_model,)
    lm_head/kernel, lm_head/bias            (d_model, vocab), (vocab,)

for i in 0..num_layers-1. Query/key/value outputs lay heads out contiguously:
head h owns output columns [h * head_dim, (h + 1) * head_dim), so splitting
their kernels' output dimension into n equal shards (n dividing num_heads) gives
each shard whole heads, and `attention_output` is then split on its input dim.

Attention is written out here rather than with keras.layers.MultiHeadAttention
so that these names and layouts are ours to keep. Softmax runs in float32 under
mixed precision; the logits are cast to float32 by a variable-free final layer.
"""

import math

import keras
from keras import ops

from tfdist.data.base import LANGUAGE_MODEL
from tfdist.errors import require
from tfdist.models import common

NAME = "transformer"
LAYER_NORM_EPSILON = 1e-5
EMBEDDING_STDDEV = 0.02  # GPT-2's initialisation for token and position tables
MASKED_SCORE = -1e9      # exp() of this underflows to exactly 0 in float32


def build(info, config) -> keras.Model:
    """Returns a built transformer LM mapping (N, seq_len) tokens to float32 logits."""
    _validate(info)
    seq_len, vocab_size = info.input_shape[0], info.num_classes
    tokens = keras.Input(info.input_shape, dtype=info.input_dtype, name="tokens")
    x = keras.layers.Embedding(
        vocab_size, config.d_model, name="embedding",
        embeddings_initializer=keras.initializers.RandomNormal(stddev=EMBEDDING_STDDEV))(tokens)
    x = PositionEmbedding(seq_len, name="position_embedding")(x)
    for index in range(config.num_layers):
        x = TransformerBlock(config.d_model, config.num_heads, config.d_ff,
                             name=f"block_{index}")(x)
    x = keras.layers.LayerNormalization(epsilon=LAYER_NORM_EPSILON, name="final_norm")(x)
    x = keras.layers.Dense(vocab_size, name="lm_head")(x)
    # A linear float32 layer casts the logits up, so the loss never sees bf16/fp16.
    logits = common.float32_logits(x)
    return keras.Model(tokens, logits, name=NAME)


@keras.saving.register_keras_serializable(package="tfdist")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned (sequence_length, d_model) table to its (N, T, d_model) input."""

    def __init__(self, sequence_length: int, **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = sequence_length
        self.initializer = keras.initializers.RandomNormal(stddev=EMBEDDING_STDDEV)

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=(self.sequence_length, input_shape[-1]), name="embeddings",
            initializer=self.initializer)

    def call(self, x):
        # Shorter inputs (e.g. generation prompts) use the first T positions.
        table = self.embeddings[: ops.shape(x)[1]]
        return x + ops.cast(table, x.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "sequence_length": self.sequence_length}


@keras.saving.register_keras_serializable(package="tfdist")
class TransformerBlock(keras.layers.Layer):
    """x + attention(norm(x)), then x + mlp(norm(x)); see the module docstring for names."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, **kwargs):
        super().__init__(**kwargs)
        self.d_model, self.num_heads, self.d_ff = d_model, num_heads, d_ff
        self.head_dim = d_model // num_heads
        # Constructed in path order: each initialiser draws its seed from the
        # seeded global RNG now, so the weights follow from the seed alone.
        self.attention_norm = keras.layers.LayerNormalization(
            epsilon=LAYER_NORM_EPSILON, name="attention_norm")
        self.query = keras.layers.Dense(d_model, name="query")
        # No key bias: q.(k + b) adds the same q.b to every key of a query, which
        # softmax ignores, so its gradient is exactly zero and its value would be
        # rounding noise (Adam amplifies it) that no two summation orders agree on.
        self.key = keras.layers.Dense(d_model, use_bias=False, name="key")
        self.value = keras.layers.Dense(d_model, name="value")
        self.attention_output = keras.layers.Dense(d_model, name="attention_output")
        self.mlp_norm = keras.layers.LayerNormalization(
            epsilon=LAYER_NORM_EPSILON, name="mlp_norm")
        self.mlp_fc_in = keras.layers.Dense(d_ff, activation="gelu", name="mlp_fc_in")
        self.mlp_fc_out = keras.layers.Dense(d_model, name="mlp_fc_out")

    def build(self, input_shape):
        # Building sublayers here, inside this layer's name scope, makes their
        # paths `block_{i}/<name>/...` and fixes the variable creation order.
        hidden_shape = tuple(input_shape[:-1]) + (self.d_ff,)
        for layer in (self.attention_norm, self.query, self.key, self.value,
                      self.attention_output, self.mlp_norm, self.mlp_fc_in):
            layer.build(input_shape)
        self.mlp_fc_out.build(hidden_shape)

    def call(self, x):
        x = x + self.attention_output(self._attend(self.attention_norm(x)))
        return x + self.mlp_fc_out(self.mlp_fc_in(self.mlp_norm(x)))

    def _attend(self, x):
        """Causal multi-head attention; returns the merged heads before the output Dense."""
        length = ops.shape(x)[1]
        query = self._split_heads(self.query(x)) * (1.0 / math.sqrt(self.head_dim))
        key = self._split_heads(self.key(x))
        value = self._split_heads(self.value(x))
        scores = ops.cast(ops.matmul(query, ops.swapaxes(key, -1, -2)), "float32")
        positions = ops.arange(length)
        causal = positions[:, None] >= positions[None, :]      # (T, T): key <= query
        scores = ops.where(causal, scores, MASKED_SCORE)
        weights = ops.cast(ops.softmax(scores, axis=-1), value.dtype)
        context = ops.matmul(weights, value)                   # (N, heads, T, head_dim)
        return ops.reshape(ops.transpose(context, (0, 2, 1, 3)), (-1, length, self.d_model))

    def _split_heads(self, x):
        """(N, T, d_model) -> (N, heads, T, head_dim); head h is columns h*head_dim.."""
        x = ops.reshape(x, (-1, ops.shape(x)[1], self.num_heads, self.head_dim))
        return ops.transpose(x, (0, 2, 1, 3))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "d_model": self.d_model,
                "num_heads": self.num_heads, "d_ff": self.d_ff}


def _validate(info) -> None:
    require(info.task == LANGUAGE_MODEL,
            f"Model '{NAME}' needs a language_model dataset (e.g. text), but dataset "
            f"'{info.name}' is a {info.task} dataset. For classification use model "
            f"'mlp', 'cnn' or 'resnet'.")
    require(len(info.input_shape) == 1,
            f"Model '{NAME}' needs token sequences shaped (seq_len,), but dataset "
            f"'{info.name}' has examples shaped {tuple(info.input_shape)}.")
    require(keras.backend.is_int_dtype(info.input_dtype),
            f"Model '{NAME}' needs integer token ids, but dataset '{info.name}' "
            f"provides {info.input_dtype}.")
