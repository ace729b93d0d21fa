"""Cutting a built Keras model into S pipeline stages.

A model is a list of operations in topological order (a functional model's
`model.operations`, input layers dropped, so that keras.ops calls such as
keras-hub's `x * sqrt(hidden_dim)` belong to a stage too; a Sequential's
layers). A *cut* before operation i sends, from stage to stage, every tensor
that crosses it: produced by the model inputs or operations [0, i) and consumed
by operations [i, L) or a model output. Because the order is topological, every
consumed tensor was produced before its consumer, so any cut is valid as long as

- the stages before it compute something that crosses it (not only model inputs), and
- at most MAX_BOUNDARY_TENSORS tensors cross it.

A stage is then a sub-model from the tuple of tensors crossing the cut before it
to the tuple crossing the cut after it (a single tensor when one crosses, as in a
chain of layers). Model inputs that later layers read (a keras-hub backbone's
padding mask, read by every decoder block) travel along the stages as boundary
tensors. Forward, every boundary tensor is sent; backward, the gradient of each
float tensor computed by a layer (integer and boolean tensors, and model inputs,
have none to send).

Why the cap (our choice): each crossing tensor is one more send per micro-batch
forward, and one more backward if it is float. A cut that many tensors cross is
usually a cut through the middle of a wide block (a U-Net's skips, a DenseNet
block), where a nearby cut between blocks is far cheaper; four covers a hidden
state plus a mask plus a couple of skips.

Automatic balancing (no --pipeline_split) is more careful: it only cuts where ONE
computed tensor crosses, with any number of model inputs riding along (the
padding mask). Those are the cuts between blocks. A cut inside a residual block
sends the skip and the branch, twice the traffic of the cut after the block, and
the cost model below cannot weigh that against the parameters it balances; so
such a cut is made only where the user names it in --pipeline_split.

Cost model (our choice): a layer costs its number of parameters (trainable and
non-trainable elements). That is exactly what placement divides among devices
(parameters, and optimizer slots in proportion), it needs no input shape, and
for the dense layers of an MLP or transformer it is proportional to FLOPs per
token. It undercounts convolutions (whose weights are reused at every spatial
position) and attention scores, and ignores what the boundary tensors cost to
send; give --pipeline_split for those models if the automatic split is
lopsided. With no split given, cuts are chosen among the valid ones to minimise
the most expensive stage (ties: the earliest cuts).
"""

import dataclasses
from typing import List, Optional, Sequence, Tuple

import keras

from tfdist.errors import require
from tfdist.parallel.pipeline_balance import balanced_cuts

MAX_BOUNDARY_TENSORS = 4   # tensors a cut may send per micro-batch (see the module doc)


@dataclasses.dataclass(frozen=True)
class BoundaryTensor:
    """One tensor crossing a cut, named so that it can be found again in a clone."""
    producer: Optional[str]  # name of the operation producing it; None: a model input
    index: int               # its position in flatten(producer.output), or in model.inputs
    name: str                # the tensor's name, for messages
    differentiable: bool     # float and computed by a layer: its gradient is sent back

    def describe(self) -> str:
        return f"{self.name} ({self.producer or 'model input'})"


@dataclasses.dataclass(frozen=True)
class Stage:
    index: int
    layers: Tuple[str, ...]
    params: int
    cost: int
    output_layer: Optional[str]  # producer of the first tensor it sends; None: last stage
    boundary: Tuple[BoundaryTensor, ...] = ()  # what it sends to the next stage, in order


@dataclasses.dataclass(frozen=True)
class Partition:
    stages: Tuple[Stage, ...]
    cost_model: str = "parameters"

    @property
    def imbalance(self) -> float:
        """max stage cost / mean stage cost: 1.0 is perfectly balanced."""
        costs = [stage.cost for stage in self.stages]
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean else 1.0

    def describe(self) -> str:
        lines = [f"pipeline partition: {len(self.stages)} stages, cost = {self.cost_model}, "
                 f"imbalance (max/mean cost) {self.imbalance:.2f}"]
        for stage in self.stages:
            sends = (f"; sends {', '.join(t.describe() for t in stage.boundary)}"
                     if len(stage.boundary) > 1 else "")
            lines.append(f"  stage {stage.index}: {stage.params} params, cost {stage.cost}, "
                         f"layers {', '.join(stage.layers)}{sends}")
        return "\n".join(lines)


