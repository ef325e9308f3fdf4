"""The scalar composition, kept only for the rows the array engine does not cover yet: ``estimate_batch``
(attune.estimator.batch) calls it for the rows ``batch.scalar_rows`` selects (MoE, low precision, MTP), nothing else
does. When ``scalar_rows`` selects none, this module goes, with ``memory.estimate_memory`` / ``_stage_bytes``,
``performance.estimate_performance`` / ``_pipeline`` / ``_mtp_parts`` and ``reuse``.
"""

from __future__ import annotations

from attune.estimator.memory import MemoryEstimate, estimate_memory
from attune.estimator.performance import PerfEstimate, estimate_performance
from attune.estimator.reuse import placement as shared_placement
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec

from .coefficients import Coefficients


def estimate_parts(model: ModelSpec, cluster: Cluster, layout: Layout, workload: Workload, engine: Engine,
                   coef: Coefficients, perf_below_gib: float | None = None) -> tuple[MemoryEstimate, PerfEstimate | None]:
    """The one composition of an estimate (no checks): the placement derived once and handed to the memory and
    performance models. With ``perf_below_gib`` (the search's memory-first scoring), no performance (None) for
    a layout whose peak exceeds it or whose host memory does not fit."""
    placement = shared_placement(model, layout, workload, engine)
    mem = estimate_memory(model, cluster, layout, workload, engine, coef, placement)
    if perf_below_gib is not None and (mem.peak_gib > perf_below_gib or not mem.host_fits):
        return mem, None
    return mem, estimate_performance(model, cluster, layout, workload, engine, coef, placement)
