"""--layout: `data`, `megatron`, `auto`, or a user layout file (JSON or .py).

`auto`: tfdist picks an exact tensor-parallel layout for the built model
(auto_layout.py: Dense pairs column-then-row, attention by heads, embeddings by
vocabulary, the rest replicated) and logs the table of what it sharded.

`data`: every variable replicated; only the inputs are split (along `batch`).

`megatron` (Shoeybi et al. 2019): in each MLP pair, the first kernel is
column-parallel [unsharded, model] (its bias split with it), the second is
row-parallel [model, unsharded] (bias replicated), so the hidden activation stays
split and one all-reduce joins the pair's output (one more in the backward pass).
In attention, Q/K/V are column-parallel (heads are contiguous column blocks in
tfdist's transformer, so model=n gives each shard num_heads/n whole heads) and
the output projection is row-parallel. The token embedding is split along the
vocabulary [model, unsharded] (vocab-parallel) and lm_head along its output
(vocab) columns; norms and the position table are replicated.

A user file maps regex -> list of axis names / "unsharded" (or null):
    {"dense_0/kernel": ["unsharded", "model"], "dense_0/bias": ["model"]}
A .py file defines LAYOUT_MAP = {...} the same way, or LAYOUT_MAP = a map object
(below), e.g. keras_layouts.from_backbone(GemmaBackbone, "batch=2,model=2"):
how a keras-hub model's own layout map reaches the --layout flag.

From Python, `layout` may also be a map object instead of a string: a tfdist
LayoutMap, a keras.distribution.LayoutMap (e.g. a keras-hub backbone's
`get_layout_map(mesh)`) or a dict of regex -> Keras axes tuple; the last two
are converted by keras_layouts.from_keras, with Keras' matching rules.
"""

import json
import os
import runpy

from tfdist.errors import UsageError, require
from tfdist.parallel.dtensor.layout_map import UNSHARDED, LayoutMap

U = UNSHARDED
M = "model"

DATA = {".*": None}

MEGATRON_MLP = {
    # dense_0 column, dense_1 row, dense_2 column, ... (even: column, odd: row)
    r"dense_\d*[02468]/kernel": [U, M],
    r"dense_\d*[02468]/bias": [M],
    r"dense_\d*[13579]/kernel": [M, U],
    r"dense_\d*[13579]/bias": [U],
    r"logits/(kernel|bias)": None,
}

MEGATRON_TRANSFORMER = {
    r"embedding/embeddings": [M, U],
    r"position_embedding/embeddings": None,
    r"block_\d+/(query|key|value|mlp_fc_in)/kernel": [U, M],
    r"block_\d+/(query|key|value|mlp_fc_in)/bias": [M],
    r"block_\d+/(attention_output|mlp_fc_out)/kernel": [M, U],
    r"block_\d+/(attention_output|mlp_fc_out)/bias": [U],
    r"(block_\d+/(attention_norm|mlp_norm)|final_norm)/(gamma|beta)": [U],
    r"lm_head/kernel": [U, M],
    r"lm_head/bias": [M],
}

MEGATRON = {"mlp": MEGATRON_MLP, "transformer": MEGATRON_TRANSFORMER}
PRESETS = ("data", "megatron", "auto")


def layout_map_for(layout, model_name: str, model=None, mesh_axes=None) -> LayoutMap:
    """The LayoutMap named by --layout for model `model_name` (or given as a map object).

    `auto` reads the built Keras `model` and needs it and the mesh's `mesh_axes`
    ({axis: size}); the other layouts need neither."""
    if not isinstance(layout, str):
        return _from_object(layout)
    if layout == "auto":
        require(model is not None and mesh_axes is not None,
                "--layout=auto is chosen from the built model and the mesh; this caller "
                "has neither (the planner estimates only data and megatron).")
        from tfdist.parallel.dtensor import auto_layout
        return auto_layout.layout_map(model, mesh_axes)
    if layout == "data":
        return LayoutMap(DATA)
    if layout == "megatron":
        require(model_name in MEGATRON,
                f"--layout=megatron has rules for models {', '.join(sorted(MEGATRON))}, not "
                f"{model_name!r}. Use --layout=auto (tfdist picks an exact layout for any model), "
                f"--layout=data or a layout file (JSON: regex -> axes).")
        return LayoutMap(MEGATRON[model_name])
    return load_file(layout)


def load_file(path: str) -> LayoutMap:
    if not os.path.isfile(path):
        raise UsageError(f"--layout {path!r} is neither a preset ({', '.join(PRESETS)}) nor "
                         f"an existing layout file (.json or .py).")
    if path.endswith(".py"):
        namespace = runpy.run_path(path)
        require("LAYOUT_MAP" in namespace,
                f"Layout file {path!r} must define LAYOUT_MAP = {{regex: [axes...]}}.")
        rules = namespace["LAYOUT_MAP"]
        if _is_map_object(rules):  # a dict keeps its --layout file meaning
            return _from_object(rules)
    else:
        try:
            with open(path) as f:
                rules = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise UsageError(f"Layout file {path!r} is not valid JSON: {error}.") from None
    require(isinstance(rules, dict),
            f"Layout file {path!r} must hold an object of regex -> list of axis names, "
            f"got {type(rules).__name__}.")
    return LayoutMap(rules)


def _is_map_object(value) -> bool:
    from tfdist.parallel.dtensor import keras_layouts
    return isinstance(value, LayoutMap) or keras_layouts.is_keras_layout_map(value)


def _from_object(layout) -> LayoutMap:
    from tfdist.parallel.dtensor import keras_layouts
    if isinstance(layout, LayoutMap):
        return layout
    if isinstance(layout, dict) or keras_layouts.is_keras_layout_map(layout):
        return keras_layouts.from_keras(layout)
    raise UsageError(
        f"layout must be a preset name ({', '.join(PRESETS)}), a layout file path (.json or "
        f".py), a keras.distribution.LayoutMap, a dict of regex -> axes, or a tfdist "
        f"LayoutMap; got {type(layout).__name__}: {layout!r:.200}.")

