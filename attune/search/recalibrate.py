"""Recalibration of the model to one study's measurements.

Throughput: a few physical coefficients of the performance model are refitted by bounded least squares on
log tokens/s/GPU (`scipy.optimize.least_squares`), with the shipped calibration as a Gaussian prior in log
space, so a few points cannot run away. The fitted coefficients and their bounds come from the `bounds`
metadata of `attune.estimator.coefficients.Coefficients` fields where present, else from FALLBACK_BOUNDS;
coefficients that change predicted memory are left to the memory terms.

Memory: measured peaks and real OOMs update an additive offset per stage position (first, middle, last
pipeline stage; a single stage is both first and last): a common offset (the mean of measured - predicted over
every measured stage, shrunk toward 0 with a prior of MEMORY_PRIOR_FRACTION of capacity) plus a per-position
deviation (shrunk toward 0 with MEMORY_POSITION_FRACTION), so a position never measured (the middle stages
after a PP=2 baseline) borrows the common offset; each offset is raised so that every stage that ran out of
memory for real is predicted over capacity. The posterior spread of each offset is kept for P(fit).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import least_squares

from attune.estimator import estimate
from attune.estimator.coefficients import Coefficients
from attune.spec.layout import Layout

# Fallback (name, low, high) of the refitted performance coefficients when Coefficients carries no `bounds`
# metadata. Ranges are the physical ones quoted in attune/estimator/coefficients.py: large-GEMM efficiency of
# cuBLAS/TE on Hopper 0.6-0.8 (widened to 0.45-0.9), FlashAttention 0.35-0.75, FLA GDN kernels far below GEMMs,
# achieved NVLink bus bandwidth / line rate up to ~0.9, the host Adam step a few to ~30% of STREAM bandwidth.
FALLBACK_BOUNDS = (("gemm_efficiency", 0.45, 0.90), ("attention_efficiency", 0.25, 0.80),
                   ("gdn_kernel_efficiency", 0.03, 0.30), ("hbm_efficiency", 0.40, 0.95),
                   ("nvlink_efficiency", 0.50, 0.95), ("host_optimizer_efficiency", 0.02, 0.30))
# prior standard deviation of log(coefficient / shipped) = this fraction of the log-width of its bounds
PRIOR_WIDTH_FRACTION = 0.25
# run-to-run noise of a measured throughput, as a log standard deviation (2-5% between runs, issue 11)
THROUGHPUT_NOISE = 0.03
# memory: prior standard deviation of the offset common to every stage, as a fraction of capacity (the
# calibration's peak-memory MAPE is 4.9%, `attune calibrate` on memory.yaml), of a stage position's deviation from
# it (first / last stage buffers, 1% of capacity), and of one measured stage peak (allocator noise, GiB)
MEMORY_PRIOR_FRACTION, MEMORY_POSITION_FRACTION, MEMORY_NOISE_GIB = 0.05, 0.01, 0.5
# a stage that ran out of memory is put this far over capacity by the offset (GiB)
OOM_MARGIN_GIB = 0.25
POSITIONS = ("first", "middle", "last")


def stage_positions(stage: int, pp: int) -> tuple[str, ...]:
    """Positions of pipeline stage `stage` of `pp`: a single stage is both first and last."""
    if pp == 1:
        return ("first", "last")
    return ("first",) if stage == 0 else ("last",) if stage == pp - 1 else ("middle",)


def fitted_bounds(coef: Coefficients) -> list[tuple[str, float, float]]:
    """(name, low, high) of every coefficient with `bounds` metadata, else FALLBACK_BOUNDS (names that exist)."""
    meta = [(f.name, *f.metadata["bounds"]) for f in dataclasses.fields(coef) if f.metadata and "bounds" in f.metadata]
    if meta:
        return [(n, float(lo), float(hi)) for n, lo, hi in meta]
    have = {f.name for f in dataclasses.fields(coef)}
    return [b for b in FALLBACK_BOUNDS if b[0] in have]


@dataclass(kw_only=True)
class Measurement:
    """One measured trial as recalibration sees it."""

    layout: Layout
    """The layout that ran."""
    tokens_per_s_per_gpu: float | None = None
    """Measured throughput (None unless it completed)."""
    stage_peak_gib: list[float] | None = None
    """Measured peak per pipeline stage, GiB (None when not measured)."""
    oom_stage: int | None = None
    """The stage that ran out of memory for real (None unless it did)."""

    def __post_init__(self) -> None:
        if self.tokens_per_s_per_gpu is not None and not self.tokens_per_s_per_gpu > 0:
            raise ValueError(f"Measurement: tokens/s/GPU must be positive (got {self.tokens_per_s_per_gpu})")


@dataclass(kw_only=True)
class Calibration:
    """The study's recalibrated model: coefficients and memory offsets."""

    coefficients: Coefficients
    """Coefficients after the refit (the shipped ones when nothing was fitted)."""
    log_shift: dict[str, float] = field(default_factory=dict)
    """log(fitted / shipped) of each refitted coefficient."""
    memory_offset_gib: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in POSITIONS})
    """Additive memory offset per stage position (first, middle, last), GiB."""
    memory_spread_gib: dict[str, float] = field(default_factory=dict)
    """Standard deviation of a predicted stage peak with the offsets, per stage position, GiB (empty when no
    peak or OOM was measured: the sampler keeps the shipped model's headroom)."""
    residual_rms: float = 0.0
    """RMS of log(measured / predicted) after the refit, over the completed trials."""

    def __post_init__(self) -> None:
        if set(self.memory_offset_gib) != set(POSITIONS):
            raise ValueError(f"Calibration.memory_offset_gib needs the positions {', '.join(POSITIONS)}")

    def stage_offset(self, stage: int, pp: int) -> float:
        """GiB added to a stage's predicted peak."""
        return max(self.memory_offset_gib[p] for p in stage_positions(stage, pp))


