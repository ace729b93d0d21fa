"""keras.distribution layout maps (e.g. a keras-hub backbone's `get_layout_map(mesh)`)
as tfdist LayoutMaps, with Keras' matching rules kept exactly.

    layout = keras_layouts.from_backbone(GemmaBackbone, "batch=2,model=2")
    # the same as: from_keras(GemmaBackbone.get_layout_map(device_mesh("batch=2,model=2")))
    tfdist.run(RunConfig(strategy="dtensor", mesh="batch=2,model=2", layout=layout, ...))

Keras 3.15's `LayoutMap.__getitem__(path)` (keras/src/distribution/
distribution_lib.py), which ModelParallel asks with `variable.path`:
1. a key equal to the path wins outright, whatever else matches;
2. otherwise every key is a regex tried with re.fullmatch; two or more matches
   are an error, none means replicated.
tfdist's own LayoutMap has rule 2 only (an exact key that another regex also
matches is an error there), so KerasLayoutMap adds rule 1.

Values: a TensorLayout (or a tuple of axes) per key; each axis is a mesh axis
name or None (that dimension replicated). Keras' axis names are renamed to
tfdist's mesh axes (`batch`, `model`) by `axis_names` when they differ.

Stricter than Keras, because a silent no-op sharding is the failure that costs a
day: a key matching none of the model's variables is a UsageError (naming the
key and some variable paths), and so is a layout map made for a mesh whose axis
sizes differ from the mesh tfdist runs on. Activation keys (`<layer>/output`)
are refused too: DTensor propagates activation layouts from the variables'.
"""

import difflib
from typing import Dict, Mapping, Optional, Sequence, Tuple

from tfdist.errors import UsageError, require
from tfdist.parallel.dtensor.layout_map import UNSHARDED, LayoutMap

SHOWN_PATHS = 6  # variable paths quoted in an error: enough to see the naming scheme


class KerasLayoutMap(LayoutMap):
    """A tfdist LayoutMap with keras.distribution.LayoutMap's lookup (see module docstring).

    `source_axes` is the mesh the Keras map was made for ({axis: size}, tfdist's
    axis names), or None when it named none.
    """

    def __init__(self, rules: Mapping[str, Optional[Sequence[str]]],
                 source_axes: Optional[Mapping[str, int]] = None):
        super().__init__(rules)
        self.source_axes = dict(source_axes) if source_axes else None

    def matching_keys(self, path: str):
        if path in self._rules:  # Keras: the exact key wins before any regex is tried
            return [path]
        return super().matching_keys(path)

    def resolve(self, variables, mesh_axes, strict: bool = False):
        variables = [(path, tuple(shape)) for path, shape in variables]
        self._check_source_mesh(mesh_axes)
        self._check_every_key_used([path for path, _ in variables])
        return super().resolve(variables, mesh_axes, strict=strict)

    def _check_source_mesh(self, mesh_axes: Mapping[str, int]) -> None:
        if self.source_axes is None:
            return
        differing = {a: s for a, s in self.source_axes.items() if mesh_axes.get(a) != s}
        require(not differing,
                f"The Keras layout map was made for mesh {_describe(self.source_axes)}, but "
                f"tfdist runs on mesh {_describe(mesh_axes)}. Build the keras DeviceMesh "
                f"with the same axes (keras_layouts.device_mesh({_describe(mesh_axes)!r})) "
                f"or change --mesh.")

    def _check_every_key_used(self, paths: Sequence[str]) -> None:
        used = {key for path in paths for key in self.matching_keys(path)}
        for key in self._rules:
            if key not in used:
                raise UsageError(_unused_key_message(key, paths))

    def to_dict(self) -> Dict[str, Optional[list]]:
        """JSON-friendly {key: [axes] or None} (for logs and checkpoint fingerprints)."""
        return {key: None if spec is None else list(spec) for key, spec in self._rules.items()}

    def __repr__(self) -> str:
        return f"KerasLayoutMap({self.to_dict()!r})"


