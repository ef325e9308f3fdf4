"""Recalibration of the model to one study's measurements.

Throughput: a few physical coefficients of the performance model are refitted by bounded least squares on
log tokens/s/GPU (`scipy.optimize.least_squares`), with the shipped calibration as a Gaussian prior in log
space, so a few points cannot run away. An option of the sampler (`attune.search.sampler.EFFECT_PRIORS`) also
weighs each measurement with the model's structural error (FIT_RESIDUAL_SD) and caps each coefficient's prior so
that a one-standard-deviation move changes no candidate's predicted throughput by more than EFFECT_PRIOR_SD
(`effect_prior_caps`). The fitted
coefficients and their bounds come from the `bounds` metadata of `attune.estimator.coefficients.Coefficients`
fields; coefficients that change predicted memory are left to the memory terms.

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
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy.special import log_ndtr

from attune.estimator import estimate, estimate_batch
from attune.estimator.coefficients import Coefficients
from attune.spec.columns import LayoutColumns
from attune.spec.layout import Layout

# prior standard deviation of log(coefficient / shipped) = this fraction of the log-width of its bounds
PRIOR_WIDTH_FRACTION = 0.25
# run-to-run noise of a measured throughput, as a log standard deviation (2-5% between runs, issue 11)
THROUGHPUT_NOISE = 0.03
# prior spread of the recalibrated model's log throughput error away from measured layouts (10%: the seed
# recipe's measured layouts are predicted within a few percent, untried regions of the space less well)
PRIOR_SPREAD = 0.10
# standard deviation of a measured layout's log throughput about the coefficients' prediction in the refit: the
# run-to-run noise and the model's structural error at that layout (knob effects no coefficient carries, which the
# sampler's residual GP models: `PRIOR_SPREAD`, 10%). Weighted by the run-to-run noise alone,
# the refit explains one measurement's whole structural error by the coefficients, and moves every layout that shares
# them
FIT_RESIDUAL_SD = math.hypot(THROUGHPUT_NOISE, PRIOR_SPREAD)
# memory: prior standard deviation of the offset common to every stage, as a fraction of capacity (the
# calibration's peak-memory MAPE is 4.9%, `attune calibrate` on memory.yaml), of a stage position's deviation from
# it (first / last stage buffers, 1% of capacity), and of one measured stage peak (allocator noise, GiB)
MEMORY_PRIOR_FRACTION, MEMORY_POSITION_FRACTION, MEMORY_NOISE_GIB = 0.05, 0.01, 0.5
# a stage that ran out of memory is put this far over capacity by the offset (GiB)
OOM_MARGIN_GIB = 0.25
POSITIONS = ("first", "middle", "last")
# the prior on a coefficient's refit, as the log throughput it moves (`effect_prior_caps`): the shipped calibration
# predicts its corpus within its per-series error (throughput MAPE up to 9.5%, `attune calibrate`), so a
# one-standard-deviation move of one coefficient changes no candidate's predicted throughput by more than that
EFFECT_PRIOR_SD = 0.10
# the per-stage memory correction (`MemoryModel`, issue 20): prior standard deviation of the relative error of a
# predicted stage peak (the calibration's peak-memory MAPE is 4.9%, `attune calibrate` on memory.yaml) and the
# allocator's extra spread near capacity: up to MEMORY_EDGE_GIB within MEMORY_EDGE_FRACTION of capacity
# (PyTorch's caching allocator splits and retries blocks when nearly full: fragmentation then varies more between
# runs; an assumption of 1 GiB on a 140 GiB GPU, twice MEMORY_NOISE_GIB)
MEMORY_SCALE_SD = 0.05
# a pipeline depth's own memory offset (in-flight microbatches and buffers the model prices per PP degree), as a
# fraction of capacity: a share of the calibration's 4.9% peak MAPE; PP degrees 1, 2, 4, ... 2^(PP_LEVELS - 1)
MEMORY_PP_FRACTION, PP_LEVELS = 0.02, 7
_NP = 5 + PP_LEVELS
MEMORY_EDGE_GIB, MEMORY_EDGE_FRACTION = 1.0, 0.10


@dataclass(kw_only=True)
class MemoryModel:
    """Per-stage memory correction learned from every memory measurement of a study: measured stage peaks and
    the stage of each real OOM (a censored observation: that stage needed more than capacity).

    true peak of a stage = predicted x (1 + scale) + common + deviation of its position (first, middle, last),
    a Bayesian linear model with the shipped model as its prior (a common offset of MEMORY_PRIOR_FRACTION of
    capacity, positions MEMORY_POSITION_FRACTION, a scale MEMORY_SCALE_SD). Its predictive spread is largest
    where it extrapolates (stages predicted far above the measured ones: near capacity, where it matters) and
    gets the allocator's extra spread near capacity (MEMORY_EDGE_GIB)."""

    mean: np.ndarray
    """Posterior mean of (common GiB, first GiB, middle GiB, last GiB, scale, one offset per PP degree GiB)."""
    cov: np.ndarray
    """Posterior covariance."""
    capacity_gib: float
    """GPU memory, GiB."""

    @staticmethod
    def design(pred: np.ndarray, position: int, pp, single: bool = False) -> np.ndarray:
        """Rows of the linear model for predicted stage peaks `pred` (GiB) at position index `position` of
        pipelines of `pp` stages (an int or one per row; a single stage is first and last: half of each)."""
        X = np.zeros((len(pred), _NP))
        X[:, 0] = 1.0
        if single:
            X[:, 1] = X[:, 3] = 0.5
        else:
            X[:, 1 + position] = 1.0
        X[:, 4] = pred
        lv = np.minimum(np.round(np.log2(np.broadcast_to(np.asarray(pp, dtype=float), (len(pred),)))), PP_LEVELS - 1)
        X[np.arange(len(pred)), 5 + lv.astype(int)] = 1.0
        return X

    def predict(self, pred: np.ndarray, position: int, single=None, pp=1) -> tuple[np.ndarray, np.ndarray]:
        """(mean, standard deviation) of the true peak, GiB, of stages predicted at `pred` GiB (pipelines of `pp`
        stages, one per row or one for all)."""
        pred = np.asarray(pred, dtype=float)
        X = self.design(pred, position, pp)
        if single is not None:
            X[single, 1:4] = (0.5, 0.0, 0.5)
        mu = pred + X @ self.mean
        var = np.einsum("ij,jk,ik->i", X, self.cov, X) + MEMORY_NOISE_GIB ** 2
        edge = MEMORY_EDGE_GIB * np.clip(1.0 - (self.capacity_gib - mu) / (MEMORY_EDGE_FRACTION * self.capacity_gib),
                                         0.0, 1.0)
        return mu, np.sqrt(var + edge ** 2)