def _fit_names(shipped: Coefficients, probe: Layout | None, ctx: tuple) -> list[tuple[str, float, float]]:
    """Bounded coefficients that change throughput and not memory (probed on one layout)."""
    out = []
    model, cluster, workload, engine = ctx
    base = estimate(model, cluster, probe, workload, engine, shipped, check_layout=False) if probe else None
    for name, lo, hi in fitted_bounds(shipped):
        c0 = getattr(shipped, name)
        if not (c0 > 0 and 0 < lo < hi):  # a fixed or non-positive range has nothing to fit in log space
            continue
        if base is not None:
            e = estimate(model, cluster, probe, workload, engine, dataclasses.replace(shipped, **{name: c0 * 1.1}),
                         check_layout=False)
            if abs(e.memory.peak_gib - base.memory.peak_gib) > 1e-9:
                continue
        out.append((name, min(lo, c0), max(hi, c0)))
    return out


def recalibrate(measurements: list[Measurement], shipped: Coefficients, ctx: tuple,
                capacity_gib: float) -> Calibration:
    """Refit throughput coefficients and memory offsets to a study's measurements (see the module docstring).
    `ctx` is (model, cluster, workload, engine)."""
    model, cluster, workload, engine = ctx
    ok = [m for m in measurements if m.tokens_per_s_per_gpu]
    shift: dict[str, float] = {}
    coef = shipped
    rms = 0.0
    if ok:
        names = _fit_names(shipped, ok[0].layout, ctx)
        c0 = np.array([getattr(shipped, n) for n, _, _ in names])
        lo = np.log(np.array([b[1] for b in names]) / c0)
        hi = np.log(np.array([b[2] for b in names]) / c0)
        prior = PRIOR_WIDTH_FRACTION * (hi - lo)
        y = np.log([m.tokens_per_s_per_gpu for m in ok])

        def coef_at(theta):
            return dataclasses.replace(shipped, **{n: float(v) for (n, _, _), v in zip(names, c0 * np.exp(theta))})

        def resid(theta):
            c = coef_at(theta)
            pred = np.log([estimate(model, cluster, m.layout, workload, engine, c, check_layout=False)
                           .perf.tokens_per_s_per_gpu for m in ok])
            return np.concatenate([(pred - y) / THROUGHPUT_NOISE, theta / prior])

        if names:
            fit = least_squares(resid, np.zeros(len(names)), bounds=(lo - 1e-12, hi + 1e-12), x_scale=prior,
                                diff_step=1e-3, xtol=1e-6, ftol=1e-8, max_nfev=60)
            theta = fit.x
            if np.max(np.abs(theta)) > 1e-6:
                coef = coef_at(theta)
                shift = {n: float(v) for (n, _, _), v in zip(names, theta)}
            rms = float(np.sqrt(np.mean((resid(theta)[:len(ok)] * THROUGHPUT_NOISE) ** 2)))
    offset, spread = memory_offsets(measurements, ctx, capacity_gib, shipped)
    return Calibration(coefficients=coef, log_shift=shift, memory_offset_gib=offset, memory_spread_gib=spread,
                       residual_rms=rms)


