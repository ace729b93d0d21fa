"""One small registry class for every pluggable thing (models, datasets, modes).

Entries may be callables or lazy "module:attribute" strings, so that listing and
validating names never imports TensorFlow (importing it costs seconds).
"""

import difflib
import importlib
from typing import Callable, Dict, List, Union

from tfdist.errors import UsageError

Entry = Union[Callable, str]


class Registry:
    """Maps names to factories; unknown names get an error listing valid ones."""

    def __init__(self, kind: str, entries: Dict[str, Entry] = None):
        self.kind = kind
        self._entries: Dict[str, Entry] = dict(entries or {})

    def register(self, name: str, entry: Entry = None):
        """Registers `entry` under `name`; usable as a decorator."""
        if entry is None:
            return lambda fn: self.register(name, fn) or fn
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def names(self) -> List[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def validate(self, name: str) -> str:
        """Returns `name` if registered, else raises a UsageError naming the valid ones."""
        if name in self._entries:
            return name
        close = difflib.get_close_matches(str(name), self.names(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UsageError(
            f"Unknown {self.kind} {name!r}. Valid {self.kind} names: "
            f"{', '.join(self.names())}.{hint}")

    def get(self, name: str) -> Callable:
        """Returns the factory for `name`, importing it if it is a lazy string."""
        entry = self._entries[self.validate(name)]
        if isinstance(entry, str):
            module_name, attribute = entry.split(":")
            entry = getattr(importlib.import_module(module_name), attribute)
            self._entries[name] = entry
        return entry
