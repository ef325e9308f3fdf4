"""The estimator over a batch of layouts held as columns: ``estimate_batch`` (issue 18's array engine).

``estimate_batch(model, cluster, cols, workload, engine, coef=None) -> BatchEstimate`` estimates every row of a
`LayoutColumns` batch at once with numpy: the placement as ``[rows, stages, chunks]`` arrays (``batch_place``), the
per-layer costs and times once per distinct shape (``batch_tables``, by the scalar functions), the per-stage step-time
parts (``batch_time``) and memory terms (``batch_memory``), accumulated in the scalar path's order so that every term
equals the scalar composition's before ``estimate()`` became a batch of one (tests/test_batch_engine.py's frozen
reference, benchmarks/estimate_equivalence.py against bb2a96d). Rows are computed in groups
of one (PP, VPP, full-recompute method), so no group carries padding; the per-stage records a caller reads are
``[rows, stages]`` arrays padded to the batch's largest PP, with the mask ``BatchEstimate.stage``. Coefficients are
chosen as ``estimate()`` chooses them: ``coefficients_for`` the cluster's GPU when ``coef`` is None. No layout rule
is checked (``estimate(..., check_layout=False)``).

The rows the array engine does not cover are estimated by the scalar composition (``estimate_parts``) row by row and
written into the same arrays: ``scalar_rows`` decides which (one place), and ``BatchEstimate.scalar_rows`` says
which rows went that way: none now. MoE models (routed and shared experts, router, EP / ETP, the dispatchers, the
expert all-to-all overlap, expert memory: ``batch_moe``), low-precision GEMMs (``batch_precision``, the routed experts'
included) and multi-token prediction (``batch_mtp``, MoE-kind MTP layers included) are all in the arrays.
"""

from __future__ import annotations

import math
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
from attune.estimator.compose import estimate_parts
from attune.estimator.memory import MemoryEstimate
from attune.estimator.metrics import model_flops_utilization
from attune.estimator.performance import PerfEstimate
from attune.spec.columns import KINDS, NONE_INT, LayoutColumns
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster, GiB
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec

from .coefficients import Coefficients, coefficients_for


@dataclass(frozen=True)
class StagePiece:
    """The per-stage records of some rows of a batch (one (PP, VPP) group, or one scalar row)."""

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


class ScalarPiece:
    """The per-stage records of rows the scalar composition estimated (``scalar_rows``), built from its results
    only when read: a search reads one term (``total_gib``), not every record of thousands of rows."""

    def __init__(self, rows: np.ndarray, mems: list[MemoryEstimate], perfs: list[PerfEstimate | None]) -> None:
        self.rows, self._mems, self._perfs = rows, mems, perfs

    def renumber(self, rows: np.ndarray) -> "ScalarPiece":
        return ScalarPiece(rows, self._mems, self._perfs)

    def _per_stage(self, read, dtype=np.float64, fill=0.0) -> np.ndarray:
        out = np.full((len(self._mems), self.stage.shape[1]), fill, dtype=dtype)
        for i, m in enumerate(self._mems):
            got = read(i, m)
            out[i, :len(got)] = got
        return out

    @cached_property
    def stage(self) -> np.ndarray:
        S = max(len(m.stages) for m in self._mems)
        return np.array([[s < len(m.stages) for s in range(S)] for m in self._mems], dtype=bool).reshape(-1, S)

    @cached_property
    def layers(self) -> np.ndarray:
        return self._per_stage(lambda i, m: [s.layers for s in m.stages])

    def values(self, name: str) -> np.ndarray:
        if name in _TIME_NAMES:
            def read(i, m):
                p = self._perfs[i]
                if p is None:  # memory first (``perf_below_gib``): no seconds
                    return [math.nan] * len(m.stages)
                return [s.parts[name] if name in s.parts else getattr(s, name) for s in p.stages]
        elif name in _MEMORY_NAMES:
            def read(i, m):
                return [getattr(s, name) for s in m.stages]
        else:
            def read(i, m):
                return [s.overheads.get(name, 0.0) for s in m.stages]
        return self._per_stage(read)

    @cached_property
    def time(self) -> BatchStageTime:
        return BatchStageTime(**{n: self.values(n) for n in _TIME_FIELDS})

    @cached_property
    def memory(self) -> BatchStageMemory:
        names = list(dict.fromkeys(k for m in self._mems for s in m.stages for k in s.overheads))
        return BatchStageMemory(**{n: self.values(n) for n in _MEMORY_FIELDS}, overheads={k: self.values(k)
                                                                                          for k in names})