def refuse_uncuttable(model) -> None:
    """A pipeline cuts a model's graph of layers; a subclassed model's `call` is Python
    code with no graph to cut. Say how to make it pipeline-able, before any trace."""
    # Keras exports no class for functional models (keras.Model(inputs, outputs) returns a
    # keras.src Functional; Sequential builds one inside): canary in test_upstream_canaries.py.
    graph_model = isinstance(model, (keras.Sequential, keras.src.models.functional.Functional))
    require(graph_model,
            f"Model '{model.name}' ({type(model).__name__}) is a subclassed Keras model: "
            f"its call() is Python code, with no graph of layers that --strategy=pipeline "
            f"could cut into stages. Build it as a functional model (keras.Model(inputs, "
            f"outputs)) or a keras.Sequential, then name the layers that start stages 2..S "
            f"with --pipeline_split (or pipeline_split=[...]), or train it with mirrored, "
            f"multi_worker_mirrored or dtensor.")


def chain_layers(model) -> List:
    """The model's operations in topological order, without input layers.

    A functional model's `operations` (public in Keras 3) also hold the keras.ops
    calls made on symbolic tensors (a `Multiply` for `x * 2`), which `layers` omits;
    each must run in some stage. A Sequential has only layers."""
    operations = model.operations if hasattr(model, "operations") else model.layers
    return [op for op in operations if not isinstance(op, keras.layers.InputLayer)]


def flat_tensors(structure) -> list:
    return [t for t in keras.tree.flatten(structure) if t is not None]


def _single_node_layers(layers) -> None:
    """A layer called twice (shared weights) would belong to two stages."""
    for layer in layers:
        nodes = getattr(layer, "_inbound_nodes", [])  # Keras 3 functional graph; no public count
        require(len(nodes) <= 1,
                f"Layer '{layer.name}' is called {len(nodes)} times (shared weights); "
                f"pipeline stages need each layer used once (a language-model head tied "
                f"to the token embedding calls the embedding twice: use an untied "
                f"keras.layers.Dense head, or train with mirrored or dtensor).")


def _produced_before(model, layers, cut: int) -> dict:
    """id(tensor) -> BoundaryTensor for the model inputs and the outputs of layers[:cut],
    in production order."""
    produced = {}
    for index, t in enumerate(flat_tensors(model.inputs)):
        produced[id(t)] = (t, BoundaryTensor(None, index, t.name, False))
    for layer in layers[:cut]:
        for index, t in enumerate(flat_tensors(layer.output)):
            floating = "float" in str(t.dtype)   # int and bool tensors have no gradient
            produced[id(t)] = (t, BoundaryTensor(layer.name, index, t.name, floating))
    return produced


def crossing_tensors(model, layers, cut: int) -> list:
    """Tensors produced before layer `cut` and used at or after it (or model outputs),
    in production order (model inputs first)."""
    return [t for t, _ in _crossing(model, layers, cut)]


def boundary_tensors(model, layers, cut: int) -> Tuple[BoundaryTensor, ...]:
    """What a stage ending before layers[cut] sends, in the order the next stage takes it."""
    return tuple(boundary for _, boundary in _crossing(model, layers, cut))


def _crossing(model, layers, cut: int) -> list:
    used_later = {id(t) for layer in layers[cut:] for t in flat_tensors(layer.input)}
    used_later |= {id(t) for t in flat_tensors(model.outputs)}
    return [pair for key, pair in _produced_before(model, layers, cut).items()
            if key in used_later]


def _cut_problem(model, layers, cut: int, named: bool = False) -> Optional[str]:
    """None when automatic balancing (or, with `named`, a --pipeline_split naming
    layers[cut]) may start a stage at layers[cut]; else why not."""
    crossing = boundary_tensors(model, layers, cut)
    names = ", ".join(t.describe() for t in crossing)
    computed = [t for t in crossing if t.producer is not None]
    if not computed:
        return (f"only model inputs cross it ({names}): they go straight to "
                f"'{layers[cut].name}' or later layers, so the stages before it would "
                f"compute nothing that is used")
    if len(crossing) > MAX_BOUNDARY_TENSORS:
        return (f"{len(crossing)} tensors cross the cut before '{layers[cut].name}' "
                f"({names}); a stage boundary may pass at most {MAX_BOUNDARY_TENSORS}, "
                f"each sent per micro-batch (cut where fewer cross, e.g. between blocks)")
    if len(computed) > 1 and not named:
        return (f"{len(computed)} computed tensors cross the cut before "
                f"'{layers[cut].name}' ({names}); automatic balancing only cuts where one "
                f"does (name the layer in --pipeline_split to cut here)")
    return None


