"""What a batch of layouts shares, evaluated once per distinct value by the scalar estimator's own functions.

A search's layouts differ in many fields, but each per-layer quantity depends on a handful of them: the layer
costs and per-layer times on (TP, SP, CP, tokens per GPU, TP overlap); the selective-recompute and activation-offload
terms on those plus the module lists; the fixed memory overheads on ``memory.OVERHEAD_FIELDS`` and whether the stage
is first / last. Each table below groups the rows by those fields, evaluates the scalar function
(``costs.layer_costs``, ``performance._layer_parts``, ``offload.*``, ``memory.fixed_overheads``) on one
representative row of each group, and holds the result as arrays indexed by group; ``gid`` maps every row to its
group. So the array engine reads the same numbers the scalar path computes, by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from attune.estimator import batch_mtp as mtp_batch
from attune.estimator import batch_precision as lp_batch
from attune.estimator import offload as knob_terms
from attune.estimator.batch_moe import moe_group, moe_keys, moe_time_row
from attune.estimator.costs import BF16, Shape, layer_costs, logits_flops
from attune.estimator.memory import OVERHEAD_FIELDS, fixed_overheads
from attune.estimator.performance import _layer_parts, _link_gbps, gemm_efficiency
from attune.spec.columns import LayoutColumns
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.layout import Workload
from attune.spec.model import FULL, ModelSpec

from .coefficients import Coefficients, peak_ratio

TIME_KEYS = ("fwd_gemm", "fwd_attention", "fwd_gdn", "fwd_memory", "bwd_gemm", "bwd_attention", "bwd_gdn",
             "bwd_memory", "tp_fwd", "tp_bwd", "cp_fwd", "cp_bwd")
"""The per-layer times of ``performance._layer_parts``, in the order of ``KindTables.times``' last axis."""


def object_ids(col: np.ndarray) -> np.ndarray:
    """An int id per distinct value of an object column (None, strings, tuples): equal values, equal ids. Rows
    holding the same object (as an enumeration's do) are grouped by identity first, then the few objects by value."""
    ident = np.fromiter(map(id, col), dtype=np.int64, count=len(col))
    u, first, inv = np.unique(ident, return_index=True, return_inverse=True)
    seen: dict = {}
    by_value = np.array([seen.setdefault(col[i], len(seen)) for i in first], dtype=np.int64)
    return by_value[inv]


def group_ids(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group per row, first row of each group) for rows equal on every column (int / bool arrays)."""
    if len(cols[0]) == 1:  # a batch of one (``estimate``): one group
        return np.zeros(1, np.int64), np.zeros(1, np.int64)
    code = np.zeros(len(cols[0]), dtype=np.int64)
    for c in cols:
        c = c.astype(np.int64)
        lo = int(c.min()) if len(c) else 0
        span = (int(c.max()) - lo + 1) if len(c) else 1
        if int(code.max(initial=0)) * span + span >= 2**62:  # keep the mixed-radix code inside int64
            code = np.unique(code, return_inverse=True)[1]
        code = code * span + (c - lo)
    _, first, inv = np.unique(code, return_index=True, return_inverse=True)
    return inv.reshape(-1), first


def tp_overlap(cols: LayoutColumns, engine: Engine) -> np.ndarray:
    """TE userbuffers on: TP > 1 with SP and the layout's or the engine recipe's --tp-comm-overlap."""
    return (cols["tp"] > 1) & cols["sp"] & (cols["tp_comm_overlap"] | engine.recipe_tp_comm_overlap)


@dataclass(frozen=True)
class KindTables:
    """Per (TP, SP, CP, tokens per GPU, TP overlap) group: every layer kind's costs and times (K: model.kinds)."""

    gid: np.ndarray  # [N] group of each row
    costs: list  # per group: layer_costs' dict
    times: np.ndarray  # [G, K, len(TIME_KEYS)] one layer, one microbatch, seconds
    act: np.ndarray  # [G, K] bytes saved for backward (LayerCost.act_bytes)
    work: np.ndarray  # [G, K] backward working set, bytes
    params: np.ndarray  # [G, K] parameters of one layer on one GPU
    full_act: np.ndarray  # [G] the reference (FULL) kind's act_bytes
    full_input: np.ndarray  # [G] FULL's input_bytes (what a recomputed layer keeps)
    full_work: np.ndarray  # [G] FULL's bwd_work_bytes
    logits_gemm_s: np.ndarray  # [G] output-layer GEMM forward, seconds
    logits_memory_s: np.ndarray  # [G] softmax / loss HBM passes over the logits, seconds
    embedding_memory_s: np.ndarray  # [G] the embedding lookup's HBM write, seconds
    time_dicts: list  # per group: {kind: _layer_parts dict}
    plain_costs: list  # per group: layer_costs' dict as the times read it (``costs`` adds the routed experts' tensors)
    moe: np.ndarray  # [G, len(batch_moe.MOE_TIME_KEYS)] one MoE layer's routed part, seconds (0 for dense models)
    moe_dicts: list  # per group: moe.moe_layer_times' dict ({} for dense models)
    expert_act: np.ndarray  # [G] bytes one MoE layer's routed part saves per microbatch
    mem_costs: list  # per group: the costs memory reads (low precision: ``costs`` with saved GEMM inputs quantized)
    recipe: np.ndarray  # [N] precision class (batch_precision.recipe_codes)
    plans: list  # per recipe code: precision.Plan or None (batch_precision.plans)
    mtp: object = None  # batch_mtp.MtpTables when a row has multi-token-prediction layers

    def rows(self, idx: np.ndarray):
        """The same tables for a subset of the rows (``LayoutColumns.take(idx)``)."""
        return replace(self, gid=self.gid[idx], recipe=self.recipe[idx])


