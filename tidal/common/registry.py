"""Name -> entry registries: adding an algorithm, a recipe or a reward is one `register` line."""
from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A flat name -> entry map that refuses silent overrides (two entries under one name)."""

    def __init__(self, kind: str, *, key: str | None = None, plugin: type | None = None) -> None:
        self.kind = kind  # used in error messages: "unknown <kind> 'x'"
        self.key = key  # the config key that names an entry, if one does: the error names it first
        # entries of this type may also be named "module:attr", a user's own in a file of theirs (imported
        # where it is asked for, on every rank that asks), without a line added here
        self.plugin = plugin
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> T:
        where = f"{self.key}: " if self.key else ""
        if self.plugin is not None and ":" in name:
            return self._imported(name, where=where)
        if name not in self._entries:
            also = f", or module:attr naming an object of type {self.plugin.__name__}" if self.plugin is not None else ""
            raise ValueError(f"{where}unknown {self.kind} {name!r}; known: {', '.join(self.names())}{also}")
        return self._entries[name]

    def _imported(self, spec: str, *, where: str) -> T:
        module_name, _, attr = spec.partition(":")
        try:
            entry = getattr(importlib.import_module(module_name), attr, None)
        except ImportError as exc:
            raise ValueError(f"{where}{self.kind} {spec!r}: cannot import {module_name!r} ({exc}; is its directory "
                             f"on PYTHONPATH?)") from None
        if not isinstance(entry, self.plugin):
            what = "missing" if entry is None else f"of type {type(entry).__name__}"
            raise ValueError(f"{where}{self.kind} {spec!r}: {module_name}.{attr} is {what}, where an object of type "
                             f"{self.plugin.__name__} is needed")
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def having(self, capability: Callable[[T], object]) -> list[str]:
        """The names of the entries that have a capability (`capability(entry)` true)."""
        return [name for name in self.names() if capability(self._entries[name])]

    def offer(self, capability: Callable[[T], object]) -> str:
        """What a refusal for a missing capability suggests: the registered entries that have it, read
        from the registry (a third entry with it is offered too), never a name written into the check."""
        names = self.having(capability)
        if not names:
            return f"no registered {self.kind} has it"
        return f"use {self.key or self.kind}={' or '.join(names)}"

    def __contains__(self, name: object) -> bool:
        return name in self._entries
