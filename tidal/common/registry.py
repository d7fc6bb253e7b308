"""Name -> entry registries: adding an algorithm, a recipe or a reward is one `register` line."""
from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


def load_attr(spec: str, *, what: str) -> object:
    """The object "package.module:attr" names, its module imported here: a user's own reward, environment,
    engine, backend or correction. ValueError starting with `what` (e.g. "reward 'my:f'"); where the
    module itself is missing (not one of its imports), the hint a path problem needs."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and e.name is not None and (
            module_name == e.name or module_name.startswith(e.name + "."))
        hint = " (is its directory on PYTHONPATH? e.g. PYTHONPATH=/path/to/dir python launch.py ...)" if missing else ""
        raise ValueError(f"{what}: cannot import module {module_name!r}: {e}{hint}") from None
    value = getattr(module, attr, None) if attr else None
    if value is None:
        raise ValueError(f"{what}: module {module_name!r} has no attribute {attr!r}")
    return value


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
        entry = load_attr(spec, what=f"{where}{self.kind} {spec!r}")
        if not isinstance(entry, self.plugin):
            raise ValueError(f"{where}{self.kind} {spec!r}: {spec.replace(':', '.')} is of type {type(entry).__name__}, "
                             f"where an object of type {self.plugin.__name__} is needed")
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[tuple[str, T]]:
        """(name, entry) in the order registered."""
        return list(self._entries.items())

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
