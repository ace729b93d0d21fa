"""User code by name: `--model=MODULE:FUNCTION` and `--dataset=MODULE:FUNCTION`.

A spec is recognised by its ':' (no registry name has one). `tfds:NAME` is the
one exception: it names a tensorflow-datasets dataset, never user code, so a
user module literally named `tfds` cannot be loaded this way (rename it, or call
the public API with the objects instead of a spec).

MODULE is imported the way `python -m` would find it: the current directory is
on sys.path. FUNCTION is called with no arguments. Every mistake is a UsageError
of one paragraph naming what was received and what would work.

Importing this module is cheap: TensorFlow and Keras are imported only when a
model or a dataset is actually built.
"""

import difflib
import importlib
import inspect
import os
import sys
import traceback
from typing import Callable, List, Tuple

from tfdist.errors import UsageError

TFDS_PREFIX = "tfds:"  # tensorflow-datasets names, handled by tfdist.data, not user code


def is_user_code_spec(name) -> bool:
    """True for 'MODULE:FUNCTION' (anything with ':' that is not 'tfds:NAME')."""
    return isinstance(name, str) and ":" in name and not name.startswith(TFDS_PREFIX)


def split_spec(spec: str, flag: str) -> Tuple[str, str]:
    """(MODULE, FUNCTION) of a spec, checked for shape only (nothing is imported)."""
    module_name, colon, function_name = str(spec).partition(":")
    module_name, function_name = module_name.strip(), function_name.strip()
    if not colon or not module_name or not function_name or ":" in function_name:
        raise UsageError(
            f"{flag}={spec!r} is not of the form MODULE:FUNCTION (one ':', both parts "
            f"non-empty), e.g. {flag}=my_project.models:build. MODULE is a Python module "
            f"importable from the current directory or PYTHONPATH; FUNCTION a function in it "
            f"taking no arguments.")
    return module_name, function_name


def load_function(spec: str, flag: str) -> Callable:
    """Imports MODULE of 'MODULE:FUNCTION' and returns its callable FUNCTION."""
    module_name, function_name = split_spec(spec, flag)
    module = import_user_module(module_name, spec, flag)
    if not hasattr(module, function_name):
        raise UsageError(_missing_attribute_message(module, function_name, spec, flag))
    function = getattr(module, function_name)
    if not callable(function):
        raise UsageError(
            f"{flag}={spec!r}: {module_name}.{function_name} is "
            f"{with_article(type(function).__name__)} "
            f"({_short_repr(function)}), not a function. "
            f"{_callables_hint(module)}")
    return function


def import_user_module(module_name: str, spec: str, flag: str):
    """The module, imported with the current directory on sys.path; errors as UsageError."""
    _put_current_directory_on_path()
    importlib.invalidate_caches()  # a module written since the last import must be seen
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(_import_error_message(error, module_name, spec, flag)) from None
    except Exception as error:  # a SyntaxError or any exception raised by the module's code
        raise UsageError(
            f"{flag}={spec!r}: importing module {module_name!r} raised "
            f"{type(error).__name__}: {_one_line(error)}{_where(error)}. Fix the module, "
            f"then rerun.") from None


def _put_current_directory_on_path() -> None:
    # `python -m experiments.train` puts the current directory first on sys.path;
    # `python experiments/train.py` or a launcher would not, so do the same here.
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


def _import_error_message(error: ImportError, module_name: str, spec: str, flag: str) -> str:
    missing = getattr(error, "name", None)
    itself = missing is not None and (module_name + ".").startswith(missing + ".")
    if itself:
        where = (f"Python looked in sys.path (the current directory {os.getcwd()} first, then "
                 f"{_path_summary()}); run from the directory that holds "
                 f"{module_name.replace('.', '/')}.py, or add its directory to PYTHONPATH")
    else:
        missing = missing or "see the message"
        where = (f"the module was found but something it imports was not ({missing}); "
                 f"install it or fix that import")
    return f"{flag}={spec!r}: module {module_name!r} does not import: {_one_line(error)}. {where}."


def _path_summary(limit: int = 4) -> str:
    others = [p for p in sys.path if p not in ("", os.getcwd())]
    more = len(others) - limit
    return ", ".join(others[:limit]) + (f" and {more} more" if more > 0 else "")


def _missing_attribute_message(module, function_name: str, spec: str, flag: str) -> str:
    close = difflib.get_close_matches(function_name, public_callables(module), n=1)
    hint = f" Did you mean {module.__name__}:{close[0]}?" if close else ""
    return (f"{flag}={spec!r}: module {module.__name__!r} ({_module_file(module)}) has no "
            f"attribute {function_name!r}.{hint} {_callables_hint(module)}")


def public_callables(module) -> List[str]:
    """Public callables the module defines itself (imported ones only if it defines none)."""
    public = {name: value for name, value in vars(module).items()
              if not name.startswith("_") and callable(value)}
    own = [name for name, value in public.items()
           if getattr(value, "__module__", None) == module.__name__]
    return sorted(own or public)


def _callables_hint(module) -> str:
    names = public_callables(module)
    if not names:
        return f"Module {module.__name__!r} defines no public callables."
    return f"Public callables of {module.__name__!r}: {', '.join(names)}."


def _module_file(module) -> str:
    return getattr(module, "__file__", None) or "a built-in or namespace module"


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _short_repr(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _where(error: BaseException) -> str:
    """' (at FILE:LINE)' of the innermost frame, or of the bad line of a SyntaxError."""
    if isinstance(error, SyntaxError) and error.filename:
        return f" (at {error.filename}:{error.lineno})"
    frames = traceback.extract_tb(error.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def call_without_arguments(function: Callable, spec: str, flag: str):
    """FUNCTION(), refused early when FUNCTION needs arguments."""
    try:
        inspect.signature(function).bind()
    except TypeError:
        raise UsageError(
            f"{flag}={spec!r}: {_name(function)}{inspect.signature(function)} needs arguments, "
            f"but tfdist calls it with none. Give its parameters defaults or wrap it in a "
            f"function without parameters.") from None
    except ValueError:
        pass  # no signature to inspect (some built-ins): just call it
    return function()


def _name(function) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def with_article(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def type_name(value) -> str:
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__name__
    return f"{kind.__module__}.{kind.__qualname__}"


def build_user_model(spec: str, flag: str = "--model"):
    """Calls FUNCTION() of 'MODULE:FUNCTION' and returns the keras.Model it builds.

    The caller decides the scope (a strategy's scope, a DTensor layout, ...):
    this only calls the user's function and checks what came back.
    """
    import keras
    model = call_without_arguments(load_function(spec, flag), spec, flag)
    if isinstance(model, keras.Model):
        return model
    hint = ""
    if type(model).__module__.startswith("tf_keras"):
        hint = " That is a Keras 2 (tf_keras) model; tfdist needs Keras 3: `import keras`."
    raise UsageError(
        f"{flag}={spec!r} returned {with_article(type_name(model))}, not a keras.Model. "
        f"FUNCTION() must build and return an uncompiled Keras 3 model (keras.Sequential, "
        f"a functional keras.Model, or a keras.Model subclass).{hint}")
