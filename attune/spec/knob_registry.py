"""The knob registry: every knob of a `Layout` declared once (issue 19).

Two tables, and everything else is generated from them:

* ``IDENTITY``: every Layout field, in the order of the layout key, with how it enters **the** identity of a
  layout (`attune.spec.identity.layout_key`: anything that can change a measurement, memory included, is in it,
  normalised where a value cannot change the run) and its recipe path (`recipe_paths`: where a recipe carries
  it, a key of the ``layout`` / ``workload`` block or ``run.flags`` for the options that travel as launch flags).
  A field's flags and most recipe keys are not repeated here: the flag table (``megatron_flags.yaml``,
  `attune.spec.flags`) maps each flag to its field and its recipe key, and `flags_of` / `recipe_paths` read it
  (the same Megatron-LM flags for every engine; ``engine_choices`` in the table narrows a flag's values per
  engine); only the four fields no flag's entry places (DP, the microbatch rows, the distributed optimizer, the
  precision) declare theirs.
* ``KNOBS``: every search-space knob (the Optuna parameter names of ``attune/search/spaces/*.yaml``), with its
  typed domain (a choice of typed values, an integer range, or a '+'-joined list of module names), its default,
  whether it is searched or only fixed, the Layout fields it sets and its knob-distance features. A *generic*
  knob also says where it applies (the rule that expands it only where it can change the layout), how a value
  becomes Layout fields and how a layout reads back as a value; `attune.search.space` then needs no code for
  it: adding such a knob is one entry here and its line in a space file.

The search space's tables (``KNOBS`` kinds, ``KNOB_NOTES``, ``FIXED_ONLY``, ``DEFAULTS``, ``FEATURES``), the
space-file model (`attune.search.spacefile`) and the layout key are generated from these two tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .flag_data import raw_table
from .knobs import OFFLOAD_MODULES, RECOMPUTE_MODULES
from .layout import MOE_DISPATCHERS, Layout

__all__ = ["Choice", "IntSpan", "Modules", "Knob", "KnobContext", "IdentityField", "IDENTITY", "KEY_CONTEXT", "KNOBS",
           "GENERIC", "GENERIC_DENSE", "TRIALS_CSV_COLUMNS", "knob", "flags_of", "modules_of", "recipe_paths"]


# ---------------------------------------------------------------------------------------------- domains
@dataclass(frozen=True)
class Choice:
    """A list of values of one type: ``posint`` (parallel sizes, >= 1), ``bool``, ``fraction`` (in (0, 1]) or
    ``str`` from ``values``."""

    of: str
    values: tuple | None = None
    kind: str = "choice"


@dataclass(frozen=True)
class IntSpan:
    """An integer range ``{low, high}`` (layer offsets and counts)."""

    kind: str = "int"


@dataclass(frozen=True)
class Modules:
    """'+'-joined module names from ``names`` (a tuple of modules as one choice value); ``none``: the value
    ``none`` (no module) is allowed too."""

    names: tuple[str, ...]
    none: bool = False
    kind: str = "choice"


def modules_of(value: str) -> tuple[str, ...]:
    """A '+'-joined module list value as a tuple ('none': ())."""
    return () if value in ("none", "") else tuple(str(value).split("+"))


# ---------------------------------------------------------------------------------------------- knobs
@dataclass(slots=True)
class KnobContext:
    """What a generic knob's rules may read: the layout being built, as far as the core knobs decided it."""

    tp: int
    sp: bool
    pp: int
    cp: int
    dp: int
    vpp: int
    recompute: str
    offload: bool
    shared_experts: bool
    """The model's MoE layers have a shared expert."""
    ep: int = 1
    dispatcher: str | None = None

    @property
    def dp_comm(self) -> bool:
        """There is DP x CP gradient / parameter traffic to overlap."""
        return self.dp * self.cp > 1


@dataclass(frozen=True)
class Knob:
    """One search-space knob."""

    name: str
    """The knob's name in a space file and its Optuna parameter."""
    fields: tuple[str, ...]
    """The Layout fields it sets."""
    domain: Choice | IntSpan | Modules
    default: Any
    """Its value when a space neither searches nor fixes it."""
    searched: bool = True
    """False: a setting a space can only fix (``fixed:``), never search."""
    note: str | None = None
    """What it means and where it is expanded, for readers of a space file."""
    features: tuple[str, ...] = ()
    """Its knob-distance features (`attune.search.space.layout_features`; one unit is one knob step)."""
    feature: Callable[[Layout], float] | None = None
    """Generic knobs: the value of its one feature for a layout."""
    applies: Callable[[KnobContext], bool] | None = None
    """Generic knobs: where the enumeration expands it (elsewhere only its first value is tried: it cannot change
    the layout there). None: not generic (`attune.search.space` builds it with the core knobs)."""
    to_fields: Callable[[Any, KnobContext], dict] | None = None
    """Generic knobs: the Layout fields a value gives in a context."""
    from_layout: Callable[[Layout, Any], Any] | None = None
    """Generic knobs: the value that gives ``layout`` (second argument: the space's first value of the knob)."""
    off_domain_ok: Callable[[Layout], bool] = field(default=lambda lay: False)
    """Generic knobs: a layout whose value this space lacks is still expressed (the knob cannot matter there)."""
    moe_only: bool = False
    """Generic knobs: a mixture-of-experts setting; a dense model keeps the Layout default (neither expanded nor
    set)."""

    @property
    def generic(self) -> bool:
        return self.applies is not None


