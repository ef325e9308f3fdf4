"""`ModelGuidedSampler`: an Optuna sampler that proposes the layout with the best expected improvement under the
study's recalibrated model.

The whole space is scored once (`attune.search.scoring.score_space`). For each proposal, over every layout
not RUNNING, queued or already measured in the study (`busy_or_done_keys`) and predicted to fit in memory:

* mean: log of the predicted tokens/s/GPU with the study's recalibrated coefficients (`recalibrate`), plus a
  Gaussian-process correction from the residuals of the measured layouts (log measured / predicted), with an
  exponential kernel over knob distance (`attune.search.space.layout_features`, correlation length
  KERNEL_LENGTH knob steps);
* spread: the GP's posterior standard deviation: 0 at a measured layout, growing with the knob distance from
  the measured layouts to the prior scale, itself shrunk toward the residuals seen so far
  (`PRIOR_SPREAD` with `PRIOR_WEIGHT` pseudo-observations);
* probability of fitting in memory: each stage position's predicted peak plus its recalibrated offset against
  capacity, with the offset's posterior spread (`Calibration.memory_spread_gib`; MEMORY_SPREAD_GIB when the
  model is not recalibrated), multiplied over the positions;
* acquisition: expected improvement over the best measured result, times the probability of fitting;
* candidates: layouts predicted to fit (under the headroom until a measured peak or OOM calibrates the memory
  model, then under capacity with P(fit) pricing the risk), not measured or busy, and not a near-duplicate of
  a measured layout of the same structure and batching (within NEAR_DUPLICATE knob steps: a split or recompute
  neighbour) unless the recalibrated model predicts it better than
  that layout by more than min_gain.

A runner that is not measured (`sim`: the model is the measurement) has no spread: the sampler proposes the
model's optimum and the stop rule ends the study once it is measured.

Stop rule (`Assessment.should_stop`): no candidate has more than `p_stop` probability of beating the best
measured by more than `min_gain`. The estimated remaining regret is the largest expected improvement.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import optuna
from optuna.samplers import BaseSampler, RandomSampler
from scipy.special import ndtr

from attune.estimator import estimate_batch
from attune.estimator.coefficients import Coefficients
from attune.search import edge as edge_module
from attune.search import family_probe, spread_check
from attune.search.options import TuneOptions
from attune.search.recalibrate import (
    FIT_RESIDUAL_SD,
    POSITIONS,
    PRIOR_SPREAD,
    THROUGHPUT_NOISE,
    Calibration,
    Measurement,
    effect_prior_caps,
    recalibrate,
)
from attune.search.scoring import ScoredSpace
from attune.search.space import FEATURES, layout_features, layout_from_dict, layout_key, params_key
from attune.spec.columns import LayoutColumns
from attune.spec.layout import Layout

# weight of that prior, in pseudo-observations, against the residuals of the study's measurements
PRIOR_WEIGHT = 2.0
# correlation length of the residual GP over knob distance (knob steps, see space.FEATURES)
KERNEL_LENGTH = 2.0
# per-knob-step log error of the model (a TP / PP doubling, a recompute unit costing a few percent more or less
# than modelled), for the linear term of the residual GP, and the prior spread of a level shift common to every
# layout. The corpus cannot measure the per-step error: its sweeps (one series, model, GPU and precision) hold one
# pair of rows that differ in a structural knob (23 sweeps; they vary DP); its dense series left out of the fit are
# off by up to 8.8% (`attune calibrate --leave-one-out`), a distance of two to four knob steps at 0.05 per step.
# 0.05 (was 0.03): on the 90 structural worlds 0-29 of benchmarks/search_efficiency.py it reached 2% in 82 against
# 80 (regret at 5 / 10 trials 1.65% / 0.76% against 1.82% / 0.82%), then was checked once on fresh worlds 30-34
# (benchmarks/RESULTS.md, issue 20 eighth follow-up)
KNOB_EFFECT_SD = 0.05
LEVEL_SD = 0.05
# knob distance within which an unmeasured layout is a near-duplicate of a measured one (one knob step: a
# layer split shifted by up to 4 layers in all, a few recomputed layers). Only layouts of the same structure and
# batching count (`_STRUCTURE_BATCH`): a TP / PP / VPP / CP / EP doubling, SP, the dispatcher or a doubling of
# the tokens per microbatch changes the schedule, whose modelled cost is off by KNOB_EFFECT_SD per step (more
# than what separates split / recompute neighbours), so a measured layout says little about such a neighbour and
# the posterior (not a distance cut) decides whether it is worth a trial
NEAR_DUPLICATE = 1.0
_STRUCTURE_BATCH = np.array(edge_module.STRUCTURE + (FEATURES.index("log2_tokens"),))
# whether the posterior spread is scaled by the study's own out-of-sample check (attune.search.spread_check).
# Off by default, as EMPIRICAL_SCALES: on the 60 structural worlds of benchmarks/search_efficiency.py the two together
# reached 2% in 52 worlds against 54 without them (Llama-3.1-70B worlds 1 and 13 lost) for a stop rule firing in 22
# studies instead of 14 (benchmarks/RESULTS.md, issue 20 third follow-up)
SPREAD_CHECK = False
# empirical Bayes for the residual GP's two scales (`ModelGuidedSampler._scales`): multipliers tried on the
# local standard deviation and on the linear (per-knob-step) one, and the log-normal hyperprior's sd on each (ln 2:
# a factor of two either way is one standard deviation). The linear scale only grows: a study's layouts cluster
# around its incumbent, so its residuals can show that a knob direction is mis-priced, never that the structure
# far away (another PP or TP, where the best layout of a table not in the repository may sit) is priced well
EMPIRICAL_SCALES = False
SCALE_GRID = (0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8)
LINEAR_GRID = (1.0, 1.4, 2.0, 2.8)
SCALE_PRIOR_SD = math.log(2.0)
# whether the study's coefficient refit weighs each measurement with the model's structural error
# (`recalibrate.FIT_RESIDUAL_SD`) and caps each coefficient's prior by its effect on the candidates
# (`recalibrate.effect_prior_caps`), so that a few measurements cannot move the predictions of layouts that were
# not measured by more than the calibration's own error. Off by default: on 40 structural worlds (Llama-3.1-70B and
# Qwen3-30B-A3B, worlds 0-19 of benchmarks/search_efficiency.py) it lowered the MoE regret at 5 trials (0.57% to
# 0.28%) but reached 2% in 35 worlds against 36 without it (Llama world 14 lost at trial 10), so reach did not improve
# (benchmarks/RESULTS.md, issue 20 fourth follow-up)
EFFECT_PRIORS = False
# whether an unmeasured TP x PP family whose best candidate could beat the best measured gets one trial
# (attune.search.family_probe). Off by default: on the held-out Llama-3.1-70B worlds 8-14 of
# benchmarks/search_efficiency.py it reached 2% in 4 of 7 against 5 (world 14 lost, 9 and 13 later), MoE 13 one
# trial later (benchmarks/RESULTS.md, issue 20 fifth follow-up)
FAMILY_PROBE = False
# whether the acquisition prices a trial that may run out of memory by its expected cost: an OOM fails in its first
# step, so it costs the start-up and one step against the start-up and the measured steps of a fit, about half a
# trial (benchmarks/search_efficiency.py: STARTUP_S 180 s + one step against 180 s + 20 steps of ~10 s). Expected
# improvement per expected trial, P(fit) EI / (P(fit) + (1 - P(fit)) OOM_TRIAL_COST), makes a layout near the
# memory edge with a large predicted gain worth a trial sooner. Off by default: it changed no trajectory on the
# held-out Llama-3.1-70B worlds 8-14 (benchmarks/RESULTS.md, issue 20 fifth follow-up)
OOM_HALF_TRIAL = False
OOM_TRIAL_COST = 0.5
# whether the residual GP's linear term is anchored at the first measured proposal instead of the first measured
# layout, with the baseline left out of it (its residual explained by the level and the local term only). The
# baseline is measured because slime's layout is the comparison, not because the model proposed it: it sits far
# from the candidates, and anchored there its residual and the first proposal's make a slope toward the baseline's
# knobs. Off by default: on the structural worlds run it reached Qwen3.6-27B world 29 and Llama-3.1-70B world 6 but lost
# Llama-3.1-70B world 14 (13.7% short at 10 trials, was reached at trial 10; Llama regret @10 0.94% to 1.41%),
# and left Qwen3.6-27B worlds 9 and 22 as they were: in 22 the tilt is the coefficient refit's (the baseline's +26%
# moves the host optimizer's efficiency by 2.15 in log), the linear term's share at the missed best about 5%
# (benchmarks/RESULTS.md, issue 20 sixth follow-up)
BASELINE_OUT_OF_LINEAR = False
# spread of the recalibrated memory prediction, GiB (allocator fragmentation between runs)
MEMORY_SPREAD_GIB = 1.0
# layouts re-estimated exactly after a recalibration (the best by the linearised rescoring)
EXACT_TOP = 32
# the layouts the refit's prior caps are priced on (`ModelGuidedSampler._prior_caps`): the best predicted that fit,
# as many as are re-estimated exactly
CAP_ROWS = EXACT_TOP
# the states in which a trial's layout is taken (running, queued, or measured)
_LIVE = (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)


# the claimed remaining regret: the layouts it looks at (the best by an upper bound) and its Monte Carlo draws
REGRET_TOP, REGRET_DRAWS = 256, 400


def remaining_regret(gap: np.ndarray, spread: np.ndarray, p_fit: np.ndarray, rows: np.ndarray,
                     cov: Callable[[np.ndarray], np.ndarray] | None = None) -> float:
    """Expected largest improvement over the best measured among `rows` (a bool mask), a fraction: each layout
    improves by exp(gap + error) - 1 if it fits (probability p_fit, independent). The errors are drawn jointly
    from the posterior covariance `cov(rows)` when given (layouts a few knob steps apart share their error: the
    GP's linear, level and local terms), else independent N(0, spread) (which overstates the largest of
    correlated layouts, so that claim errs high); the REGRET_TOP layouts with the highest gap + 3 spread carry it
    (the rest cannot change it by more than their tiny tail)."""
    idx = np.flatnonzero(rows & np.isfinite(gap))
    if not len(idx):
        return 0.0
    ucb = gap[idx] + 3.0 * spread[idx]
    idx = idx[np.argsort(-ucb)[:REGRET_TOP]]
    rng = np.random.default_rng(0)
    z = rng.standard_normal((REGRET_DRAWS, len(idx)))
    if cov is not None:
        c = cov(idx)
        w, v = np.linalg.eigh((c + c.T) / 2)
        e = z @ (v * np.sqrt(np.maximum(w, 0.0))).T  # joint draws of the errors, N(0, c)
        z = np.where(spread[idx] > 0, e / np.maximum(spread[idx], 1e-12), 0.0)
    fit = rng.random((REGRET_DRAWS, len(idx))) < p_fit[idx]
    imp = np.where(fit, np.expm1(gap[idx] + spread[idx] * z), 0.0)
    return float(np.mean(np.maximum(imp.max(axis=1), 0.0)))


def busy_or_done_keys(study: optuna.Study, num_layers: int) -> set:
    """layout_key and params_key of every trial of the study that is RUNNING, queued (WAITING) or measured
    (has a role); proposals that were only estimated (TPE sampler's pruned trials) do not count."""
    keys: set = set()
    for t in study.get_trials(deepcopy=False):
        if t.state not in _LIVE and t.user_attrs.get("role") is None:
            continue
        lay = t.user_attrs.get("layout")
        if lay:
            keys.add(layout_key(lay, num_layers))
        if t.params:
            keys.add(params_key(t.params))
    return keys


def layout_of(d: dict) -> Layout:
    """A Layout from its `to_dict()` as stored on a trial (`attune.search.space.layout_from_dict`)."""
    return layout_from_dict(d)


def measurements_of(study: optuna.Study) -> list[tuple[int, Measurement]]:
    """(trial number, Measurement) of every finished measured trial."""
    out = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,
                                                      optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)):
        a = t.user_attrs
        if a.get("role") is None or not a.get("layout"):
            continue
        done = t.state == optuna.trial.TrialState.COMPLETE and t.value
        out.append((t.number, Measurement(layout=layout_of(a["layout"]),
                                           tokens_per_s_per_gpu=float(t.value) if done else None,
                                           stage_peak_gib=a.get("measured_peak_gib") if a.get("measured") else None,
                                           oom_stage=a.get("oom_stage") if a.get("outcome") == "oom" else None)))
    return out


