"""Megatron-LM / slime command-line flags: the one flag table and what derives from it.

``megatron_flags.yaml`` (beside this module) records, for every flag attune knows, its arity, value type,
argparse choices, default, owner (Megatron-LM, slime or slime's Megatron patch), the ``Layout`` /
``Workload`` field it sets, its numerics class and its source. Its header documents the keys and the
slime / Megatron-LM commits it describes. From it:

* ``flag_table`` / ``known_flag``: typed ``FlagSpec`` records (recipe lint and the numerics rules read
  these);
* ``flag_parser``: a real ``argparse.ArgumentParser`` of the table's flags (``parse_known_args``: flags
  the table does not hold are collected, not rejected);
* ``from_flags`` / ``to_flags``: a ``Layout`` and ``Workload`` in and out of flags, through the table's
  field mapping (``from_flags(to_flags(...))`` gives the same layout back);
* ``LAYOUT_FLAGS`` / ``WORKLOAD_FLAGS`` / ``SPECIAL_FLAGS``: read-only views of the field mapping.

A bad value is a one-line ``FlagError`` (``--tensor-model-parallel-size 'abc': expected an integer``); a
layout the flags describe that breaks a rule is a ``LayoutError``.
"""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Mapping

from attune.errors import FlagError, LayoutError

from .engine import Engine
from .flag_data import TABLE_FILE, engine_choices, raw_table
from .layout import Layout, Workload
from .model import ModelSpec
from .pipeline_layout import expand
from .placement import stage_layer_counts
from .rules import derive_dp

__all__ = [
    "FlagSpec", "NoEffect", "ParsedFlags", "flag_table", "flag_prefixes", "known_flag", "table_describes", "flag_parser",
    "from_flags", "to_flags", "format_value", "engine_choices", "LAYOUT_FLAGS", "WORKLOAD_FLAGS", "SPECIAL_FLAGS", "TABLE_FILE",
]

ARITIES = ("switch", "value", "values")
VALUE_TYPES = ("int", "float", "str", "bool")
OWNERS = ("megatron", "slime", "slime-patch")
NUMERICS_CLASSES = ("layout", "numerics")
EMITS = ("changed", "always", "never")

# Flags from_flags reads with code rather than through a field (the table notes say so):
# slime's dynamic batching switch (ParsedFlags.dynamic_batching; with it --max-tokens-per-gpu is read and
# --micro-batch-size is not written), and the older layers-per-virtual-stage form of VPP.
DYNAMIC_BATCHING = "--use-dynamic-batch-size"
LAYERS_PER_VIRTUAL_STAGE = "--num-layers-per-virtual-pipeline-stage"
MICRO_BATCH = "--micro-batch-size"
# Issue 15: the activation-offloading switch is written / read from layout.offload_modules (non-empty: on),
# and an explicit pipeline layout string sets VPP itself (Megatron refuses both flags together).
FINE_GRAINED_OFFLOAD = "--fine-grained-activation-offloading"
PIPELINE_LAYOUT = "--pipeline-model-parallel-layout"
VIRTUAL_STAGES = "--num-virtual-stages-per-pipeline-rank"

_ENTRY_KEYS = {"arity", "type", "nargs", "choices", "default", "unset", "owner", "field", "sets", "fixed", "emit",
               "only_with", "recipe", "recipe_optional", "class", "requires", "note", "no_effect",
               "engine_choices"}
_NO_EFFECT_KEYS = {"when", "reason", "source"}
_TARGETS = {"layout": {f.name for f in fields(Layout)} - {"dp"}, "workload": {f.name for f in fields(Workload)}}
_MISSING = object()