_BOOL, _POSINT = Choice("bool"), Choice("posint")


def _selective_modules(v, c: KnobContext) -> dict:
    mods = modules_of(v) if c.recompute == "selective" else ()
    return {"recompute_modules": () if mods == ("core_attn",) else mods}


def _overlap(v, c: KnobContext) -> dict:
    on = bool(v)
    return {"overlap_grad_reduce": on, "overlap_param_gather": on, "tp_comm_overlap": on and c.sp}


def _moe_switch(name: str, needs_shared: bool = False) -> Callable[[Any, KnobContext], dict]:
    """A MoE switch (its knob is ``moe_only``); the shared-expert ones set only where the model has a shared
    expert."""
    return lambda v, c: {name: bool(v) and (c.shared_experts or not needs_shared)}


KNOBS: tuple[Knob, ...] = (
    # ---- core knobs: attune.search.space builds the parallel sizes, the split, recompute and batching itself
    Knob("tp", ("tp",), _POSINT, 1, features=("log2_tp",)),
    Knob("sequence_parallel", ("sp",), _BOOL, False, features=("sp",)),
    Knob("pp", ("pp",), _POSINT, 1, features=("log2_pp",)),
    Knob("first_offset", ("first",), IntSpan(), 0, features=("first_shift",)),
    Knob("last_offset", ("last",), IntSpan(), 0, features=("last_shift",)),
    Knob("vpp", ("vpp",), _POSINT, 1, features=("log2_vpp",)),
    Knob("cp", ("cp",), _POSINT, 1, features=("log2_cp",)),
    Knob("recompute", ("recompute_granularity",), Choice("str", ("none", "selective", "full")), "none",
         features=("selective", "full", "recompute_fraction", "uniform")),
    Knob("recompute_method", ("recompute_method",), Choice("str", ("block", "uniform")), "block"),
    Knob("recompute_layers", ("recompute_num_layers",), IntSpan(), 1),
    Knob("optimizer_cpu_offload", ("optimizer_cpu_offload",), _BOOL, False, features=("offload",)),
    Knob("tokens_per_microbatch_rows", ("max_tokens_per_gpu", "micro_batch_size"), _POSINT, 1,
         features=("log2_tokens",)),
    # MoE (issue 14): expert parallel sizes, dispatcher
    Knob("ep", ("ep",), _POSINT, 1, features=("log2_ep",)),
    Knob("etp", ("etp",), _POSINT, 1, features=("log2_etp",)),
    Knob("dispatcher", ("moe_dispatcher",), Choice("str", MOE_DISPATCHERS), "alltoall", features=("allgather",)),
    # ---- issue 15 knobs, generic: expanded only where they can change the layout
    Knob("recompute_modules", ("recompute_modules",), Modules(RECOMPUTE_MODULES), "core_attn",
         note="selective recompute only: '+'-joined --recompute-modules names (core_attn, core_attn+mlp)",
         applies=lambda c: c.recompute == "selective", to_fields=_selective_modules,
         from_layout=lambda lay, first: "+".join(lay.effective_recompute_modules) or "core_attn"),
    Knob("activation_offload", ("offload_modules",), Modules(OFFLOAD_MODULES, none=True), "none",
         note="with no or selective recompute (full recompute keeps no activations to offload): 'none' or "
              "'+'-joined --offload-modules names",
         applies=lambda c: c.recompute != "full",
         to_fields=lambda v, c: {"offload_modules": modules_of(v) if c.recompute != "full" else ()},
         from_layout=lambda lay, first: "+".join(lay.offload_modules) or "none"),
    Knob("offload_fraction", ("offload_fraction",), Choice("fraction"), 1.0,
         note="with optimizer_cpu_offload, under any recompute (partial offload beside recompute where memory "
              "binds; otherwise the domain's first value): --optimizer-offload-fraction",
         applies=lambda c: c.offload,
         to_fields=lambda v, c: {"offload_fraction": float(v) if c.offload else 1.0},
         from_layout=lambda lay, first: lay.offload_fraction if lay.optimizer_cpu_offload else first,
         off_domain_ok=lambda lay: not lay.optimizer_cpu_offload),
    Knob("comm_overlap", ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap"), _BOOL, False,
         note="--overlap-grad-reduce and --overlap-param-gather (and --tp-comm-overlap at TP > 1 with SP); "
              "expanded only where there is DP x CP or TP communication to overlap",
         applies=lambda c: c.dp_comm or (c.tp > 1 and c.sp), to_fields=_overlap,
         from_layout=lambda lay, first: bool(lay.overlap_grad_reduce)),
    # MoE: the expert all-to-all of one microbatch under another's compute (megatron-core's combined 1F1B); priced
    # in attune/estimator/moe.py, its constraints in attune/spec/moe.py (ep_overlap_rules drop the layouts Megatron
    # refuses: PP > 1 without VPP, full recompute, the allgather dispatcher, shared-expert overlap)
    Knob("moe_ep_overlap", ("moe_ep_overlap",), _BOOL, False,
         note="--overlap-moe-expert-parallel-comm; MoE models at EP > 1 only (elsewhere there is no expert "
              "all-to-all to hide)",
         applies=lambda c: c.ep > 1, to_fields=_moe_switch("moe_ep_overlap"), moe_only=True,
         from_layout=lambda lay, first: bool(lay.moe_ep_overlap), feature=lambda lay: float(lay.moe_ep_overlap)),
    Knob("stage_layout", ("pipeline_layout",), Choice("str", ("split", "string")), "split",
         note="'split' (first/last counts, middle stages even) or 'string': the same first/last with the middle "
              "remainder spread over the middle stages as --pipeline-model-parallel-layout (PP > 2; at VPP > 1 each "
              "stage's layers spread over its virtual stages, so they need not divide by VPP; first and last at "
              "most their even share: the end stages carry the in-flight activations and the logits; "
              "only where the split would move the remainder onto the last stage)"),
    # ---- settings a space can only fix
    Knob("precision_aware_optimizer", ("precision_aware_optimizer",), _BOOL, True, searched=False),
    Knob("distributed_optimizer", ("distributed_optimizer",), _BOOL, True, searched=False),
    Knob("overlap_cpu_optimizer", ("overlap_cpu_optimizer",), _BOOL, True, searched=False),
    Knob("moe_grouped_gemm", ("moe_grouped_gemm",), _BOOL, True, searched=False,
         applies=lambda c: False, to_fields=_moe_switch("moe_grouped_gemm"), moe_only=True),
    Knob("moe_permute_fusion", ("moe_permute_fusion",), _BOOL, True, searched=False,
         applies=lambda c: False, to_fields=_moe_switch("moe_permute_fusion"), moe_only=True),
    Knob("moe_shared_expert_overlap", ("moe_shared_expert_overlap",), _BOOL, False, searched=False,
         applies=lambda c: False, to_fields=_moe_switch("moe_shared_expert_overlap", needs_shared=True),
         moe_only=True),
)
"""Every knob, in the order of a space's parameters and of the knob-distance features."""