def stage_positions(stage: int, pp: int) -> tuple[str, ...]:
    """Positions of pipeline stage `stage` of `pp`: a single stage is both first and last."""
    if pp == 1:
        return ("first", "last")
    return ("first",) if stage == 0 else ("last",) if stage == pp - 1 else ("middle",)


def fitted_bounds(coef: Coefficients) -> list[tuple[str, float, float]]:
    """(name, low, high) of every coefficient with `bounds` metadata (attune.estimator.coefficients)."""
    return [(f.name, float(f.metadata["bounds"][0]), float(f.metadata["bounds"][1])) for f in dataclasses.fields(coef)
            if f.metadata and "bounds" in f.metadata]


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
    memory: MemoryModel | None = None
    """The per-stage memory correction (None when no peak or OOM was measured)."""

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
                capacity_gib: float, prior_cap: dict[str, float] | None = None,
                residual_sd: float = THROUGHPUT_NOISE) -> Calibration:
    """Refit throughput coefficients and memory offsets to a study's measurements (see the module docstring).
    `ctx` is (model, cluster, workload, engine). `prior_cap`: an upper bound on a coefficient's prior standard
    deviation in log space (`effect_prior_caps`), by name; `residual_sd`: the log standard deviation a measurement
    is weighed with (THROUGHPUT_NOISE, or FIT_RESIDUAL_SD to count the model's structural error too)."""
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
        if prior_cap:
            prior = np.minimum(prior, [prior_cap.get(n, math.inf) for n, _, _ in names])
        y = np.log([m.tokens_per_s_per_gpu for m in ok])
        measured = LayoutColumns.from_layouts([m.layout for m in ok])  # one batch per evaluation of the fit

        def coef_at(theta):
            return dataclasses.replace(shipped, **{n: float(v) for (n, _, _), v in zip(names, c0 * np.exp(theta))})

        def resid(theta):
            c = coef_at(theta)
            pred = np.log(estimate_batch(model, cluster, measured, workload, engine, c).tokens_per_s_per_gpu)
            return np.concatenate([(pred - y) / residual_sd, theta / prior])

        if names:
            from scipy.optimize import least_squares  # loaded on the first measured recalibration (0.4 s to import)

            fit = least_squares(resid, np.zeros(len(names)), bounds=(lo - 1e-12, hi + 1e-12), x_scale=prior,
                                diff_step=1e-3, xtol=1e-6, ftol=1e-8, max_nfev=60)
            theta = fit.x
            if np.max(np.abs(theta)) > 1e-6:
                coef = coef_at(theta)
                shift = {n: float(v) for (n, _, _), v in zip(names, theta)}
            rms = float(np.sqrt(np.mean((resid(theta)[:len(ok)] * residual_sd) ** 2)))
    offset, spread = memory_offsets(measurements, ctx, capacity_gib, shipped)
    return Calibration(coefficients=coef, log_shift=shift, memory_offset_gib=offset, memory_spread_gib=spread,
                       residual_rms=rms, memory=memory_model(measurements, ctx, capacity_gib, shipped))