@dataclass(frozen=True)
class FlagSpec:
    """One flag of the table (see the header of megatron_flags.yaml for what each key means)."""

    name: str
    """The flag, e.g. ``--tensor-model-parallel-size`` (for a prefix family, the prefix: ``--sglang-``)."""
    arity: str
    """switch (no value) | value (exactly one) | values (``nargs``)."""
    type: str
    """int | float | str | bool (bool for switches)."""
    owner: str
    """megatron | slime | slime-patch."""
    nargs: str | None = None
    """For ``values``: ``+`` (at least one) or ``*`` (any number)."""
    choices: tuple[Any, ...] | None = None
    """argparse choices, if any."""
    default: Any = None
    """The value an absent flag takes (False for switches; None: unknown / None)."""
    unset: Any = _MISSING
    """The field's value when the flag is absent, where it differs from ``default``."""
    field: str | None = None
    """``layout.<name>`` or ``workload.<name>``: the Layout / Workload field the value goes to."""
    sets: Any = None
    """For a switch: the constant it sets ``field`` to (``--bf16`` sets layout.precision to bf16)."""
    fixed: Any = None
    """The only value attune models (from_flags rejects another; to_flags writes it)."""
    emit: str = "changed"
    """How to_flags writes the field: always | never | changed (differs from ``absent``; switches: true)."""
    only_with: str | None = None
    """to_flags writes it only together with this flag (``FLAG`` or ``FLAG=VALUE``)."""
    recipe: str | None = None
    """The recipe key (dotted path) lint compares the run's value with."""
    recipe_optional: bool = False
    """Lint compares ``recipe`` only when the recipe has the key."""
    cls: str | None = None
    """Numerics class: layout | numerics; None: not classed (``unknown`` to the numerics rules)."""
    requires: tuple[str, ...] = ()
    """Tests a difference in this flag needs beyond ``convergence``."""
    note: str | None = None
    """What else to know, with its source."""
    prefix: bool = False
    """True for a prefix family (every flag starting with ``name``)."""
    no_effect: "NoEffect | None" = None
    """When the flag is accepted but does nothing (``no_effect`` in the table), else None."""

    @property
    def absent(self) -> Any:
        """The field's value when the flag is absent: ``unset`` if given, else ``default``."""
        return self.default if self.unset is _MISSING else self.unset

    @property
    def has_unset(self) -> bool:
        """True when the table gives the field's own name for "absent" (``unset``)."""
        return self.unset is not _MISSING

    @property
    def target(self) -> tuple[str, str] | None:
        """(``layout`` | ``workload``, field name), or None when the flag sets no field."""
        if self.field is None:
            return None
        owner, _, name = self.field.partition(".")
        return owner, name

    @property
    def dest(self) -> str:
        """The argparse destination: the field for switches that set a constant (they share it, the last
        one given wins), else the flag itself."""
        return self.field if self.sets is not None else self.name

    @property
    def min_values(self) -> int:
        """How many values the flag needs at least (0 for switches and ``nargs *``)."""
        if self.arity == "value":
            return 1
        return 1 if self.arity == "values" and self.nargs != "*" else 0

    def convert(self, text: str) -> Any:
        """One value of this flag from its text; a one-line ``FlagError`` when argparse would reject it."""
        if self.arity == "switch":
            raise FlagError(f"{self.name} takes no value (got {text!r})")
        try:
            value = int(text) if self.type == "int" else float(text) if self.type == "float" else str(text)
        except ValueError:
            raise FlagError(f"{self.name} {text!r}: expected {'an integer' if self.type == 'int' else 'a number'}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise FlagError(f"{self.name} {text!r}: expected a finite number")
        if self.choices is not None and value not in self.choices:
            raise FlagError(f"{self.name} {text!r}: expected one of {', '.join(map(str, self.choices))}")
        return value


@dataclass(frozen=True)
class NoEffect:
    """A flag slime / Megatron-LM accept but ignore under a condition (``no_effect`` in the table)."""

    when: str
    """``always`` | ``unless FLAG=VALUE`` (no effect unless the run passes FLAG with VALUE) | ``env NAME``
    (no effect when the launch exports NAME)."""
    reason: str
    """Why it has no effect."""
    source: str
    """Where that was read (file and line of slime / Megatron-LM)."""

    def applies(self, flags: Mapping[str, str | None], env: Mapping[str, str]) -> bool:
        """Whether the condition holds for a run with these flags (flag -> value text) and exports."""
        kind, _, arg = self.when.partition(" ")
        if kind == "always":
            return True
        if kind == "env":
            return arg in env
        flag, _, value = arg.partition("=")
        return flags.get(flag) != value


def _no_effect(where: str, entry: Any) -> NoEffect | None:
    if entry is None:
        return None
    if not isinstance(entry, dict) or set(entry) != _NO_EFFECT_KEYS:
        raise ValueError(f"{where}: no_effect needs exactly the keys {', '.join(sorted(_NO_EFFECT_KEYS))}")
    when = str(entry["when"])
    kind, _, arg = when.partition(" ")
    if not (when == "always" or (kind == "env" and arg) or (kind == "unless" and "=" in arg and arg.startswith("--"))):
        raise ValueError(f"{where}: no_effect.when {when!r}; allowed: always, unless --FLAG=VALUE, env NAME")
    return NoEffect(when=when, reason=str(entry["reason"]), source=str(entry["source"]))


# ------------------------------------------------------------------------------------------- the table

def _spec(name: str, entry: Any, *, prefix: bool = False) -> FlagSpec:
    where = f"{TABLE_FILE}: {name}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping")
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    arity, vtype, owner = entry.get("arity"), entry.get("type"), entry.get("owner")
    if arity not in ARITIES:
        raise ValueError(f"{where}: arity {arity!r}; allowed: {', '.join(ARITIES)}")
    if vtype not in VALUE_TYPES or (vtype == "bool") != (arity == "switch"):
        raise ValueError(f"{where}: type {vtype!r} (switches are bool, valued flags int, float or str)")
    if owner not in OWNERS:
        raise ValueError(f"{where}: owner {owner!r}; allowed: {', '.join(OWNERS)}")
    nargs = entry.get("nargs")
    if (arity == "values") != (nargs is not None) or nargs not in (None, "+", "*"):
        raise ValueError(f"{where}: nargs {nargs!r} (values flags take '+' or '*', others none)")
    emit = entry.get("emit", "changed")
    if emit not in EMITS:
        raise ValueError(f"{where}: emit {emit!r}; allowed: {', '.join(EMITS)}")
    fld = entry.get("field")
    if fld is not None:
        owner_obj, _, fname = str(fld).partition(".")
        if fname not in _TARGETS.get(owner_obj, ()):
            raise ValueError(f"{where}: field {fld!r} is not a Layout or Workload field")
    cls = entry.get("class")
    if cls is not None and cls not in NUMERICS_CLASSES:
        raise ValueError(f"{where}: class {cls!r}; allowed: {', '.join(NUMERICS_CLASSES)}")
    if entry.get("sets") is not None and (arity != "switch" or fld is None):
        raise ValueError(f"{where}: `sets` needs a switch with a field")
    choices = entry.get("choices")
    per_engine = entry.get("engine_choices")
    if per_engine is not None and (choices is None or not isinstance(per_engine, dict) or any(
            not isinstance(v, list) or not set(v) <= set(choices) for v in per_engine.values())):
        raise ValueError(f"{where}: engine_choices maps an engine to a list of the flag's choices")
    return FlagSpec(
        name=name, arity=arity, type=vtype, owner=owner, nargs=nargs,
        choices=tuple(choices) if choices is not None else None,
        default=entry.get("default", False if arity == "switch" else None),
        unset=entry["unset"] if "unset" in entry else _MISSING,
        field=fld, sets=entry.get("sets"), fixed=entry.get("fixed"), emit=emit, only_with=entry.get("only_with"),
        recipe=entry.get("recipe"), recipe_optional=bool(entry.get("recipe_optional", False)), cls=cls,
        requires=tuple(entry.get("requires") or ()), note=entry.get("note"), prefix=prefix,
        no_effect=_no_effect(where, entry.get("no_effect")))


