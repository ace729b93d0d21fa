"""What a registry model is made of, computed from its config without TensorFlow.

For each layer, in the order of `model.layers` (what the pipeline partitioner
cuts): its weights (Keras variable path, shape, trainable), the activation
elements per example it keeps for the backward pass, and whether a pipeline
stage may start at it. The shapes are a contract with tfdist/models/*.py:
tests/test_plan.py builds every registry model and checks this inventory
against the real variables and the real valid cuts, so `tfdist plan` stays
exact (and costs milliseconds: no TensorFlow import, no weights allocated,
any size can be planned).

Activation counts are an estimate (layer outputs, plus the pre-activation of
a Dense/Conv with a non-linearity, plus attention's score and probability
tensors; ResNet counts what its backward pass keeps); tests compare them
with the TF allocator's peak (benchmarks/memory.py) and docs/planner.md
states the error.
"""

import dataclasses
import math
from typing import Callable, Dict, Optional, Tuple

from tfdist.errors import UsageError, require

DIGITS_SHAPE = (8, 8, 1)      # tfdist/data/digits.py: sklearn's 8x8 digits, 10 classes
TEXT_VOCAB = 256              # tfdist/data/text.py: bytes
PARAMS_ONLY = "params"        # Inventory.model of a model known only by --params


@dataclasses.dataclass(frozen=True)
class Weight:
    path: str
    shape: Tuple[int, ...]
    trainable: bool = True

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    weights: Tuple[Weight, ...] = ()
    saved: int = 0              # activation elements per example kept for backward
    saved_split: int = 0        # the part of `saved` megatron splits over the model axis
    saved_float32: int = 0      # activation elements that stay float32 under mixed precision
    cut_before: bool = True     # a pipeline stage may start at this layer
    # --remat=full: the elements per example this layer keeps when recomputed (its input);
    # None where the planner counts no saving (an embedding, or a single layer whose
    # own intermediates are small next to its output: only blocks are counted)
    kept_when_recomputed: Optional[int] = None

    @property
    def params(self) -> int:
        return sum(w.size for w in self.weights)


