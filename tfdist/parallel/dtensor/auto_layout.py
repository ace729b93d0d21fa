"""layout="auto" (--layout=auto): an exact tensor-parallel layout for any built Keras model.

The rule is to shard only what provably stays exact and cheap, and replicate the rest:
- Dense / EinsumDense PAIRS in Megatron's column-then-row pattern (Shoeybi et al.
  2019): the first kernel split by its output columns [unsharded, model] with its
  bias, the second by its input rows [model, unsharded], bias replicated. Between
  the two, only elementwise layers (relu, gelu, Activation, Dropout...), each used
  once, so the split activation reaches nothing but the second kernel, whose
  all-reduce makes the pair's output whole again. Read from the model's graph
  (functional models, Sequential, and functional models nested anywhere, such as
  a block's feed-forward `keras.Sequential`), in keras-hub's TransformerEncoder
  and TransformerDecoder, whose call is known, and in any other subclassed layer
  of a functional model by tracing its call once (model_graph.trace_sublayer_calls:
  nothing runs) and reading in TensorFlow's graph that every op reading the first
  Dense's output belongs to the second's call;
- MultiHeadAttention (and keras-hub's CachedMultiHeadAttention): query, key, value
  (and gate) split by heads, the output projection by its head rows: each shard
  computes whole heads, one all-reduce sums them;
- Embedding tables split along the vocabulary [model, unsharded] (a lookup
  then needs one all-reduce), except position tables (their layer's name says
  "pos", or their lookup does not come from the model's inputs): small, and kept
  whole as tfdist's megatron preset does; keras-io's TokenAndPositionEmbedding holds
  its table as `self.pos_emb`, which counts as a name).
Everything else is replicated: convolutions (DTensor splits them only along the
batch, layout_check.py), normalisations, a Dense with no partner, a pair whose
hidden size the model axis does not divide, any pair whose split could leak (an
activation used twice, a model output, a non-elementwise activation such as
softmax between the two). Each choice is logged in one table (variable, layout,
bytes per device before and after) on the "tfdist" logger.
"""

import collections
import dataclasses
import logging
import math
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from tfdist.parallel.dtensor import layout_check, model_graph
from tfdist.parallel.dtensor.layout_map import UNSHARDED, LayoutMap

log = logging.getLogger("tfdist")

MODEL = "model"
U = UNSHARDED
# Keras activations that act on each element alone: a column split passes through them.
ELEMENTWISE = ("linear", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu", "silu",
               "swish", "tanh", "sigmoid", "hard_sigmoid", "hard_silu", "hard_swish",
               "softplus", "softsign", "exponential", "mish", "log_sigmoid", "hard_tanh",
               "sparse_plus", "squareplus", "tanh_shrink", "soft_shrink", "hard_shrink")
# Elementwise activations defined outside keras.activations, by (module, name):
# keras-hub's BERT and GPT-2 blocks use this one (keras.activations.gelu, approximate).
ELEMENTWISE_FUNCTIONS = {("keras_hub.src.utils.keras_utils", "gelu_approximate")}
# Library classes whose call tfdist knows; a user's subclass may override it.
KNOWN_MODULES = ("keras.", "keras_hub.")
KERAS_HUB_BLOCKS = ("TransformerEncoder", "TransformerDecoder")
POSITION_NAME = re.compile(r"pos", re.IGNORECASE)


@dataclasses.dataclass
class Choice:
    """One variable sharded: why, and its spec."""
    path: str
    spec: Tuple[str, ...]
    shape: Tuple[int, ...]
    itemsize: int
    reason: str               # "pair fc_in -> fc_out", "attention heads", "vocabulary"


def layout_map(model, mesh_axes: Mapping[str, int]) -> LayoutMap:
    """The LayoutMap layout="auto" picks for the built `model` on a mesh of `mesh_axes`;
    logs the table of what it sharded. Every variable has its own exact key (so
    --layout_strict holds); the unsharded ones map to None."""
    ways = int(mesh_axes.get(MODEL, 1))
    choices = choose(model, ways) if ways > 1 else []
    log_table(model, choices, mesh_axes)
    chosen = {c.path: c.spec for c in choices}
    return LayoutMap({re.escape(v.path): chosen.get(v.path) for v in model.variables})


