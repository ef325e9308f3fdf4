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

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, \
    model_validator

from attune.spec.knobs import OFFLOAD_MODULES, RECOMPUTE_MODULES

__all__ = ["SpaceFile", "Knobs", "Fixed", "IntRange", "MAX_INT_RANGE", "MAX_CHOICES", "MAX_SPACE_SIZE",
           "MODULE_LIST_VALUES"]

# Bounds on a space file, so that enumerating it stays possible: an int knob spans layer offsets or counts (the
# largest bundled model, Llama-3.1-405B, has 126 layers; 1024 is far above), a choice list names parallel sizes or
# modules (tens at most), and the product of all domains stays within 50x the bundled dense space's 2e8.
MAX_INT_RANGE = 1024
MAX_CHOICES = 256
MAX_SPACE_SIZE = 10 ** 10
# '+'-joined module lists: each part must be one of these (attune.spec.knobs)
MODULE_LIST_VALUES = {"recompute_modules": RECOMPUTE_MODULES, "activation_offload": OFFLOAD_MODULES}


def _module_list(knob: str):
    names = MODULE_LIST_VALUES[knob]

    def check(x: str) -> str:
        parts = [] if x == "none" and knob == "activation_offload" else x.split("+")
        if any(m not in names for m in parts) or not parts and knob == "recompute_modules":
            raise ValueError(f"{x!r} not allowed; allowed: '+'-joined names of {', '.join(names)}"
                             f"{' or none' if knob == 'activation_offload' else ''}")
        return x
    return check


def _fraction(x: float) -> float:
    if not 0 < x <= 1:
        raise ValueError(f"{x!r} must be a fraction in (0, 1]")
    return x


PosInt = Annotated[StrictInt, Field(ge=1)]
Recompute = Literal["none", "selective", "full"]
RecomputeMethod = Literal["block", "uniform"]
Dispatcher = Literal["alltoall", "allgather", "flex"]
StageLayout = Literal["split", "string"]
RecomputeModules = Annotated[StrictStr, AfterValidator(_module_list("recompute_modules"))]
ActivationOffload = Annotated[StrictStr, AfterValidator(_module_list("activation_offload"))]
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


# A field left out of the file keeps its default None (not validated); a `null` written in the file is refused.
class Knobs(BaseModel):
    """``knobs:``, each the domain Optuna samples (attune.search.space.KNOBS names the same knobs)."""

    model_config = ConfigDict(extra="forbid", title="knob")
    tp: Choices(PosInt) = None
    sequence_parallel: Choices(StrictBool) = None
    pp: Choices(PosInt) = None
    first_offset: IntRange = None
    last_offset: IntRange = None
    vpp: Choices(PosInt) = None
    cp: Choices(PosInt) = None
    recompute: Choices(Recompute) = None
    recompute_method: Choices(RecomputeMethod) = None
    recompute_layers: IntRange = None
    optimizer_cpu_offload: Choices(StrictBool) = None
    tokens_per_microbatch_rows: Choices(PosInt) = None
    ep: Choices(PosInt) = None
    etp: Choices(PosInt) = None
    dispatcher: Choices(Dispatcher) = None
    recompute_modules: Choices(RecomputeModules) = None
    offload_fraction: Choices(Fraction) = None
    activation_offload: Choices(ActivationOffload) = None
    comm_overlap: Choices(StrictBool) = None
    stage_layout: Choices(StageLayout) = None


class Fixed(BaseModel):
    """``fixed:``, one value per knob or fixed-only setting."""

    model_config = ConfigDict(extra="forbid", title="setting")
    tp: PosInt = None
    sequence_parallel: StrictBool = None
    pp: PosInt = None
    first_offset: StrictInt = None
    last_offset: StrictInt = None
    vpp: PosInt = None
    cp: PosInt = None
    recompute: Recompute = None
    recompute_method: RecomputeMethod = None
    recompute_layers: StrictInt = None
    optimizer_cpu_offload: StrictBool = None
    tokens_per_microbatch_rows: PosInt = None
    ep: PosInt = None
    etp: PosInt = None
    dispatcher: Dispatcher = None
    recompute_modules: RecomputeModules = None
    offload_fraction: Fraction = None
    activation_offload: ActivationOffload = None
    comm_overlap: StrictBool = None
    stage_layout: StageLayout = None
    precision_aware_optimizer: StrictBool = None
    distributed_optimizer: StrictBool = None
    overlap_cpu_optimizer: StrictBool = None
    moe_grouped_gemm: StrictBool = None
    moe_permute_fusion: StrictBool = None
    moe_shared_expert_overlap: StrictBool = None


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
