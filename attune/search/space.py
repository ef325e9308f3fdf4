"""Search spaces: knobs with fixed Optuna domains, and their mapping to a Layout.

The bundled spaces are package data in `attune/search/spaces/` (read with `importlib.resources`, so they
ship in the wheel): `dense` (the default) and `small` (the torch runner on CPU). `load_space` takes a
bundled name or a path to your own YAML file.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import numpy as np
import optuna
from pydantic import ValidationError

from attune.errors import LayoutError, SearchSpaceError
from attune.search.spacefile import IntRange, SpaceFile
from attune.spec.engine import Engine
from attune.spec.identity import KEY_DERIVED_FIELDS, layout_from_dict, layout_key  # noqa: F401 (re-exported)
from attune.spec.knob_registry import GENERIC, GENERIC_DENSE, KnobContext
from attune.spec.knob_registry import KNOBS as REGISTRY
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec
from attune.spec.pipeline_layout import layout_stage_counts, layout_string
from attune.spec.placement import stage_layer_counts, virtual_stage_counts
from attune.spec.rules import check, layout_string_refusal
from attune.spec.textio import load_yaml, read_text
from attune.spec.validation import one_line

# The tables below are generated from the knob registry (attune.spec.knob_registry.KNOBS: each knob declared once)
# knob -> kind: "choice" (a list of values) or "int" ({low, high}), for the knobs a space may search
KNOBS = {k.name: k.domain.kind for k in REGISTRY if k.searched}
KNOB_NOTES = {k.name: k.note for k in REGISTRY if k.note}
"""What each knob that needs saying means and where it is expanded."""
FIXED_ONLY = {k.name for k in REGISTRY if not k.searched}
DEFAULTS = {k.name: k.default for k in REGISTRY}
# knob-distance features of a layout (see `layout_features`) and their weights: one unit is "one knob step"
# (a doubling of TP/PP/VPP/CP/rows, a switch, a recompute kind, 4 layers moved between stages); a generic knob's
# one feature (its declared `feature`) comes after the core knobs' ones
_FEATURED = tuple(k for k in GENERIC if k.feature is not None)
FEATURES = tuple(f for k in REGISTRY for f in k.features) + tuple(k.name for k in _FEATURED)
LAYERS_PER_FEATURE_UNIT = 4.0


def params_key(params: dict) -> tuple:
    """Identity of an Optuna parameter set (sorted items)."""
    return tuple(sorted(params.items()))


def layout_features(layout: Layout, num_layers: int) -> np.ndarray:
    """A layout as a point for knob distances (FEATURES, unit = one knob step)."""
    counts = stage_layer_counts(layout, num_layers)
    even = num_layers / layout.pp
    rec = layout.recompute_granularity
    per_chunk = max(counts) / layout.vpp
    frac = 0.0
    if rec == "full":
        frac = 1.0 if layout.recompute_method == "uniform" else min(1.0, (layout.recompute_num_layers or 1) / per_chunk)
    tokens = layout.max_tokens_per_gpu * layout.cp if layout.max_tokens_per_gpu else layout.micro_batch_size
    return np.array([math.log2(layout.tp), float(layout.sp), math.log2(layout.pp),
                     (counts[0] - even) / LAYERS_PER_FEATURE_UNIT, (counts[-1] - even) / LAYERS_PER_FEATURE_UNIT,
                     math.log2(layout.vpp), math.log2(layout.cp), float(rec == "selective"), float(rec == "full"),
                     frac, float(rec == "full" and layout.recompute_method == "uniform"),
                     float(layout.optimizer_cpu_offload), math.log2(max(tokens, 1)),
                     # MoE (issue 14): EP / ETP steps and the dispatcher, so EP variants are not near-duplicates
                     math.log2(layout.ep), math.log2(layout.etp), float(layout.moe_dispatcher == "allgather"),
                     *(float(k.feature(layout)) for k in _FEATURED)])




@dataclass(frozen=True)
class SearchSpace:
    name: str
    path: str
    knobs: dict  # knob -> list of choices or (low, high)
    fixed: dict

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        out = {}
        for k, v in self.knobs.items():
            if KNOBS[k] == "int":
                out[k] = optuna.distributions.IntDistribution(v[0], v[1])
            else:
                out[k] = optuna.distributions.CategoricalDistribution(list(v))
        return out

    def suggest(self, trial: optuna.Trial) -> dict:
        params = {}
        for k, dist in self.distributions().items():
            if isinstance(dist, optuna.distributions.IntDistribution):
                params[k] = trial.suggest_int(k, dist.low, dist.high)
            else:
                params[k] = trial.suggest_categorical(k, dist.choices)
        return params

    def domain(self, key: str) -> list:
        """Every value knob `key` can take here (its fixed or default value when it is not a knob)."""
        if key not in self.knobs:
            return [self.value({}, key)]
        dom = self.knobs[key]
        return list(range(dom[0], dom[1] + 1)) if KNOBS[key] == "int" else list(dom)

    def splits(self, L: int, pp: int, strings_refused: bool) -> dict[tuple, tuple[int, int, str]]:
        """The distinct layer splits of `L` layers over `pp` stages the offsets and stage layouts give, in the
        enumeration's order: split -> (first offset, last offset, stage layout) of the first that gives it
        (`strings_refused`: the engine refuses layout strings for this model)."""
        near0 = lambda k: min(self.domain(k), key=abs)  # noqa: E731
        splits: dict[tuple, tuple[int, int, str]] = {}
        fos = self.domain("first_offset") if pp > 1 else [near0("first_offset")]
        los = self.domain("last_offset") if pp > 2 else [near0("last_offset")]
        stage_layouts = self.domain("stage_layout")
        if strings_refused:
            stage_layouts = [x for x in stage_layouts if x != "string"] or stage_layouts
        for fo, lo in itertools.product(fos, los):
            if pp == 1:
                splits.setdefault((0, 0), (fo, lo, self.domain("stage_layout")[0]))
                continue
            even = L // pp
            first = even + fo
            last = L - first if pp == 2 else even + lo
            if "string" in stage_layouts and pp > 2 and fo <= 0 and lo <= 0 and first >= 1 and last >= 1:
                sc = _string_counts(L, pp, first, last)
                if sc is not None:  # issue 15: the middle remainder spread instead of moved onto the last stage
                    splits.setdefault(("string",) + tuple(sc), (fo, lo, "string"))
            if pp > 2 and L - first - last > 0:
                last += (L - first - last) % (pp - 2)
            if first < 1 or last < 1 or L - first - last < pp - 2:
                continue
            splits.setdefault((first, last), (fo, lo, stage_layouts[0] if "split" not in stage_layouts else "split"))
        return splits

    def enumerate(self, model: ModelSpec, world_size: int, workload: Workload, engine: Engine,
                  shard: tuple[int, int] | None = None) -> list:
        """Every distinct valid layout of the space with one parameter set that maps to it (the first in knob
        order), deduplicated by `layout_key`. Knobs that cannot change the layout are not expanded: splits at
        PP 1, the last offset at PP 2, recompute method and layers without full recompute, uniform groups,
        block layers past a chunk's layers, SP at TP 1. Returns (params, layout) pairs in knob order; with
        `shard=(k, n)` only every n-th block of SHARD_BLOCK candidates from the k-th, as (order, params, layout,
        layout_key) tuples (parallel scoring merges the shards by order and deduplicates again by the key)."""
        L = model.num_layers
        near0 = lambda k: min(self.domain(k), key=abs)  # noqa: E731
        fixed_rl, fixed_rm = near0("recompute_layers"), self.domain("recompute_method")[0]
        out: dict[tuple, tuple[dict, Layout]] = {}
        k_shard, n_shards = shard or (0, 1)
        counter = -1
        # the searchable generic knobs with their domain here and its first value (a one-value domain never expands)
        generic = [(k, d, d[:1]) for k in (GENERIC if model.moe else GENERIC_DENSE) if k.searched
                   for d in (self.domain(k.name),)]
        generic_names = [k.name for k, _, _ in generic]
        shared = model.moe is not None and model.moe.shared_ffn > 0
        for tp, pp, cp in itertools.product(self.domain("tp"), self.domain("pp"), self.domain("cp")):
            if world_size % (tp * pp * cp):
                continue
            sps = [s for s in self.domain("sequence_parallel") if not s] or self.domain("sequence_parallel")[:1] \
                if tp == 1 else self.domain("sequence_parallel")
            splits = self.splits(L, pp, bool(layout_string_refusal(model, engine)))
            for (fo, lo, sl), vpp in itertools.product(splits.values(), self.domain("vpp")):
                counts = _probe_counts(L, pp, vpp, fo, lo, sl)
                if counts is not None and (min(counts) < vpp if sl == "string" else any(c % vpp for c in counts)):
                    continue  # to_layout refuses every candidate of this split: VPP must divide each stage's layers
                    # (a layout string: every virtual stage needs a layer)
                recs = self._recompute_choices(counts, vpp, fixed_rm, fixed_rl)
                moe = self._moe_choices(model, tp, pp, cp, world_size)
                dp = world_size // (tp * pp * cp)
                for sp, (rec, rm, rl), off, rows, (ep, etp, dsp) in itertools.product(
                        sps, recs, self.domain("optimizer_cpu_offload"), self.domain("tokens_per_microbatch_rows"), moe):
                    # the registry's generic knobs, expanded only where they can change the layout (their `applies`)
                    ctx = KnobContext(tp, bool(sp) and tp > 1, pp, cp, dp, vpp, rec, bool(off), shared, ep, dsp)
                    for values in itertools.product(*(d if len(d) > 1 and k.applies(ctx) else d1 for k, d, d1 in generic)):
                        counter += 1
                        if (counter // SHARD_BLOCK) % n_shards != k_shard:
                            continue
                        params = {"tp": tp, "sequence_parallel": sp, "pp": pp, "first_offset": fo, "last_offset": lo,
                                  "vpp": vpp, "cp": cp, "recompute": rec, "recompute_method": rm, "recompute_layers": rl,
                                  "optimizer_cpu_offload": off, "tokens_per_microbatch_rows": rows, "ep": ep, "etp": etp,
                                  "dispatcher": dsp, **dict(zip(generic_names, values)), "stage_layout": sl}
                        params = {k: v for k, v in params.items() if k in self.knobs}
                        try:
                            lay = self.to_layout(params, model, world_size, workload, engine)
                        except LayoutError:
                            continue
                        out.setdefault(layout_key(lay, L), (counter, params, lay))
        if shard is None:
            return [(p, lay) for _, p, lay in sorted(out.values(), key=lambda x: x[0])]
        return [(o, p, lay, key) for key, (o, p, lay) in out.items()]

    def _recompute_choices(self, counts: list[int] | None, vpp: int, fixed_rm, fixed_rl) -> list[tuple]:
        """(recompute, method, layers) of one split: method and layers expanded only for full recompute, block layers
        only up to a chunk's layers."""
        recs = []
        for rec in self.domain("recompute"):
            if rec != "full":
                recs.append((rec, fixed_rm, fixed_rl))
                continue
            for rm in self.domain("recompute_method"):
                if rm == "uniform":
                    recs.append((rec, rm, self.domain("recompute_layers")[0]))
                else:
                    top = max(counts) // vpp if counts else max(self.domain("recompute_layers"))
                    recs += [(rec, rm, n) for n in self.domain("recompute_layers") if n <= max(top, 1)]
        return recs

    def _moe_choices(self, model: ModelSpec, tp: int, pp: int, cp: int, world_size: int) -> list[tuple]:
        """(EP, ETP, dispatcher) of one TP x PP x CP: those whose EP x ETP divides TP x CP x DP (a dense model: one)."""
        if model.moe is None:
            return [(1, 1, self.domain("dispatcher")[0])]
        return [(ep, etp, dsp) for ep, etp, dsp in itertools.product(
            self.domain("ep"), self.domain("etp"), self.domain("dispatcher"))
            if (tp * cp * (world_size // (tp * pp * cp))) % (ep * etp) == 0]

    def value(self, params: dict, key: str):
        if key in params:
            return params[key]
        return self.fixed.get(key, DEFAULTS[key])

    def to_layout(self, params: dict, model: ModelSpec, world_size: int, workload: Workload, engine: Engine) -> Layout:
        """The layout for a parameter set; LayoutError names the rule it breaks."""
        vals = {**DEFAULTS, **self.fixed, **params}  # what `value` reads, merged once for this parameter set
        g = vals.__getitem__
        tp, pp, cp, vpp = int(g("tp")), int(g("pp")), int(g("cp")), int(g("vpp"))
        mp = tp * pp * cp
        if world_size % mp:
            raise LayoutError(f"TP {tp} x PP {pp} x CP {cp} = {mp} does not divide the {world_size} GPUs")
        L = model.num_layers
        first, last, pipeline_layout = _stage_split(g, L, pp, vpp)
        offload = bool(g("optimizer_cpu_offload"))
        rec = g("recompute")
        method = n = None
        counts = stage_layer_counts(_Split(pp, vpp, first, last, pipeline_layout), L)
        if pipeline_layout is None and any(c % vpp for c in counts):
            raise LayoutError(f"VPP {vpp} must divide every stage's layers ({'/'.join(map(str, counts))})")
        if rec == "full":
            method = g("recompute_method")
            per_chunk = (max(counts) if method == "block" else min(counts)) // vpp
            n = max(1, min(int(g("recompute_layers")), per_chunk))
        micro, max_tokens = _microbatch(int(g("tokens_per_microbatch_rows")), workload, cp, engine)
        lay = Layout(
            tp=tp, pp=pp, cp=cp, dp=world_size // mp, sp=bool(g("sequence_parallel")) and tp > 1, first=first, last=last,
            vpp=vpp, micro_batch_size=micro, max_tokens_per_gpu=max_tokens,
            recompute_granularity=rec, recompute_method=method, recompute_num_layers=n,
            distributed_optimizer=bool(g("distributed_optimizer")) or engine.forces_distributed_optimizer,
            precision_aware_optimizer=bool(g("precision_aware_optimizer")) or offload,
            optimizer_cpu_offload=offload, overlap_cpu_optimizer=bool(g("overlap_cpu_optimizer")) and offload,
            pipeline_layout=pipeline_layout, **self._moe_fields(g, model),
            **self._generic_fields(g, tp, pp, cp, world_size // mp, vpp, rec, offload, model),
        )
        errs = check(lay, model, world_size, workload, engine)
        if errs:
            raise LayoutError("; ".join(errs))
        return lay

    @staticmethod
    def _generic_fields(g, tp: int, pp: int, cp: int, dp: int, vpp: int, rec: str, offload: bool,
                        model: ModelSpec) -> dict:
        """The Layout fields of the registry's generic knobs (module recompute, activation offload, overlap, ...)."""
        moe = model.moe
        ctx = KnobContext(tp, bool(g("sequence_parallel")) and tp > 1, pp, cp, dp, vpp, rec, offload,
                          moe is not None and moe.shared_ffn > 0, int(g("ep")) if moe else 1,
                          g("dispatcher") if moe else None)
        out: dict = {}
        for k in GENERIC if moe else GENERIC_DENSE:
            out.update(k.to_fields(g(k.name), ctx))
        return out

    @staticmethod
    def _moe_fields(g, model: ModelSpec) -> dict:
        """The expert parallel sizes and dispatcher of a parameter set (none for a dense model: EP and ETP stay 1)."""
        if model.moe is None:
            return {}
        return {"ep": int(g("ep")), "etp": int(g("etp")), "moe_dispatcher": g("dispatcher")}

    def params_for(self, layout: Layout, model: ModelSpec, workload: Workload) -> dict | None:
        """The parameters that map to `layout`, or None when this space cannot express it."""
        L = model.num_layers
        want = {"tp": layout.tp, "sequence_parallel": layout.sp, "pp": layout.pp, "vpp": layout.vpp, "cp": layout.cp,
                "recompute": layout.recompute_granularity, "optimizer_cpu_offload": layout.optimizer_cpu_offload}
        if model.moe is not None:
            want.update(ep=layout.ep, etp=layout.etp, dispatcher=layout.moe_dispatcher or "allgather")
        if layout.pp > 1:
            counts = stage_layer_counts(layout, L)
            even = L // layout.pp
            want["first_offset"] = counts[0] - even
            want["last_offset"] = counts[-1] - even if layout.pp > 2 else 0
        else:
            want["first_offset"] = want["last_offset"] = 0
        # issue 15 knobs
        want["stage_layout"] = "string" if layout.pipeline_layout is not None else "split"
        gen = string_layout(L, layout.pp, layout.vpp, counts[0], counts[-1]) \
            if layout.pipeline_layout is not None and layout.pp > 2 else None
        if layout.pipeline_layout is not None and (gen is None or layout_stage_counts(
                gen, layout.pp, layout.vpp, L) != virtual_stage_counts(layout, L)):
            return None  # a layout string the 'string' knob does not generate
        if layout.account_for_embedding or layout.account_for_loss:
            return None
        for k in _READ_BACK:
            want[k.name] = k.from_layout(layout, self.domain(k.name)[0])
        if layout.recompute_granularity == "full":
            want["recompute_method"] = layout.recompute_method
            want["recompute_layers"] = layout.recompute_num_layers
        else:
            want["recompute_method"] = "block"
            want["recompute_layers"] = 1
        if layout.max_tokens_per_gpu:
            want["tokens_per_microbatch_rows"] = max(1, layout.max_tokens_per_gpu * layout.cp // workload.seq_length)
        else:
            want["tokens_per_microbatch_rows"] = layout.micro_batch_size
        params = {}
        for k, v in want.items():
            if k in self.knobs:
                dom = self.knobs[k]
                if KNOBS[k] == "int":
                    if not dom[0] <= v <= dom[1]:
                        if k in ("recompute_layers",) and layout.recompute_granularity != "full":
                            v = dom[0]
                        elif k == "last_offset" and layout.pp <= 2:
                            v = max(dom[0], min(dom[1], 0))
                        else:
                            return None
                elif v not in dom:
                    if k in ("recompute_method",) and layout.recompute_granularity != "full":
                        v = dom[0]
                    else:
                        return None
                params[k] = v
            elif k in self.fixed and self.fixed[k] != v and not (k in ("recompute_method", "recompute_layers")
                                                                 and layout.recompute_granularity != "full"):
                return None
            elif k in _DEFAULT_ONLY and k not in self.fixed and v != self.domain(k)[0] and not (
                    k in _READ_BACK_NAMES and _READ_BACK_NAMES[k].off_domain_ok(layout)):
                return None  # a knob this space does not search, away from its default
        return params


# generic knobs a layout reads back as a value, and the knobs a space that neither searches nor fixes them expresses
# only at their default
_READ_BACK = tuple(k for k in GENERIC if k.from_layout is not None)
_READ_BACK_NAMES = {k.name: k for k in _READ_BACK}
_DEFAULT_ONLY = frozenset(_READ_BACK_NAMES) | {"stage_layout"}


# candidates per shard block: a layout's optimizer variants are adjacent candidates and stay in one shard
SHARD_BLOCK = 64


class _Split(NamedTuple):
    """The Layout fields `stage_layer_counts` reads: the layer split of a parameter set without building (and
    validating) a whole Layout for it."""

    pp: int
    vpp: int
    first: int | None
    last: int | None
    pipeline_layout: str | None
    account_for_embedding: bool = False
    account_for_loss: bool = False


def _string_counts(L: int, pp: int, first: int, last: int) -> list[int] | None:
    """Per-stage layers with the middle remainder spread over the first middle stages (the 'string' stage
    layout), or None when there is no remainder (the 'split' layout is the same) or a stage would be empty."""
    n_mid = pp - 2
    rest = L - first - last
    if n_mid < 1 or first < 1 or last < 1 or rest < n_mid or rest % n_mid == 0:
        return None
    base, extra = divmod(rest, n_mid)
    return [first] + [base + 1] * extra + [base] * (n_mid - extra) + [last]


def _virtual_string_counts(counts: list[int], vpp: int) -> list[int] | None:
    """Layers per virtual stage (Megatron's order: virtual stage ``j * PP + r`` is rank r's chunk j) of the
    'string' stage layout at VPP ``vpp``: each rank's layers spread over its chunks, the earlier chunks taking
    the remainder (so a rank's layers need not divide by VPP); None when a chunk would be empty."""
    if min(counts) < vpp:
        return None
    pp = len(counts)
    return [counts[r] // vpp + (1 if j < counts[r] % vpp else 0) for j in range(vpp) for r in range(pp)]


def string_layout(L: int, pp: int, vpp: int, first: int, last: int) -> str | None:
    """The ``--pipeline-model-parallel-layout`` of the 'string' stage layout (`_string_counts` per rank, over VPP
    chunks by `_virtual_string_counts`), or None when it does not apply."""
    sc = _string_counts(L, pp, first, last)
    if sc is None:
        return None
    virt = _virtual_string_counts(sc, vpp) if vpp > 1 else sc
    return layout_string(virt) if virt is not None else None


def _probe_counts(L: int, pp: int, vpp: int, fo: int, lo: int, sl: str) -> list[int] | None:
    """Per-stage layers of a split's offsets and stage layout (before the layout is built), None when they do not
    give one."""
    probe_first = L // pp + fo if pp > 1 else None
    try:
        if sl == "string":
            return _string_counts(L, pp, probe_first, L // pp + lo)
        return stage_layer_counts(_Split(pp, vpp, probe_first, None if pp == 1 else (
            L - probe_first if pp == 2 else L // pp + lo), None), L)
    except (LayoutError, ValueError):
        return None


def _stage_split(g, L: int, pp: int, vpp: int) -> tuple[int | None, int | None, str | None]:
    """(first, last, pipeline layout) of a parameter set's offsets and stage layout (``g`` reads its values):
    a layout string for stage layout 'string' at PP > 2, else first/last stage layers at PP > 1."""
    if pp > 2 and g("stage_layout") == "string":
        even = L // pp
        pipeline_layout = string_layout(L, pp, vpp, even + int(g("first_offset")), even + int(g("last_offset")))
        if pipeline_layout is None:
            raise LayoutError("stage_layout 'string' needs PP > 2, a middle remainder to spread (else it is the "
                              "'split' layout) and at least VPP layers on every stage")
        return None, None, pipeline_layout
    if pp <= 1:
        return None, None, None
    even = L // pp
    first = even + int(g("first_offset"))
    if pp == 2:
        last = L - first
    else:
        last = even + int(g("last_offset"))
        rest = L - first - last
        if rest > 0:
            last += rest % (pp - 2)  # repair so the middle stages divide evenly
    if first < 1 or last < 1 or L - first - last < (pp - 2):
        raise LayoutError(f"layer split first={first} last={last} leaves a stage without layers")
    return first, last, None


def _microbatch(rows: int, workload: Workload, cp: int, engine: Engine) -> tuple[int, int | None]:
    """(micro batch size, max tokens per GPU) of ``rows`` rows per microbatch: with dynamic batching one
    microbatch of at most rows x seq / CP tokens per GPU, else ``rows`` rows."""
    if not engine.dynamic_batching:
        return rows, None
    if (rows * workload.seq_length) % cp:
        raise LayoutError(f"{rows} row(s) of {workload.seq_length} tokens do not split over CP {cp}")
    return 1, rows * workload.seq_length // cp


# the bundled space used when none is given
DEFAULT_SPACE = "dense"
# where the bundled spaces live, as an importlib.resources package
SPACES_PACKAGE = "attune.search.spaces"


def bundled_spaces() -> list[str]:
    """Names of the search spaces shipped with attune (package data)."""
    return sorted(f.name[:-5] for f in resources.files(SPACES_PACKAGE).iterdir() if f.name.endswith(".yaml"))


def _space_text(name_or_path: str | Path | None) -> tuple[str, str]:
    """(where, YAML text) of a bundled space name, or of a file path; SearchSpaceError when neither exists."""
    name = DEFAULT_SPACE if name_or_path is None else str(name_or_path)
    if name in bundled_spaces():
        f = resources.files(SPACES_PACKAGE) / f"{name}.yaml"
        return f"{SPACES_PACKAGE}/{name}.yaml", f.read_text()
    p = Path(name)
    if not p.is_file():
        raise SearchSpaceError(f"{p}: no such search space file (bundled spaces: {', '.join(bundled_spaces())})")
    return str(p), read_text(p, "search space file", SearchSpaceError)


def load_space(path: str | Path | None = None) -> SearchSpace:
    """A search space: None is the default bundled space (`dense`), a bare name (`small`) a bundled one, anything
    else a path to a YAML file."""
    p, text = _space_text(path)
    data = load_yaml(text, p, SearchSpaceError)
    if not isinstance(data, dict):
        raise SearchSpaceError(f"{p}: a search space must be a mapping with 'knobs' and 'fixed'")
    try:
        f = SpaceFile.model_validate(data)
    except ValidationError as e:
        raise SearchSpaceError(f"{p}: {one_line(e, SpaceFile)}") from None
    # the file's own order of knobs and settings (Optuna's parameters, the enumeration order)
    knobs = {k: (v.low, v.high) if isinstance(v := getattr(f.knobs, k), IntRange) else tuple(v)
             for k in (data.get("knobs") or {})}
    fixed = {k: getattr(f.fixed, k) for k in (data.get("fixed") or {})}
    return SearchSpace(name=f.name or Path(p).stem, path=str(p), knobs=knobs, fixed=fixed)
