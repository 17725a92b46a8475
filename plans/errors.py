"""One-line messages for bad input: the field path and the reason, never a traceback."""

from __future__ import annotations

from pydantic import ValidationError


class SpecError(ValueError):
    """Bad user input: a wrong name, a malformed file, an impossible spec or plan."""


def describe(err: ValidationError, prefix: str = "") -> str:
    """First problem of a pydantic error as ``field.path: reason`` (plus a count of the rest)."""
    errors = err.errors(include_url=False)
    first = errors[0]
    loc = ".".join(str(p) for p in (prefix, *first["loc"]) if p != "")
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        msg = "required field is missing"
    elif first["type"] == "extra_forbidden":
        msg = f"unknown field (value {first.get('input')!r})"
    text = f"{loc}: {msg}" if loc else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return text