_BY_NAME = {k.name: k for k in KNOBS}
GENERIC: tuple[Knob, ...] = tuple(k for k in KNOBS if k.generic)
"""The knobs `attune.search.space` handles through their declarations alone (expansion, fields, read-back)."""
GENERIC_DENSE: tuple[Knob, ...] = tuple(k for k in GENERIC if not k.moe_only)
"""The generic knobs of a dense model."""


def knob(name: str) -> Knob:
    return _BY_NAME[name]


def flags_of(layout_field: str) -> tuple[str, ...]:
    """The Megatron-LM / slime flags that set a Layout field, from the flag table (its one record of that fact)."""
    return tuple(name for name, e in (raw_table().get("flags") or {}).items()
                 if isinstance(e, dict) and e.get("field") == f"layout.{layout_field}")


# ---------------------------------------------------------------------------------------------- identity
KEY_CONTEXT = ("counts", "virt", "full", "offload", "sp", "n")
"""What the identity's normalisations may read besides the layout ``lay``, derived once per layout
(`attune.spec.identity.layout_key`): ``counts`` the layers of every pipeline stage, ``virt`` of every virtual
stage (() with VPP 1), ``full`` full recompute, ``offload`` optimizer offload, ``sp`` SP that acts (TP > 1),
``n`` full recompute's layer count capped at a chunk's layers."""


@dataclass(frozen=True)
class IdentityField:
    """One item of the layout key."""

    name: str
    """The key item (a Layout field's name, or a derived item: the stage layers)."""
    covers: tuple[str, ...]
    """The Layout fields it carries."""
    value: str
    """The item's value as a Python expression over ``lay`` and KEY_CONTEXT: the field normalised where a value
    cannot change the run (`attune.spec.identity` compiles all of them into one function)."""
    recipe: str | None = None
    """Where a recipe carries the fields, for the fields whose flags do not say it (`recipe_paths`)."""


