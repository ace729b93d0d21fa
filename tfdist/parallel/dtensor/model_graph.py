"""Which layer feeds which, in a built Keras model: what the layout check and layout="auto" read.

A model is read as a list of Calls (one layer or Keras op applied to some tensors,
giving others), with each tensor named by an integer key:
- a functional model (keras.Model(inputs, outputs), keras.applications, keras-hub
  backbones) and a Sequential are read from Keras' own graph of nodes; a nested
  functional model is read in place, its inputs and outputs being the tensors of
  the call that uses it;
- any other layer with sublayers (a subclassed model or block, MultiHeadAttention)
  is OPAQUE: tfdist cannot see in which order its Python `call` uses its
  sublayers, so it is one Call from its inputs to its outputs; functional models
  inside it (a block's `keras.Sequential` feed-forward) are read as separate
  graphs, whose inputs and outputs then connect to nothing tfdist can see.

Private Keras API (Keras 3 has no public graph walk; keras-team/keras#19328 asks
for one): `Function._nodes_by_depth`, `Sequential._functional` and
`Layer._flatten_layers`. tests/test_dtensor_auto_layout.py::
test_keras_graph_api_canary fails if Keras changes them.
"""

import dataclasses
from typing import Dict, Iterable, List, Optional, Tuple


@dataclasses.dataclass
class Call:
    layer: object                 # the keras Layer (or Operation) called
    inputs: Tuple[int, ...]       # tensor keys
    outputs: Tuple[int, ...]
    opaque: bool = False          # a layer with sublayers whose call tfdist cannot see into
    node: object = None           # the Keras Node (its call arguments), when read from a graph


@dataclasses.dataclass
class Graph:
    """The calls of one functional model (or the one opaque call of a non-functional one)."""
    owner: object                 # the model the graph belongs to
    calls: List[Call]
    inputs: Tuple[int, ...]
    outputs: Tuple[int, ...]

    def consumers(self) -> Dict[int, List[Call]]:
        found: Dict[int, List[Call]] = {}
        for call in self.calls:
            for key in call.inputs:
                found.setdefault(key, []).append(call)
        return found


def sublayers(layer) -> List[object]:
    """Every layer below `layer` (not itself), at any depth."""
    return layer._flatten_layers(include_self=False, recursive=True)  # private, see above


def functional_graph_of(model):
    """The keras Function that `model` runs (itself, or a Sequential's), or None when
    `model` is not functional or its class overrides `call` (then the graph is not what runs)."""
    import keras
    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)  # private, see module docstring
    if getattr(model, "_nodes_by_depth", None) is None:
        return None
    from keras.src.models.functional import Functional  # private, see module docstring
    if type(model).call is not Functional.call:
        return None
    return model


def read(model) -> List[Graph]:
    """The model's graphs: its own (or one opaque call), then those found inside opaque layers."""
    reader = _Reader()
    graphs = [reader.top(model)]
    pending = [call.layer for call in graphs[0].calls if call.opaque]
    seen = set()
    while pending:
        layer = pending.pop(0)
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        for inner in _direct_models(layer):
            graph = reader.top(inner)
            graphs.append(graph)
            pending.extend(call.layer for call in graph.calls if call.opaque)
    return graphs


def _direct_models(layer) -> Iterable[object]:
    """Functional models inside an opaque layer, not counting ones nested in those."""
    found = []
    for inner in sublayers(layer):
        if functional_graph_of(inner) is not None and not any(
                inner in sublayers(outer) for outer in found):
            found.append(inner)
    return found