def memory_offsets(measurements: list[Measurement], ctx: tuple, capacity_gib: float,
                   coef: Coefficients) -> tuple[dict[str, float], dict[str, float]]:
    """(offset, spread) per stage position, GiB: a common offset (the shrunk mean of measured - predicted over
    every measured stage) plus a shrunk per-position deviation, raised to explain every real OOM; the spread is
    the posterior standard deviation of that offset plus MEMORY_NOISE_GIB."""
    model, cluster, workload, engine = ctx
    diffs: dict[str, list[float]] = {p: [] for p in POSITIONS}
    every: list[float] = []
    need = {p: -math.inf for p in POSITIONS}
    for m in measurements:
        if not m.stage_peak_gib and m.oom_stage is None:
            continue
        e = estimate(model, cluster, m.layout, workload, engine, coef, check_layout=False)
        pred = [s.total_gib for s in e.memory.stages]
        peaks = list(enumerate(m.stage_peak_gib or []))
        if len(peaks) == 1 and len(pred) > 1:  # one peak for the whole run: that of the predicted fullest stage
            peaks = [(int(np.argmax(pred)), peaks[0][1])]
        for s, peak in peaks:
            if s < len(pred) and m.tokens_per_s_per_gpu:
                every.append(peak - pred[s])
                for p in stage_positions(s, m.layout.pp):
                    diffs[p].append(peak - pred[s])
        if m.oom_stage is not None and m.oom_stage < len(pred):
            for p in stage_positions(m.oom_stage, m.layout.pp):
                need[p] = max(need[p], capacity_gib - pred[m.oom_stage] + OOM_MARGIN_GIB)
    if not every and all(v == -math.inf for v in need.values()):
        return {p: 0.0 for p in POSITIONS}, {}  # nothing measured: the shipped memory model and its headroom
    noise2 = MEMORY_NOISE_GIB ** 2
    prior_all = (MEMORY_PRIOR_FRACTION * capacity_gib) ** 2
    prior_pos = (MEMORY_POSITION_FRACTION * capacity_gib) ** 2
    n = len(every)
    var_all = 1.0 / (1.0 / prior_all + n / noise2)
    common = var_all * sum(every) / noise2
    offset, spread = {}, {}
    for p in POSITIONS:
        k = len(diffs[p])
        var_p = 1.0 / (1.0 / prior_pos + k / noise2)
        dev = var_p * sum(d - common for d in diffs[p]) / noise2
        offset[p] = round(max(common + dev, need[p]), 4)
        spread[p] = round(math.sqrt(noise2 + var_all + var_p), 4)
    return offset, spread