def choose(model, ways: int) -> List[Choice]:
    """Every variable to shard over `model` (of size `ways`), in model order."""
    choices: Dict[str, Choice] = {}
    finders = (_graph_pairs, _keras_hub_pairs, _traced_pairs, _attention, _embeddings)
    for finder in finders:
        for group in finder(model, ways):   # a pair, an attention layer, a table
            if not any(c.path in choices for c in group):   # each layer in one group only
                choices.update((c.path, c) for c in group)
    order = {v.path: i for i, v in enumerate(model.variables)}
    return sorted(choices.values(), key=lambda c: order.get(c.path, len(order)))


# ------------------------------------------------------------------------------- pairs

def _graph_pairs(model, ways: int) -> List[List[Choice]]:
    graphs = model_graph.read(model)
    calls_per_layer: Dict[int, int] = {}
    for graph in graphs:
        for call in graph.calls:
            calls_per_layer[id(call.layer)] = calls_per_layer.get(id(call.layer), 0) + 1
    used, out = set(), []
    for graph in graphs:
        consumers = graph.consumers()
        for call in graph.calls:
            if id(call.layer) in used or calls_per_layer[id(call.layer)] != 1:
                continue
            second = _partner(call, graph, consumers, calls_per_layer)
            if second is None or id(second) in used:
                continue
            pair = _pair_choices(call.layer, second, ways)
            if pair:
                used.update((id(call.layer), id(second)))
                out.append(pair)
    return out


def _partner(call, graph, consumers, calls_per_layer):
    """The Dense that alone receives `call`'s output through elementwise layers, or None."""
    if _dense_roles(call.layer) is None or not _elementwise(call.layer):
        return None
    current = call
    while True:
        if len(current.outputs) != 1 or current.outputs[0] in graph.outputs:
            return None
        users = consumers.get(current.outputs[0], [])
        if len(users) != 1 or len(users[0].inputs) != 1:
            return None
        current = users[0]
        if calls_per_layer.get(id(current.layer), 0) != 1:
            return None
        if _dense_roles(current.layer) is not None:
            return current.layer
        if not _passes_split(current.layer):
            return None


def _keras_hub_pairs(model, ways: int) -> List[List[Choice]]:
    """keras-hub's TransformerEncoder / TransformerDecoder: their call runs
    `_feedforward_intermediate_dense` then `_feedforward_output_dense` directly."""
    out = []
    for layer in model_graph.sublayers(model):
        if not _is_keras_hub_block(layer):
            continue
        first = getattr(layer, "_feedforward_intermediate_dense", None)
        second = getattr(layer, "_feedforward_output_dense", None)
        if first is not None and second is not None and _elementwise(first):
            out.append(_pair_choices(first, second, ways))
    return out


def _traced_pairs(model, ways: int) -> List[List[Choice]]:
    """Pairs inside subclassed layers (a user's transformer block calling fc_in then
    fc_out in Python): the layer's call is traced once as a tf.function and TensorFlow's
    graph shows whether the first Dense's output reaches anything but the second."""
    out = []
    for graph in model_graph.read(model):
        for call in graph.calls:
            watched = _traceable(call)
            if not watched:
                continue
            traced = model_graph.trace_sublayer_calls(call, watched) or []
            calls_per_layer = collections.Counter(id(t.layer) for t in traced)
            for first in traced:
                if calls_per_layer[id(first.layer)] != 1 or not _elementwise(first.layer):
                    continue
                second = _traced_partner(first, traced, calls_per_layer)
                if second is not None:
                    out.append(_pair_choices(first.layer, second, ways))
    return out


def _traceable(call) -> List[object]:
    """The Dense-like and elementwise sublayers of an opaque call worth tracing, or []
    (not opaque, known already, holds convolutions, or fewer than two Dense layers)."""
    import keras
    layer = call.layer
    if not call.opaque or call.node is None or _is_keras_hub_block(layer) or \
            isinstance(layer, keras.layers.MultiHeadAttention):
        return []
    inside = model_graph.sublayers(layer)
    if any(layout_check.is_conv(s) for s in inside):
        return []   # the layout check refuses any split inside such a layer
    dense = [s for s in inside if _dense_roles(s) is not None]
    if len(dense) < 2:
        return []
    return dense + [s for s in inside if _passes_split(s)]


