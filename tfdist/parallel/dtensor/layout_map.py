"""LayoutMap: regex over Keras variable paths -> a sharding spec per dimension.

The mental model of keras.distribution.LayoutMap, in plain Python (no TF here):
each key is a regular expression matched against the WHOLE variable path
(re.fullmatch, e.g. `block_\\d+/query/kernel`); its value names, per dimension
of the variable, the mesh axis that dimension is split over, or "unsharded".
A value of None (JSON null) means replicated, whatever the rank.

Resolution rules (`resolve`), all checked before any variable is sharded:
- a variable matching no key is replicated (UsageError when strict);
- a variable matching two keys is a UsageError naming it and both keys;
- a key matching no variable is a warning (UsageError when strict);
- every axis must exist in the mesh, be used at most once per spec, and divide
  the dimension it splits (UsageError naming variable, dimension and axis).
"""

import logging
import re
from typing import Dict, Iterable, Mapping, Optional, Sequence, Tuple

from tfdist.errors import UsageError, require

log = logging.getLogger("tfdist")

UNSHARDED = "unsharded"
Spec = Optional[Tuple[str, ...]]  # None: replicated whatever the rank


class LayoutMap:
    """Ordered regex -> spec rules; see the module docstring."""

    def __init__(self, rules: Optional[Mapping[str, Optional[Sequence[str]]]] = None):
        self._rules: Dict[str, Spec] = {}
        self._compiled: Dict[str, re.Pattern] = {}
        for key, spec in (rules or {}).items():
            self[key] = spec

    def __setitem__(self, key: str, spec) -> None:
        require(isinstance(key, str) and key,
                f"A layout map key must be a non-empty regex string, got {key!r}.")
        try:
            self._compiled[key] = re.compile(key)
        except re.error as error:
            raise UsageError(f"Layout map key {key!r} is not a valid regex: {error}.") from None
        self._rules[key] = _normalise_spec(key, spec)

    def __getitem__(self, key: str) -> Spec:
        return self._rules[key]

    def __iter__(self):
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def items(self):
        return self._rules.items()

    def matching_keys(self, path: str):
        return [key for key, pattern in self._compiled.items() if pattern.fullmatch(path)]

    def resolve(self, variables: Iterable[Tuple[str, Sequence[int]]],
                mesh_axes: Mapping[str, int], strict: bool = False) -> Dict[str, Tuple[str, ...]]:
        """Returns {variable path: spec tuple (one entry per dimension)} for `variables`.

        `variables` are (path, shape) pairs; `mesh_axes` maps axis name -> size.
        """
        self._check_axes(mesh_axes)
        resolved, unmatched, used = {}, [], set()
        for path, shape in variables:
            shape = tuple(int(d) for d in shape)
            keys = self.matching_keys(path)
            if len(keys) > 1:
                raise UsageError(
                    f"Variable {path!r} matches {len(keys)} layout map keys: "
                    f"{', '.join(repr(k) for k in keys)}. Make the regexes exclusive "
                    f"(each is matched against the whole path).")
            if not keys:
                unmatched.append(path)
                resolved[path] = (UNSHARDED,) * len(shape)
                continue
            used.add(keys[0])
            spec = self._rules[keys[0]]
            resolved[path] = (UNSHARDED,) * len(shape) if spec is None else spec
            _check_fits(path, shape, resolved[path], keys[0], mesh_axes)
        unused = [key for key in self._rules if key not in used]
        if unused:
            message = (f"Layout map key(s) matched no variable: "
                       f"{', '.join(repr(k) for k in unused)}.")
            if strict:
                raise UsageError(message + " (--layout_strict)")
            log.warning("%s They are ignored.", message)
        if unmatched and strict:
            raise UsageError(
                f"--layout_strict: {len(unmatched)} variable(s) match no layout map key: "
                f"{', '.join(unmatched[:10])}{' ...' if len(unmatched) > 10 else ''}. Add a "
                f"rule (e.g. {unmatched[0]!r}: null for replicated) or drop --layout_strict.")
        if unmatched:
            log.info("layout: %d variable(s) match no rule and are replicated", len(unmatched))
        return resolved

    def _check_axes(self, mesh_axes: Mapping[str, int]) -> None:
        for key, spec in self._rules.items():
            for axis in spec or ():
                if axis != UNSHARDED and axis not in mesh_axes:
                    raise UsageError(
                        f"Layout map key {key!r} shards over mesh axis {axis!r}, which is not "
                        f"in the mesh (axes: {', '.join(f'{a}={s}' for a, s in mesh_axes.items())}). "
                        f"Use one of those names or {UNSHARDED!r}.")


def _normalise_spec(key: str, spec) -> Spec:
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = [spec]
    require(isinstance(spec, (list, tuple)) and all(isinstance(a, str) and a for a in spec),
            f"Layout map key {key!r}: a spec is a list of mesh axis names or "
            f"{UNSHARDED!r} (one per dimension), or null for replicated; got {spec!r}.")
    sharded = [a for a in spec if a != UNSHARDED]
    require(len(sharded) == len(set(sharded)),
            f"Layout map key {key!r}: spec {list(spec)} uses a mesh axis twice; each axis "
            f"can split at most one dimension.")
    return tuple(spec)


def _check_fits(path, shape, spec, key, mesh_axes) -> None:
    require(len(spec) == len(shape),
            f"Variable {path!r} has shape {list(shape)} (rank {len(shape)}), but layout map "
            f"key {key!r} gives a rank-{len(spec)} spec {list(spec)}.")
    for dim, (size, axis) in enumerate(zip(shape, spec)):
        if axis == UNSHARDED:
            continue
        require(size % mesh_axes[axis] == 0,
                f"Variable {path!r} (shape {list(shape)}): dimension {dim} of size {size} is "
                f"not divisible by mesh axis {axis!r} of size {mesh_axes[axis]} (layout map key "
                f"{key!r}). Change the model size, the mesh, or the layout.")


def shards_per_variable(spec: Sequence[str], mesh_axes: Mapping[str, int]) -> int:
    """How many pieces a variable with `spec` is cut into (product of its axes' sizes)."""
    count = 1
    for axis in spec:
        if axis != UNSHARDED:
            count *= mesh_axes[axis]
    return count
