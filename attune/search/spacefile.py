"""The search-space file (``--search-space``, the bundled ``attune/search/spaces/*.yaml``) as a typed, ranged pydantic
model. :func:`attune.search.space.load_space` validates every file with :class:`SpaceFile` and builds the
``SearchSpace`` from it.

A file is a mapping with ``name``, ``description``, ``knobs`` (each knob a non-empty list of choices, or
``{low: INT, high: INT}`` for an integer knob) and ``fixed`` (one value per setting). The file is closed: an unknown
key, knob or setting is an error naming the allowed ones. Parallel sizes are positive integers (``true`` is not 1),
switches are ``true``/``false`` (``1`` is not true), names are from their fixed sets, fractions finite in (0, 1].
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Optional

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    create_model,
    model_validator,
)

from attune.spec.knob_registry import KNOBS, IntSpan, Knob, Modules
from attune.spec.knob_registry import knob as knob_decl

__all__ = ["SpaceFile", "Knobs", "Fixed", "IntRange", "MAX_INT_RANGE", "MAX_CHOICES", "MAX_SPACE_SIZE",
           "MODULE_LIST_VALUES"]

# Bounds on a space file, so that enumerating it stays possible: an int knob spans layer offsets or counts (the
# largest bundled model, Llama-3.1-405B, has 126 layers; 1024 is far above), a choice list names parallel sizes or
# modules (tens at most), and the product of all domains stays within 50x the bundled dense space's 2e8.
MAX_INT_RANGE = 1024
MAX_CHOICES = 256
MAX_SPACE_SIZE = 10 ** 10
# '+'-joined module lists: each part must be one of these (attune.spec.knobs)
MODULE_LIST_VALUES = {k.name: k.domain.names for k in KNOBS if isinstance(k.domain, Modules)}


def _module_list(knob: str):
    names, none = MODULE_LIST_VALUES[knob], knob_decl(knob).domain.none

    def check(x: str) -> str:
        parts = [] if x == "none" and none else x.split("+")
        if any(m not in names for m in parts) or not parts and not none:
            raise ValueError(f"{x!r} not allowed; allowed: '+'-joined names of {', '.join(names)}"
                             f"{' or none' if none else ''}")
        return x
    return check


def _fraction(x: float) -> float:
    if not 0 < x <= 1:
        raise ValueError(f"{x!r} must be a fraction in (0, 1]")
    return x


PosInt = Annotated[StrictInt, Field(ge=1)]
Fraction = Annotated[float, Field(strict=True), AfterValidator(_fraction)]


def Choices(t: Any) -> Any:  # noqa: N802 (a type)
    """A knob's domain: a non-empty list of at most MAX_CHOICES values of type ``t``."""
    return Annotated[list[t], Field(min_length=1, max_length=MAX_CHOICES)]


class IntRange(BaseModel):
    """An integer knob's domain, ``{low: INT, high: INT}``, at most MAX_INT_RANGE values."""

    model_config = ConfigDict(extra="forbid")
    low: StrictInt
    high: StrictInt

    @model_validator(mode="after")
    def _ordered(self) -> "IntRange":
        if self.low > self.high:
            raise ValueError(f"low {self.low} > high {self.high}")
        if self.high - self.low + 1 > MAX_INT_RANGE:
            raise ValueError(f"{self.high - self.low + 1:,} values; at most {MAX_INT_RANGE}")
        return self

    def size(self) -> int:
        return self.high - self.low + 1


def _element(k: Knob) -> Any:
    """The pydantic type of one value of knob ``k`` (its registry domain)."""
    d = k.domain
    if isinstance(d, Modules):
        return Annotated[StrictStr, AfterValidator(_module_list(k.name))]
    if isinstance(d, IntSpan):
        return StrictInt
    if d.values is not None:
        return Literal[d.values]
    return {"posint": PosInt, "bool": StrictBool, "fraction": Fraction}[d.of]


# Both models are generated from the knob registry (attune.spec.knob_registry.KNOBS), in its order.
# A field left out of the file keeps its default None (not validated); a `null` written in the file is refused.
Knobs = create_model(
    "Knobs", __config__=ConfigDict(extra="forbid", title="knob"),
    __doc__="``knobs:``, each the domain Optuna samples (attune.search.space.KNOBS names the same knobs).",
    **{k.name: (IntRange if isinstance(k.domain, IntSpan) else Choices(_element(k)), None)
       for k in KNOBS if k.searched})
Fixed = create_model(
    "Fixed", __config__=ConfigDict(extra="forbid", title="setting"),
    __doc__="``fixed:``, one value per knob or fixed-only setting.",
    **{k.name: (_element(k), None) for k in KNOBS})


def _empty_is_none(v: Any) -> Any:
    return {} if v is None else v


class SpaceFile(BaseModel):
    """A search-space file (module docstring)."""

    model_config = ConfigDict(extra="forbid")
    name: Optional[StrictStr] = None
    description: Optional[StrictStr] = None
    knobs: Annotated[Knobs, BeforeValidator(_empty_is_none)] = Knobs()
    fixed: Annotated[Fixed, BeforeValidator(_empty_is_none)] = Fixed()

    @model_validator(mode="after")
    def _consistent(self) -> "SpaceFile":
        both = [k for k in Knobs.model_fields if k in self.knobs.model_fields_set and k in self.fixed.model_fields_set]
        if both:
            raise ValueError(f"knobs.{both[0]}: also set in 'fixed' (contradictory)")
        f = self.fixed
        if f.optimizer_cpu_offload is True and f.precision_aware_optimizer is False:
            raise ValueError("fixed.optimizer_cpu_offload: CPU offload needs precision_aware_optimizer true")
        if f.distributed_optimizer is False and f.precision_aware_optimizer is True:
            raise ValueError("fixed.precision_aware_optimizer: needs distributed_optimizer true")
        size = math.prod(v.size() if isinstance(v, IntRange) else len(v)
                         for k in self.knobs.model_fields_set if (v := getattr(self.knobs, k)) is not None)
        if size > MAX_SPACE_SIZE:
            raise ValueError(f"{size:.3g} knob combinations; at most {MAX_SPACE_SIZE:.0e} (the dense space has 2e8): "
                             f"narrow a knob")
        return self
