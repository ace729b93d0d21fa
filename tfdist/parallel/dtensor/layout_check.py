"""Refuses, before any step is traced, a layout DTensor cannot run on the model's convolutions.

DTensor (TF 2.21) splits a convolution only along the batch: a split filter fails
with "Filter for convolution must have fully replicated layout", a split channel
with "Conv input's channel dimension must be replicated" or, in the backward pass,
"{0} only supports batch parallel layouts.tf.Conv2DBackpropFilter". And a split
reaches a convolution from layers that are not convolutions, because DTensor
propagates layouts both ways along the data:
- forward: a layer whose variable splits its output features (a normalisation's
  gamma, a Dense kernel split by columns, a bias) splits its output, then every
  elementwise layer, pooling, reshape, residual add... passes the split on;
- backward: a Dense kernel split along its INPUT features (row-parallel, [model,
  unsharded]) makes DTensor split that input, and the split travels back up the
  same way: a convnet that shards only its final Dense this way fails when a
  global pooling, not a Dense, sits between it and the last convolution.
A Dense or EinsumDense with a replicated kernel, an embedding split along its
vocabulary, multi-head attention split by heads and a convolution itself stop
the split; everything else is assumed to pass it on (assumed, not measured, for
a layer tfdist does not know: a refusal, never a TensorFlow error).

So: tensors that must share a split are joined (model_graph.Components), each
group that a split enters and a convolution touches is refused, naming both
layers; so is a split variable of a convolution, and a split inside a layer with
convolutions whose Python call tfdist cannot see (a subclassed block).

Depthwise convolutions (DepthwiseConv1D/2D, SeparableConv1D/2D): DTensor has no
layout rule for the gradients of their filter and input (measured on TF 2.21), so
the train step gives them gradients it can run (rewrites.py) for channels_last
data; channels_first ones are refused whatever the layout.
"""

import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from tfdist.errors import UsageError
from tfdist.parallel.dtensor import model_graph
from tfdist.parallel.dtensor.layout_map import UNSHARDED

RULE = ("DTensor runs convolutions only with replicated filters and channel-replicated "
        "inputs; it can split them only along the batch")
SUPPORTED = ("replicate those variables (leave them out of the layout, or map them to "
             "None), shard the Dense layers instead (a column-parallel Dense followed by a "
             "row-parallel one keeps the split between the two), or use --layout=auto, which "
             "shards only what runs exactly and replicates the rest")
SHOWN = 3  # problems quoted in one message; the count of the others follows


def check(model, specs: Mapping[str, Sequence[str]],
          activation_layouts: Optional[Mapping[str, Sequence]] = None) -> None:
    """UsageError (one paragraph) unless DTensor can run `specs` ({variable path: spec})
    on `model`'s convolutions. `activation_layouts`: keras.distribution's
    `<layer path>/output` keys ({regex: axes}), which split a layer's output."""
    depthwise = depthwise_layers(model)
    if depthwise:
        raise UsageError(_depthwise_message(depthwise))
    problems = find_problems(model, specs, activation_layouts or {})
    if problems:
        raise UsageError(_message(problems))


def keras_activation_layouts() -> Dict[str, Tuple]:
    """The `<layer path>/output` keys ({regex: axes}) of the keras.distribution
    ModelParallel in effect, if any: Keras' Layer.__call__ relayouts a layer's output
    by them (tfdist.keras_distribution runs that on the mesh), so they split
    activations as variables do. Private Keras API: ModelParallel._layout_map (no
    public getter; tfdist.keras_distribution reads it the same way)."""
    import sys
    if "keras" not in sys.modules:
        return {}
    import keras
    distribution = keras.distribution.distribution()
    layout_map = getattr(distribution, "_layout_map", None)
    if layout_map is None:
        return {}
    out = {}
    for key in layout_map:
        if key.endswith("/output"):
            value = layout_map[key]
            out[key] = tuple(getattr(value, "axes", value) or ())
    return out


# ------------------------------------------------------------------------ layer kinds

def conv_classes():
    import keras
    layers = keras.layers
    return (layers.Conv1D, layers.Conv2D, layers.Conv3D, layers.Conv1DTranspose,
            layers.Conv2DTranspose, layers.Conv3DTranspose, layers.DepthwiseConv1D,
            layers.DepthwiseConv2D, layers.SeparableConv1D, layers.SeparableConv2D)


def depthwise_classes():
    import keras
    layers = keras.layers
    return (layers.DepthwiseConv1D, layers.DepthwiseConv2D, layers.SeparableConv1D,
            layers.SeparableConv2D)