@lru_cache(maxsize=1)
def _load() -> tuple[Mapping[str, FlagSpec], tuple[FlagSpec, ...], Mapping[str, str]]:
    data = raw_table()
    specs: dict[str, FlagSpec] = {}
    for name, entry in (data.get("flags") or {}).items():
        if not (isinstance(name, str) and name.startswith("--") and len(name) > 2):
            raise ValueError(f"{TABLE_FILE}: {name!r} is not a --flag")
        specs[name] = _spec(name, entry)
    prefixes = tuple(_spec(p, e, prefix=True) for p, e in (data.get("prefixes") or {}).items())
    for s in specs.values():
        if s.only_with is not None and s.only_with.partition("=")[0] not in specs:
            raise ValueError(f"{TABLE_FILE}: {s.name}: only_with names unknown flag {s.only_with!r}")
    for flag in (DYNAMIC_BATCHING, LAYERS_PER_VIRTUAL_STAGE, MICRO_BATCH):
        if flag not in specs:
            raise ValueError(f"{TABLE_FILE}: {flag} is missing (attune.spec.flags reads it)")
    return MappingProxyType(specs), prefixes, MappingProxyType(dict(data.get("describes") or {}))


def flag_table() -> Mapping[str, FlagSpec]:
    """Every flag of the table, by name, in table order (read-only)."""
    return _load()[0]