def recipe_paths(item: IdentityField) -> tuple[str, ...]:
    """Where a recipe carries an identity item: its declared ``recipe``, else the flag table's ``recipe`` keys of
    its fields' flags (the layout-block keys lint compares the run with), else ``run.flags`` for fields that have
    flags but no recipe key (a recipe carries them in its run flags only); () for a derived item."""
    if item.recipe is not None:
        return (item.recipe,)
    table = raw_table().get("flags") or {}
    paths = tuple(dict.fromkeys(e["recipe"] for f in item.covers for e in table.values()
                                if isinstance(e, dict) and e.get("field") == f"layout.{f}" and e.get("recipe")))
    return paths or (("run.flags",) if any(flags_of(f) for f in item.covers) else ())


def _item(name: str, value: str, recipe: str | None = None) -> IdentityField:
    """The key item of one Layout field of that name."""
    return IdentityField(name, (name,), value, recipe)


def _plain(name: str, recipe: str | None = None, *, as_bool: bool = False) -> IdentityField:
    return IdentityField(name, (name,), f"bool(lay.{name})" if as_bool else f"lay.{name}", recipe)


IDENTITY: tuple[IdentityField, ...] = (
    _plain("tp"),
    _item("sp", "sp"),
    _plain("pp"), _plain("dp", "layout.dp"), _plain("cp"), _plain("vpp"),
    # the split as the layers of every stage and virtual stage: first/last or a layout string giving the same
    # counts are one layout
    IdentityField("stage_layers", ("first", "last", "pipeline_layout"), "counts"),
    IdentityField("virtual_stage_layers", (), "virt"),
    _plain("account_for_embedding", as_bool=True), _plain("account_for_loss", as_bool=True),
    _plain("recompute_granularity"),
    # the method and the layer count only with full recompute, the count capped at a chunk's layers (block
    # recompute of N >= a chunk's layers recomputes the whole chunk; uniform groups of N >= it are one group).
    # The uniform group size IS identity: every group keeps its input and one group is rebuilt in backward
    # (attune/estimator/memory.py, uniform branch), so groups of 2 and of 3 use different memory.
    _item("recompute_method", "lay.recompute_method if full else None"),
    _item("recompute_num_layers", "n"),
    _item("recompute_modules", "tuple(sorted(lay.effective_recompute_modules))"),
    _item("offload_modules", "tuple(sorted(lay.offload_modules))"),
    _plain("mtp_layers"),
    _plain("distributed_optimizer", "layout.distributed_optimizer", as_bool=True),
    _plain("precision_aware_optimizer", as_bool=True),
    _item("optimizer_cpu_offload", "offload"),
    _item("offload_fraction", "float(lay.offload_fraction) if offload else None"),
    _item("overlap_cpu_optimizer", "bool(lay.overlap_cpu_optimizer) if offload else None"),
    _plain("precision", "workload.precision"),
    _plain("overlap_grad_reduce", as_bool=True), _plain("overlap_param_gather", as_bool=True),
    _item("tp_comm_overlap", "bool(lay.tp_comm_overlap) and sp"),
    # the microbatch size only without dynamic batching
    _item("max_tokens_per_gpu", "lay.max_tokens_per_gpu or None"),
    _item("micro_batch_size", "None if lay.max_tokens_per_gpu else lay.micro_batch_size", "layout.rows_per_microbatch"),
    _plain("ep"), _plain("etp"), _plain("moe_dispatcher"),
    _plain("moe_grouped_gemm", as_bool=True), _plain("moe_permute_fusion", as_bool=True),
    _plain("moe_shared_expert_overlap", as_bool=True), _plain("moe_capacity_factor"),
    _plain("moe_force_balance", as_bool=True), _plain("moe_ep_overlap", as_bool=True),
    # low precision (issue 22): the recipe only where a format is set, as the flags say
    _plain("fp8_format"),
    _item("fp8_recipe", "lay.fp8_recipe if lay.fp8_format else None"),
    _plain("fp8_param_gather", as_bool=True),
    _plain("fp4_format"),
)
"""The layout key's items, in its fixed order: every Layout field is covered by exactly one."""


TRIALS_CSV_COLUMNS = ("tp", "sp", "pp", "first", "last", "vpp", "cp", "dp", "recompute_granularity", "recompute_method",
                      "recompute_num_layers", "optimizer_cpu_offload", "max_tokens_per_gpu")
"""The Layout fields a trials.csv carries in columns of their own, in column order (attune.reporting.trials_csv
writes them; the replay runner reads a trials.csv back by them and matches the other fields as unknown)."""
