"""A config's validation errors as one line a user acts on: each problem named by its dotted key, an unknown key
with the closest known key of its section. Pydantic only, below every layer: the run config (tidal/recipes/config.py)
and a section that validates a part of itself with a model of its own (an engine's options) word them alike."""
from __future__ import annotations

import difflib

from pydantic import BaseModel, ValidationError


def config_error(exc: ValidationError, source: str, *, prefix: str = "",
                 model: type[BaseModel] | None = None) -> str:
    """One line per problem, naming the dotted field: `trainer.lr: Input should be ...`; an unknown
    key gets the closest known key of its section (`model`: the class validated)."""
    lines = []
    for err in exc.errors():
        field = (prefix + ".".join(str(p) for p in err["loc"])).rstrip(".") or "(top level)"  # a section's own check: its name
        got = f" (got {err['input']!r})" if err["type"] != "extra_forbidden" and "input" in err and \
            not isinstance(err["input"], dict) else ""
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        if err["type"] == "extra_forbidden" and model is not None:
            msg += _did_you_mean(model, err["loc"], prefix=prefix)
        said = msg.removeprefix("Value error, ")
        if said.startswith(f"{field}."):  # a section's check that names the key within it (an engine's options)
            lines.append(said)
            continue
        lines.append(f"{field}: {msg}{got}")
    return f"invalid config ({source}): " + "; ".join(lines)


def _did_you_mean(model: type[BaseModel], loc: tuple, *, prefix: str) -> str:
    """`; did you mean trainer.lr?` for the unknown key at `loc`, or "" when no known key is close."""
    for part in loc[:-1]:  # down to the section that holds the key
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return ""
        model = field.annotation
    known = [name for name, f in model.model_fields.items() if not f.exclude]  # algo, sources: not user keys
    close = closest(str(loc[-1]), known)
    return f"; did you mean {prefix}{'.'.join([*map(str, loc[:-1]), close])}?" if close else ""


def closest(key: str, known) -> str | None:
    """The known key closest to a mistyped one, or None when none is close."""
    close = difflib.get_close_matches(key, list(known), n=1)
    return close[0] if close else None