def kind_tables(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, tokens: np.ndarray, workload: Workload,
                engine: Engine, coef: Coefficients) -> KindTables:
    """Layer costs and times per group of rows sharing a Shape and TP overlap (bb2a96d's ``performance._pipeline``'s), and for
    an MoE model the fields its routed experts read (``batch_moe.MOE_FIELDS``)."""
    gpu = cluster.gpu
    peak = gpu.bf16_tflops * 1e12 * peak_ratio(gpu, coef)
    hbm = gpu.hbm_gbps * 1e9
    ov = tp_overlap(cols, engine)
    recipe = lp_batch.recipe_codes(cols)
    plans = lp_batch.plans(cols, recipe, gpu, coef)
    gid, first = group_ids(cols["tp"], cols["sp"], cols["cp"], tokens, ov, recipe, *moe_keys(model, cols))
    kinds = model.kinds
    G, K = len(first), len(kinds)
    times, act, work, par = (np.zeros((G, K, len(TIME_KEYS))), np.zeros((G, K)), np.zeros((G, K)), np.zeros((G, K)))
    full = np.zeros((3, G))
    lg, lm, em = np.zeros(G), np.zeros(G), np.zeros(G)
    all_costs, all_times, all_mem, plain, moe_t, e_act = [], [], [], [], [], np.zeros(G)
    for g, i in enumerate(first):
        tp, cp = int(cols["tp"][i]), int(cols["cp"][i])
        shape = Shape(tp, bool(cols["sp"][i]), cp, int(tokens[i]), workload.seq_length)
        plain.append(layer_costs(model, engine, shape))
        lay = cols.layout(int(i)) if model.moe is not None else None  # the routed experts read MOE_FIELDS
        costs, mt, e_act[g] = moe_group(model, cluster, lay, shape, plain[-1], coef)
        p = plans[recipe[i]]  # low-precision GEMMs: their times and quantized saved inputs (batch_precision)
        lay = cols.layout(int(i)) if p else lay
        moe_t.append(lp_batch.quantized_moe(mt, model, lay, shape, p, engine, gpu, coef, peak))
        tp_bw = _link_gbps(tp, 1, cluster, coef) * 1e9
        cp_bw = _link_gbps(cp, tp, cluster, coef) * 1e9
        t = {k: _layer_parts(c, peak, hbm, tp_bw, cp_bw, tp, bool(ov[i]), coef, engine.async_dgrad)
             for k, c in plain[-1].items()}
        t, mem = lp_batch.quantized_layer(plain[-1], costs, t, lay, p, engine, gpu, coef, peak, tp_bw, bool(ov[i]))
        for j, k in enumerate(kinds):
            times[g, j] = [t[k][x] for x in TIME_KEYS]
            act[g, j], work[g, j], par[g, j] = mem[k].act_bytes, mem[k].bwd_work_bytes, costs[k].params_on_gpu
        full[:, g] = mem[FULL].act_bytes, mem[FULL].input_bytes, mem[FULL].bwd_work_bytes
        if model.vocab:
            fl, d = logits_flops(model, shape)
            lg[g] = fl / (peak * gemm_efficiency(d, coef))
            lm[g] = coef.memory_passes * engine.logits_bytes_per_element * shape.tokens * model.vocab / tp / (
                hbm * coef.hbm_efficiency)
        em[g] = BF16 * shape.tokens * model.hidden / (hbm * coef.hbm_efficiency)
        all_costs.append(costs)
        all_times.append(t)
        all_mem.append(mem)
    kt = KindTables(gid, all_costs, times, act, work, par, full[0], full[1], full[2], lg, lm, em, all_times, plain,
                    np.array([moe_time_row(d) for d in moe_t]), moe_t, e_act, all_mem, recipe, plans)
    return mtp_batch.with_mtp_tables(kt, model, cluster, cols, first, tokens, workload, coef)