def _traced_partner(first, traced, calls_per_layer):
    """The Dense whose call alone consumes `first`'s output (through elementwise
    sublayers), judged on every consumer op in TensorFlow's graph; else None."""
    current = first
    while current.output is not None:
        tensor = current.output
        users = [t for t in traced if t.input is tensor and t is not current]
        if len(users) != 1 or users[0].output is tensor:
            return None
        user = users[0]
        if not {op.name for op in tensor.consumers()} <= user.ops:
            return None   # something else reads it too (a residual, an output)
        if calls_per_layer[id(user.layer)] != 1:
            return None
        if _dense_roles(user.layer) is not None:
            return user.layer
        if not _passes_split(user.layer):
            return None
        current = user
    return None


def _is_keras_hub_block(layer) -> bool:
    cls = type(layer)
    return cls.__module__.startswith("keras_hub.") and cls.__name__ in KERAS_HUB_BLOCKS


def _pair_choices(first, second, ways: int) -> List[Choice]:
    """Column split of `first`, row split of `second`; [] unless both divide by `ways`."""
    first_roles, second_roles = _dense_roles(first), _dense_roles(second)
    if first_roles is None or second_roles is None:
        return []
    _, first_out = first_roles
    second_in, _ = second_roles
    hidden = first.kernel.shape[first_out]
    if hidden % ways or second.kernel.shape[second_in] != hidden:
        return []
    reason = f"pair {_name(first)} -> {_name(second)}"
    out = [_choice(first.kernel, _split_at(len(first.kernel.shape), first_out), reason),
           _choice(second.kernel, _split_at(len(second.kernel.shape), second_in), reason)]
    if first.bias is not None:
        out.append(_choice(first.bias, (MODEL,), reason))
    return out


def _dense_roles(layer) -> Optional[Tuple[int, int]]:
    """(kernel dim of the input features, kernel dim of the output features) of a plain
    Dense, or of an EinsumDense whose equation is a Dense's ("abc,cd->abd"); None for
    anything else (LoRA, quantized, other equations, a user's subclass)."""
    import keras
    cls = type(layer)
    if cls not in (keras.layers.Dense, keras.layers.EinsumDense):
        return None
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return None
    names = sorted(v.name for v in layer.variables)
    if names not in (["kernel"], ["bias", "kernel"]):
        return None
    if cls is keras.layers.Dense:
        return 0, 1
    return _dense_like_equation(layer)


def _dense_like_equation(layer) -> Optional[Tuple[int, int]]:
    equation = layer.equation.replace(" ", "")
    match = re.fullmatch(r"(\.\.\.|[a-z]*)([a-z]),([a-z])([a-z])->(\.\.\.|[a-z]*)([a-z])",
                         equation)
    if not match:
        return None
    batch_in, contracted, k_in, k_out, batch_out, kept = match.groups()
    if contracted != k_in or kept != k_out or batch_in != batch_out or k_in == k_out \
            or k_in in batch_in or k_out in batch_in:
        return None
    bias_axes = getattr(layer, "bias_axes", None)
    if layer.bias is not None and bias_axes != k_out:
        return None
    return 0, 1


def _elementwise(layer) -> bool:
    import keras
    activation = getattr(layer, "activation", None)
    if activation is None:
        return True
    where = (getattr(activation, "__module__", None), getattr(activation, "__name__", None))
    return where in ELEMENTWISE_FUNCTIONS or any(
        activation is getattr(keras.activations, name, object()) for name in ELEMENTWISE)


def _passes_split(layer) -> bool:
    """Layers between a pair's two kernels that act on each element alone."""
    import keras
    layers = keras.layers
    if type(layer) in (layers.ReLU, layers.LeakyReLU, layers.ELU, layers.Dropout):
        return True
    return type(layer) is layers.Activation and _elementwise(layer)


# -------------------------------------------------------------------- attention, tables