class BatchEstimate:
    """Memory and speed of every row of a batch: arrays ``[rows]`` and, per stage, ``[rows, stages]`` (stages up
    to the batch's largest PP; ``stage`` masks the ones a row has). The per-stage records are assembled in row order
    when first read (a search reads the per-row figures only)."""

    def __init__(self, *, step: BatchStep, tokens_per_s_per_gpu: np.ndarray, mfu: np.ndarray,
                 usd_per_million_tokens: np.ndarray, peak_gib: np.ndarray, peak_allocated_gib: np.ndarray,
                 peak_reserved_gib: np.ndarray, peak_stage: np.ndarray, host_needed_gib: np.ndarray,
                 host_capacity_gib: float, capacity_gib: float, fits: np.ndarray, scalar_rows: np.ndarray,
                 pieces: list[StagePiece]) -> None:
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
        self.scalar_rows = scalar_rows
        """[N] rows estimated by the scalar composition (``scalar_rows``), not the array engine."""
        self.pieces = pieces

    def __len__(self) -> int:
        return len(self.fits)

    @property
    def host_fits(self) -> np.ndarray:
        """[N] the CPU-offloaded optimizer state fits in the nodes' host memory (``MemoryEstimate.host_fits``)."""
        return self.host_needed_gib <= self.host_capacity_gib

    def terms(self, i: int) -> dict[str, float]:
        """Every term of row i by name, as ``estimate_terms`` names a scalar estimate's (stage terms as
        ``name[stage]``; a named overhead the stage does not have reads 0)."""
        st = self.step
        out = {k: float(getattr(st, k)[i]) for k in STEP_FIELDS}
        out.update({k: float(getattr(self, k)[i]) for k in ROW_FIELDS if k != "scalar_rows"})
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


def scalar_rows(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, engine: Engine) -> np.ndarray:
    """[N] the rows the array engine does not cover (the one place that decides): none. Dense and MoE models, bf16 /
    fp16 and low-precision GEMMs (``batch_precision``, an MoE model's routed experts included), multi-token prediction
    (``batch_mtp``, MoE-kind MTP layers: ``batch_moe``) are all arrays. Kept (all False) until the scalar composition
    it routes to is deleted."""
    return np.zeros(len(cols), dtype=bool)


def _array_estimate(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, workload: Workload, engine: Engine,
                    coef: Coefficients) -> BatchEstimate:
    """The array engine on rows it covers: the shared tables once, then each group of rows of one (PP, VPP) and
    full-recompute method (none, block, uniform), without padding (stages and chunks are whole arrays there, and
    only that recompute policy's terms are computed)."""
    _, tokens, _ = batching(cols, workload, engine)
    # the performance model's coefficients: CPU BLAS saturates at smaller GEMMs (estimate_performance)
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
    return _finish(model, cluster, cols, workload, pl.stage, st, step, mem, np.zeros(len(cols), dtype=bool),
                   pl.layers.sum(axis=2))


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


PLACEMENTS_KEPT_ROWS = 256
"""Batches up to this many layouts keep their placement (a search's table does not come through here)."""


def _finish(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, workload: Workload, stage: np.ndarray,
            st: BatchStageTime, step: BatchStep, mem: BatchStageMemory, scalar: np.ndarray,
            layers: np.ndarray) -> BatchEstimate:
    """Throughput, MFU, cost, peaks and the verdict from the per-stage terms (``MemoryEstimate``'s properties)."""
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
        fits=(peak <= capacity) & (host_needed <= host_cap), scalar_rows=scalar,
        pieces=[StagePiece(np.arange(len(peak)), stage, st, mem, layers)])


