"""The search space enumerated as columns (issue 18): every distinct valid layout of a space as a
`LayoutColumns` batch, with its layout keys and Optuna parameter sets, without building a `Layout` per layout.

Same layouts, same order, same parameter set per layout and the same deduplication by `layout_key` as
`SearchSpace.enumerate` (the reference, kept as it is; tests/test_enumeration.py checks equality on the bundled
models' default spaces). How it gets there:

* **Structures** (TP, PP, CP, layer split, VPP): a few hundred, built in Python in the enumeration's order. Only
  the rules about the layer split read them (every stage has layers, VPP divides each stage, a layout string is
  well formed and the engine takes it, every stage starts on a DSA computing layer: the split part of
  `attune.spec.rules.check`).
* **Templates**: everything else a parameter set decides (SP, recompute, offload, rows, experts, the registry's
  generic knobs) depends on a structure only through its parallel sizes (TP, PP, CP, DP, VPP) and, for the block
  recompute layer counts tried, its largest chunk. The candidates of every structure with the same sizes are one
  template, in the enumeration's own order. Each template row less its recompute layer count (a base row, a
  few thousand in all) is checked once with the real `SearchSpace.to_layout` (so `attune.spec.rules.check`) on a
  representative split of those sizes with one recomputed layer; the count changes no rule but the chunk bounds,
  which the clipping in `to_layout` always satisfies, and the MTP rule on uniform recompute, checked on the
  columns.
* **Candidates** = structures x their template, as index arrays (numpy): the recompute layer count clipped to the
  chunk, the key of each candidate as one integer (template key part, layers per stage and virtual stage, the
  recompute count), the first valid candidate of each key kept.

The assumption this rests on: no rule of `check` reads both the layer split and a field the template sets, apart
from the recompute layer count (true of `check` and of every family's `layout_rules`, which read the parallel
sizes).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from attune.errors import LayoutError, SearchSpaceError
from attune.search.space import (
    GENERIC,
    GENERIC_DENSE,
    LAYERS_PER_FEATURE_UNIT,
    KnobContext,
    SearchSpace,
    _Split,
    _string_counts,
    layout_string_refusal,
    string_layout,
)
from attune.spec.columns import NONE_INT, LayoutColumns
from attune.spec.engine import Engine
from attune.spec.identity import IDENTITY_ITEMS, key_function, layout_key
from attune.spec.knob_registry import GENERIC as _ALL_GENERIC
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec
from attune.spec.pipeline_layout import check_layout_string
from attune.spec.placement import stage_layer_counts, virtual_stage_counts
from attune.spec.rules import index_sharing_rule

_FEATURED = tuple(k for k in _ALL_GENERIC if k.feature is not None)
_POS_COUNTS = IDENTITY_ITEMS.index("stage_layers")
_POS_VIRT = IDENTITY_ITEMS.index("virtual_stage_layers")
_POS_N = IDENTITY_ITEMS.index("recompute_num_layers")
_SPLIT_KNOBS = ("first_offset", "last_offset", "stage_layout")
_PARAM_ORDER = ("tp", "sequence_parallel", "pp", "first_offset", "last_offset", "vpp", "cp", "recompute",
                "recompute_method", "recompute_layers", "optimizer_cpu_offload", "tokens_per_microbatch_rows", "ep",
                "etp", "dispatcher")


@dataclass(frozen=True)
class _Structure:
    """One (TP, PP, CP, layer split, VPP) of the enumeration."""

    tp: int
    pp: int
    cp: int
    dp: int
    vpp: int
    fo: int
    lo: int
    sl: str
    top: int
    """The largest block recompute layer count the enumeration tries here (from its probe split)."""
    first: int | None
    last: int | None
    pipeline_layout: str | None
    counts: tuple[int, ...]
    virt: tuple[int, ...]


class EnumeratedSpace:
    """Every distinct valid layout of a space as columns (see the module docstring).

    ``cols``: the layouts; ``params(i)``: row i's Optuna parameter set; ``key(i)``: its `layout_key`;
    ``row_of_key(key)``: the row of a layout key (None when the space does not hold it); ``features``: the
    knob-distance features (`attune.search.space.FEATURES`), one row per layout.
    """

    def __init__(self, *, cols: LayoutColumns, structs: list[_Structure], struct_idx: np.ndarray,
                 tparams: list[dict], tmpl_idx: np.ndarray, rl_param: np.ndarray, tkeys: list[tuple],
                 tkey_idx: np.ndarray, split_ids: dict, codes: np.ndarray, n_key: np.ndarray, radix: tuple[int, int],
                 knobs: tuple[str, ...], features: np.ndarray, num_layers: int, target: tuple) -> None:
        self.cols = cols
        self._target = target  # (space, model, world size, workload, engine)
        self.features = features
        self.num_layers = num_layers
        self._structs, self._struct_idx = structs, struct_idx
        self._tparams, self._tmpl_idx, self._rl = tparams, tmpl_idx, rl_param
        self._tkeys, self._tkey_idx = tkeys, tkey_idx
        self._tkey_ids = {k: i for i, k in enumerate(tkeys)}
        self._split_ids = split_ids
        self._n_key = n_key
        self._radix = radix
        self._knobs = knobs
        order = np.argsort(codes, kind="stable")
        self._sorted_codes, self._sorted_rows = codes[order], order

    def __len__(self) -> int:
        return len(self.cols)

    def params(self, i: int) -> dict:
        """Row i's Optuna parameter set (the first in knob order that maps to its layout)."""
        s = self._structs[int(self._struct_idx[i])]
        p = dict(self._tparams[int(self._tmpl_idx[i])])
        if "recompute_layers" in p:
            p["recompute_layers"] = int(self._rl[i])
        p.update(first_offset=s.fo, last_offset=s.lo, stage_layout=s.sl)
        return {k: p[k] for k in self._knobs if k in p}

    def key(self, i: int) -> tuple:
        """Row i's `layout_key`."""
        s = self._structs[int(self._struct_idx[i])]
        k = list(self._tkeys[int(self._tkey_idx[i])])
        n = int(self._n_key[i])
        k[_POS_COUNTS] = ("stage_layers", s.counts)
        k[_POS_VIRT] = ("virtual_stage_layers", s.virt)
        k[_POS_N] = ("recompute_num_layers", n if n > 0 else None)
        return tuple(k)

    def row_of_params(self, params: dict) -> int | None:
        """The row whose parameter set is `params` (None when no row has exactly it: a parameter set that maps to
        a row's layout but is not its first in knob order has none)."""
        space, model, world, workload, engine = self._target
        try:
            lay = space.to_layout(dict(params), model, world, workload, engine)
        except (LayoutError, KeyError, TypeError, ValueError):
            return None
        r = self.row_of_key(layout_key(lay, self.num_layers))
        return r if r is not None and self.params(r) == dict(params) else None

    def row_of_key(self, key: tuple) -> int | None:
        """The row holding this `layout_key` (None when there is none)."""
        try:
            counts, virt, n = key[_POS_COUNTS][1], key[_POS_VIRT][1], key[_POS_N][1]
            t = list(key)
            t[_POS_COUNTS] = t[_POS_VIRT] = t[_POS_N] = None
            tk = self._tkey_ids.get(tuple(t))
            sid = self._split_ids.get((counts, virt))
        except (IndexError, TypeError):
            return None
        if tk is None or sid is None:
            return None
        code = (tk * self._radix[0] + sid) * self._radix[1] + (n or 0)
        j = int(np.searchsorted(self._sorted_codes, code))
        if j < len(self._sorted_codes) and self._sorted_codes[j] == code:
            return int(self._sorted_rows[j])
        return None