class _Reader:
    """Turns Keras nodes into Calls, giving every KerasTensor one integer key."""

    def __init__(self):
        self.keys: Dict[int, int] = {}      # id(KerasTensor) -> key
        self.next_key = 0

    def new_key(self) -> int:
        self.next_key += 1
        return self.next_key

    def key(self, tensor) -> int:
        if id(tensor) not in self.keys:
            self.keys[id(tensor)] = self.new_key()
        return self.keys[id(tensor)]

    def top(self, model) -> Graph:
        function = functional_graph_of(model)
        if function is None:
            inputs, outputs = (self.new_key(),), (self.new_key(),)
            return Graph(model, [Call(model, inputs, outputs, opaque=True)], inputs, outputs)
        calls: List[Call] = []
        self.expand(function, calls)
        return Graph(model, calls, tuple(self.key(t) for t in function.inputs),
                     tuple(self.key(t) for t in function.outputs))

    def expand(self, function, calls: List[Call]) -> None:
        """Appends the calls of `function` in topological order (inputs first)."""
        import keras
        depths = sorted(function._nodes_by_depth, reverse=True)  # private, see docstring
        for depth in depths:
            for node in function._nodes_by_depth[depth]:
                layer = node.operation
                if isinstance(layer, keras.layers.InputLayer):
                    continue
                inputs = [self.key(t) for t in node.input_tensors]
                outputs = [self.key(t) for t in node.outputs]
                inner = functional_graph_of(layer) if layer is not function else None
                if inner is not None and self.alias(inner, node):
                    self.expand(inner, calls)
                    continue
                opaque = hasattr(layer, "_flatten_layers") and bool(sublayers(layer))
                calls.append(Call(layer, tuple(inputs), tuple(outputs), opaque, node))

    def alias(self, inner, node) -> bool:
        """Makes a nested model's inputs and outputs the keys of the call that uses it;
        False (read it as opaque) when the counts do not line up."""
        outer_in, outer_out = list(node.input_tensors), list(node.outputs)
        if len(outer_in) != len(inner.inputs) or len(outer_out) != len(inner.outputs):
            return False
        for inner_tensor, outer_tensor in zip(list(inner.inputs) + list(inner.outputs),
                                              outer_in + outer_out):
            self.keys[id(inner_tensor)] = self.key(outer_tensor)
        return True


class Components:
    """Union-find over tensor keys: tensors DTensor must give the same split."""

    def __init__(self):
        self.parent: Dict[int, int] = {}

    def find(self, key: int) -> int:
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def join(self, keys: Iterable[int]) -> Optional[int]:
        keys = list(keys)
        if not keys:
            return None
        root = self.find(keys[0])
        for key in keys[1:]:
            other = self.find(key)
            if other != root:
                self.parent[other] = root
        return root


# ------------------------------------------------------------- inside an opaque layer

@dataclasses.dataclass
class Traced:
    """One call of a watched sublayer while an opaque layer's call was traced."""
    layer: object
    input: object                 # the tf.Tensor passed first (None if not a tensor)
    output: object                # the tf.Tensor returned (None if not one tensor)
    ops: frozenset                # names of the graph ops the call created


def trace_sublayer_calls(call: Call, watched) -> Optional[List[Traced]]:
    """Traces `call` (an opaque layer's call in a functional graph) once as a tf.function
    (nothing runs) and records each call of the `watched` sublayers: what Python
    code connects them is then read off TensorFlow's graph (Traced.output.consumers()).

    Each watched sublayer's `call` is wrapped on the instance for the trace only (Keras'
    Operation.__call__ looks `self.call` up on the instance) and restored after.
    None when the call cannot be traced from its Keras node.
    """
    import inspect
    import tensorflow as tf
    if call.node is None:
        return None
    arguments = call.node.arguments
    symbols = list(arguments.keras_tensors)
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in symbols]
    kwargs_extra = {}
    if "training" in inspect.signature(call.layer.call).parameters:
        kwargs_extra["training"] = True   # the mode that trains (Dropout and the like)
    recorded: List[Traced] = []

    def traced_fn(*tensors):
        args, kwargs = arguments.fill_in({id(s): t for s, t in zip(symbols, tensors)})
        kwargs = dict(kwargs, **{k: v for k, v in kwargs_extra.items() if k not in kwargs})
        return call.layer(*args, **kwargs)

    wrapped = []
    try:
        for layer in watched:
            object.__setattr__(layer, "call", _recording(layer, layer.call, recorded))
            wrapped.append(layer)
        tf.function(traced_fn, autograph=False).get_concrete_function(*specs)
    except Exception:  # noqa: BLE001  (a layer tfdist cannot trace alone: read nothing)
        return None
    finally:
        for layer in wrapped:
            object.__delattr__(layer, "call")
    return recorded


def _recording(layer, original, recorded):
    import tensorflow as tf

    def call(*args, **kwargs):
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        output = original(*args, **kwargs)
        created = frozenset(op.name for op in graph.get_operations()[before:])
        first = args[0] if args else None
        recorded.append(Traced(layer, first if tf.is_tensor(first) else None,
                               output if tf.is_tensor(output) else None, created))
        return output

    return call