def _describe(axes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={s}" for a, s in axes.items())


def _unused_key_message(key: str, paths: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, paths, n=SHOWN_PATHS, cutoff=0.3)
    shown = close or list(paths[:SHOWN_PATHS])
    if key.endswith("/output"):
        why = ("It looks like an activation layout (<layer path>/output): --strategy=dtensor "
               "lays out only variables and lets DTensor propagate activation layouts; ")
    else:
        why = ("Keys are regexes matched against the WHOLE variable path (re.fullmatch, as "
               "keras.distribution.LayoutMap does); ")
    return (f"Layout map key {key!r} matches none of the model's {len(paths)} variables, "
            f"e.g. {', '.join(repr(p) for p in shown)}. {why}fix the key, or delete it "
            f"(del layout_map[{key!r}]).")


# ---- conversion ---------------------------------------------------------------------------

def is_keras_layout_map(value) -> bool:
    """True for a keras.distribution.LayoutMap (checked without importing Keras)."""
    return any(cls.__name__ == "LayoutMap" and cls.__module__.startswith("keras")
               for cls in type(value).__mro__)


def from_keras(layout_map, axis_names: Optional[Mapping[str, str]] = None) -> LayoutMap:
    """A keras.distribution.LayoutMap, or a dict {regex: TensorLayout | axes tuple | None},
    as a KerasLayoutMap; a tfdist LayoutMap is returned as it is.

    `axis_names` renames Keras mesh axes to tfdist's ({"data": "batch"}); axes
    not in it keep their names.
    """
    if isinstance(layout_map, LayoutMap):
        return layout_map
    keras_map = is_keras_layout_map(layout_map)
    require(keras_map or isinstance(layout_map, Mapping),
            f"A layout map must be a keras.distribution.LayoutMap, a dict of regex -> axes, "
            f"or a tfdist LayoutMap; got {type(layout_map).__name__}: {layout_map!r:.200}.")
    renames = dict(axis_names or {})
    rules = {}
    for key in layout_map:
        # Public lookup: Keras returns a stored key's own layout before trying regexes.
        rules[key] = _spec_from_keras(key, layout_map[key], renames)
    source = _source_axes(getattr(layout_map, "device_mesh", None), renames)
    return KerasLayoutMap(rules, source)


def _spec_from_keras(key, value, renames: Mapping[str, str]) -> Optional[Tuple[str, ...]]:
    if value is None:
        return None
    axes = getattr(value, "axes", value)  # a TensorLayout, or the axes themselves
    require(isinstance(axes, (tuple, list)),
            f"Layout map key {key!r}: expected a keras.distribution.TensorLayout, a tuple of "
            f"mesh axis names / None (one per dimension), or None; got {value!r}.")
    spec = []
    for axis in axes:
        require(axis is None or (isinstance(axis, str) and axis),
                f"Layout map key {key!r}: axes {tuple(axes)!r} hold {axis!r}; each entry must "
                f"be one mesh axis name or None (replicated along that dimension).")
        spec.append(UNSHARDED if axis in (None, UNSHARDED) else renames.get(axis, axis))
    return tuple(spec)


def _source_axes(keras_mesh, renames: Mapping[str, str]) -> Optional[Dict[str, int]]:
    if keras_mesh is None:
        return None
    return {renames.get(name, name): int(size)
            for name, size in zip(keras_mesh.axis_names, keras_mesh.shape)}


def device_mesh(mesh: str, devices: Optional[Sequence[str]] = None):
    """A keras.distribution.DeviceMesh with tfdist's --mesh axes ("batch=2,model=2"), for
    layout-map builders such as keras-hub's `Backbone.get_layout_map(device_mesh)`.

    Only its axis names and sizes are used by tfdist (the devices come from tfdist's
    own mesh); `devices` defaults to keras.distribution.list_devices()' first ones.
    """
    import keras
    from tfdist.parallel.dtensor import mesh as mesh_lib
    available = list(devices) if devices is not None else keras.distribution.list_devices()
    axes = mesh_lib.parse_mesh(mesh, len(available))
    size = mesh_lib.mesh_size(axes)
    require(size <= len(available),
            f"Mesh {mesh!r} needs {size} devices, but only {len(available)} are available: "
            f"{', '.join(available[:8])}{' ...' if len(available) > 8 else ''}.")
    return keras.distribution.DeviceMesh(
        shape=tuple(s for _, s in axes), axis_names=[a for a, _ in axes],
        devices=available[:size])


def from_backbone(backbone, mesh: str) -> LayoutMap:
    """A keras-hub backbone's (class or instance) own `get_layout_map` for `mesh`
    ("batch=2,model=2"), converted: its data axis is `batch`, its model axis `model`."""
    get_layout_map = getattr(backbone, "get_layout_map", None)
    require(callable(get_layout_map),
            f"{getattr(backbone, '__name__', type(backbone).__name__)} has no get_layout_map"
            f"(device_mesh); keras-hub publishes it on e.g. GemmaBackbone and LlamaBackbone. "
            f"Pass a keras.distribution.LayoutMap or a dict of regex -> axes instead.")
    return from_keras(get_layout_map(device_mesh(mesh), model_parallel_dim_name="model",
                                     data_parallel_dim_name="batch"))