@dataclass(frozen=True)
class KnobTables:
    """Per (shape group, recompute granularity and modules, offload modules): selective recompute and offload."""

    gid: np.ndarray  # [N]
    freed: np.ndarray  # [G, K] bytes selective recompute frees per layer (offload.recompute_freed_bytes)
    freed_full: np.ndarray  # [G] the same for the reference FULL kind
    seconds: np.ndarray  # [G, K] selective recompute's extra backward seconds per layer (offload.recompute_seconds)
    offloaded: np.ndarray  # [G, K] bytes activation offload sends to the host per layer (offload.offloaded_bytes)
    offloaded_time: np.ndarray  # [G, K] the same as the step time prices it (low precision: of the bf16 tensors)

    def rows(self, idx: np.ndarray):
        """The same tables for a subset of the rows (``LayoutColumns.take(idx)``)."""
        return replace(self, gid=self.gid[idx])


def knob_tables(model: ModelSpec, cols: LayoutColumns, kt: KindTables, engine: Engine) -> KnobTables:
    gid, first = group_ids(kt.gid, object_ids(cols["recompute_granularity"]), object_ids(cols["recompute_modules"]),
                           object_ids(cols["offload_modules"]), cols["moe_shared_expert_overlap"])
    G, K = len(first), len(model.kinds)
    freed, secs, off, freed_full = np.zeros((G, K)), np.zeros((G, K)), np.zeros((G, K)), np.zeros(G)
    off_t = off if all(m is c for m, c in zip(kt.mem_costs, kt.costs)) else np.zeros((G, K))
    for g, i in enumerate(first):
        lay = cols.layout(int(i))
        costs, times, mem, tg = kt.costs[kt.gid[i]], kt.time_dicts[kt.gid[i]], kt.mem_costs[kt.gid[i]], kt.gid[i]
        for j, k in enumerate(model.kinds):
            freed[g, j] = knob_terms.recompute_freed_bytes(mem[k], k, lay, model, engine)
            secs[g, j] = knob_terms.recompute_seconds(kt.plain_costs[tg][k], times[k], k, lay, model, engine,
                                                      kt.moe_dicts[tg] or None)
            off[g, j] = knob_terms.offloaded_bytes(mem[k], k, lay, model, engine)
            if off_t is not off:
                off_t[g, j] = knob_terms.offloaded_bytes(costs[k], k, lay, model, engine)
        freed_full[g] = knob_terms.recompute_freed_bytes(mem[FULL], FULL, lay, model, engine)
    return KnobTables(gid, freed, freed_full, secs, off, off_t)


@dataclass(frozen=True)
class OverheadTables:
    """Per ``memory.OVERHEAD_FIELDS`` group: the named fixed overheads of a first / last / middle stage, GiB."""

    gid: np.ndarray  # [N]
    names: tuple[str, ...]  # in the order memory.fixed_overheads adds them
    values: np.ndarray  # [G, 4, len(names)]: stage class 2 x first + last; 0 where the name is absent

    def rows(self, idx: np.ndarray):
        """The same tables for a subset of the rows (``LayoutColumns.take(idx)``)."""
        return replace(self, gid=self.gid[idx])


def merged_order(orders: list[list[str]]) -> list[str]:
    """One order of every name that keeps each list's own order as a sub-sequence (the fixed overheads' dicts of
    different rows: e.g. DeepEP's buffers before TP overlap's, as ``memory._fixed_overheads`` adds them), ties in
    order of first appearance; an AssertionError if the lists contradict each other."""
    seen = list(dict.fromkeys(n for o in orders for n in o))
    after: dict[str, set] = {n: set() for n in seen}
    for o in orders:
        for a, b in zip(o, o[1:]):
            after[b].add(a)
    out: list[str] = []
    while len(out) < len(seen):
        ready = [n for n in seen if n not in out and after[n] <= set(out)]
        if not ready:
            raise AssertionError(f"fixed overheads in orders no merge can keep: {orders}")
        out.append(ready[0])
    return out


def overhead_tables(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, workload: Workload, engine: Engine,
                    coef: Coefficients) -> OverheadTables:
    keys = [object_ids(cols[f]) if cols[f].dtype == object else cols[f] for f in OVERHEAD_FIELDS]
    gid, first = group_ids(*keys)
    dicts: list[dict[tuple[int, int], dict]] = []
    for i in first:
        lay = cols.layout(int(i))
        p = lay.pp
        stages = {0, p - 1} | ({1} if p > 2 else set())
        got = {}
        for s in stages:
            d = fixed_overheads(lay, workload, engine, cluster, s, model, coef)
            got[2 * (s == 0) + (s == p - 1)] = d
        dicts.append(got)
    names = merged_order([list(d) for g in dicts for d in g.values()])
    for g in dicts:  # the merged order must be each dict's own order (the sums below add in it)
        for d in g.values():
            if [n for n in names if n in d] != list(d):
                raise AssertionError(f"fixed overheads in an order the merge cannot keep: {list(d)} vs {names}")
    values = np.zeros((len(first), 4, len(names)))
    for g, got in enumerate(dicts):
        for cls, d in got.items():
            values[g, cls] = [d.get(n, 0.0) for n in names]
    return OverheadTables(gid, tuple(names), values)

