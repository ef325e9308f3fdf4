"""The estimator over a batch of layouts held as columns: ``estimate_batch`` (issue 18's array engine).

``estimate_batch(model, cluster, cols, workload, engine, coef=None) -> BatchEstimate`` estimates every row of a
`LayoutColumns` batch at once with numpy: the placement as ``[rows, stages, chunks]`` arrays (``batch_place``), the
per-layer costs and times once per distinct shape (``batch_tables``, by the per-layer functions), the per-stage
step-time parts (``batch_time``) and memory terms (``batch_memory``), accumulated in the deleted scalar composition's
order so that every term equals what it gave (tests/test_batch_engine.py's and tests/test_batch_moe.py's frozen
references, benchmarks/estimate_equivalence.py against bb2a96d). Rows are computed in groups of one (PP, VPP,
full-recompute method), so no group carries padding; the per-stage records a caller reads are ``[rows, stages]`` arrays
padded to the batch's largest PP, with the mask ``BatchEstimate.stage``. Coefficients are chosen as ``estimate()``
chooses them: ``coefficients_for`` the cluster's GPU when ``coef`` is None. No layout rule is checked (``estimate(...,
check_layout=False)``).

Every row goes through the arrays; there is no other composition. MoE models (routed and shared experts, router,
EP / ETP, the dispatchers, the expert all-to-all overlap, expert memory: ``batch_moe``), low-precision GEMMs
(``batch_precision``, the routed experts' included) and multi-token prediction (``batch_mtp``, MoE-kind MTP layers
included) are arrays like the dense terms. ``estimate()`` is a batch of one read through typed records (``terms``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cached_property

import numpy as np

from attune.errors import LayoutError
from attune.estimator import batch_moe
from attune.estimator import batch_precision as lp_batch
from attune.estimator.batch_memory import BatchStageMemory, stage_memory
from attune.estimator.batch_place import batching, place_batch
from attune.estimator.batch_tables import (
    TIME_KEYS,
    KindTables,
    KnobTables,
    OverheadTables,
    group_ids,
    kind_tables,
    knob_tables,
    overhead_tables,
)
from attune.estimator.batch_time import (
    BatchStageTime,
    BatchStep,
    dp_seconds,
    grad_bytes,
    optimizer_seconds,
    pipeline,
    pp_send_seconds,
    stage_params,
    stage_times,
)
from attune.estimator.metrics import model_flops_utilization
from attune.spec.columns import LayoutColumns
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster, GiB
from attune.spec.layout import Workload
from attune.spec.model import ModelSpec

from .coefficients import Coefficients, coefficients_for


@dataclass(frozen=True)
class StagePiece:
    """The per-stage records of some rows of a batch (one (PP, VPP, recompute method) group)."""

    rows: np.ndarray
    """Their row numbers in the batch."""
    stage: np.ndarray
    time: BatchStageTime
    memory: BatchStageMemory
    layers: np.ndarray
    """[rows, stages] decoder layers of each stage."""

    def values(self, name: str) -> np.ndarray:
        """[rows, stages] one per-stage term by name: a ``BatchStageTime`` or ``BatchStageMemory`` field, or a named
        overhead (0 where the rows have none)."""
        if name in _TIME_NAMES:
            return getattr(self.time, name)
        if name in _MEMORY_NAMES:
            return getattr(self.memory, name)
        return self.memory.overheads.get(name, np.zeros_like(self.memory.params))

    def renumber(self, rows: np.ndarray) -> "StagePiece":
        """The same records for other row numbers (a batch merged from pieces)."""
        return replace(self, rows=rows)


class BatchEstimate:
    """Memory and speed of every row of a batch: arrays ``[rows]`` and, per stage, ``[rows, stages]`` (stages up
    to the batch's largest PP; ``stage`` masks the ones a row has). The per-stage records are assembled in row order
    when first read (a search reads the per-row figures only)."""

    def __init__(self, *, step: BatchStep, tokens_per_s_per_gpu: np.ndarray, mfu: np.ndarray,
                 usd_per_million_tokens: np.ndarray, peak_gib: np.ndarray, peak_allocated_gib: np.ndarray,
                 peak_reserved_gib: np.ndarray, peak_stage: np.ndarray, host_needed_gib: np.ndarray,
                 host_capacity_gib: float, capacity_gib: float, fits: np.ndarray, pieces: list[StagePiece]) -> None:
        self.step = step
        """Per row: pipeline, bubble, exposed DP communication, optimizer, overhead, step time, critical stage."""
        self.tokens_per_s_per_gpu, self.mfu = tokens_per_s_per_gpu, mfu
        self.usd_per_million_tokens = usd_per_million_tokens
        self.peak_gib = peak_gib
        """The largest stage's total (what the verdict compares with capacity_gib), GiB."""
        self.peak_allocated_gib, self.peak_reserved_gib = peak_allocated_gib, peak_reserved_gib
        self.peak_stage = peak_stage
        self.host_needed_gib = host_needed_gib
        """CPU-offloaded optimizer state per node, GiB."""
        self.host_capacity_gib, self.capacity_gib, self.fits = host_capacity_gib, capacity_gib, fits
        self.pieces = pieces

    def __len__(self) -> int:
        return len(self.fits)

    @property
    def host_fits(self) -> np.ndarray:
        """[N] the CPU-offloaded optimizer state fits in the nodes' host memory (``terms.MemoryTerms.host_fits``)."""
        return self.host_needed_gib <= self.host_capacity_gib

    def terms(self, i: int) -> dict[str, float]:
        """Every term of row i by name, as ``terms.estimate_terms`` names a row's typed records' (stage terms as
        ``name[stage]``; a named overhead the stage does not have reads 0)."""
        st = self.step
        out = {k: float(getattr(st, k)[i]) for k in STEP_FIELDS}
        out.update({k: float(getattr(self, k)[i]) for k in ROW_FIELDS})
        out.update(critical_stage=float(st.critical_stage[i]), microbatches=float(st.microbatches[i]))
        for s in np.flatnonzero(self.stage[i]):
            out.update({f"{f.name}[{s}]": float(getattr(self.time, f.name)[i, s]) for f in fields(BatchStageTime)})
            out.update({f"{f.name}[{s}]": float(getattr(self.memory, f.name)[i, s]) for f in fields(BatchStageMemory)
                        if f.name != "overheads"})
            out.update({f"overhead.{k}[{s}]": float(v[i, s]) for k, v in self.memory.overheads.items()})
        return out

    @cached_property
    def stage(self) -> np.ndarray:
        """[N, S] the row has this pipeline stage."""
        return _merge_array(self._order, self._stages, [p.stage for p in self.pieces])

    @cached_property
    def time(self) -> BatchStageTime:
        """Per stage, one microbatch: forward / backward GEMM, attention, GDN, memory-bound work, recompute, exposed
        TP / CP / PP / EP communication, activation offload, seconds."""
        return _merge_record(BatchStageTime, self._order, self._stages, [p.time for p in self.pieces])

    @cached_property
    def memory(self) -> BatchStageMemory:
        """Per stage: weights, grads, optimizer states, activations, logits, each named overhead; allocated,
        reserved and total peaks, GiB."""
        return _merge_record(BatchStageMemory, self._order, self._stages, [p.memory for p in self.pieces])

    def stage_values(self, name: str) -> np.ndarray:
        """[N, S] one per-stage term by name (a ``BatchStageTime`` or ``BatchStageMemory`` field, or a named
        overhead), assembled alone: what a search reads (``total_gib``) without building every record."""
        if "time" in self.__dict__ or "memory" in self.__dict__:
            rec = self.time if name in _TIME_NAMES else self.memory
            return getattr(rec, name) if hasattr(rec, name) else rec.overheads[name]
        if len(self.pieces) == 1 and np.array_equal(self.pieces[0].rows, np.arange(len(self))):
            return self.pieces[0].values(name)  # one piece in row order: its own array (read, not written)
        return _merge_array(self._order, self._stages, [p.values(name) for p in self.pieces])

    def piece_of(self, i: int) -> tuple[StagePiece, int]:
        """(the per-stage piece holding row i, the row's index in it): one row's records without assembling the
        batch's (``terms.row_terms``)."""
        for p in self.pieces:
            at = np.flatnonzero(p.rows == i)
            if at.size:
                return p, int(at[0])
        raise IndexError(f"row {i} of a batch of {len(self)}")

    @property
    def _order(self) -> np.ndarray:
        return np.concatenate([p.rows for p in self.pieces])

    @property
    def _stages(self) -> int:
        return max(p.stage.shape[1] for p in self.pieces)


STEP_FIELDS = ("pipeline_s", "bubble_s", "dp_comm_s", "optimizer_s", "overhead_s", "step_time_s")
"""The seconds of ``BatchStep`` that ``terms.PerfTerms`` has under the same names."""


_TIME_NAMES = frozenset(f.name for f in fields(BatchStageTime))
_MEMORY_NAMES = frozenset(f.name for f in fields(BatchStageMemory)) - {"overheads"}


def _array_estimate(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, workload: Workload, engine: Engine,
                    coef: Coefficients) -> BatchEstimate:
    """The array engine: the shared tables once, then each group of rows of one (PP, VPP) and
    full-recompute method (none, block, uniform), without padding (stages and chunks are whole arrays there, and
    only that recompute policy's terms are computed)."""
    _, tokens, _ = batching(cols, workload, engine)
    # the performance model's coefficients: CPU BLAS saturates at smaller GEMMs (as bb2a96d's estimate_performance)
    pcoef = replace(coef, gemm_half_dim=coef.cpu_gemm_half_dim) if cluster.gpu.is_cpu else coef
    kt = kind_tables(model, cluster, cols, tokens, workload, engine, pcoef)
    kn = knob_tables(model, cols, kt, engine)
    ot = overhead_tables(model, cluster, cols, workload, engine, coef)
    pp_send = pp_send_seconds(model, cluster, cols, tokens, engine, coef)
    gran = cols["recompute_granularity"]
    policy = np.where(gran == "full", np.where(cols["recompute_method"] == "block", 1, 2), 0)
    gid, first = group_ids(cols["pp"], cols["vpp"], policy)
    if len(first) == 1:
        return _group_estimate(model, cluster, cols, workload, engine, coef, kt, kn, ot, pp_send)
    pieces = []
    for g in range(len(first)):
        idx = np.flatnonzero(gid == g)
        pieces.append((idx, _group_estimate(model, cluster, cols.take(idx), workload, engine, coef, kt.rows(idx),
                                            kn.rows(idx), ot.rows(idx), pp_send[idx])))
    return _merge(pieces)


def _group_estimate(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, workload: Workload, engine: Engine,
                    coef: Coefficients, kt: KindTables, kn: KnobTables, ot: OverheadTables,
                    pp_send: np.ndarray) -> BatchEstimate:
    """Rows of one (PP, VPP, recompute method): placement, per-stage times and memory, the step and the verdict."""
    pl = _placement(model, cols, workload, engine)
    pcoef = replace(coef, gemm_half_dim=coef.cpu_gemm_half_dim) if cluster.gpu.is_cpu else coef
    mr = batch_moe.moe_rows(model, cols, pl, kt, TIME_KEYS, engine, pcoef)
    st = stage_times(model, cluster, cols, pl, kt, kn, pp_send, mr)
    params = stage_params(model, cols, pl, kt)
    pipe, bubble, crit, _ = pipeline(st, pl)
    ex_s = ex_shard = None
    if model.moe is not None:  # the routed experts' expert-DP communication and optimizer shard
        ex = batch_moe.stage_expert_params(model, cols, pl)
        ex_s = batch_moe.expert_dp_seconds(model, cluster, cols, ex, grad_bytes(cols, engine), coef)
        ex_shard = batch_moe.expert_shard(model, cols, pl, ex)
    dp_s = dp_seconds(cluster, cols, engine, coef, pl, st, params, ex_s)
    opt = optimizer_seconds(cluster, cols, engine, coef, pl, params, ex_shard)
    e_cast = 0.0 if ex_shard is None else batch_moe.cast_shard(cols, pl, params, ex_shard)
    cast = lp_batch.weight_cast_seconds(cluster, cols, kt.recipe, kt.plans, coef, pl.stage, params, e_cast)
    opt = opt if cast is None else opt + cast  # the weights cast to the low-precision recipe once per step
    overhead = np.full(len(cols), float(getattr(coef, engine.step_overhead)))
    step_s = pipe + dp_s + opt + overhead
    mem = stage_memory(model, cluster, cols, engine, coef, pl, kt, kn, ot, params)
    step = BatchStep(pipe, bubble, dp_s, opt, overhead, step_s, crit, pl.microbatches)
    return _finish(model, cluster, cols, workload, pl.stage, st, step, mem, pl.layers.sum(axis=2))


def _placement(model: ModelSpec, cols: LayoutColumns, workload: Workload, engine: Engine):
    """``place_batch``, kept for small batches made of layouts (``estimate``, the calibration fit, the recalibration:
    they ask for the same layouts again with other coefficients; the placement reads none)."""
    source = cols.source() if len(cols) <= PLACEMENTS_KEPT_ROWS else None
    if source is None:
        return place_batch(model, cols, workload, engine)
    key = (id(model), id(engine), workload, source)
    hit = _PLACEMENTS.get(key)
    if hit is None or hit[0] is not model or hit[1] is not engine:  # held: an id reused after collection misses
        if len(_PLACEMENTS) >= 4096:
            _PLACEMENTS.clear()
        hit = _PLACEMENTS[key] = (model, engine, place_batch(model, cols, workload, engine))
    return hit[2]


_PLACEMENTS: dict[tuple, tuple] = {}


def forget_placements() -> None:
    """Drop the kept placements (``attune.estimator.forget``)."""
    _PLACEMENTS.clear()


# batches of at most this many rows keep their placement between calls (rows): the calibration fit's per-target
# batches (tens of rows) and single estimates are placed again on every evaluation otherwise; a search's slices
# (BATCH_ROWS, 65,536 rows) are placed once and would only hold memory
PLACEMENTS_KEPT_ROWS = 256
"""Batches up to this many layouts keep their placement (a search's table does not come through here)."""


def _finish(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, workload: Workload, stage: np.ndarray,
            st: BatchStageTime, step: BatchStep, mem: BatchStageMemory, layers: np.ndarray) -> BatchEstimate:
    """Throughput, MFU, cost, peaks and the verdict from the per-stage terms (``terms.MemoryTerms``' properties)."""
    gpu = cluster.gpu
    world = cols["tp"] * cols["pp"] * cols["cp"] * cols["dp"]
    tps = workload.tokens_per_step / step.step_time_s / world
    total = np.where(stage, mem.total_gib, -np.inf)
    host = 0.0
    for s in range(stage.shape[1]):
        host = host + np.where(stage[:, s], mem.host_optimizer_gib[:, s], 0.0)
    host_needed = host / cols["pp"] * cluster.gpus_per_node
    host_cap = 0.9 * gpu.host_memory_bytes / GiB
    capacity = gpu.capacity_gib / cluster.gpus_per_node if gpu.is_cpu else gpu.capacity_gib  # CPU workers share it
    peak = total.max(axis=1)
    with np.errstate(divide="ignore"):
        usd = np.where(tps > 0, gpu.usd_per_hour / 3600.0 / tps * 1e6, np.inf)  # metrics.usd_per_million_tokens
    return BatchEstimate(
        step=step, tokens_per_s_per_gpu=tps, mfu=model_flops_utilization(tps, model, gpu), usd_per_million_tokens=usd,
        peak_gib=peak, peak_allocated_gib=np.where(stage, mem.allocated_gib, -np.inf).max(axis=1),
        peak_reserved_gib=np.where(stage, mem.reserved_gib, -np.inf).max(axis=1), peak_stage=np.argmax(total, axis=1),
        host_needed_gib=host_needed, host_capacity_gib=host_cap, capacity_gib=capacity,
        fits=(peak <= capacity) & (host_needed <= host_cap),
        pieces=[StagePiece(np.arange(len(peak)), stage, st, mem, layers)])


def _merge_array(order: np.ndarray, S: int, pieces: list[np.ndarray]) -> np.ndarray:
    """One [n] or [n, S] array from pieces holding the rows ``order`` lists, in that order (stages past a piece's own
    are 0 / False): the pieces are stacked, then put back in row order with one gather."""
    if pieces[0].ndim == 2:
        out = np.zeros((len(order), S), dtype=pieces[0].dtype)
        at = 0
        for a in pieces:
            out[at:at + len(a), :a.shape[1]] = a
            at += len(a)
    else:
        out = np.concatenate(pieces)
    back = np.empty_like(order)
    back[order] = np.arange(len(order))
    return out[back]


def _merge_record(cls, order: np.ndarray, S: int, pieces: list):
    """A record of arrays (BatchStageTime, BatchStep, BatchStageMemory) merged field by field."""
    out = {}
    for f in fields(cls):
        if f.name == "overheads":
            names = list(dict.fromkeys(k for r in pieces for k in r.overheads))
            out[f.name] = {k: _merge_array(order, S, [r.overheads.get(k, np.zeros_like(r.params)) for r in pieces])
                           for k in names}
        else:
            out[f.name] = _merge_array(order, S, [getattr(r, f.name) for r in pieces])
    return cls(**out)


ROW_FIELDS = ("tokens_per_s_per_gpu", "mfu", "usd_per_million_tokens", "peak_gib", "peak_allocated_gib",
              "peak_reserved_gib", "peak_stage", "host_needed_gib", "fits")
"""The [rows] arrays of a BatchEstimate besides ``step``."""


def _merge(pieces: list[tuple[np.ndarray, BatchEstimate]]) -> BatchEstimate:
    """The batch from estimates of disjoint row sets (row indices, estimate) covering every row, in row order; the
    per-stage pieces are kept as they are (renumbered), to be assembled when read."""
    order = np.concatenate([i for i, _ in pieces])
    ests = [b for _, b in pieces]
    row = {k: _merge_array(order, 1, [getattr(b, k) for b in ests]) for k in ROW_FIELDS}
    stage_pieces = [p.renumber(i[p.rows]) for i, b in pieces for p in b.pieces]
    return BatchEstimate(step=_merge_record(BatchStep, order, 1, [b.step for b in ests]),
                         host_capacity_gib=ests[0].host_capacity_gib, capacity_gib=ests[0].capacity_gib,
                         pieces=stage_pieces, **row)


def estimate_batch(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, workload: Workload, engine: Engine,
                   coef: Coefficients | None = None) -> BatchEstimate:
    """Memory and performance of every row of ``cols`` (no layout rule checked). Without ``coef``, the fitted set of
    the cluster's GPU generation (``coefficients_for``), as ``estimate`` does."""
    if not len(cols):
        raise LayoutError("estimate_batch: an empty batch (give at least one layout)")
    coef = coef if coef is not None else coefficients_for(cluster.gpu)
    return _array_estimate(model, cluster, cols, workload, engine, coef)
