"""The conformance corpus: Keras models tfdist did not write, small enough to train 8 steps.

Three families:
- keras.applications at 32x32x3, weights=None, classes=10;
- keras-hub backbones and task models built from tiny configs with random weights
  (constructor arguments only: nothing is downloaded, no preset is read);
- reproductions of keras-io examples' architectures, each citing the example by its
  title. Their custom layers are written the way keras-io writes them (no **kwargs in
  __init__, no get_config unless the example has one), because that is what users copy.

Every entry builds an UNCOMPILED model: `build(random_layers)` with random_layers=False
puts every stochastic layer at rate 0 (the equivalence comparison: tfdist's guarantee
does not cover random numbers), and with True at the rate its source uses (the check
that tfdist warns about them). `data(n, seed)` gives n examples (x, y) as NumPy, and
`loss()` the loss the harness compiles with.
"""

import dataclasses
from typing import Callable, Dict

import numpy as np

IMAGE_SHAPE = (32, 32, 3)
CLASSES = 10
VOCABULARY = 256        # token models: ids in [0, 256)
SEQUENCE = 16           # token models: positions per example


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    family: str                       # keras.applications, keras-hub or keras-io
    origin: str                       # the class, or the keras-io example's title
    build: Callable                   # build(random_layers: bool) -> uncompiled keras.Model
    data: Callable                    # data(n, seed) -> (x, y) NumPy
    loss: Callable                    # loss() -> a Keras loss


ZOO: Dict[str, ZooModel] = {}


def register(name, family, origin, data, loss):
    def decorator(build):
        ZOO[name] = ZooModel(name, family, origin, build, data, loss)
        return build
    return decorator


# ------------------------------------------------------------------------------ data

def images(n, seed, shape=IMAGE_SHAPE, classes=CLASSES):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, *shape)).astype("float32"),
            rng.integers(0, classes, size=(n,)).astype("int32"))


def tokens_and_labels(n, seed, classes=2):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCABULARY, size=(n, SEQUENCE)).astype("int32"),
            rng.integers(0, classes, size=(n,)).astype("int32"))


def next_token_data(n, seed):
    """A keras-hub causal LM's inputs (token_ids, padding_mask) and next-token labels."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCABULARY, size=(n, SEQUENCE + 1)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((n, SEQUENCE), "int32")}
    return x, ids[:, 1:]


def bert_inputs(n, seed):
    rng = np.random.default_rng(seed)
    x = {"token_ids": rng.integers(0, VOCABULARY, size=(n, SEQUENCE)).astype("int32"),
         "segment_ids": np.zeros((n, SEQUENCE), "int32"),
         "padding_mask": np.ones((n, SEQUENCE), "int32")}
    return x, rng.integers(0, 2, size=(n,)).astype("int32")


def timeseries(n, seed, steps=64):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, steps, 1)).astype("float32"),
            rng.integers(0, 2, size=(n,)).astype("int32"))


def binary_tokens(n, seed):
    x, y = tokens_and_labels(n, seed, classes=2)
    return x, y.astype("float32")[:, None]


def ticket_data(n, seed, num_tags=12, departments=4):
    """The Functional API guide's ticket ranker inputs: title, body, tags."""
    rng = np.random.default_rng(seed)
    x = {"title": rng.integers(0, VOCABULARY, size=(n, 10)).astype("int32"),
         "body": rng.integers(0, VOCABULARY, size=(n, SEQUENCE)).astype("int32"),
         "tags": rng.integers(0, 2, size=(n, num_tags)).astype("float32")}
    y = {"priority": rng.uniform(size=(n, 1)).astype("float32"),
         "department": rng.integers(0, departments, size=(n,)).astype("int32")}
    return x, y


# ------------------------------------------------------------------------------ losses

def sparse_ce():
    return "sparse_categorical_crossentropy"


def sparse_ce_logits():
    import keras
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def binary_ce():
    return "binary_crossentropy"


def ticket_losses():
    import keras
    return {"priority": keras.losses.BinaryCrossentropy(from_logits=True),
            "department": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}


# ------------------------------------------------------------------ keras.applications

def application(constructor_name, **kwargs):
    import keras
    return getattr(keras.applications, constructor_name)(
        weights=None, input_shape=IMAGE_SHAPE, classes=CLASSES, **kwargs)


def zero_rate_dropouts(model):
    """The same functional model with every Dropout at rate 0 (Dropout(0) draws no random
    numbers), for applications whose constructor does not expose the rates."""
    import keras

    def clone(layer):
        if isinstance(layer, keras.layers.Dropout):
            return keras.layers.Dropout(0.0, noise_shape=layer.noise_shape, name=layer.name)
        return layer.__class__.from_config(layer.get_config())
    return keras.models.clone_model(model, clone_function=clone)


@register("resnet50", "keras.applications", "ResNet50", images, sparse_ce)
def resnet50(random_layers):
    return application("ResNet50")


@register("mobilenet_v2", "keras.applications", "MobileNetV2(alpha=0.35)", images, sparse_ce)
def mobilenet_v2(random_layers):
    return application("MobileNetV2", alpha=0.35)