def flag_prefixes() -> tuple[FlagSpec, ...]:
    """The flag families the table accepts by prefix (``--sglang-``: every SGLang server argument)."""
    return _load()[1]


def table_describes() -> Mapping[str, str]:
    """The slime / Megatron-LM commits the table describes."""
    return _load()[2]


def known_flag(name: str) -> FlagSpec | None:
    """The table's record of ``name`` (``--flag`` or ``--flag=value``), its prefix family's record, or None."""
    name = name.partition("=")[0]
    spec = flag_table().get(name)
    if spec is not None:
        return spec
    return next((p for p in flag_prefixes() if name.startswith(p.name)), None)


def format_value(value: Any) -> str:
    """A flag value as text that reads back to the same value (1.0 -> ``1``, 0.5 -> ``0.5``, 1e-05)."""
    if isinstance(value, float):
        short = format(value, "g")
        return short if float(short) == value else repr(value)
    return str(value)


# ------------------------------------------------------------------------------------------- argparse

class _FlagParser(argparse.ArgumentParser):
    def error(self, message: str):  # the errors argparse does not raise as ArgumentError
        raise FlagError(" ".join(str(message).split()))


def _type(spec: FlagSpec):
    def convert(text: str) -> Any:
        try:
            return spec.convert(text)
        except FlagError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = spec.type
    return convert


@lru_cache(maxsize=1)
def flag_parser() -> argparse.ArgumentParser:
    """An ``argparse.ArgumentParser`` of every flag in the table, with its arity, type and choices.

    Use ``parse_known_args``: flags the table does not hold come back unparsed. Absent flags are absent
    from the namespace (no defaults are filled in); a switch that sets a constant stores it under its
    field (``layout.precision``). Errors raise ``FlagError``; ``from_flags`` turns them into one line.
    """
    p = _FlagParser(prog="slime/Megatron-LM", add_help=False, allow_abbrev=False, exit_on_error=False,
                    argument_default=argparse.SUPPRESS)
    for spec in flag_table().values():
        if spec.arity == "switch":
            if spec.sets is not None:
                p.add_argument(spec.name, dest=spec.dest, action="store_const", const=spec.sets)
            else:
                p.add_argument(spec.name, dest=spec.dest, action="store_true")
        else:
            p.add_argument(spec.name, dest=spec.dest, type=_type(spec), choices=spec.choices,
                           nargs=spec.nargs, metavar=spec.type.upper())
    return p


def _words(argv: list[str] | str) -> list[str]:
    if isinstance(argv, str):
        try:
            return shlex.split(argv.replace("\\\n", " "))
        except ValueError as e:  # an unclosed quote
            raise FlagError(f"flags {argv[:60]!r}: {e} (quote values the way a shell does)") from None
    return [str(w) for w in argv]


def _parse(words: list[str]) -> dict[str, Any]:
    try:
        ns, _ = flag_parser().parse_known_args(words)
    except argparse.ArgumentError as e:
        name, msg = e.argument_name or "flags", e.message
        if msg.startswith("expected"):  # argparse's "expected one argument" / "at least one argument"
            spec = flag_table().get(name)
            msg = f"{name} needs {'at least one value' if spec is not None and spec.arity == 'values' else 'a value'}"
        elif not msg.startswith(name):
            msg = f"{name}: {msg}"
        raise FlagError(" ".join(msg.split())) from None
    return vars(ns)


# ------------------------------------------------------------------------------------------- field views

