"""Named components that a config key chooses: ``algo.name``, ``algo.policy_loss``,
``reward.name``, ``rollout.engine``, ``rollout.workflow``.

A component is one function registered under its config name::

    @ADVANTAGE_ESTIMATORS.register("my_estimator")
    def my_estimator(rewards, lengths, eps, normalize_by_std): ...

Config validation reads the accepted values from the registries, so a registered name is a valid
config value with no other edit. This module imports nothing heavy because config validation
imports every registry."""

from __future__ import annotations

from typing import Callable, Dict, Generic, Iterator, Tuple, TypeVar

T = TypeVar("T")


class UnknownName(KeyError, ValueError):
    """A name that no component is registered under. A KeyError (a failed lookup) and a
    ValueError (a bad config value) both, so callers catching either keep working."""

    def __str__(self) -> str:
        # KeyError's own str() is the repr of its argument: quotes around a readable message.
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Components of one kind by name, in the order they were registered (the order in which
    error messages list the choices)."""

    def __init__(self, kind: str):
        self.kind = kind  # what one component is called in error messages, e.g. "reward"
        self._items: Dict[str, T] = {}

    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` under ``name``; a name already taken is an error (two components
        would silently shadow each other otherwise)."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered ({self._items[name]!r})")
        self._items[name] = obj
        return obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of ``add``: returns the object unchanged."""
        def decorator(obj: T) -> T:
            return self.add(name, obj)

        return decorator

    def remove(self, name: str) -> T:
        """Unregister ``name`` and return what was registered (tests register temporary ones)."""
        self.get(name)
        return self._items.pop(name)

    def get(self, name: str) -> T:
        """The component registered under ``name``; UnknownName lists the registered names."""
        try:
            return self._items[name]
        except KeyError:
            raise UnknownName(f"unknown {self.kind} {name!r}; choose one of {', '.join(self._items)}") from None

    __getitem__ = get

    def names(self) -> Tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._items)})"
