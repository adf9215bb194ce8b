"""User components loaded by import path: ``reward.fn=my_pkg.scoring:score``,
``rollout.workflow=my_pkg.agents:MyAgent``.

A path is ``module:attribute`` (the attribute may be dotted, ``module:Class.method``). Every way
it can be wrong -- malformed, a module that is not importable, a module whose own import fails,
a missing attribute, a callable with the wrong parameters -- raises PluginError with one line
naming the config key, the path and the fix, so the command line can print it as is.

This module imports nothing heavy: config validation uses it.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any, Callable, Optional, Sequence

# module.path:attr.path, each a run of Python identifiers joined by dots.
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_IMPORT_PATH = re.compile(rf"^({_IDENT}(?:\.{_IDENT})*):({_IDENT}(?:\.{_IDENT})*)$")


class PluginError(ValueError):
    """A user component that cannot be loaded or used; the message is one line: the key, the
    path, what is wrong and how to fix it."""


def is_import_path(value: object) -> bool:
    """True for a value meant as ``module:attribute`` (it holds a colon); registry names never do."""
    return isinstance(value, str) and ":" in value


def split_import_path(spec: str, what: str) -> tuple:
    """``(module, attribute)`` of ``spec``; PluginError when it is not ``module:attribute``."""
    match = _IMPORT_PATH.match(spec.strip()) if isinstance(spec, str) else None
    if match is None:
        raise PluginError(f"{what}={spec!r} is not an import path; write it as package.module:name "
                          f"(e.g. {what}=my_pkg.my_module:my_function)")
    return match.group(1), match.group(2)


def load_object(spec: str, what: str) -> Any:
    """The object at import path ``spec`` (``package.module:attribute``).

    ``what`` is the config key the path came from (``reward.fn``), named in every error."""
    module_name, attr_path = split_import_path(spec, what)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise PluginError(f"{what}={spec!r}: module {missing!r} is not importable; install the package "
                              "(pip install -e <dir>) or add its directory to PYTHONPATH") from None
        raise PluginError(f"{what}={spec!r}: importing {module_name!r} failed: it imports {missing!r}, "
                          "which is not installed") from None
    except Exception as err:  # noqa: BLE001 - any error in the user's module is reported as one line
        raise PluginError(f"{what}={spec!r}: importing {module_name!r} raised {type(err).__name__}: "
                          f"{_one_line(err)}; fix the module so that it imports") from None
    obj: Any = module
    walked = module_name
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            public = sorted(n for n in dir(obj) if not n.startswith("_"))
            hint = f" (it has: {', '.join(public[:12])}{', ...' if len(public) > 12 else ''})" if public else ""
            raise PluginError(f"{what}={spec!r}: {walked!r} has no attribute {part!r}{hint}; "
                              "check the name after the colon") from None
        walked = f"{walked}.{part}" if walked != module_name else f"{module_name}:{part}"
    return obj


def check_callable(obj: Any, spec: str, what: str, params: Sequence[str]) -> Callable:
    """``obj`` itself, after checking that it can be called with ``len(params)`` positional
    arguments (a class: its constructor).

    ``params`` are the names the framework passes, used only in the message
    (``reward.fn=...: score(completion) takes 1 argument; it is called as score(completion, target)``)."""
    if not callable(obj):
        raise PluginError(f"{what}={spec!r} is a {type(obj).__name__}, not a function; point it at a "
                          f"function called as f({', '.join(params)})")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return obj  # a builtin or C callable without a readable signature: its call will tell
    try:
        signature.bind(*params)
    except TypeError as err:
        name = getattr(obj, "__name__", "it")
        raise PluginError(f"{what}={spec!r}: {name}{signature} cannot be called as "
                          f"{name}({', '.join(params)}) ({err}); give it exactly these parameters") from None
    return obj


def accepts_keyword(obj: Callable, name: str) -> bool:
    """Whether ``obj`` declares parameter ``name`` (or takes ``**kwargs``)."""
    try:
        parameters = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def is_async(obj: Any) -> bool:
    """Whether calling ``obj`` returns an awaitable coroutine (an ``async def`` function, or an
    object whose ``__call__`` is one)."""
    if inspect.iscoroutinefunction(obj):
        return True
    call = getattr(obj, "__call__", None)
    return call is not None and inspect.iscoroutinefunction(call)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:300] + ("..." if len(text) > 300 else "") if text else repr(err)


def describe(obj: Any, default: Optional[str] = None) -> str:
    """A short human name for a loaded object (``my_pkg.scoring.score``)."""
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if module and name:
        return f"{module}.{name}"
    return default or repr(obj)