def _field_view(owner: str) -> Mapping[str, tuple[str, str]]:
    return MappingProxyType({s.name: (s.target[1], "bool" if s.arity == "switch" else s.type)
                             for s in flag_table().values()
                             if s.target is not None and s.target[0] == owner and s.sets is None})


LAYOUT_FLAGS: Mapping[str, tuple[str, str]] = _field_view("layout")
"""flag -> (Layout field, kind: int | float | str | bool) for the flags that set one Layout field."""
WORKLOAD_FLAGS: Mapping[str, tuple[str, str]] = _field_view("workload")
"""flag -> (Workload field, kind) for the flags that set one Workload field."""
SPECIAL_FLAGS: frozenset[str] = frozenset(
    s.name for s in flag_table().values() if s.sets is not None or s.fixed is not None) | {
    DYNAMIC_BATCHING, LAYERS_PER_VIRTUAL_STAGE, FINE_GRAINED_OFFLOAD}
"""Flags from_flags reads without a one-field mapping (constants, fixed values, dynamic batching, VPP)."""


# ------------------------------------------------------------------------------------------- from / to

@dataclass
class ParsedFlags:
    layout: Layout
    workload: Workload
    ignored: list[str] = field(default_factory=list)
    """Flags with no effect on the layout or workload (unknown to the table, or known without a field),
    in the order given."""
    dynamic_batching: bool = False


def _reads(spec: FlagSpec | None) -> bool:
    return spec is not None and (spec.field is not None or spec.name in SPECIAL_FLAGS)


def from_flags(argv: list[str] | str, model: ModelSpec, world_size: int, base: Workload | None = None) -> ParsedFlags:
    """Read a layout and workload from Megatron-LM / slime command-line flags.

    ``argv`` is a list of words or one shell string. Absent flags take the Layout's defaults, switches
    false (so no --use-distributed-optimizer is no distributed optimizer). DP is derived from
    ``world_size``. ``--num-layers-per-virtual-pipeline-stage`` becomes the layout's VPP; with
    ``--use-dynamic-batch-size`` the layout batches by ``--max-tokens-per-gpu`` (which it then needs),
    without it ``--max-tokens-per-gpu`` is dropped. Raises ``FlagError`` for a bad value and
    ``LayoutError`` for a layout that breaks a rule.
    """
    words = _words(argv)
    given = _parse(words)
    targets: dict[str, dict[str, Any]] = {"layout": {}, "workload": {}}
    for spec in flag_table().values():
        if spec.fixed is not None and spec.dest in given and given[spec.dest] != spec.fixed:
            raise LayoutError(f"{spec.name} {given[spec.dest]}: only {spec.fixed} is supported")
        if spec.target is None:
            continue
        owner, name = spec.target
        if spec.arity == "switch" and spec.sets is None:
            targets[owner][name] = spec.dest in given
        elif spec.dest in given:
            targets[owner][name] = tuple(given[spec.dest]) if spec.arity == "values" else given[spec.dest]
    lay, wl = targets["layout"], targets["workload"]
    if FINE_GRAINED_OFFLOAD not in given:
        lay.pop("offload_modules", None)
    if lay.get("pipeline_layout") is not None:
        n_stages = len(expand(lay["pipeline_layout"]))
        pp_given = lay.get("pp", 1)
        if VIRTUAL_STAGES in given and given[VIRTUAL_STAGES] * pp_given != n_stages:
            raise LayoutError(f"{PIPELINE_LAYOUT} has {n_stages} stages but PP {pp_given} x "
                              f"{VIRTUAL_STAGES} {given[VIRTUAL_STAGES]} = {pp_given * given[VIRTUAL_STAGES]}")
        if n_stages % pp_given:
            raise LayoutError(f"{PIPELINE_LAYOUT} has {n_stages} stages, not a multiple of PP {pp_given}")
        lay["vpp"] = n_stages // pp_given
    dynamic = DYNAMIC_BATCHING in given
    if dynamic and "max_tokens_per_gpu" not in lay:
        raise LayoutError(f"{DYNAMIC_BATCHING} needs --max-tokens-per-gpu")
    if not dynamic:
        lay.pop("max_tokens_per_gpu", None)
    tp, pp, cp = lay.get("tp", 1), lay.get("pp", 1), lay.get("cp", 1)
    if "etp" not in lay and lay.get("ep", 1) > 1:
        lay["etp"] = tp  # Megatron validate_args: an absent --expert-tensor-parallel-size is the TP size
    lay["dp"] = derive_dp(world_size, tp, pp, cp)
    layers_per_vstage = given.get(LAYERS_PER_VIRTUAL_STAGE)
    if layers_per_vstage is not None:
        counts = stage_layer_counts(Layout(pp=pp, first=lay.get("first"), last=lay.get("last")), model.num_layers)
        if layers_per_vstage < 1 or counts[0] % layers_per_vstage:
            raise LayoutError(f"{LAYERS_PER_VIRTUAL_STAGE} {layers_per_vstage} must divide the {counts[0]} layers per stage")
        lay["vpp"] = counts[0] // layers_per_vstage
    ignored = [w.partition("=")[0] for w in words
               if w.startswith("--") and len(w) > 2 and not _reads(flag_table().get(w.partition("=")[0]))]
    return ParsedFlags(Layout(**lay), replace(base or Workload(), **wl), ignored, dynamic)