def _scalar_estimate(mems: list[MemoryEstimate], perfs: list[PerfEstimate | None]) -> BatchEstimate:
    """The rows ``scalar_rows`` selects, from the scalar composition's results (rows 0..n-1): the per-row figures
    now, the per-stage records when read (``ScalarPiece``); without a row's performance (``estimate_batch``'s
    ``perf_below_gib``) its seconds and throughput read NaN."""
    n = len(mems)
    nan = math.nan
    peak, alloc, reserved, stage_of, fits = [], [], [], [], []
    for m in mems:
        totals = [s.total_gib for s in m.stages]
        top = max(totals)
        peak.append(top)
        stage_of.append(m.stages[totals.index(top)].stage)
        alloc.append(max(s.allocated_gib for s in m.stages))
        reserved.append(max(s.reserved_gib for s in m.stages))
        fits.append(top <= m.capacity_gib and m.host_fits)
    step = [(nan,) * 7 + (0,) if p is None else
            (p.pipeline_s, p.bubble_s, p.dp_comm_s, p.optimizer_s, p.overhead_s, p.step_time_s,
             p.tokens_per_s_per_gpu, p.breakdown.critical_stage) for p in perfs]
    cols = np.array([x[:7] for x in step], dtype=np.float64).reshape(n, 7).T
    other = [(nan, nan) if p is None else (p.mfu, p.usd_per_million_tokens) for p in perfs]
    mfu, usd = np.array(other, dtype=np.float64).reshape(n, 2).T
    return BatchEstimate(
        step=BatchStep(*cols[:6], np.array([x[7] for x in step], dtype=np.int64),
                       np.array([m.batch.microbatches for m in mems])),
        tokens_per_s_per_gpu=cols[6], mfu=mfu, usd_per_million_tokens=usd, peak_gib=np.array(peak),
        peak_allocated_gib=np.array(alloc), peak_reserved_gib=np.array(reserved), peak_stage=np.array(stage_of),
        host_needed_gib=np.array([m.host_needed_gib for m in mems]), host_capacity_gib=mems[0].host_capacity_gib,
        capacity_gib=mems[0].capacity_gib, fits=np.array(fits, dtype=bool), scalar_rows=np.ones(n, dtype=bool),
        pieces=[ScalarPiece(np.arange(n), mems, perfs)])


_TIME_FIELDS = tuple(f.name for f in fields(BatchStageTime))
_MEMORY_FIELDS = tuple(f.name for f in fields(BatchStageMemory) if f.name != "overheads")


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
              "peak_reserved_gib", "peak_stage", "host_needed_gib", "fits", "scalar_rows")
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


def _layouts(cols: LayoutColumns):
    """Every row as a `Layout`, in order (`LayoutColumns.layout` per row, with the columns turned into Python
    values once instead of one numpy scalar at a time)."""
    names = list(cols.columns())
    values = []
    for name in names:
        col = cols[name].tolist()
        if KINDS[name] == "opt_int":
            col = [None if v == NONE_INT else v for v in col]
        elif KINDS[name] == "opt_float":
            col = [None if v != v else v for v in col]  # NaN
        values.append(col)
    for row in zip(*values):
        yield Layout(**dict(zip(names, row)))


def estimate_batch(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, workload: Workload, engine: Engine,
                   coef: Coefficients | None = None, perf_below_gib: float | None = None) -> BatchEstimate:
    """Memory and performance of every row of ``cols`` (no layout rule checked). Without ``coef``, the fitted set of
    the cluster's GPU generation (``coefficients_for``), as ``estimate`` does. Rows ``scalar_rows`` selects go
    through the scalar composition (``estimate_parts``), the others through the array engine. ``perf_below_gib``
    (the search's memory-first scoring): a scalar row whose peak exceeds it or whose host memory does not fit gets
    no performance (NaN seconds and throughput); array rows always have theirs."""
    coef = coef if coef is not None else coefficients_for(cluster.gpu)
    scalar = scalar_rows(model, cluster, cols, engine)
    pieces: list[tuple[np.ndarray, BatchEstimate]] = []
    if not scalar.all():
        sub = cols if not scalar.any() else cols.take(~scalar)
        est = _array_estimate(model, cluster, sub, workload, engine, coef)
        if not scalar.any():
            return est
        pieces.append((np.flatnonzero(~scalar), est))
    idx = np.flatnonzero(scalar)
    if idx.size:
        lays = [cols.layout(0)] if len(cols) == 1 else _layouts(cols.take(idx))
        mems, perfs = zip(*(estimate_parts(model, cluster, lay, workload, engine, coef, perf_below_gib)
                            for lay in lays))
        pieces.append((idx, _scalar_estimate(list(mems), list(perfs))))
    if not pieces:
        raise LayoutError("estimate_batch: an empty batch (give at least one layout)")
    return pieces[0][1] if len(cols) == 1 else _merge(pieces)
