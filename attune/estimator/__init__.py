"""One estimate of a layout: memory per stage, the verdict and the predicted speed, as one object.

A single layout is a batch of one: ``estimate`` checks the layout, estimates it with ``estimate_batch`` and reads row
0 as typed records (``attune.estimator.terms``). There is no other composition of an estimate."""

from __future__ import annotations

from dataclasses import dataclass

from attune.errors import LayoutError
from attune.estimator.batch import BatchEstimate, estimate_batch, forget_placements
from attune.estimator.memory import forget_overheads
from attune.estimator.terms import MemoryTerms, PerfTerms, row_terms
from attune.spec.columns import LayoutColumns
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec
from attune.spec.placement import batching
from attune.spec.precision import hardware_refusal
from attune.spec.rules import validate

from .coefficients import Coefficients, coefficients_for

__all__ = ["Estimate", "estimate", "estimate_layouts", "estimate_batch", "BatchEstimate"]


@dataclass
class Estimate:
    model: ModelSpec
    cluster: Cluster
    layout: Layout
    workload: Workload
    engine: Engine
    memory: MemoryTerms
    perf: PerfTerms

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def to_dict(self) -> dict:
        m, p = self.memory, self.perf
        return {
            "fits": m.fits,
            "verdict": m.verdict(),
            "capacity_gib": round(m.capacity_gib, 3),
            "peak_gib": round(m.peak_gib, 3),
            "peak_allocated_gib": round(m.peak_allocated_gib, 3),
            "peak_reserved_gib": round(m.peak_reserved_gib, 3),
            "peak_stage": m.peak_stage,
            "host_optimizer_gib_per_node": round(m.host_needed_gib, 1),
            "host_capacity_gib_per_node": round(m.host_capacity_gib, 1),
            "stages": [s.to_dict() for s in m.stages],
            "step_time_s": round(p.step_time_s, 4),
            "tokens_per_s_per_gpu": round(p.tokens_per_s_per_gpu, 2),
            "mfu": round(p.mfu, 4),
            "usd_per_million_tokens": round(p.usd_per_million_tokens, 4),
            "performance": p.to_dict(),
            "layout": {"label": self.layout.label(), **self.layout.to_dict()},
            "batching": {"rows_per_microbatch": m.batch.rows_per_microbatch,
                         "tokens_per_gpu_per_microbatch": m.batch.tokens_per_gpu,
                         "microbatches_per_step": m.batch.microbatches},
            "workload": {"seq_length": self.workload.seq_length, "global_batch": self.workload.global_batch},
            "engine": self.engine.name,
            "gpus": self.cluster.spec,
            "gpu": {"name": self.cluster.gpu.name, "usd_per_hour": self.cluster.gpu.usd_per_hour},
            "model": {"name": self.model.name, "active_params": self.model.active_params,
                      "total_params": self.model.total_params},
        }


def estimate(model: ModelSpec, cluster: Cluster, layout: Layout, workload: Workload, engine: Engine,
             coef: Coefficients | None = None, check_layout: bool = True) -> Estimate:
    """Memory and performance of one layout: a batch of one through ``estimate_batch``, read as typed records.
    Without ``coef``, the fitted set of the cluster's GPU generation (``coefficients_for``)."""
    coef = coef if coef is not None else coefficients_for(cluster.gpu)
    if check_layout:
        validate(layout, model, cluster.world_size, workload, engine)
        refused = hardware_refusal(layout, cluster.gpu.generation, cluster.gpu.is_cpu)
        if refused:
            raise LayoutError(refused)
    key = (id(model), id(cluster), id(engine), layout, workload, coef)
    hit = _ESTIMATES.get(key)
    if hit is not None and hit.model is model and hit.cluster is cluster and hit.engine is engine:
        return hit  # the held objects make an id reused after garbage collection a miss
    cols = _COLUMNS.get(layout)
    if cols is None:
        if len(_COLUMNS) >= ESTIMATES_KEPT:
            _COLUMNS.clear()
        cols = _COLUMNS[layout] = LayoutColumns.from_layouts([layout])
    b = estimate_batch(model, cluster, cols, workload, engine, coef)
    est = _ESTIMATES[key] = _row_estimate(b, 0, model, cluster, layout, workload, engine)
    if len(_ESTIMATES) > ESTIMATES_KEPT:
        del _ESTIMATES[next(iter(_ESTIMATES))]
    return est


def estimate_layouts(model: ModelSpec, cluster: Cluster, layouts: list[Layout], workload: Workload, engine: Engine,
                     coef: Coefficients | None = None) -> list[Estimate]:
    """``estimate`` of several layouts of one target as one batch (no layout rule checked): what a caller that
    estimates many layouts at once reads (the calibration fit). The same records, row for row."""
    coef = coef if coef is not None else coefficients_for(cluster.gpu)
    key = tuple(layouts)
    cols = _COLUMNS.get(key)
    if cols is None:
        if len(_COLUMNS) >= ESTIMATES_KEPT:
            _COLUMNS.clear()
        cols = _COLUMNS[key] = LayoutColumns.from_layouts(layouts)
    b = estimate_batch(model, cluster, cols, workload, engine, coef)
    return [_row_estimate(b, i, model, cluster, lay, workload, engine) for i, lay in enumerate(layouts)]


def _row_estimate(b: BatchEstimate, i: int, model: ModelSpec, cluster: Cluster, layout: Layout, workload: Workload,
                  engine: Engine) -> Estimate:
    """Row i of a batch as an ``Estimate`` (typed records)."""
    mem, perf = row_terms(b, i, batching(layout, workload, engine), model.moe is not None,
                          bool(layout.offload_modules))
    return Estimate(model, cluster, layout, workload, engine, mem, perf)


ESTIMATES_KEPT = 4096
"""Estimates ``estimate`` keeps, oldest out first: the tuner, the report and the recalibration ask again for the
layouts they already asked for (each is a few dozen records; the search's table does not come through here)."""
_ESTIMATES: dict[tuple, Estimate] = {}
def forget() -> None:
    """Drop what ``estimate`` and ``estimate_batch`` keep between calls (estimates, batches, placements, fixed
    overheads): a test that checks kept results against fresh ones calls this first."""
    _ESTIMATES.clear()
    _COLUMNS.clear()
    forget_placements()
    forget_overheads()


_COLUMNS: dict[Layout | tuple[Layout, ...], LayoutColumns] = {}
"""Each layout's batch of one, each list's batch (the calibration fit asks for the same layouts again with other
coefficients)."""