def to_flags(layout: Layout, workload: Workload | None = None, engine: Engine | None = None) -> list[str]:
    """Megatron-LM / slime flags for a layout (and the workload's batch and row length), in table order;
    ``from_flags`` reads them back to the same layout. ``engine`` is accepted for callers that pass it."""
    objects = {"layout": layout, "workload": workload}
    out: list[str] = []
    written: dict[str, str | None] = {}  # flag -> the words written after it (None for a switch)
    for spec in flag_table().values():
        value = _flag_value(spec, layout, objects, written)
        if value is _NOT_WRITTEN:
            continue
        out.append(spec.name)
        if spec.arity == "values":
            words = [format_value(v) for v in value]
            out.extend(words)
            written[spec.name] = " ".join(words)
            continue
        text = None if spec.arity == "switch" else format_value(value)
        if text is not None:
            out.append(text)
        written[spec.name] = text
    return out


_NOT_WRITTEN = object()
"""``_flag_value``'s answer for a flag the layout does not write."""


def _flag_value(spec: FlagSpec, layout: Layout, objects: dict, written: dict[str, str | None]) -> Any:
    """The value ``to_flags`` writes for ``spec`` (None for a switch), or ``_NOT_WRITTEN``; ``written`` holds the
    flags written before it (its ``only_with`` condition reads them)."""
    dynamic = bool(layout.max_tokens_per_gpu)
    if spec.emit == "never":
        return _NOT_WRITTEN
    if spec.name == DYNAMIC_BATCHING:
        return None if dynamic else _NOT_WRITTEN
    if spec.name == FINE_GRAINED_OFFLOAD:
        return None if layout.offload_modules else _NOT_WRITTEN
    if (spec.name == MICRO_BATCH and dynamic) or (spec.name == VIRTUAL_STAGES and layout.pipeline_layout is not None):
        return _NOT_WRITTEN
    holds = spec.only_with is None or _condition_holds(spec.only_with, written)
    if spec.arity == "values" and spec.target is not None and objects[spec.target[0]] is not None:
        value = getattr(objects[spec.target[0]], spec.target[1]) if holds else None
        return value if value else _NOT_WRITTEN
    if not holds:
        return _NOT_WRITTEN
    if spec.fixed is not None:
        return spec.fixed
    if spec.target is None or objects[spec.target[0]] is None:
        return _NOT_WRITTEN
    value = getattr(objects[spec.target[0]], spec.target[1])
    if spec.sets is not None:
        return None if value == spec.sets else _NOT_WRITTEN
    if spec.arity == "switch":
        return None if value else _NOT_WRITTEN
    if value is not None and (spec.emit == "always" or spec.only_with is not None or value != spec.absent):
        return value
    return _NOT_WRITTEN


def _condition_holds(cond: str, written: dict[str, str | None]) -> bool:
    """``--flag`` (written) or ``--flag=value`` (written with that value)."""
    flag, has_value, value = cond.partition("=")
    return flag in written and (not has_value or written[flag] == value)