def _attention(model, ways: int) -> List[List[Choice]]:
    import keras
    out = []
    for layer in model_graph.sublayers(model):
        if not (isinstance(layer, keras.layers.MultiHeadAttention) and _known(layer)):
            continue
        if layer.num_heads % ways or not layer.built:
            continue
        reason = (f"attention {_name(layer)}: {layer.num_heads // ways} of {layer.num_heads} "
                  f"heads per shard")
        group = []
        for dense in (layer.query_dense, layer.key_dense, layer.value_dense,
                      getattr(layer, "_gate_dense", None)):
            if dense is None:
                continue
            group.append(_choice(dense.kernel, _split_at(len(dense.kernel.shape), 1), reason))
            if dense.bias is not None:
                group.append(_choice(dense.bias, _split_at(len(dense.bias.shape), 0), reason))
        output = layer.output_dense
        group.append(_choice(output.kernel, _split_at(len(output.kernel.shape), 0), reason))
        out.append(group)
    return out


def _embeddings(model, ways: int) -> List[List[Choice]]:
    import keras
    positions = _position_lookups(model) | _position_attributes(model)
    out = []
    for layer in model_graph.sublayers(model):
        if not (isinstance(layer, keras.layers.Embedding) and _known(layer)):
            continue
        table = layer.embeddings
        if id(layer) in positions or POSITION_NAME.search(layer.name) or \
                table.shape[0] % ways or getattr(layer, "quantization_mode", None):
            continue
        out.append([_choice(table, (MODEL, U), f"vocabulary of {_name(layer)}")])
    return out


def _position_lookups(model) -> set:
    """Embeddings in a graph whose indices do not come from the graph's inputs (a
    position table looked up with arange)."""
    import keras
    found = set()
    for graph in model_graph.read(model):
        fed = set(graph.inputs)
        for call in graph.calls:    # topological order
            if any(key in fed for key in call.inputs):
                fed.update(call.outputs)
            elif isinstance(call.layer, keras.layers.Embedding):
                found.add(id(call.layer))
    return found


def _position_attributes(model) -> set:
    """Embeddings a layer holds under an attribute named like a position table
    (keras-io's TokenAndPositionEmbedding: `self.pos_emb = layers.Embedding(maxlen, ...)`)."""
    found = set()
    for layer in model_graph.sublayers(model) + [model]:
        for attribute, value in vars(layer).items():
            if POSITION_NAME.search(attribute) and hasattr(value, "embeddings"):
                found.add(id(value))
    return found


def _known(layer) -> bool:
    return type(layer).__module__.startswith(KNOWN_MODULES)


# ------------------------------------------------------------------------------ helpers

def _split_at(rank: int, dim: int) -> Tuple[str, ...]:
    return tuple(MODEL if d == dim else U for d in range(rank))


def _choice(variable, spec, reason) -> Choice:
    import numpy as np
    return Choice(variable.path, tuple(spec), tuple(int(d) for d in variable.shape),
                  np.dtype(variable.dtype).itemsize, reason)


def _name(layer) -> str:
    return getattr(layer, "path", None) or layer.name


def _bytes(variable) -> int:
    import numpy as np
    return math.prod(int(d) for d in variable.shape) * np.dtype(variable.dtype).itemsize


def log_table(model, choices: Sequence[Choice], mesh_axes: Mapping[str, int]) -> None:
    """The table of what layout="auto" sharded, with each variable's bytes per device."""
    ways = int(mesh_axes.get(MODEL, 1))
    mesh = ",".join(f"{a}={s}" for a, s in mesh_axes.items())
    total = sum(_bytes(v) for v in model.variables)
    saved = sum(math.prod(c.shape) * c.itemsize * (ways - 1) // ways for c in choices)
    lines = [f"layout=auto on mesh {mesh}: {len(choices)} of {len(model.variables)} "
             f"variables sharded over {MODEL!r}; everything else replicated (convolutions, "
             f"norms, position tables, unpaired Dense layers, dimensions {ways} does not divide)."]
    if choices:
        width = max(len(c.path) for c in choices)
        lines.append(f"  {'variable':<{width}}  {'layout':<28} bytes/device before -> after"
                     f"  (why)")
        for c in choices:
            full = math.prod(c.shape) * c.itemsize
            layout = "[" + ", ".join(c.spec) + "]"
            lines.append(f"  {c.path:<{width}}  {layout:<28} {full:>10,} -> {full // ways:<10,}"
                         f"  ({c.reason})")
    lines.append(f"  parameters per device: {total:,} -> {total - saved:,} bytes "
                 f"(optimizer slots follow their parameter)")
    log.info("\n".join(lines))
