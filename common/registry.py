"""Name -> entry registries: adding an algorithm, a recipe or a reward is one `register` line."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A flat name -> entry map that refuses silent overrides (two entries under one name)."""

    def __init__(self, kind: str, *, key: str | None = None) -> None:
        self.kind = kind  # used in error messages: "unknown <kind> 'x'"
        self.key = key  # the config key that names an entry, if one does: the error names it first
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> T:
        if name not in self._entries:
            where = f"{self.key}: " if self.key else ""
            raise ValueError(f"{where}unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        return self._entries[name]

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