def layer_params(layer) -> int:
    """Elements of all the layer's weights (Keras 3 shapes are tuples); a keras.ops
    operation has none."""
    total = 0
    for weight in getattr(layer, "weights", ()):
        count = 1
        for size in weight.shape:
            count *= int(size)
        total += count
    return total


def partition_model(model, num_stages: int, split: Optional[Sequence[str]] = None,
                    virtual_stages: int = 1) -> Partition:
    """Returns the stages of `model`: at `split` (layer names starting stages 2..S) or balanced.

    With virtual_stages V > 1 (the interleaved schedule) the model is cut into S * V
    chunks, the Partition's stages, in model order; placement puts chunk c on device c mod S."""
    layers = chain_layers(model)
    names = [layer.name for layer in layers]
    pieces = num_stages * virtual_stages
    asked = _asked(num_stages, virtual_stages)
    require(pieces <= len(layers),
            f"{asked} is more than the {len(layers)} layers of model "
            f"'{model.name}' ({', '.join(names)}); every stage needs at least one layer.")
    _single_node_layers(layers)
    costs = [layer_params(layer) for layer in layers]
    if split:
        cuts = _named_cuts(model, layers, names, pieces, split, asked)
    else:
        valid = [i for i in range(1, len(layers)) if _cut_problem(model, layers, i) is None]
        require(len(valid) >= pieces - 1 or virtual_stages == 1,
                f"{asked} needs {pieces - 1} cuts, but model '{model.name}' has only "
                f"{len(valid)} place(s) where one computed tensor (and any model inputs) "
                f"crosses between layers. Use fewer --virtual_stages or --pipeline_stages, or "
                f"name the {pieces - 1} cuts with --pipeline_split.")
        cuts = balanced_cuts(costs, pieces, valid, model.name)
    return _make_partition(model, layers, costs, cuts)


def _asked(num_stages: int, virtual_stages: int) -> str:
    """The flags that set the number of pieces, for messages."""
    if virtual_stages == 1:
        return f"--pipeline_stages={num_stages}"
    return (f"--pipeline_stages={num_stages} x --virtual_stages={virtual_stages} "
            f"({num_stages * virtual_stages} model chunks)")


def _named_cuts(model, layers, names, num_stages, split, asked=None) -> List[int]:
    split = list(split)
    asked = asked or f"--pipeline_stages={num_stages}"
    require(len(split) == num_stages - 1,
            f"--pipeline_split names {len(split)} layer(s) ({', '.join(split)}) but "
            f"{asked} needs {num_stages - 1} (the first layer of "
            f"stages 2..{num_stages}).")
    for name in split:
        require(name in names, f"--pipeline_split layer {name!r} is not a layer of model "
                               f"'{model.name}'. Valid layer names: {', '.join(names)}.")
    cuts = [names.index(name) for name in split]
    require(cuts == sorted(set(cuts)) and cuts[0] > 0,
            f"--pipeline_split layers must be distinct, in model order and after the first "
            f"layer '{names[0]}'; got {', '.join(split)} (layer order: {', '.join(names)}).")
    for cut in cuts:
        problem = _cut_problem(model, layers, cut, named=True)
        require(problem is None, f"Model '{model.name}' cannot be cut at --pipeline_split "
                                 f"{names[cut]!r}: {problem}.")
    return cuts


def _make_partition(model, layers, costs, cuts) -> Partition:
    bounds = [0] + list(cuts) + [len(layers)]
    stages = []
    for k in range(len(bounds) - 1):
        members = layers[bounds[k]:bounds[k + 1]]
        is_last = k == len(bounds) - 2
        boundary = () if is_last else boundary_tensors(model, layers, bounds[k + 1])
        first_computed = next((t.producer for t in boundary if t.producer), None)
        stages.append(Stage(
            index=k, layers=tuple(layer.name for layer in members),
            params=sum(costs[bounds[k]:bounds[k + 1]]), cost=sum(costs[bounds[k]:bounds[k + 1]]),
            output_layer=first_computed, boundary=boundary))
    return Partition(tuple(stages))
