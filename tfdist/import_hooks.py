"""How tfdist changes the way a module loads without changing what loads: a finder at the
front of sys.meta_path finds the named modules as the other finders do and wraps their
loaders (tfdist.lazy_keras: load later; tfdist.quiet: load with stderr filtered)."""

import importlib.abc
import sys
from typing import Callable, Iterable


class WrappingFinder(importlib.abc.MetaPathFinder):
    """Finds each of `names` with the next finders; wraps its loader with wrap_loader."""

    def __init__(self, purpose: str, names: Iterable[str], wrap_loader: Callable):
        self.purpose, self.names, self.wrap_loader = purpose, frozenset(names), wrap_loader

    def find_spec(self, name, path, target=None):
        if name not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = self.wrap_loader(spec.loader)
                return spec
        return None


def installed(purpose: str) -> bool:
    return any(getattr(f, "purpose", None) == purpose for f in sys.meta_path)


def install(purpose: str, names: Iterable[str], wrap_loader: Callable) -> None:
    """Puts a WrappingFinder for `purpose` first on sys.meta_path, once."""
    if not installed(purpose):
        sys.meta_path.insert(0, WrappingFinder(purpose, names, wrap_loader))