def is_conv(layer) -> bool:
    return isinstance(layer, conv_classes())


def depthwise_layers(model) -> List[object]:
    """Depthwise or separable convolutions whose gradients rewrites.py cannot rewrite
    (channels_first): DTensor has no layout rule for the native ones, so they fail
    even fully replicated, and frozen too unless nothing before them trains."""
    return [layer for layer in model_graph.sublayers(model)
            if isinstance(layer, depthwise_classes())
            and getattr(layer, "data_format", "channels_last") != "channels_last"]


def layer_path(layer) -> str:
    return getattr(layer, "path", None) or layer.name


def is_split(spec: Optional[Sequence[str]]) -> bool:
    return bool(spec) and any(axis != UNSHARDED for axis in spec)


def split_variables(layer, specs) -> List[Tuple[object, Tuple[str, ...]]]:
    """(variable, spec) for every split variable of `layer` (its sublayers' included)."""
    return [(v, tuple(specs[v.path])) for v in getattr(layer, "variables", ())  # ops: none
            if is_split(specs.get(v.path))]


def own_split_variables(layer, specs):
    """Like split_variables, for a layer without sublayers, keyed by the short name."""
    return {v.name: spec for v, spec in split_variables(layer, specs)}


# ------------------------------------------------------------------- where a split goes

class Split:
    """Why a group of tensors is split: one sentence about the layer that splits it."""

    def __init__(self, text: str):
        self.text = text


def dense_like_sides(layer, specs) -> Tuple[List[str], List[str]]:
    """(reasons the output is split, reasons the input is split) for a Dense/EinsumDense."""
    import keras
    out, into = [], []
    for name, spec in own_split_variables(layer, specs).items():
        described = f"{layer_path(layer)}/{name} split as {list(spec)}"
        if name != "kernel":         # a bias (or anything else) lies along the output
            out.append(described)
            continue
        if isinstance(layer, keras.layers.EinsumDense):
            contracted, kept = _einsum_kernel_roles(layer)
        else:
            contracted, kept = {0}, {1}
        dims = {d for d, axis in enumerate(spec) if axis != UNSHARDED}
        if dims & kept:
            out.append(described)
        if dims & contracted:
            into.append(described)
        if dims - contracted - kept:
            out.append(described)
            into.append(described)
    return out, into


def _einsum_kernel_roles(layer):
    """Kernel dims summed over (in the input, not the output) and kept (in the output)."""
    equation = layer.equation.replace(" ", "")
    inputs, output = equation.split("->")
    data, kernel = inputs.split(",")
    contracted = {d for d, letter in enumerate(kernel) if letter in data and letter not in output}
    kept = {d for d, letter in enumerate(kernel) if letter in output}
    return contracted, kept


def attention_split_by_heads(layer, specs) -> bool:
    """True when every split variable of a MultiHeadAttention is split along its heads
    only: each shard then runs whole heads, and the output projection sums them."""
    heads_dim = {}
    for sub in (layer.query_dense, layer.key_dense, layer.value_dense,
                getattr(layer, "_gate_dense", None)):
        if sub is not None:
            heads_dim[sub.kernel.path] = 1
            if sub.bias is not None:
                heads_dim[sub.bias.path] = 0
    heads_dim[layer.output_dense.kernel.path] = 0
    for variable, spec in split_variables(layer, specs):
        dims = [d for d, axis in enumerate(spec) if axis != UNSHARDED]
        if variable.path not in heads_dim or dims != [heads_dim[variable.path]]:
            return False
    return True


def embedding_split_by_vocabulary(layer, specs) -> bool:
    return all([d for d, axis in enumerate(spec) if axis != UNSHARDED] == [0]
               for _, spec in split_variables(layer, specs))


# --------------------------------------------------------------------------- the walk