def effect_prior_caps(shipped: Coefficients, log_tokens: Callable[[Coefficients], np.ndarray],
                      effect_sd: float = EFFECT_PRIOR_SD) -> dict[str, float]:
    """Prior caps for `recalibrate` (name -> largest log standard deviation of the coefficient): a
    one-standard-deviation move of a coefficient (either way, within its bounds) may change the predicted log
    throughput `log_tokens(coefficients)` of the layouts that matter (the candidates) by at most `effect_sd`; a
    coefficient whose prior moves them more has its prior shrunk in proportion. The move is priced for real, not by a
    derivative: a term hidden behind another at the shipped value (the host optimizer's step, overlapped) has no
    derivative there but sets the step once the move is large. Without it, one baseline 24% under its prediction
    moved the host optimizer's bandwidth to its bound and put the best predicted layouts of a MoE space 30-50% under
    theirs (benchmarks/RESULTS.md, issue 20 fourth follow-up)."""
    base = log_tokens(shipped)
    caps = {}
    for name, lo, hi in fitted_bounds(shipped):
        c0 = getattr(shipped, name)
        if not (c0 > 0 and 0 < lo < hi):
            continue
        lo, hi = min(lo, c0), max(hi, c0)
        prior = PRIOR_WIDTH_FRACTION * math.log(hi / lo)
        effect = max(float(np.max(np.abs(log_tokens(dataclasses.replace(
            shipped, **{name: float(np.clip(c0 * math.exp(sign * prior), lo, hi))})) - base), initial=0.0))
            for sign in (-1.0, 1.0))
        if effect > effect_sd:
            caps[name] = prior * effect_sd / effect
    return caps