@dataclass(kw_only=True)
class Assessment:
    """The sampler's view of the space after the study's measurements."""

    candidate: int | None
    """Row of the table with the best acquisition (None: no unmeasured layout is predicted to fit)."""
    p_improve: float
    """Largest probability over candidates of beating the best measured by more than min_gain."""
    expected_gain: float
    """Largest expected improvement over the best measured, a fraction (the estimated remaining regret)."""
    best_tokens: float | None
    """Best measured tokens/s/GPU (None before a completed trial)."""
    candidates: int
    """Unmeasured layouts predicted to fit."""
    calibration: Calibration
    """The recalibrated model."""
    mean_log: np.ndarray = field(repr=False)
    """Posterior mean of log tokens/s/GPU per row."""
    spread: np.ndarray = field(repr=False)
    """Posterior standard deviation (log) per row."""
    peak_gib: np.ndarray = field(repr=False)
    """Predicted peak memory with the recalibrated offsets, GiB per row."""

    p_fit: np.ndarray = field(default=None, repr=False)
    """Probability of fitting in memory per row (0 where the layout is not a candidate)."""
    remaining_regret: float = math.inf
    """The claimed remaining regret: the expected largest improvement over the best measured among the
    unmeasured layouts, a fraction (`remaining_regret`; inf before a completed trial)."""
    edge_step: dict | None = None
    """The edge step proposed (attune.search.edge): row, after_trial, from, why, kind, to, p_fit; else None."""
    oom_neighbour: int | None = None
    """Row of an unmeasured neighbour of a measured OOM predicted better than the best measured (None: none)."""
    family_probe: dict | None = None
    """The family probe proposed (attune.search.family_probe): row, family, p_improve; else None."""
    spread_factor: float = 1.0
    """The study's check of its own spread (attune.search.spread_check): `spread` times this is what the stop
    rule, the claimed remaining regret and the acquisition read."""

    def should_stop(self, p_stop: float, min_gain: float = TuneOptions.min_gain) -> bool:
        """No candidate has more than p_stop probability of beating the best measured by more than min_gain,
        the claimed remaining regret is at most min_gain, and no unmeasured neighbour of a measured OOM is
        predicted better than the best measured."""
        if self.best_tokens is None:
            return False
        if self.candidate is None:
            return True
        return self.p_improve <= p_stop and self.remaining_regret <= min_gain and self.oom_neighbour is None