@dataclasses.dataclass(frozen=True)
class Inventory:
    model: str
    layers: Tuple[Layer, ...]
    has_batch_norm: bool = False

    @property
    def weights(self) -> Tuple[Weight, ...]:
        return tuple(w for layer in self.layers for w in layer.weights)

    @property
    def num_params(self) -> int:
        return sum(layer.params for layer in self.layers)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The dataset facts a model's shapes depend on (tfdist.data.base.DatasetInfo's)."""
    input_shape: Tuple[int, ...]
    num_classes: int


def dataset_shape(data_config) -> ModelShape:
    """Input shape and classes of a registry dataset, without loading it."""
    name = data_config.name
    if name == "digits":
        return ModelShape(DIGITS_SHAPE, 10)
    if name == "text":
        return ModelShape((data_config.seq_len,), TEXT_VOCAB)
    if name == "synthetic":
        return ModelShape(tuple(data_config.synthetic_shape), data_config.synthetic_classes)
    raise UsageError(f"tfdist plan needs the input shape without loading data; it knows "
                     f"datasets digits, text and synthetic, not {name!r}. Plan with "
                     f"--dataset=synthetic --synthetic_shape=... --synthetic_classes=... "
                     f"matching {name!r}.")


# --------------------------------------------------------------------------- models

def _dense(name: str, fan_in: int, units: int, bias: bool = True) -> Tuple[Weight, ...]:
    weights = (Weight(f"{name}/kernel", (fan_in, units)),)
    return weights + ((Weight(f"{name}/bias", (units,)),) if bias else ())


def _classifier_head(fan_in: int, classes: int):
    return (Layer("logits", _dense("logits", fan_in, classes), saved=classes),
            Layer("float32_logits", saved_float32=classes))


def mlp(shape: ModelShape, config) -> Inventory:
    require(len(shape.input_shape) >= 1, "mlp needs examples with at least one dimension.")
    fan_in = math.prod(shape.input_shape)
    layers = [Layer("flatten", saved=0)]  # a reshape: no new buffer
    for index, width in enumerate(config.hidden_sizes):
        column = index % 2 == 0  # megatron: even layers column-parallel (output split)
        layers.append(Layer(f"dense_{index}", _dense(f"dense_{index}", fan_in, width),
                            saved=2 * width, saved_split=2 * width if column else 0))
        fan_in = width
    return Inventory("mlp", tuple(layers) + _classifier_head(fan_in, shape.num_classes))


def cnn(shape: ModelShape, config) -> Inventory:
    _require_image("cnn", shape)
    height, width, channels = shape.input_shape
    layers = []
    for index, filters in enumerate(config.filters):
        kernel = Weight(f"conv_{index}/kernel", (3, 3, channels, filters))
        bias = Weight(f"conv_{index}/bias", (filters,))
        layers.append(Layer(f"conv_{index}", (kernel, bias), saved=2 * height * width * filters))
        channels = filters
        if min(height, width) // 2 >= 2:  # tfdist/models/cnn.py MIN_POOLED_SIZE
            height, width = height // 2, width // 2
            layers.append(Layer(f"pool_{index}", saved=height * width * filters))
    layers.append(Layer("flatten"))
    return Inventory("cnn", tuple(layers) + _classifier_head(height * width * channels,
                                                             shape.num_classes))


def _norm(name: str, channels: int) -> Tuple[Weight, ...]:
    return (Weight(f"{name}/gamma", (channels,)), Weight(f"{name}/beta", (channels,)),
            Weight(f"{name}/moving_mean", (channels,), trainable=False),
            Weight(f"{name}/moving_variance", (channels,), trainable=False))


def _conv(name: str, size: int, fan_in: int, filters: int) -> Tuple[Weight, ...]:
    return (Weight(f"{name}/kernel", (size, size, fan_in, filters)),)


def resnet(shape: ModelShape, config) -> Inventory:
    _require_image("resnet", shape)
    height, width, channels = shape.input_shape
    f0 = config.filters[0]
    area = height * width
    layers = [Layer("stem_conv", _conv("stem_conv", 3, channels, f0), saved=area * f0),
              Layer("stem_norm", _norm("stem_norm", f0)),
              Layer("stem_relu", saved=area * f0)]
    channels = f0
    for stage, filters in enumerate(config.filters):
        for block in range(2):  # tfdist/models/resnet.py BLOCKS_PER_STAGE
            stride = 2 if stage > 0 and block == 0 and min(height, width) // 2 >= 2 else 1
            if stride == 2:
                height, width = (height + 1) // 2, (width + 1) // 2
            layers += _basic_block(f"stage{stage}_block{block}_", channels, filters,
                                   stride, height * width)
            channels = filters
    layers.append(Layer("pool", saved=channels))
    return Inventory("resnet", tuple(layers) + _classifier_head(channels, shape.num_classes),
                     has_batch_norm=True)


def _basic_block(prefix: str, fan_in: int, filters: int, stride: int, area: int):
    """Layers in Keras' functional order (by depth: the shortcut sits between conv2 and
    norm2); a stage may start only at conv1 or relu2, where one tensor crosses. Saved for
    backward: each conv's output (the norm's input) and each relu's output; a
    norm's output only feeds a relu or the add, whose gradients do not need it."""
    out = area * filters
    project = stride != 1 or fan_in != filters
    conv1 = Layer(prefix + "conv1", _conv(prefix + "conv1", 3, fan_in, filters), saved=out)
    inside = [Layer(prefix + "norm1", _norm(prefix + "norm1", filters)),
              Layer(prefix + "relu1", saved=out),
              Layer(prefix + "conv2", _conv(prefix + "conv2", 3, filters, filters), saved=out)]
    if project:
        inside.append(Layer(prefix + "shortcut_conv",
                            _conv(prefix + "shortcut_conv", 1, fan_in, filters), saved=out))
    inside.append(Layer(prefix + "norm2", _norm(prefix + "norm2", filters)))
    if project:
        inside.append(Layer(prefix + "shortcut_norm", _norm(prefix + "shortcut_norm", filters)))
    inside.append(Layer(prefix + "add"))
    inside = [dataclasses.replace(layer, cut_before=False) for layer in inside]
    return [conv1, *inside, Layer(prefix + "relu2", saved=out)]


