"""Keras' own model.fit / evaluate / predict, routed through tfdist where tfdist owns the
model, and model.compile / load_weights reported to it.

Two parties route calls here, each registering itself with `install`:
- tfdist.api (a `Router`): a model compiled in (or trained by) a tfdist.Strategy's scope
  takes that Strategy's exact loop;
- tfdist.keras_distribution (`distribution_routes`): under a set keras.distribution, fit,
  evaluate and predict run through the distribution's Strategy.
Every other call is Keras' own. The wrappers sit on keras.Model (compile on the class
that defines it, see _defining_class), so a model tfdist has not seen yet is covered and
no model object changes. This module imports nothing of tfdist's: both parties depend on
it, not it on them, so there is no import cycle between the API and keras.distribution.
"""

import functools
import inspect
from typing import Callable, Dict, Optional, Protocol

ROUTED_METHODS = ("fit", "evaluate", "predict")
HOOKED_METHODS = ("compile", "load_weights")   # tell the router what happened to a model

_keras_methods: Dict[str, object] = {}                  # Keras' own, before wrapping
_router: Optional["Router"] = None                      # tfdist.api's
_distribution_routes: Dict[str, Callable] = {}          # keras.distribution's


class Router(Protocol):
    """What tfdist.api answers for the wrapped methods."""

    def inside_tfdist_call(self) -> bool: ...
    def owner_of(self, model): ...
    def keras_call(self, owner, name: str, model, arguments: dict): ...
    def compiled(self, model) -> None: ...
    def weights_loaded(self, model) -> None: ...


def install(router: Optional[Router] = None,
            distribution_routes: Optional[Dict[str, Callable]] = None) -> None:
    """Wraps keras.Model's methods (once) and registers who answers them: the API's
    router, keras.distribution's routes (name -> fn(distribution, model, arguments))."""
    global _router
    import keras
    if router is not None:
        _router = router
    if distribution_routes is not None:
        _distribution_routes.update(distribution_routes)
    for name in ROUTED_METHODS + HOOKED_METHODS:
        if name not in _keras_methods:
            _keras_methods[name] = getattr(keras.Model, name)
            wrap = _routed if name in ROUTED_METHODS else _hooked
            setattr(_defining_class(keras.Model, name), name, wrap(name, _keras_methods[name]))


def _defining_class(cls, name: str):
    """The class of cls's MRO that defines `name`. Why not always keras.Model: Keras'
    compile_from_config (keras.Model loading) skips compiling a loaded model whose
    class's compile is not Trainer.compile ("the model's compile() method is custom"),
    so compile is wrapped where Trainer defines it. No upstream issue (Keras' intended
    check for user overrides); canary: tests/test_keras_calls.py::
    test_canary_a_loaded_model_is_compiled_with_the_routes_installed."""
    if name != "compile":
        return cls
    return next(klass for klass in cls.__mro__ if name in vars(klass))


def keras_own(name: str):
    """Keras' own keras.Model.<name>, whether or not the routes are installed."""
    import keras
    return _keras_methods.get(name) or getattr(keras.Model, name)


def _inside_tfdist_call() -> bool:
    return _router is not None and _router.inside_tfdist_call()


def _routed(name, keras_method):
    """keras.Model.<name> that goes through tfdist for a tfdist model or distribution."""
    @functools.wraps(keras_method)
    def method(self, *args, **kwargs):
        import keras
        if _inside_tfdist_call():
            return keras_method(self, *args, **kwargs)   # tfdist inside, or a callback's call
        owner = _router.owner_of(self) if _router is not None else None
        distribution = keras.distribution.distribution() if _distribution_routes else None
        if owner is None and distribution is None:
            return keras_method(self, *args, **kwargs)   # Keras' own
        bound = inspect.signature(keras_method).bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop("self")
        if owner is not None:
            return _router.keras_call(owner, name, self, arguments)
        return _distribution_routes[name](distribution, self, arguments)
    method.tfdist_routed = True
    return method


def _hooked(name, keras_method):
    """keras.Model.<name> (Keras' own), then the router told what it did to the model."""
    @functools.wraps(keras_method)
    def method(self, *args, **kwargs):
        result = keras_method(self, *args, **kwargs)
        if _router is not None:
            if name == "compile":
                _router.compiled(self)
            elif not _router.inside_tfdist_call():
                _router.weights_loaded(self)
        return result
    method.tfdist_routed = True
    return method
