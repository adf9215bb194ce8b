"""What an agent is and what each run of it is handed (checked at config time, one line each).

An agent is a class with ``async def run(self, data, ...)`` (constructed once, with
``rollout.agent_args`` as keyword arguments) or an ``async`` function of ``(data, ...)``. Besides
``data``, a run is handed what its signature asks for:

* ``client``, by that name or as the second positional parameter: an ``openai.AsyncOpenAI`` on
  the run's base URL;
* ``base_url``, ``api_key``, ``http_client``, by name, or all three through ``**kwargs`` (what
  AReaL hands its agents): the run's base URL, its API key, and an HTTP client of its own for
  ``AsyncOpenAI(http_client=...)``;
* nothing else: ``run(self, data)`` builds its client itself (``AsyncOpenAI()`` from the
  environment, or ``megatron_rl.rollout.agent.openai_client()``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

# What a run can be handed by name; what ``**kwargs`` receives (AReaL's extra_kwargs).
HANDED = ("client", "base_url", "api_key", "http_client")
AREAL_KWARGS = ("base_url", "http_client", "api_key")
SHAPES = ("`async def run(self, data, client)`, `async def run(self, data, **kwargs)` (base_url, api_key, "
          "http_client) or `async def run(self, data)`")


class AgentError(ValueError):
    """The user's agent broke its contract (a signature the trainer cannot call, returned no
    number, never reached the chat server)."""


@dataclass
class AgentSpec:
    """A loaded agent: its run callable, what each run is handed, and its name for messages."""

    name: str
    run: Callable[..., Any]  # run(data, [client], **handed) -> awaitable reward
    client_positional: bool = False  # the client goes second, positionally (``run(self, data, client)``)
    by_name: Tuple[str, ...] = ()  # the HANDED names passed as keyword arguments
    args: Dict[str, Any] = field(default_factory=dict)  # the class's constructor arguments

    @property
    def wants(self) -> Tuple[str, ...]:
        return (("client",) if self.client_positional else ()) + self.by_name

    def call(self, data: Dict[str, Any], handed: Mapping[str, Any]) -> Any:
        """The run's coroutine, handed what it asks for."""
        positional = (handed["client"],) if self.client_positional else ()
        return self.run(data, *positional, **{name: handed[name] for name in self.by_name})


def _what_to_hand(fn: Callable, where: str, shown: str) -> Tuple[bool, Tuple[str, ...]]:
    """(client positionally, names by keyword) for ``fn(data, ...)``; AgentError if it cannot
    be called that way."""
    params = list(inspect.signature(fn).parameters.values())
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not params or params[0].kind not in positional_kinds + (inspect.Parameter.VAR_POSITIONAL,):
        raise AgentError(f"{where}: {shown}{inspect.signature(fn)} takes no `data` argument first; the shapes "
                         f"are {SHAPES}")
    client_positional, by_name, var_keyword = False, [], False
    for i, param in enumerate(params[1:], start=1):
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            var_keyword = True
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        elif param.name in HANDED and param.kind is not inspect.Parameter.POSITIONAL_ONLY:
            by_name.append(param.name)
        elif i == 1 and param.kind in positional_kinds and param.default is param.empty:
            client_positional = True  # run(self, data, client) under any name: the client
        elif param.default is param.empty:
            raise AgentError(f"{where}: {shown}{inspect.signature(fn)} has a parameter `{param.name}` the trainer "
                             f"cannot fill: a run is handed data and, by name, {', '.join(HANDED)}; the shapes are "
                             f"{SHAPES}")
    if var_keyword:
        by_name += [name for name in AREAL_KWARGS if name not in by_name]
    if client_positional and "client" in by_name:
        raise AgentError(f"{where}: {shown}{inspect.signature(fn)} would get the client twice; name one "
                         "parameter `client`")
    return client_positional, tuple(by_name)


def agent_spec(obj: Any, name: str, args: Optional[Mapping[str, Any]] = None) -> AgentSpec:
    """The AgentSpec of an agent class (constructed here with ``args``) or function; AgentError
    with one line when ``obj`` is neither or cannot be called (``name`` is the config value,
    e.g. ``my_pkg.agents:MyAgent``)."""
    where = f"rollout.workflow={name!r}"
    args = dict(args or {})
    if inspect.isclass(obj):
        run = getattr(obj, "run", None)
        if run is None or not inspect.iscoroutinefunction(run):
            raise AgentError(f"{where}: class {obj.__name__} needs a method `async def run(self, data, ...) -> "
                             f"float`; the shapes are {SHAPES}")
        agent = _construct(obj, args, where)
        client_positional, by_name = _what_to_hand(agent.run, where, f"{obj.__name__}.run")
        return AgentSpec(name, agent.run, client_positional, by_name, args)
    if inspect.iscoroutinefunction(obj):
        if args:
            raise AgentError(f"{where} is a function, so rollout.agent_args={args} has nothing to construct; "
                             "agent_args are the keyword arguments of an agent class's constructor")
        client_positional, by_name = _what_to_hand(obj, where, obj.__name__)
        return AgentSpec(name, obj, client_positional, by_name)
    raise AgentError(f"{where} is a {type(obj).__name__}; point it at an agent class with `async def run(self, "
                     "data, ...)` or at a function `async def run_agent_return_reward(data) -> float`")


def _construct(cls: type, args: Dict[str, Any], where: str) -> Any:
    shown = f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as err:
        fix = ("give its required arguments in rollout.agent_args" if "missing" in str(err) else
               "rollout.agent_args gives its constructor's keyword arguments")
        raise AgentError(f"{where}: {shown} cannot be called ({err}); {fix}") from None
    except ValueError:  # no signature to check (a C type): the call says
        pass
    try:
        return cls(**args)
    except Exception as err:  # noqa: BLE001 - the user's constructor: its failure is one line
        raise AgentError(f"{where}: {shown} failed: {type(err).__name__}: {err} (rollout.agent_args gives its "
                         "arguments)") from None