def transformer(shape: ModelShape, config) -> Inventory:
    require(len(shape.input_shape) == 1,
            f"transformer needs token sequences shaped (seq_len,), got {shape.input_shape}.")
    (seq_len,), vocab, d = shape.input_shape, shape.num_classes, config.d_model
    layers = [Layer("embedding", (Weight("embedding/embeddings", (vocab, d)),), saved=seq_len * d),
              Layer("position_embedding",
                    (Weight("position_embedding/embeddings", (seq_len, d)),), saved=seq_len * d)]
    layers += [_transformer_block(f"block_{i}", seq_len, config) for i in range(config.num_layers)]
    final_norm = (Weight("final_norm/gamma", (d,)), Weight("final_norm/beta", (d,)))
    layers += [Layer("final_norm", final_norm, saved=seq_len * d),
               Layer("lm_head", _dense("lm_head", d, vocab), saved=seq_len * vocab,
                     saved_split=seq_len * vocab),
               Layer("float32_logits", saved_float32=seq_len * vocab)]
    return Inventory("transformer", tuple(layers))


def _transformer_block(name: str, seq_len: int, config) -> Layer:
    d, f, heads = config.d_model, config.d_ff, config.num_heads
    norm = lambda n: (Weight(f"{name}/{n}/gamma", (d,)), Weight(f"{name}/{n}/beta", (d,)))  # noqa: E731
    weights = (norm("attention_norm") + _dense(f"{name}/query", d, d)
               + _dense(f"{name}/key", d, d, bias=False) + _dense(f"{name}/value", d, d)
               + _dense(f"{name}/attention_output", d, d) + norm("mlp_norm")
               + _dense(f"{name}/mlp_fc_in", d, f) + _dense(f"{name}/mlp_fc_out", f, d))
    # Split under megatron: q, k, v, scores, probabilities, context (whole heads) and
    # the MLP hidden (pre- and post-gelu); full: 2 norms, 2 projections, 2 residuals.
    split = 4 * seq_len * d + 2 * heads * seq_len * seq_len + 2 * seq_len * f
    return Layer(name, weights, saved=6 * seq_len * d + split, saved_split=split,
                 kept_when_recomputed=seq_len * d)


def _require_image(name: str, shape: ModelShape) -> None:
    require(len(shape.input_shape) == 3,
            f"Model '{name}' needs images shaped (height, width, channels), got "
            f"{shape.input_shape}.")


BUILDERS: Dict[str, Callable[[ModelShape, object], Inventory]] = {
    "mlp": mlp, "cnn": cnn, "resnet": resnet, "transformer": transformer,
}


def inventory(model_config, data_config=None, shape: Optional[ModelShape] = None) -> Inventory:
    """The Inventory of registry model `model_config.name` on a dataset (or a ModelShape)."""
    require(model_config.name in BUILDERS,
            f"tfdist plan has no inventory for model {model_config.name!r}; it knows "
            f"{', '.join(sorted(BUILDERS))}. For another model, plan with --params.")
    return BUILDERS[model_config.name](shape or dataset_shape(data_config), model_config)


def from_param_count(num_params: int, num_layers: int = 1) -> Inventory:
    """A stand-in for a model known only by its size: `num_layers` equal dense layers.

    Good for data-parallel and pipeline estimates; nothing about it can be run.
    """
    require(num_params >= num_layers >= 1,
            f"--params must be >= --num_layers >= 1, got {num_params} and {num_layers}.")
    base, extra = divmod(num_params, num_layers)
    layers = tuple(Layer(f"layer_{i}", (Weight(f"layer_{i}/kernel", (base + (i < extra),)),))
                   for i in range(num_layers))
    return Inventory(PARAMS_ONLY, layers)