def _structures(space: SearchSpace, model: ModelSpec, world_size: int, engine: Engine) -> list[_Structure]:
    """The (TP, PP, CP, split, VPP) of the enumeration, in its order, that pass the split rules."""
    L = model.num_layers
    refusal = layout_string_refusal(model, engine)
    out = []
    for tp, pp, cp in itertools.product(space.domain("tp"), space.domain("pp"), space.domain("cp")):
        if world_size % (tp * pp * cp):
            continue
        splits = space.splits(L, pp, bool(refusal))  # the same splits, in the same order, as SearchSpace.enumerate
        for (fo, lo, sl), vpp in itertools.product(splits.values(), space.domain("vpp")):
            probe_first = L // pp + fo if pp > 1 else None
            try:  # the enumeration's probe split (its block recompute counts go up to the probe's chunk)
                if sl == "string":
                    probe = _string_counts(L, pp, probe_first, L // pp + lo)
                else:
                    probe = stage_layer_counts(_Split(pp, vpp, probe_first, None if pp == 1 else (
                        L - probe_first if pp == 2 else L // pp + lo), None), L)
            except (LayoutError, ValueError):
                probe = None
            if probe is not None and (min(probe) < vpp if sl == "string" else any(c % vpp for c in probe)):
                continue
            top = max(probe) // vpp if probe else max(space.domain("recompute_layers"))
            s = _split_of(space, model, engine, tp, pp, cp, world_size // (tp * pp * cp), vpp, fo, lo, sl, top, refusal)
            if s is not None:
                out.append(s)
    return out


def _split_of(space, model, engine, tp, pp, cp, dp, vpp, fo, lo, sl, top, refusal) -> _Structure | None:
    """The split `SearchSpace.to_layout` makes of these offsets, or None when it or `check`'s split rules refuse
    it (a stage without layers, VPP not dividing a stage, a malformed or refused layout string)."""
    L = model.num_layers
    first = last = pl = None
    if pp > 2 and sl == "string":
        even = L // pp
        pl = string_layout(L, pp, vpp, even + fo, even + lo)
        if pl is None or refusal or check_layout_string(pl, pp, vpp, L):
            return None
    elif pp > 1:
        even = L // pp
        first = even + fo
        if pp == 2:
            last = L - first
        else:
            last = even + lo
            rest = L - first - last
            if rest > 0:
                last += rest % (pp - 2)
        if first < 1 or last < 1 or L - first - last < (pp - 2):
            return None
    sp = _Split(pp, vpp, first, last, pl)
    try:
        counts = tuple(stage_layer_counts(sp, L))
    except (LayoutError, ValueError):
        return None
    if any(c < 1 for c in counts) or sum(counts) != L or (pl is None and any(c % vpp for c in counts)):
        return None
    if index_sharing_rule(sp, model):  # a split rule too: DSA index sharing (GLM-5.2) fixes where stages start
        return None
    virt = tuple(virtual_stage_counts(sp, L) or ()) if vpp > 1 else ()
    return _Structure(tp, pp, cp, dp, vpp, fo, lo, sl, top, first, last, pl, counts, virt)


class _Templates:
    """The template rows of every (TP, PP, CP, DP, VPP) and largest block recompute count, as indices into global
    arrays: a row's base row (the row less its recompute layer count; checked once with `to_layout` on a
    representative split, one recomputed layer) and its recompute layer parameter."""

    def __init__(self, space: SearchSpace, model: ModelSpec, world_size: int, workload: Workload, engine: Engine):
        self.space, self.model, self.world, self.workload, self.engine = space, model, world_size, workload, engine
        self.generic = [(k, d, d[:1]) for k in (GENERIC if model.moe else GENERIC_DENSE) if k.searched
                        for d in (space.domain(k.name),)]
        self.shared = model.moe is not None and model.moe.shared_ffn > 0
        # per base row: the representative layout (None: to_layout refuses it) and the parameter set (less the split)
        self.base_layouts: list[Layout | None] = []
        self.base_params: list[dict] = []
        # per template row (global, in chunks): its base row, its recompute layer parameter, whether it is a block
        # recompute row (the rows a smaller largest-chunk drops)
        self._base: list[np.ndarray] = []
        self._rl: list[np.ndarray] = []
        self._block: list[np.ndarray] = []
        self._size = 0
        self._sizes: dict[tuple, tuple] = {}  # (TP, PP, CP, DP, VPP) -> its template rows (every block count)
        self._rows: dict[tuple, np.ndarray] = {}  # ... + (top,) -> the rows kept

    def of(self, s: _Structure, rep: _Structure) -> np.ndarray:
        """The template rows of structure `s` (global indices, in the enumeration's order; `rep`: the
        representative split of its sizes)."""
        k = (s.tp, s.pp, s.cp, s.dp, s.vpp)
        kt = k + (max(s.top, 1),)
        rows = self._rows.get(kt)
        if rows is None:
            if k not in self._sizes:
                self._sizes[k] = self._build(s, rep)
            idx, rl, block = self._sizes[k]
            keep = ~(block & (rl > kt[-1]))
            rows = self._rows[kt] = idx[keep]
        return rows

    def freeze(self) -> None:
        self.base = np.concatenate(self._base) if self._base else np.zeros(0, dtype=np.int64)
        self.rl = np.concatenate(self._rl) if self._rl else np.zeros(0, dtype=np.int64)
        self.block = np.concatenate(self._block) if self._block else np.zeros(0, dtype=bool)

    def _build(self, s: _Structure, rep: _Structure) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        space, model = self.space, self.model
        tp, pp, cp, dp, vpp = s.tp, s.pp, s.cp, s.dp, s.vpp
        sps = [x for x in space.domain("sequence_parallel") if not x] or space.domain("sequence_parallel")[:1] \
            if tp == 1 else space.domain("sequence_parallel")
        fixed_rl, fixed_rm = min(space.domain("recompute_layers"), key=abs), space.domain("recompute_method")[0]
        # (recompute, method, its layer counts): the enumeration's recompute entries, block with every count
        groups = []
        for rec in space.domain("recompute"):
            if rec != "full":
                groups.append((rec, fixed_rm, [fixed_rl]))
                continue
            for rm in space.domain("recompute_method"):
                groups.append((rec, rm, [space.domain("recompute_layers")[0]] if rm == "uniform"
                               else list(space.domain("recompute_layers"))))
        moe = ([(ep, etp, dsp) for ep, etp, dsp in itertools.product(
            space.domain("ep"), space.domain("etp"), space.domain("dispatcher"))
            if (tp * cp * dp) % (ep * etp) == 0]
            if model.moe is not None else [(1, 1, space.domain("dispatcher")[0])])
        names = [k.name for k, _, _ in self.generic]
        start, n_chunks = self._size, len(self._rl)
        for sp, (rec, rm, rls) in itertools.product(sps, groups):
            bases = []  # the base rows of one recompute layer count, in order (the same for every count)
            for off, rows, (ep, etp, dsp) in itertools.product(
                    space.domain("optimizer_cpu_offload"), space.domain("tokens_per_microbatch_rows"), moe):
                ctx = KnobContext(tp, bool(sp) and tp > 1, pp, cp, dp, vpp, rec, bool(off), self.shared, ep, dsp)
                for values in itertools.product(*(d if len(d) > 1 and k.applies(ctx) else d1
                                                  for k, d, d1 in self.generic)):
                    params = {"tp": tp, "sequence_parallel": sp, "pp": pp, "vpp": vpp, "cp": cp, "recompute": rec,
                              "recompute_method": rm, "recompute_layers": rls[0], "optimizer_cpu_offload": off,
                              "tokens_per_microbatch_rows": rows, "ep": ep, "etp": etp, "dispatcher": dsp,
                              **dict(zip(names, values))}
                    probe = {**params, "recompute_layers": 1, "first_offset": rep.fo, "last_offset": rep.lo,
                             "stage_layout": rep.sl}
                    try:
                        lay = space.to_layout(probe, model, self.world, self.workload, self.engine)
                    except LayoutError:
                        lay = None
                    bases.append(len(self.base_layouts))
                    self.base_layouts.append(lay)
                    self.base_params.append(params)
            b = np.asarray(bases, dtype=np.int64)
            self._base.append(np.tile(b, len(rls)))
            self._rl.append(np.repeat(np.asarray(rls, dtype=np.int64), len(b)))
            self._block.append(np.full(len(b) * len(rls), rec == "full" and rm != "uniform"))
            self._size += len(b) * len(rls)
        return (np.arange(start, self._size, dtype=np.int64), np.concatenate(self._rl[n_chunks:]),
                np.concatenate(self._block[n_chunks:]))


def enumerate_columns(space: SearchSpace, model: ModelSpec, world_size: int, workload: Workload,
                      engine: Engine) -> EnumeratedSpace:
    """Every distinct valid layout of `space` as columns (see the module docstring); SearchSpaceError when no
    layout passes the rules."""
    L = model.num_layers
    structs = _structures(space, model, world_size, engine)
    tm = _Templates(space, model, world_size, workload, engine)
    reps: dict[tuple, _Structure] = {}
    rows_of = []
    for s in structs:
        rep = reps.setdefault((s.tp, s.pp, s.cp, s.dp, s.vpp), s)
        rows_of.append(tm.of(s, rep))
    tm.freeze()
    if not structs or not tm.base_layouts:
        return _empty(space, model, world_size)
    # base rows: validity, recompute kind, the template part of the key
    base = tm.base_layouts
    b_ok = np.array([lay is not None for lay in base], dtype=bool)
    b_full = np.array([lay is not None and lay.recompute_granularity == "full" for lay in base], dtype=bool)
    b_uniform = np.array([lay is not None and lay.recompute_method == "uniform" for lay in base], dtype=bool)
    b_mtp = np.array([lay.mtp_layers if lay is not None else 0 for lay in base], dtype=np.int64)
    tkeys, b_tkey = _template_keys(base)
    t_base, t_rl = tm.base, tm.rl
    # candidates = structures x their template rows, in the enumeration's order
    lens = np.array([len(r) for r in rows_of], dtype=np.int64)
    c_struct = np.repeat(np.arange(len(structs), dtype=np.int64), lens)
    c_tmpl = np.concatenate(rows_of)
    c_base = t_base[c_tmpl]
    split_ids, s_split, s_block, s_uni, s_keychunk = _structure_bounds(structs)
    full = b_full[c_base]
    uniform = b_uniform[c_base]
    chunk = np.where(uniform, s_uni[c_struct], s_block[c_struct])
    n = np.where(full, np.maximum(1, np.minimum(t_rl[c_tmpl], chunk)), 0)
    # check's one rule on the recompute count beyond the chunk bounds: megatron-core's MTP with uniform recompute
    valid = b_ok[c_base] & ~((b_mtp[c_base] > 0) & full & uniform & (n != 1))
    n_key = np.where(full, np.maximum(1, np.minimum(n, s_keychunk[c_struct])), 0)
    radix = (len(split_ids), int(n_key.max()) + 1 if len(n_key) else 1)
    codes = (b_tkey[c_base] * radix[0] + s_split[c_struct]) * radix[1] + n_key
    vi = np.flatnonzero(valid)
    _, first = np.unique(codes[vi], return_index=True)
    keep = vi[np.sort(first)]
    if not len(keep):
        return _empty(space, model, world_size)
    k_struct, k_tmpl, k_base, k_n = c_struct[keep], c_tmpl[keep], c_base[keep], n[keep]
    cols = _columns(structs, base, k_struct, k_base, k_n)
    features = _features(cols, structs, k_struct, base, k_base, L)
    return EnumeratedSpace(cols=cols, structs=structs, struct_idx=k_struct, tparams=tm.base_params, tmpl_idx=k_base,
                           rl_param=t_rl[k_tmpl], tkeys=tkeys, tkey_idx=b_tkey[k_base], split_ids=split_ids,
                           codes=codes[keep], n_key=n_key[keep], radix=radix,
                           knobs=tuple(k for k in (*_PARAM_ORDER, *(g.name for g, _, _ in tm.generic), "stage_layout")
                                       if k in space.knobs),
                           features=features, num_layers=L, target=(space, model, world_size, workload, engine))


def _template_keys(base: Sequence[Layout | None]) -> tuple[list[tuple], np.ndarray]:
    """The template part of each base row's layout key (split counts and recompute layers left out), as distinct
    keys and each row's index into them (0 for an invalid row)."""
    key_fn = key_function()
    tkeys: list[tuple] = []
    tkey_ids: dict[tuple, int] = {}
    b_tkey = np.zeros(len(base), dtype=np.int64)
    for j, lay in enumerate(base):
        if lay is None:
            continue
        k = list(key_fn(lay, (), (), lay.recompute_granularity == "full", bool(lay.optimizer_cpu_offload),
                        bool(lay.sp) and lay.tp > 1, None))
        k[_POS_COUNTS] = k[_POS_VIRT] = k[_POS_N] = None
        k = tuple(k)
        b_tkey[j] = tkey_ids.setdefault(k, len(tkeys))
        if b_tkey[j] == len(tkeys):
            tkeys.append(k)
    return tkeys, b_tkey


def _structure_bounds(structs: list[_Structure]) -> tuple[dict[tuple, int], np.ndarray, np.ndarray, np.ndarray,
                                                          np.ndarray]:
    """The structures' split identity (split -> id, each structure's id) and chunk bounds: the largest chunk
    (block recompute), the smallest (uniform), the largest virtual stage (the key's recompute count)."""
    split_ids: dict[tuple, int] = {}
    s_split = np.array([split_ids.setdefault((s.counts, s.virt), len(split_ids)) for s in structs], dtype=np.int64)
    s_block = np.array([max(s.counts) // s.vpp for s in structs], dtype=np.int64)
    s_uni = np.array([min(s.counts) // s.vpp for s in structs], dtype=np.int64)
    s_keychunk = np.array([max(s.virt) if s.virt else -(-max(s.counts) // s.vpp) for s in structs], dtype=np.int64)
    return split_ids, s_split, s_block, s_uni, s_keychunk


def _empty(space: SearchSpace, model: ModelSpec, world_size: int):
    raise SearchSpaceError(f"search space {space.name}: no layout of it passes the rules for {model.name} on "
                           f"{world_size} GPUs (check the parallel sizes against the model's layers and GPUs)")


_SPLIT_FIELDS = ("first", "last", "pipeline_layout")


def _columns(structs: list[_Structure], base: Sequence[Layout | None], k_struct: np.ndarray, k_base: np.ndarray,
             k_n: np.ndarray) -> LayoutColumns:
    """The kept layouts' columns: the split from the structures, the recompute count from the candidates, every
    other field from the base rows' representative layouts."""
    ub, inv = np.unique(k_base, return_inverse=True)
    cols = LayoutColumns.from_layouts([base[int(b)] for b in ub]).take(inv).columns()
    us, sinv = np.unique(k_struct, return_inverse=True)
    split = LayoutColumns({name: [getattr(structs[int(s)], name) for s in us] for name in _SPLIT_FIELDS}, n=len(us))
    for name in _SPLIT_FIELDS:
        cols[name] = split[name][sinv]
    cols["recompute_num_layers"] = np.where(k_n > 0, k_n, NONE_INT).astype(np.int64)
    return LayoutColumns(cols, n=len(k_struct))


def _features(cols: LayoutColumns, structs: list[_Structure], k_struct: np.ndarray, base: Sequence[Layout | None],
              k_base: np.ndarray, num_layers: int) -> np.ndarray:
    """`attune.search.space.layout_features` of every row, on the columns."""
    us, sinv = np.unique(k_struct, return_inverse=True)
    c0 = np.array([structs[int(s)].counts[0] for s in us], dtype=float)[sinv]
    c1 = np.array([structs[int(s)].counts[-1] for s in us], dtype=float)[sinv]
    cmax = np.array([max(structs[int(s)].counts) for s in us], dtype=float)[sinv]
    tp, pp, vpp, cp = (cols[f].astype(float) for f in ("tp", "pp", "vpp", "cp"))
    even = num_layers / pp
    rec = cols["recompute_granularity"]
    sel, full = rec == "selective", rec == "full"
    uni = full & (cols["recompute_method"] == "uniform")
    n = np.where(cols["recompute_num_layers"] > 0, cols["recompute_num_layers"], 1).astype(float)
    frac = np.where(full, np.where(uni, 1.0, np.minimum(1.0, n / (cmax / vpp))), 0.0)
    mt = cols["max_tokens_per_gpu"]
    tokens = np.where(mt > 0, mt * cols["cp"], cols["micro_batch_size"]).astype(float)
    out = [np.log2(tp), cols["sp"].astype(float), np.log2(pp), (c0 - even) / LAYERS_PER_FEATURE_UNIT, (c1 - even) / LAYERS_PER_FEATURE_UNIT,
           np.log2(vpp), np.log2(cp), sel.astype(float), full.astype(float), frac, uni.astype(float),
           cols["optimizer_cpu_offload"].astype(float), np.log2(np.maximum(tokens, 1.0)),
           np.log2(cols["ep"].astype(float)), np.log2(cols["etp"].astype(float)),
           (cols["moe_dispatcher"] == "allgather").astype(float)]
    if _FEATURED:
        ub, binv = np.unique(k_base, return_inverse=True)
        for k in _FEATURED:
            out.append(np.array([float(k.feature(base[int(b)])) for b in ub], dtype=float)[binv])
    return np.column_stack(out) if len(k_struct) else np.zeros((0, len(out)))

