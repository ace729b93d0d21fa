"""Cutting a built Keras model into S pipeline stages.

A model is a list of layers in topological order (a functional model's
`model.layers`, input layers dropped; a Sequential's layers). A *cut* before
layer i is valid when exactly one tensor crosses it: one tensor produced by the
model inputs or layers [0, i) is consumed by layers [i, L) or is a model output.
Then stage k can be a sub-model from one boundary tensor to the next, and the
only activation sent between stages (and the only gradient sent back) is that
tensor. A residual block, for example, can only be cut between blocks.

Cost model (our choice): a layer costs its number of parameters (trainable and
non-trainable elements). That is exactly what placement divides among devices
(parameters, and optimizer slots in proportion), it needs no input shape, and
for the dense layers of an MLP or transformer it is proportional to FLOPs per
token. It undercounts convolutions (whose weights are reused at every spatial
position) and attention scores; give --pipeline_split for those models if the
automatic split is lopsided. With no split given, cuts are chosen to minimise
the most expensive stage (ties: the earliest cuts).
"""

import dataclasses
from typing import List, Optional, Sequence, Tuple

import keras

from tfdist.errors import require
from tfdist.parallel.pipeline_balance import balanced_cuts


@dataclasses.dataclass(frozen=True)
class Stage:
    index: int
    layers: Tuple[str, ...]
    params: int
    cost: int
    output_layer: Optional[str]  # layer producing the boundary tensor after it; None: last stage


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
            lines.append(f"  stage {stage.index}: {stage.params} params, cost {stage.cost}, "
                         f"layers {', '.join(stage.layers)}")
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
    """The model's layers in topological order, without input layers."""
    return [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]


def _tensors(structure) -> list:
    return [t for t in keras.tree.flatten(structure) if t is not None]


def _single_node_layers(layers) -> None:
    """A layer called twice (shared weights) would belong to two stages."""
    for layer in layers:
        nodes = getattr(layer, "_inbound_nodes", [])  # Keras 3 functional graph; no public count
        require(len(nodes) <= 1,
                f"Layer '{layer.name}' is called {len(nodes)} times (shared weights); "
                f"pipeline stages need each layer used once.")


def crossing_tensors(model, layers, cut: int) -> list:
    """Tensors produced before layer `cut` and used at or after it (or model outputs)."""
    produced = {id(t): t for t in _tensors(model.inputs)}
    for layer in layers[:cut]:
        produced.update({id(t): t for t in _tensors(layer.output)})
    used_later = [t for layer in layers[cut:] for t in _tensors(layer.input)]
    used_later += _tensors(model.outputs)
    crossing = {}
    for t in used_later:
        if id(t) in produced:
            crossing[id(t)] = t
    return list(crossing.values())


def _cut_problem(model, layers, cut: int) -> Optional[str]:
    """None when a stage may start at layers[cut]; else why not."""
    crossing = crossing_tensors(model, layers, cut)
    if len(crossing) == 1 and id(crossing[0]) in {id(t) for t in _tensors(model.inputs)}:
        return (f"the model input goes straight to '{layers[cut].name}', so the stages "
                f"before it would compute nothing that is used")
    if len(crossing) == 1:
        return None
    names = ", ".join(getattr(t, "name", "?") for t in crossing)
    return (f"{len(crossing)} tensors cross the cut before '{layers[cut].name}' ({names}); "
            f"a stage boundary must pass exactly one tensor (e.g. cut between residual blocks)")


def layer_params(layer) -> int:
    """Elements of all the layer's weights (Keras 3 shapes are tuples)."""
    total = 0
    for weight in layer.weights:
        count = 1
        for size in weight.shape:
            count *= int(size)
        total += count
    return total


def partition_model(model, num_stages: int, split: Optional[Sequence[str]] = None) -> Partition:
    """Returns the stages of `model`: at `split` (layer names starting stages 2..S) or balanced."""
    layers = chain_layers(model)
    names = [layer.name for layer in layers]
    require(num_stages <= len(layers),
            f"--pipeline_stages={num_stages} is more than the {len(layers)} layers of model "
            f"'{model.name}' ({', '.join(names)}); every stage needs at least one layer.")
    _single_node_layers(layers)
    costs = [layer_params(layer) for layer in layers]
    if split:
        cuts = _named_cuts(model, layers, names, num_stages, split)
    else:
        valid = [i for i in range(1, len(layers)) if _cut_problem(model, layers, i) is None]
        cuts = balanced_cuts(costs, num_stages, valid, model.name)
    return _make_partition(layers, costs, cuts)


def _named_cuts(model, layers, names, num_stages, split) -> List[int]:
    split = list(split)
    require(len(split) == num_stages - 1,
            f"--pipeline_split names {len(split)} layer(s) ({', '.join(split)}) but "
            f"--pipeline_stages={num_stages} needs {num_stages - 1} (the first layer of "
            f"stages 2..{num_stages}).")
    for name in split:
        require(name in names, f"--pipeline_split layer {name!r} is not a layer of model "
                               f"'{model.name}'. Valid layer names: {', '.join(names)}.")
    cuts = [names.index(name) for name in split]
    require(cuts == sorted(set(cuts)) and cuts[0] > 0,
            f"--pipeline_split layers must be distinct, in model order and after the first "
            f"layer '{names[0]}'; got {', '.join(split)} (layer order: {', '.join(names)}).")
    for cut in cuts:
        problem = _cut_problem(model, layers, cut)
        require(problem is None, f"Model '{model.name}' cannot be cut at --pipeline_split "
                                 f"{names[cut]!r}: {problem}.")
    return cuts


def _make_partition(layers, costs, cuts) -> Partition:
    bounds = [0] + list(cuts) + [len(layers)]
    stages = []
    for k in range(len(bounds) - 1):
        members = layers[bounds[k]:bounds[k + 1]]
        is_last = k == len(bounds) - 2
        stages.append(Stage(
            index=k, layers=tuple(layer.name for layer in members),
            params=sum(costs[bounds[k]:bounds[k + 1]]), cost=sum(costs[bounds[k]:bounds[k + 1]]),
            output_layer=None if is_last else _boundary_producer(layers, bounds[k + 1])))
    return Partition(tuple(stages))


def _boundary_producer(layers, cut: int) -> str:
    """Name of the layer (before `cut`) whose output is the one crossing tensor."""
    wanted = {id(t) for layer in layers[cut:] for t in _tensors(layer.input)}
    for layer in reversed(layers[:cut]):
        if any(id(t) in wanted for t in _tensors(layer.output)):
            return layer.name
    raise AssertionError(f"no producer for the cut before {layers[cut].name}")  # _cut_problem