def find_problems(model, specs, activation_layouts) -> List[str]:
    import keras
    problems = [_split_filter(layer, specs) for layer in model_graph.sublayers(model)
                if is_conv(layer) and split_variables(layer, specs)]
    groups = model_graph.Components()
    splits: Dict[int, List[str]] = {}     # group root -> why split
    convs: Dict[int, List[str]] = {}      # group root -> which convolution touches it

    def mark(table, keys, text):
        root = groups.join(keys)
        if root is not None:
            table.setdefault(root, []).append(text)

    marks = []   # (table, keys, text), applied once every join is made
    for graph in model_graph.read(model):
        for call in graph.calls:
            layer = call.layer
            for text in _activation_splits(call, activation_layouts):
                marks.append((splits, call.outputs, text))
            if is_conv(layer):
                marks.append((convs, call.inputs, f"the input of convolution "
                                                  f"{layer_path(layer)!r}"))
                marks.append((convs, call.outputs, f"the output of convolution "
                                                   f"{layer_path(layer)!r}"))
            elif isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
                out, into = dense_like_sides(layer, specs)
                for text in out:
                    marks.append((splits, call.outputs, f"{text} splits its output"))
                for text in into:
                    marks.append((splits, call.inputs,
                                  f"{text} (along its input features) makes DTensor "
                                  f"split its input"))
            elif isinstance(layer, keras.layers.Embedding) and \
                    embedding_split_by_vocabulary(layer, specs):
                pass                     # the lookup's result is whole on every device
            elif isinstance(layer, keras.layers.MultiHeadAttention) and \
                    attention_split_by_heads(layer, specs):
                pass                     # whole heads per shard, summed by the output dense
            else:
                problems += _opaque_problems(call, specs)
                groups.join(call.inputs + call.outputs)   # assumed to pass a split on
                for variable, spec in split_variables(layer, specs):
                    marks.append((splits, call.outputs,
                                  f"{variable.path} split as {list(spec)} splits the "
                                  f"output of {layer_path(layer)!r}"))
                    break
                if call.opaque and any(is_conv(s) for s in model_graph.sublayers(layer)):
                    marks.append((convs, call.inputs + call.outputs,
                                  f"the convolutions inside {layer_path(layer)!r}"))
    for table, keys, text in marks:
        mark(table, keys, text)
    for root in {groups.find(r) for r in splits}:
        why = [t for r, texts in splits.items() if groups.find(r) == root for t in texts]
        where = [t for r, texts in convs.items() if groups.find(r) == root for t in texts]
        if where:
            problems.append(f"{why[0]}, and that split reaches {where[0]}")
    return problems


def _split_filter(layer, specs) -> str:
    variable, spec = split_variables(layer, specs)[0]
    return (f"convolution {layer_path(layer)!r} ({type(layer).__name__}) has {variable.path} "
            f"split as {list(spec)}")


def _opaque_problems(call, specs) -> List[str]:
    """A split inside a subclassed layer that holds convolutions: tfdist cannot tell
    whether the split reaches them, so it is refused."""
    layer = call.layer
    if not call.opaque or not any(is_conv(s) for s in model_graph.sublayers(layer)):
        return []
    inside = [(v, spec) for v, spec in split_variables(layer, specs)
              if not any(v is w for s in model_graph.sublayers(layer) if is_conv(s)
                         for w in s.variables)]     # a conv's own variables: reported above
    if not inside:
        return []
    variable, spec = inside[0]
    return [f"{variable.path} is split as {list(spec)} inside {layer_path(layer)!r} "
            f"({type(layer).__name__}), which holds convolutions and whose Python call "
            f"tfdist cannot see into (build it as a functional model to let tfdist check "
            f"which layers the split reaches)"]


def _activation_splits(call, activation_layouts) -> List[str]:
    """keras.distribution `<layer path>/output` keys that split a layer's output
    beyond its batch dimension."""
    path = f"{layer_path(call.layer)}/output"
    return [f"the activation layout {key!r}: {tuple(axes)} splits the output of "
            f"{layer_path(call.layer)!r}"
            for key, axes in activation_layouts.items()
            if re.fullmatch(key, path) and any(a is not None for a in list(axes)[1:])]


def _message(problems: List[str]) -> str:
    more = len(problems) - SHOWN
    listed = "; ".join(problems[:SHOWN])
    tail = f" (and {more} more like it)" if more > 0 else ""
    return (f"--strategy=dtensor cannot run this layout on the model's convolutions: "
            f"{listed}{tail}. {RULE}. Supported: {SUPPORTED}.")


def _depthwise_message(layers) -> str:
    names = ", ".join(f"{layer_path(l)!r} ({type(l).__name__})" for l in layers[:SHOWN])
    more = f" and {len(layers) - SHOWN} more" if len(layers) > SHOWN else ""
    return (f"--strategy=dtensor cannot train channels_first depthwise convolutions: "
            f"{names}{more}. {RULE}, and for a depthwise (or separable) convolution it has "
            f"no rule at all for the gradients of its filter and input (TensorFlow 2.21); "
            f"tfdist gives it gradients DTensor can run only for channels_last data. Build "
            f"those layers with data_format=\"channels_last\", or train this model with a "
            f"data-parallel mode (--strategy=mirrored or multi_worker_mirrored).")
