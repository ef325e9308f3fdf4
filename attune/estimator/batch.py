"""The estimator over a batch of layouts held as columns: ``estimate_batch`` (issue 18's array engine).

``estimate_batch(model, cluster, cols, workload, engine, coef=None) -> BatchEstimate`` estimates every row of a
`LayoutColumns` batch at once with numpy: the placement as padded ``[rows, stages, chunks]`` arrays
(``batch_place``), the per-layer costs and times once per distinct shape (``batch_tables``, by the scalar
functions), the per-stage step-time parts (``batch_time``) and memory terms (``batch_memory``), accumulated in the
scalar path's order so that every term equals ``estimate()``'s (tests/test_batch_engine.py,
benchmarks/estimate_equivalence.py). Coefficients are chosen as ``estimate()`` chooses them: ``coefficients_for``
the cluster's GPU when ``coef`` is None. No layout rule is checked (``estimate(..., check_layout=False)``).

The rows the array engine does not cover are estimated by the scalar composition (``estimate_parts``) row by row and
written into the same arrays: ``scalar_rows`` decides which (one place), and ``BatchEstimate.scalar_rows`` says
which rows went that way. Those are MoE models (routed experts, EP), low-precision GEMMs (fp8 / mxfp8 / nvfp4),
multi-token prediction, CPU workers and attune's torch trainer: their physics is being changed elsewhere and stays in
one (scalar) place until it settles.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from attune.errors import LayoutError
from attune.estimator.batch_memory import BatchStageMemory, stage_memory
from attune.estimator.batch_place import place_batch
from attune.estimator.batch_tables import kind_tables, knob_tables, overhead_tables
from attune.estimator.batch_time import (
    BatchStageTime,
    BatchStep,
    dp_seconds,
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
from attune.spec.columns import LayoutColumns
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster, GiB
from attune.spec.layout import Workload
from attune.spec.model import ModelSpec

from .coefficients import Coefficients, coefficients_for


@dataclass
class BatchEstimate:
    """Memory and speed of every row of a batch: arrays ``[rows]`` and, per stage, ``[rows, stages]`` (stages up
    to the batch's largest PP; ``stage`` masks the ones a row has)."""

    stage: np.ndarray
    """[N, S] the row has this pipeline stage."""
    time: BatchStageTime
    """Per stage, one microbatch: forward / backward GEMM, attention, GDN, memory-bound work, recompute, exposed
    TP / CP / PP / EP communication, activation offload."""
    step: BatchStep
    """Per row: pipeline, bubble, exposed DP communication, optimizer, overhead, step time, critical stage."""
    memory: BatchStageMemory
    """Per stage: weights, grads, optimizer states, activations, logits, each named overhead; allocated, reserved
    and total peaks."""
    tokens_per_s_per_gpu: np.ndarray
    mfu: np.ndarray
    usd_per_million_tokens: np.ndarray
    peak_gib: np.ndarray
    """The largest stage's total (what the verdict compares with capacity_gib)."""
    peak_allocated_gib: np.ndarray
    peak_reserved_gib: np.ndarray
    peak_stage: np.ndarray
    host_needed_gib: np.ndarray
    """CPU-offloaded optimizer state per node, GiB."""
    host_capacity_gib: float
    capacity_gib: float
    fits: np.ndarray
    scalar_rows: np.ndarray
    """[N] rows estimated by the scalar composition (``scalar_rows``), not the array engine."""

    def __len__(self) -> int:
        return len(self.fits)


def scalar_rows(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, engine: Engine) -> np.ndarray:
    """[N] the rows the array engine does not cover (the one place that decides): every row of an MoE model, on CPU
    workers or with attune's torch trainer; low-precision GEMMs; multi-token prediction; expert parallelism."""
    n = len(cols)
    if model.moe is not None or cluster.gpu.is_cpu or engine.attune_trainer:
        return np.ones(n, dtype=bool)
    low = np.not_equal(cols["fp8_format"], None) | np.not_equal(cols["fp4_format"], None)
    return low | (cols["mtp_layers"] > 0) | (cols["ep"] * cols["etp"] > 1)


def _array_estimate(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, workload: Workload, engine: Engine,
                    coef: Coefficients) -> BatchEstimate:
    """The array engine on rows it covers."""
    pl = place_batch(model, cols, workload, engine)
    kt = kind_tables(model, cluster, cols, pl.tokens_per_gpu, workload, engine, coef)
    kn = knob_tables(model, cols, kt, engine)
    ot = overhead_tables(model, cluster, cols, workload, engine, coef)
    st = stage_times(model, cluster, cols, pl, kt, kn, pp_send_seconds(model, cluster, cols, pl.tokens_per_gpu,
                                                                       engine, coef))
    params = stage_params(model, cols, pl, kt)
    pipe, bubble, crit, _ = pipeline(st, pl)
    dp_s = dp_seconds(cluster, cols, engine, coef, pl, st, params)
    opt = optimizer_seconds(cluster, cols, engine, coef, pl, params)
    overhead = np.full(len(cols), float(getattr(coef, engine.step_overhead)))
    step_s = pipe + dp_s + opt + overhead
    mem = stage_memory(model, cluster, cols, engine, coef, pl, kt, kn, ot, params)
    step = BatchStep(pipe, bubble, dp_s, opt, overhead, step_s, crit, pl.microbatches)
    return _finish(model, cluster, cols, workload, pl.stage, st, step, mem, np.zeros(len(cols), dtype=bool))


def _finish(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, workload: Workload, stage: np.ndarray,
            st: BatchStageTime, step: BatchStep, mem: BatchStageMemory, scalar: np.ndarray) -> BatchEstimate:
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
    peak = total.max(axis=1)
    with np.errstate(divide="ignore"):
        usd = np.where(tps > 0, gpu.usd_per_hour / 3600.0 / tps * 1e6, np.inf)  # metrics.usd_per_million_tokens
    return BatchEstimate(
        stage=stage, time=st, step=step, memory=mem, tokens_per_s_per_gpu=tps,
        mfu=model_flops_utilization(tps, model, gpu), usd_per_million_tokens=usd, peak_gib=peak,
        peak_allocated_gib=np.where(stage, mem.allocated_gib, -np.inf).max(axis=1),
        peak_reserved_gib=np.where(stage, mem.reserved_gib, -np.inf).max(axis=1), peak_stage=np.argmax(total, axis=1),
        host_needed_gib=host_needed, host_capacity_gib=host_cap, capacity_gib=gpu.capacity_gib,
        fits=(peak <= gpu.capacity_gib) & (host_needed <= host_cap), scalar_rows=scalar)


def _one_row(mem: MemoryEstimate, perf: PerfEstimate) -> BatchEstimate:
    """A batch of one from the scalar composition's result (the rows ``scalar_rows`` selects)."""
    row = lambda xs: np.array([xs], dtype=np.float64)  # noqa: E731
    ms, ps = mem.stages, perf.stages
    time = BatchStageTime(**{f.name: row([s.parts[f.name] if f.name in s.parts else getattr(s, f.name) for s in ps])
                             for f in fields(BatchStageTime)})
    names = list(dict.fromkeys(k for s in ms for k in s.overheads))
    memory = BatchStageMemory(
        **{f.name: row([getattr(s, f.name) for s in ms]) for f in fields(BatchStageMemory) if f.name != "overheads"},
        overheads={k: row([s.overheads.get(k, 0.0) for s in ms]) for k in names})
    b = perf.breakdown
    step = BatchStep(row(perf.pipeline_s), row(perf.bubble_s), row(perf.dp_comm_s), row(perf.optimizer_s),
                     row(perf.overhead_s), row(perf.step_time_s), np.array([b.critical_stage]),
                     np.array([mem.batch.microbatches]))
    return BatchEstimate(
        stage=np.ones((1, len(ms)), dtype=bool), time=time, step=step, memory=memory,
        tokens_per_s_per_gpu=row(perf.tokens_per_s_per_gpu), mfu=row(perf.mfu),
        usd_per_million_tokens=row(perf.usd_per_million_tokens), peak_gib=row(mem.peak_gib),
        peak_allocated_gib=row(mem.peak_allocated_gib), peak_reserved_gib=row(mem.peak_reserved_gib),
        peak_stage=np.array([mem.peak_stage]), host_needed_gib=row(mem.host_needed_gib),
        host_capacity_gib=mem.host_capacity_gib, capacity_gib=mem.capacity_gib, fits=np.array([mem.fits]),
        scalar_rows=np.array([True]))


def _merge_array(n: int, S: int, pieces: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """One [n] or [n, S] array from (row indices, array) pieces (stages past a piece's own are 0 / False)."""
    a0 = pieces[0][1]
    out = np.zeros((n, S) if a0.ndim == 2 else (n,), dtype=a0.dtype)
    for idx, a in pieces:
        if a.ndim == 2:
            out[idx, :a.shape[1]] = a
        else:
            out[idx] = a
    return out


def _merge_record(cls, n: int, S: int, pieces: list[tuple[np.ndarray, object]]):
    """A record of arrays (BatchStageTime, BatchStep, BatchStageMemory) merged field by field."""
    out = {}
    for f in fields(cls):
        if f.name == "overheads":
            names = list(dict.fromkeys(k for _, r in pieces for k in r.overheads))
            out[f.name] = {k: _merge_array(n, S, [(i, r.overheads.get(k, np.zeros_like(r.params))) for i, r in pieces])
                           for k in names}
        else:
            out[f.name] = _merge_array(n, S, [(i, getattr(r, f.name)) for i, r in pieces])
    return cls(**out)


def _merge(n: int, pieces: list[tuple[np.ndarray, BatchEstimate]]) -> BatchEstimate:
    """The batch from estimates of disjoint row sets (array rows, scalar rows), in row order."""
    S = max(b.stage.shape[1] for _, b in pieces)
    records = {"time": BatchStageTime, "step": BatchStep, "memory": BatchStageMemory}
    out = {}
    for f in fields(BatchEstimate):
        if f.name in records:
            out[f.name] = _merge_record(records[f.name], n, S, [(i, getattr(b, f.name)) for i, b in pieces])
        elif f.name in ("host_capacity_gib", "capacity_gib"):
            out[f.name] = getattr(pieces[0][1], f.name)
        else:
            out[f.name] = _merge_array(n, S, [(i, getattr(b, f.name)) for i, b in pieces])
    return BatchEstimate(**out)


def estimate_batch(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, workload: Workload, engine: Engine,
                   coef: Coefficients | None = None) -> BatchEstimate:
    """Memory and performance of every row of ``cols`` (no layout rule checked). Without ``coef``, the fitted set of
    the cluster's GPU generation (``coefficients_for``), as ``estimate`` does. Rows ``scalar_rows`` selects go
    through the scalar composition (``estimate_parts``), the others through the array engine."""
    coef = coef if coef is not None else coefficients_for(cluster.gpu)
    n = len(cols)
    scalar = scalar_rows(model, cluster, cols, engine)
    pieces: list[tuple[np.ndarray, BatchEstimate]] = []
    if not scalar.all():
        sub = cols if not scalar.any() else cols.take(~scalar)
        est = _array_estimate(model, cluster, sub, workload, engine, coef)
        if not scalar.any():
            return est
        pieces.append((np.flatnonzero(~scalar), est))
    for i in np.flatnonzero(scalar):
        mem, perf = estimate_parts(model, cluster, cols.layout(int(i)), workload, engine, coef)
        pieces.append((np.array([i]), _one_row(mem, perf)))
    if not pieces:
        raise LayoutError("estimate_batch: an empty batch (give at least one layout)")
    return _merge(n, pieces)