class ModelGuidedSampler(BaseSampler):
    """Proposes the layout with the best expected improvement under the recalibrated model (module docstring).

    Every parameter of a trial comes from one proposal (a row of `table`); a trial the sampler has no proposal
    for (nothing left to propose) gets RandomSampler's values.
    """

    def __init__(self, *, table: ScoredSpace, shipped: Coefficients, capacity_gib: float, headroom: float = 0.02,
                 exact: bool = False, recalibrate: bool = True, min_gain: float = TuneOptions.min_gain, seed: int = 0,
                 runner_check: Callable[[Layout], list[str]] | None = None):
        if not 0 <= min_gain < 1:
            raise ValueError(f"min_gain {min_gain}: must be a fraction in [0, 1)")
        self.table, self.shipped, self.exact, self.recal = table, shipped, exact, recalibrate
        self.capacity, self.usable = capacity_gib, capacity_gib * (1.0 - headroom)
        self.min_gain = min_gain
        self.runner_check = runner_check
        self._random = RandomSampler(seed=seed)
        self._refused: set[int] = set()
        self._proposals: dict[int, dict] = {}
        self._sig: tuple | None = None
        self._assessment: Assessment | None = None
        self.calibrations: dict[int, Calibration] = {}
        """The calibration after each measured trial (trial number -> Calibration)."""
        t = table
        # predicted stage peaks by position (first, middle max, last); -inf where a layout has no middle stage
        self._pos_gib = t.position_gib()
        self._log_tokens = np.log(np.maximum(np.nan_to_num(t.tokens, nan=1e-9), 1e-9))
        self._scored = np.isfinite(t.tokens)
        self._pp = t.cols["pp"]
        self._single = self._pp == 1
        self._oom_floors: list[tuple[int, int, float]] = []  # (PP, position, shipped predicted GiB) of real OOMs
        self._caps: dict[str, float] | None = None
        self._probe_rows: set[int] = set()  # rows proposed as family probes (attune.search.family_probe)
        self._baselines: set[int] = set()  # trial numbers of measured baselines (role "baseline")

    # ------------------------------------------------------------------ Optuna's sampler interface
    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, param_name, param_distribution):
        prop = self._proposals.get(trial.number)
        if prop is None:
            row = self.propose(study)
            prop = dict(self.table.params[row]) if row is not None else {}
            self._proposals[trial.number] = prop
        if param_name in prop:
            return prop[param_name]
        return self._random.sample_independent(study, trial, param_name, param_distribution)

    # ------------------------------------------------------------------ the model
    def _calibrate(self, meas: list[tuple[int, Measurement]]) -> Calibration:
        ctx = self.table.context
        if self.exact or not self.recal or not meas:
            return Calibration(coefficients=self.shipped)
        if EFFECT_PRIORS:  # the refit weighed with the structural error, its priors capped by their effect
            cal = recalibrate([m for _, m in meas], self.shipped, ctx, self.capacity, self._prior_caps(),
                              FIT_RESIDUAL_SD)
        else:
            cal = recalibrate([m for _, m in meas], self.shipped, ctx, self.capacity)
        self.calibrations[meas[-1][0]] = cal
        return cal

    def _prior_caps(self) -> dict[str, float] | None:
        """Each coefficient's prior cap (`recalibrate.effect_prior_caps`): the effect of a one-standard-deviation
        move, estimated exactly on the CAP_ROWS best predicted layouts that fit (`ScoredSpace.sensitive_rows`);
        computed once per study (None when EFFECT_PRIORS is off or no layout fits)."""
        if not EFFECT_PRIORS:
            return None
        if self._caps is None:
            rows = self.table.sensitive_rows(self.capacity)
            rows = rows[np.argsort(-self.table.tokens[rows])[:CAP_ROWS]]
            self._caps = (effect_prior_caps(self.shipped, lambda c: np.log(self.table.exact_tokens(rows, c)))
                          if len(rows) else {})
        return self._caps or None

    def _mean_log(self, cal: Calibration) -> np.ndarray:
        mu = self._log_tokens.copy()
        if not cal.log_shift:
            return mu
        names = tuple(cal.log_shift)
        theta = np.array([cal.log_shift[n] for n in names])
        rows = self.table.sensitive_rows(self.capacity)
        if len(rows):
            shift = self.table.sensitivities(names, rows) @ theta
            mu += float(np.median(shift))  # the rest of the space: the typical shift (a level, no re-ranking)
            mu[rows] += shift - float(np.median(shift))
            top = rows[np.argsort(-mu[rows])[:EXACT_TOP]]
            mu[top] = np.log(self.table.exact_tokens(top, cal.coefficients))
        return mu

    def _memory(self, cal: Calibration) -> tuple[np.ndarray, np.ndarray, float]:
        """(predicted peak per position (rows, 3; -inf where none), P(fit) per row, the candidate cut in GiB):
        with the study's memory model (`recalibrate.MemoryModel`) once a peak or an OOM was measured, else the
        shipped model, MEMORY_SPREAD_GIB and the headroom."""
        if cal.memory is None:
            off = np.array([cal.memory_offset_gib[p] for p in POSITIONS])
            sd = np.array([cal.memory_spread_gib.get(p, MEMORY_SPREAD_GIB) for p in POSITIONS])
            pos = self._pos_gib + off
            limit = self.capacity if cal.memory_spread_gib else self.usable
            return pos, np.prod(ndtr((self.capacity - pos) / sd), axis=1), limit
        pos = np.full_like(self._pos_gib, -np.inf)
        p_fit = np.ones(len(pos))
        for j in range(3):
            ok = np.isfinite(self._pos_gib[:, j])
            m, sd = cal.memory.predict(self._pos_gib[ok, j], j, self._single[ok], self._pp[ok])
            pos[ok, j] = m
            p_fit[ok] *= ndtr((self.capacity - m) / sd)
        # the monotone rule: a stage position predicted to need at least what one that ran out of memory for real
        # needed (same pipeline depth, shipped model) runs out too
        for pp, j, gib in self._oom_floors:
            p_fit[(self._pp == pp) & (self._pos_gib[:, j] >= gib - 1e-6)] = 0.0
        return pos, p_fit, self.capacity

    def assess(self, study: optuna.Study) -> Assessment:
        """Recalibrate (when the study's measurements changed) and score every unmeasured layout."""
        meas = measurements_of(study)
        L = self.table.context[0].num_layers
        busy = busy_or_done_keys(study, L)
        sig = (tuple((n, m.tokens_per_s_per_gpu, m.oom_stage) for n, m in meas), len(busy), len(self._refused))
        if sig == self._sig and self._assessment is not None:
            return self._assessment
        t = self.table
        cal = self._calibrate(meas)
        self._oom_floors = self._measured_oom_floors(meas, L)
        mu = self._mean_log(cal)
        mu_model = mu.copy()
        pos, p_fit, limit = self._memory(cal)
        peak = np.max(pos, axis=1)
        fits = t.host_fits & (peak <= limit) & self._scored
        p_fit = np.where(fits, p_fit, 0.0)
        avail = self._not_busy(fits, busy)
        ok = [(n, m) for n, m in meas if m.tokens_per_s_per_gpu]
        best = max((m.tokens_per_s_per_gpu for _, m in ok), default=None)
        spread = np.zeros(len(t))
        kappa = 1.0
        if ok and not self.exact:
            self._baselines = {tr.number for tr in study.get_trials(deepcopy=False)
                               if tr.user_attrs.get("role") == "baseline"}
            mu, spread = self._posterior(mu, ok, cal)
            if SPREAD_CHECK:  # the study's own out-of-sample check of the spread (attune.search.spread_check)
                kappa = spread_check.spread_factor(spread_check.prediction_tests(study))
        unmeasured = avail.copy()  # before the near-duplicate rule: edge steps may take near-duplicates
        if best is not None and not self.exact:
            avail &= ~self._near_duplicates(ok, mu_model, L)
        y = math.log(best) if best is not None else -math.inf
        edge = None if self.exact else self._edge_step(meas, ok, best, mu, pos, p_fit, unmeasured, L)
        guard = None if self.exact else self._oom_guard(meas, mu, pos, p_fit, unmeasured, y, L)
        if best is None:
            acq = np.where(avail, mu, -np.inf)
            p_imp, gain, claim = 1.0, math.inf, math.inf
        else:
            acq, p_imp, gain, claim = self._acquisition(mu - y, spread * kappa, kappa, p_fit, avail, unmeasured)
        cand = int(np.argmax(acq)) if avail.any() else None
        probe = None if edge is not None or best is None else self._family_probe(meas, mu - y, spread * kappa,
                                                                                  p_fit, acq, avail, L, cand)
        if edge is not None:
            cand = edge["row"]
        elif probe is not None:
            cand = probe["row"]
        elif guard is not None and cand is None:
            cand = guard
        self._sig = sig
        self._assessment = Assessment(candidate=cand, p_improve=p_imp, expected_gain=gain, best_tokens=best,
                                      candidates=int(avail.sum()), calibration=cal, mean_log=mu, spread=spread,
                                      peak_gib=peak, p_fit=p_fit, remaining_regret=claim, edge_step=edge,
                                      oom_neighbour=guard, spread_factor=kappa, family_probe=probe)
        return self._assessment

    def _family_probe(self, meas, gap, sd, p_fit, acq, avail, L, chosen) -> dict | None:
        """One trial for an unmeasured TP x PP family that could hold the best (attune.search.family_probe), when
        FAMILY_PROBE is on and the runner is measured; else None."""
        if not FAMILY_PROBE or self.exact:
            return None
        rows = [self.table.row(layout_key(m.layout, L)) for _, m in meas]
        X = np.array([layout_features(m.layout, L) for _, m in meas])
        taken = sum(1 for r in rows if r in self._probe_rows)
        pi = family_probe.p_improve(gap, sd, p_fit, self.min_gain)
        probe = family_probe.family_probe(self.table.features, X, taken, pi, acq, avail, len(meas), chosen)
        if probe is not None:
            self._probe_rows.add(probe["row"])
        return probe

    def _measured_oom_floors(self, meas: list, L: int) -> list[tuple[int, int, float]]:
        """(PP, stage position, predicted GiB) of each measured OOM's stage: a floor the stage's memory is over."""
        t, floors = self.table, []
        for _, m in meas:
            r = t.row(layout_key(m.layout, L)) if m.oom_stage is not None else None
            if r is not None and m.oom_stage < len(t.stage_gib[r]):
                for j in edge_module.position(m.oom_stage, m.layout.pp):
                    floors.append((m.layout.pp, j, float(t.stage_gib[r][m.oom_stage])))
        return floors

    def _not_busy(self, fits: np.ndarray, busy) -> np.ndarray:
        """[rows] the layouts predicted to fit that no trial has taken (running, done) and none refused."""
        avail = fits.copy()
        for k in busy:
            r = self.table.row(k)
            if r is not None:
                avail[r] = False
        for r in self._refused:
            avail[r] = False
        return avail

    def _near_duplicates(self, ok: list, mu_model: np.ndarray, L: int) -> np.ndarray:
        """[rows] near-duplicates of a completed measurement (within NEAR_DUPLICATE knob steps): not worth a trial
        unless the model predicts them better than that layout by more than min_gain, since the run-to-run noise
        is larger than what separates them (a neighbour of an OOM is not a duplicate)."""
        t, gain = self.table, math.log1p(self.min_gain)
        out = np.zeros(len(t), dtype=bool)
        for _, m in ok:
            r0 = t.row(layout_key(m.layout, L))
            ref = mu_model[r0] if r0 is not None and np.isfinite(mu_model[r0]) else -np.inf
            x = layout_features(m.layout, L)
            near = (np.abs(t.features - x).sum(1) <= NEAR_DUPLICATE) & self._same_structure(x)
            out |= near & (mu_model - ref <= gain)
        return out

    def _acquisition(self, gap: np.ndarray, sd: np.ndarray, kappa: float, p_fit: np.ndarray, avail: np.ndarray,
                     unmeasured: np.ndarray) -> tuple[np.ndarray, float, float, float]:
        """Expected improvement over the best measured (log), the chance of a gain over min_gain, and the claimed
        remaining regret, from the predicted gap to the best and its checked spread ``sd`` (what the stop rule, the
        claim and the acquisition read). Returns (acquisition, p_improve, expected gain, claim)."""
        lg = math.log1p(self.min_gain)
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(sd > 0, gap / np.maximum(sd, 1e-12), np.sign(gap) * np.inf)
            ei = np.where(sd > 0, sd * np.exp(-0.5 * z ** 2) / math.sqrt(2 * math.pi) + gap * ndtr(z),
                          np.maximum(gap, 0.0)) * p_fit
            zi = np.where(sd > 0, (gap - lg) / np.maximum(sd, 1e-12), np.where(gap > lg, np.inf, -np.inf))
        pi = ndtr(zi) * p_fit
        if OOM_HALF_TRIAL:  # per expected trial: an OOM costs OOM_TRIAL_COST of one
            ei = ei / np.maximum(p_fit + (1.0 - p_fit) * OOM_TRIAL_COST, 1e-12)
        ei, pi = np.where(avail, ei, -np.inf), np.where(avail, pi, 0.0)
        p_imp = float(pi.max()) if avail.any() else 0.0
        gain = float(max(ei.max(), 0.0)) if avail.any() else 0.0
        claim = remaining_regret(gap, sd, p_fit, unmeasured,
                                 None if self.exact else (lambda rows: kappa ** 2 * self._joint_cov(rows)))
        # ties (no spread, nothing better predicted): the best predicted candidate
        return ei + 1e-9 * np.where(avail, gap, 0.0), p_imp, gain, claim

    def _same_structure(self, x: np.ndarray) -> np.ndarray:
        """Rows with the same structure and batching as features `x` (TP, SP, PP, VPP, CP, offload, EP, ETP,
        dispatcher and tokens per microbatch: they differ at most in the split and the recompute)."""
        F = self.table.features
        return np.all(F[:, _STRUCTURE_BATCH] == x[_STRUCTURE_BATCH], axis=1)

    def _edge_step(self, meas, ok, best, mu, pos, p_fit, unmeasured, L) -> dict | None:
        """The edge step after the latest measurement (attune.search.edge), or None: after a real OOM the
        cheapest change taking memory off its stage that is likely to fit (when predicted better than the best
        measured); after the best measured fit, the step toward less recompute when the model says it pays
        (predicted better by more than half of min_gain, likely to fit)."""
        if not meas:
            return None
        number, last = meas[-1]
        r0 = self.table.row(layout_key(last.layout, L))
        if r0 is None:
            return None
        F = self.table.features
        y = math.log(best) if best is not None else -math.inf
        if last.oom_stage is not None:
            js = edge_module.position(last.oom_stage, last.layout.pp)
            rows = edge_module.off_stage_rows(F, pos, r0, js, self.table.layouts, L, last.oom_stage)
            rows &= unmeasured & (p_fit >= edge_module.EDGE_P_FIT)
            rows &= mu > y
            why = f"out of memory on stage {last.oom_stage}"
        elif last.tokens_per_s_per_gpu and best is not None and last.tokens_per_s_per_gpu >= best:
            rows = edge_module.less_recompute_rows(F, r0) & unmeasured & (p_fit >= edge_module.EDGE_P_FIT)
            rows &= p_fit * (mu - y) > 0.5 * math.log1p(self.min_gain)
            # only where the study is at the front: no candidate elsewhere predicted better by more than min_gain
            top = float(np.max(np.where(unmeasured, mu, -np.inf))) if unmeasured.any() else -np.inf
            rows &= mu >= top - math.log1p(self.min_gain)
            why = "fitted"
        else:
            return None
        if not rows.any():
            return None
        score = np.where(rows, mu if last.oom_stage is not None else p_fit * (mu - y), -np.inf)
        r = int(np.argmax(score))
        return {"row": r, "after_trial": number, "from": last.layout.label(), "why": why,
                "kind": edge_module.step_kind(F[r0], F[r]), "to": self.table.layouts[r].label(),
                "p_fit": round(float(p_fit[r]), 3)}

    def _oom_guard(self, meas, mu, pos, p_fit, unmeasured, y, L) -> int | None:
        """An unmeasured neighbour of a measured OOM (a layout taking memory off the stage that ran out,
        attune.search.edge) that is likely to fit and predicted better than the best measured: its row (the best
        predicted), else None. The stop rule never fires while there is one."""
        F = self.table.features
        rows = np.zeros(len(F), dtype=bool)
        for _, m in meas:
            if m.oom_stage is None:
                continue
            r0 = self.table.row(layout_key(m.layout, L))
            if r0 is not None:
                rows |= edge_module.off_stage_rows(F, pos, r0, edge_module.position(m.oom_stage, m.layout.pp),
                                                   self.table.layouts, L, m.oom_stage)
        rows &= unmeasured & (p_fit >= edge_module.EDGE_P_FIT) & (mu > y)
        return int(np.argmax(np.where(rows, mu, -np.inf))) if rows.any() else None

    def _posterior(self, mu: np.ndarray, ok: list[tuple[int, Measurement]], cal: Calibration):
        """GP on the residuals log(measured / recalibrated prediction): a per-knob linear term (each knob step
        may cost KNOB_EFFECT_SD more or less than modelled, measured from the first measured layout), a common
        level (LEVEL_SD), and a local exponential term over knob distance (module docstring)."""
        model, cluster, workload, engine = self.table.context
        L = model.num_layers
        X = np.array([layout_features(m.layout, L) for _, m in ok])
        pred = np.log(estimate_batch(model, cluster, LayoutColumns.from_layouts([m.layout for _, m in ok]), workload,
                                     engine, cal.coefficients).tokens_per_s_per_gpu)
        r = np.log([m.tokens_per_s_per_gpu for _, m in ok]) - pred
        # the local term's scale from the residuals around their mean (the level has its own term)
        s2 = (PRIOR_WEIGHT * PRIOR_SPREAD ** 2 + float(np.sum((r - r.mean()) ** 2))) / (PRIOR_WEIGHT + len(r))
        x0, XL = X[0], X
        if BASELINE_OUT_OF_LINEAR:  # anchored at the first measured proposal; the baseline out of the linear term
            base = np.array([n in self._baselines for n, _ in ok])
            if not base.all():
                x0 = X[int(np.argmin(base))]
                XL = np.where(base[:, None], x0, X)
        Xc, Fc = XL - x0, self.table.features - x0
        lvl = LEVEL_SD ** 2
        dxx = np.abs(X[:, None, :] - X[None, :, :]).sum(-1)
        s2, lin = self._scales(r, np.exp(-dxx / KERNEL_LENGTH), Xc @ Xc.T, s2)
        K = s2 * np.exp(-dxx / KERNEL_LENGTH) + lin * (Xc @ Xc.T) + lvl + THROUGHPUT_NOISE ** 2 * np.eye(len(r))
        Ks = lin * (Fc @ Xc.T) + lvl
        for j in range(len(r)):
            Ks[:, j] += s2 * np.exp(-np.abs(self.table.features - X[j]).sum(1) / KERNEL_LENGTH)
        Kinv = np.linalg.inv(K)
        self._gp = (X, XL, x0, s2, lin, Kinv)
        mean = mu + Ks @ (Kinv @ r)
        prior = s2 + lin * np.einsum("ij,ij->i", Fc, Fc) + lvl
        var = prior - np.einsum("ij,jk,ik->i", Ks, Kinv, Ks)
        return mean, np.sqrt(np.maximum(var, 1e-10))

    @staticmethod
    def _scales(r: np.ndarray, local: np.ndarray, linear: np.ndarray, s2: float) -> tuple[float, float]:
        """(local variance, per-knob-step linear variance) of the residual GP: the prior values (s2 from the
        residuals' spread, KNOB_EFFECT_SD) scaled by the multipliers of SCALE_GRID / LINEAR_GRID that maximise the marginal
        likelihood of the residuals `r` times a log-normal hyperprior (SCALE_PRIOR_SD): empirical Bayes, so the
        study's own measurements say how much of its error is structural (a trend along knob directions the
        model mis-prices) and how much local."""
        lin0 = KNOB_EFFECT_SD ** 2
        if not EMPIRICAL_SCALES or len(r) < 2:
            return s2, lin0
        n = len(r)
        base = LEVEL_SD ** 2 + THROUGHPUT_NOISE ** 2 * np.eye(n)
        best, out = -math.inf, (s2, lin0)
        for a in SCALE_GRID:
            for b in LINEAR_GRID:
                K = (a * a * s2) * local + (b * b * lin0) * linear + base
                sign, logdet = np.linalg.slogdet(K)
                if sign <= 0:
                    continue
                ll = -0.5 * float(r @ np.linalg.solve(K, r)) - 0.5 * logdet
                ll -= 0.5 * (math.log(a) ** 2 + math.log(b) ** 2) / SCALE_PRIOR_SD ** 2
                if ll > best:
                    best, out = ll, (a * a * s2, b * b * lin0)
        return out

    def _joint_cov(self, rows: np.ndarray) -> np.ndarray:
        """Posterior covariance of the residual GP (`_posterior`, the latest fit) among `rows` of the table."""
        X, XL, x0, s2, lin, Kinv = self._gp
        F = self.table.features[rows]
        Fc, Xc = F - x0, XL - x0
        lvl = LEVEL_SD ** 2
        prior = (s2 * np.exp(-np.abs(F[:, None, :] - F[None, :, :]).sum(-1) / KERNEL_LENGTH)
                 + lin * (Fc @ Fc.T) + lvl)
        Ks = s2 * np.exp(-np.abs(F[:, None, :] - X[None, :, :]).sum(-1) / KERNEL_LENGTH) + lin * (Fc @ Xc.T) + lvl
        return prior - Ks @ Kinv @ Ks.T

    def propose(self, study: optuna.Study) -> int | None:
        """Row of the best candidate the runner accepts (refused rows are never proposed again)."""
        while True:
            a = self.assess(study)
            if a.candidate is None:
                return None
            if self.runner_check is None or not self.runner_check(self.table.layouts[a.candidate]):
                return a.candidate
            self._refused.add(a.candidate)

    def top_predicted(self, study: optuna.Study, n: int = 10) -> list[dict]:
        """The n best layouts by the recalibrated model's mean that fit: label, tokens/s/GPU, peak, margin."""
        a = self.assess(study)
        ok = self.table.host_fits & (a.peak_gib <= self.usable) & self._scored
        rows = np.flatnonzero(ok)
        rows = rows[np.argsort(-a.mean_log[rows])[:n]]
        return [{"label": self.table.layouts[i].label(), "tokens_per_s_per_gpu": round(float(np.exp(a.mean_log[i])), 1),
                 "spread_percent": round(100 * float(a.spread[i]), 2), "peak_gib": round(float(a.peak_gib[i]), 2),
                 "margin_gib": round(self.capacity - float(a.peak_gib[i]), 2)} for i in rows]