@register("mobilenet_v3_small", "keras.applications", "MobileNetV3Small(dropout_rate=0.2)",
          images, sparse_ce)
def mobilenet_v3_small(random_layers):
    return application("MobileNetV3Small", dropout_rate=0.2 if random_layers else 0.0)


@register("efficientnet_b0", "keras.applications", "EfficientNetB0", images, sparse_ce)
def efficientnet_b0(random_layers):
    model = application("EfficientNetB0")
    return model if random_layers else zero_rate_dropouts(model)


@register("convnext_tiny", "keras.applications", "ConvNeXtTiny", images, sparse_ce)
def convnext_tiny(random_layers):
    # drop_path_rate is 0 in keras.applications' ConvNeXt constructors: no random layer.
    return application("ConvNeXtTiny")


@register("densenet121", "keras.applications", "DenseNet121", images, sparse_ce)
def densenet121(random_layers):
    return application("DenseNet121")


# ----------------------------------------------------------------------------- keras-hub

def hub_dropout(random_layers):
    return 0.1 if random_layers else 0.0


@register("bert_classifier", "keras-hub", "BertTextClassifier(BertBackbone)", bert_inputs,
          sparse_ce_logits)
def bert_classifier(random_layers):
    import keras_hub
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=SEQUENCE, dropout=hub_dropout(random_layers))
    return keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None,
                                               dropout=hub_dropout(random_layers))


@register("gpt2_lm", "keras-hub", "GPT2CausalLM(GPT2Backbone)", next_token_data,
          sparse_ce_logits)
def gpt2_lm(random_layers):
    import keras_hub
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=SEQUENCE, dropout=hub_dropout(random_layers))
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def decoder_config(random_layers):
    return dict(vocabulary_size=VOCABULARY, num_layers=2, num_query_heads=2,
                num_key_value_heads=2, hidden_dim=32, intermediate_dim=64,
                dropout=hub_dropout(random_layers), dtype="float32")


@register("gemma_lm", "keras-hub", "GemmaCausalLM(GemmaBackbone)", next_token_data,
          sparse_ce_logits)
def gemma_lm(random_layers):
    import keras_hub
    backbone = keras_hub.models.GemmaBackbone(head_dim=16, **decoder_config(random_layers))
    return keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)


@register("llama_lm", "keras-hub", "LlamaCausalLM(LlamaBackbone)", next_token_data,
          sparse_ce_logits)
def llama_lm(random_layers):
    import keras_hub
    backbone = keras_hub.models.LlamaBackbone(**decoder_config(random_layers))
    return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


@register("mistral_lm", "keras-hub", "MistralCausalLM(MistralBackbone)", next_token_data,
          sparse_ce_logits)
def mistral_lm(random_layers):
    import keras_hub
    backbone = keras_hub.models.MistralBackbone(sliding_window=SEQUENCE,
                                                **decoder_config(random_layers))
    return keras_hub.models.MistralCausalLM(backbone, preprocessor=None)


@register("vit_classifier", "keras-hub", "ViTImageClassifier(ViTBackbone)", images,
          sparse_ce_logits)
def vit_classifier(random_layers):
    import keras_hub
    rate = hub_dropout(random_layers)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=IMAGE_SHAPE, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
        mlp_dim=64, dropout_rate=rate, attention_dropout=rate)
    return keras_hub.models.ViTImageClassifier(backbone, num_classes=CLASSES, dropout=rate)


# ------------------------------------------------------------------------------ keras-io

def keras_io(name, title, data, loss, rate):
    """Registers conformance_keras_io.<name> (imported only when built: it imports Keras),
    with the example's dropout `rate` when random layers are on, else 0."""
    def build(random_layers):
        from benchmarks import conformance_keras_io
        return getattr(conformance_keras_io, name)(rate if random_layers else 0.0)
    ZOO[name] = ZooModel(name, "keras-io", title, build, data, loss)


def mnist_images(n, seed):
    return images(n, seed, shape=(28, 28, 1))


keras_io("text_transformer", "Text classification with Transformer", tokens_and_labels,
         sparse_ce, 0.1)
keras_io("timeseries_fcn", "Timeseries classification from scratch", timeseries, sparse_ce, 0.0)
keras_io("mnist_convnet", "Simple MNIST convnet", mnist_images, sparse_ce, 0.5)
keras_io("frozen_base_classifier", "Transfer learning & fine-tuning (guide)", images,
         sparse_ce_logits, 0.2)
keras_io("ticket_ranker", "The Functional API (guide): multiple inputs and outputs",
         ticket_data, ticket_losses, 0.0)
keras_io("subclassed_mlp", "Making new layers and models via subclassing (guide)",
         lambda n, seed: images(n, seed, shape=(24,)), sparse_ce_logits, 0.0)
keras_io("bidirectional_lstm", "Bidirectional LSTM on IMDB", binary_tokens, binary_ce, 0.0)
keras_io("timeseries_transformer", "Timeseries classification with a Transformer model",
         timeseries, sparse_ce, 0.25)
keras_io("vit_small", "Image classification with Vision Transformer", images,
         sparse_ce_logits, 0.1)
keras_io("small_xception", "Image classification from scratch", images, sparse_ce, 0.5)