def memory_model(measurements: list[Measurement], ctx: tuple, capacity_gib: float,
                 coef: Coefficients) -> MemoryModel | None:
    """The `MemoryModel` posterior from measured stage peaks and real OOMs (None when there are neither)."""
    model, cluster, workload, engine = ctx
    obs: list[tuple[float, int, bool, float, int]] = []  # (predicted GiB, position, single stage, measured GiB, PP)
    ooms: list[tuple[float, int, bool, int]] = []
    for m in measurements:
        if not m.stage_peak_gib and m.oom_stage is None:
            continue
        e = estimate(model, cluster, m.layout, workload, engine, coef, check_layout=False)
        pred = [s.total_gib for s in e.memory.stages]
        pp = len(pred)

        def pos(s, pp=pp):
            return 0 if s == 0 else 2 if s == pp - 1 else 1

        peaks = list(enumerate(m.stage_peak_gib or []))
        if len(peaks) == 1 and pp > 1:  # one peak for the whole run: that of the predicted fullest stage
            peaks = [(int(np.argmax(pred)), peaks[0][1])]
        if m.tokens_per_s_per_gpu:
            obs += [(pred[s], pos(s), pp == 1, peak, pp) for s, peak in peaks if s < pp]
        if m.oom_stage is not None and m.oom_stage < pp:
            ooms.append((pred[m.oom_stage], pos(m.oom_stage), pp == 1, pp))
    if not obs and not ooms:
        return None
    prior = np.diag([(MEMORY_PRIOR_FRACTION * capacity_gib) ** 2] + [(MEMORY_POSITION_FRACTION * capacity_gib) ** 2] * 3
                    + [MEMORY_SCALE_SD ** 2] + [(MEMORY_PP_FRACTION * capacity_gib) ** 2] * PP_LEVELS)

    def fit(rows):
        if not rows:
            return np.zeros(_NP), prior
        X = np.vstack([MemoryModel.design(np.array([p]), k, pp, single) for p, k, single, _, pp, _ in rows])
        r = np.array([y - p for p, _, _, y, _, _ in rows])
        w = np.array([1.0 / n ** 2 for *_, n in rows])
        cov = np.linalg.inv(np.linalg.inv(prior) + (X * w[:, None]).T @ X)
        return cov @ ((X * w[:, None]).T @ r), cov

    rows = [(p, k, single, y, pp, MEMORY_NOISE_GIB) for p, k, single, y, pp in obs]
    mean, cov = fit(rows)
    # a real OOM: that stage's peak in that run exceeded capacity, by an amount the run does not say (a censored
    # observation). Each OOM in turn (assumed density filtering): the model's predictive N(m, s) of that peak,
    # truncated to > capacity, gives the mean and variance of the peak; the Gaussian pseudo-observation with those
    # moments (ytilde, noise tau) joins the fit. A stage predicted well under capacity that ran out is thus taken
    # as needing the prior's expected excess over capacity (often several GiB), not just capacity, and its
    # neighbours a few GiB lighter stay uncertain; one already predicted over capacity adds (almost) nothing.
    for p, k, single, pp in ooms:
        mm = MemoryModel(mean=mean, cov=cov, capacity_gib=capacity_gib)
        m, s = mm.predict(np.array([p]), k, np.array([single]), pp)
        m, s = float(m[0]), float(s[0])
        a = (capacity_gib - m) / s
        lam = math.exp(-0.5 * a * a - 0.5 * math.log(2 * math.pi) - float(log_ndtr(-a)))  # phi(a) / Q(a)
        e, v = m + s * lam, s * s * max(1.0 + a * lam - lam * lam, 1e-9)
        if s * s - v <= 1e-9 * s * s:
            continue
        tau2 = s * s * v / (s * s - v)
        x = MemoryModel.design(np.array([p]), k, pp, single)[0]
        run2 = s * s - float(x @ cov @ x)  # the run's own spread (allocator noise, edge), not the model's
        rows.append((p, k, single, m + (e - m) * (s * s + tau2) / (s * s), pp, math.sqrt(tau2 + max(run2, 0.0))))
        mean, cov = fit(rows)
    return MemoryModel(mean=mean, cov=cov, capacity_gib=capacity_gib)


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
