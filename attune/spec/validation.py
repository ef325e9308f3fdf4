"""One line from a pydantic ``ValidationError``: the file formats attune reads from outside (config.json, cluster
files, replay rows, search spaces) are pydantic models, and their errors reach the user as one line.

:func:`one_line` formats the first error as ``LOC: what is wrong; what is allowed (got VALUE)``, e.g.
``timeouts.trial_s: must be a finite number (got nan)`` or ``knobs.warp: unknown knob; allowed: tp, pp, ...``.
The location is dotted (``paths.slime``), list positions stay numbers (``knobs.tp.0``), and a dict key that fails
its own check is named by the key. The noun of an unknown key is the model's ``title`` (``knob``, ``setting``),
``key`` without one; the allowed keys are the model's fields. A missing field says what it is when the field
has a ``description``.
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ValidationError

__all__ = ["one_line"]

# pydantic error type -> what is allowed, in words ("'lots' is not a number")
_TYPES = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "a whole number",
    "float_type": "a number", "float_parsing": "a number", "string_type": "a string",
    "bool_type": "true or false", "bool_parsing": "true or false",
    "dict_type": "a mapping", "model_type": "a mapping", "model_attributes_type": "a mapping",
    "list_type": "a list", "tuple_type": "a list",
}


# error types whose words do not quote the value: " (got VALUE)" follows them
_SHOWN = ("finite_number", "greater_than_equal", "greater_than", "less_than_equal", "less_than")


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside a field's annotation (through Optional, Annotated, list, dict)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models(a)]


def _model_at(model: type[BaseModel] | None, loc: tuple) -> type[BaseModel] | None:
    """The model that holds the field at ``loc`` (``loc`` without the field name itself)."""
    for part in loc:
        field = model.model_fields.get(part) if model is not None and isinstance(part, str) else None
        if field is None:
            if isinstance(part, int):
                continue  # a list position: the same element model
            return None
        found = _models(field.annotation)
        model = found[0] if found else None
    return model


def _what(err: dict, model: type[BaseModel] | None, loc: tuple) -> str:
    kind, ctx, got = err.get("type", ""), err.get("ctx") or {}, err.get("input")
    if kind == "missing":
        holder = _model_at(model, loc[:-1])
        field = holder.model_fields.get(loc[-1]) if holder is not None and loc else None
        return f"missing ({field.description})" if field is not None and field.description else "missing"
    if kind == "extra_forbidden":
        holder = _model_at(model, loc[:-1])
        if holder is None:
            return "unknown key"
        noun = holder.model_config.get("title") or "key"
        return f"unknown {noun}; allowed: {', '.join(holder.model_fields)}"
    if kind == "literal_error":
        return f"{got!r:.60} not allowed; allowed: {ctx.get('expected')}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op, bound = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
                     "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}[kind]
        if op == ">=" and ctx.get(bound) == 1 and isinstance(got, int):
            return "must be a positive integer"
        b = ctx.get(bound)
        return f"must be {op} {int(b) if isinstance(b, float) and b.is_integer() else b}"
    if kind in ("too_long", "too_short"):
        n, most, least = ctx.get("actual_length"), ctx.get("max_length"), ctx.get("min_length")
        return f"{n:,} items; at most {most}" if kind == "too_long" else f"must have at least {least} item(s) (got {n})"
    if kind == "finite_number":
        return "must be a finite number"
    if kind in _TYPES:
        shown = "" if isinstance(got, (dict, list, tuple)) else f"{got!r:.60} "
        return f"{shown}is not {_TYPES[kind]}" if shown else f"must be {_TYPES[kind]} (got {type(got).__name__})"
    msg = str(err.get("msg", "invalid"))
    for head in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(head)
    return msg


def one_line(e: ValidationError, model: type[BaseModel] | None = None) -> str:
    """The first error of ``e`` as one line: ``LOC: what is wrong; what is allowed (got VALUE)``. ``model`` (the
    validated model) names the allowed keys of an unknown one and describes a missing one."""
    errors = e.errors()
    err = errors[0]
    loc = tuple(x for x in err.get("loc", ()) if x != "[key]")
    what = _what(err, model, loc)
    got = err.get("input")
    shown = (f" (got {got!r:.60})" if err.get("type") in _SHOWN and not isinstance(got, (dict, list, tuple))
             else "")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    where = ".".join(str(x) for x in loc)
    return " ".join(f"{where + ': ' if where else ''}{what}{shown}{more}".split())
