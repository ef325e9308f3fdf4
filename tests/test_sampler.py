"""The model-guided sampler: the whole space scored once, the model's optimum proposed first when the model is
exact, recalibration toward a perturbed truth, the stop rule, and the exclusion of busy or measured layouts."""

import dataclasses
from pathlib import Path

import numpy as np
import optuna
import pytest

from attune.api.tune import tune, tune_config
from attune.estimator import estimate
from attune.estimator.coefficients import coefficients_for
from attune.search import sampler as sampler_module
from attune.search.recalibrate import MEMORY_PRIOR_FRACTION, Measurement, fitted_bounds, recalibrate
from attune.search.records import records
from attune.search.sampler import ModelGuidedSampler, busy_or_done_keys
from attune.search.scoring import score_space
from attune.search.space import layout_key, load_space, params_key

SMALL = str(Path(__file__).parent / "fixtures" / "spaces" / "dense_small.yaml")
TARGET = dict(model="Qwen3.6-27B", gpus="8xH200", search_space=SMALL)


def _exhaustive_optimum(cfg):
    """The best predicted layout that fits, by estimating every parameter set's layout one by one."""
    best, cap = None, cfg.cluster.gpu.capacity_gib * (1 - cfg.headroom)
    coef = coefficients_for(cfg.cluster.gpu)
    for _params, lay in cfg.space.enumerate(cfg.model, cfg.cluster.world_size, cfg.workload, cfg.engine):
        e = estimate(cfg.model, cfg.cluster, lay, cfg.workload, cfg.engine, coef)
        if e.memory.host_fits and e.memory.peak_gib <= cap and (best is None or e.perf.tokens_per_s_per_gpu > best[0]):
            best = (e.perf.tokens_per_s_per_gpu, lay)
    return best


def test_enumeration_dedupes_and_matches_to_layout(tmp_path, qwen, slime):
    sp = load_space(SMALL)
    pairs = sp.enumerate(qwen, 8, tune_config(**TARGET, out=tmp_path).workload, slime)
    keys = [layout_key(lay, qwen.num_layers) for _, lay in pairs]
    assert len(keys) == len(set(keys)) > 500
    # every parameter set maps back to its layout, and uniform recompute appears once per layout
    wl = tune_config(**TARGET, out=tmp_path).workload
    for params, lay in pairs[::97]:
        assert layout_key(sp.to_layout(params, qwen, 8, wl, slime), 64) == layout_key(lay, 64)


def test_sim_study_measures_the_exhaustive_optimum_first_and_stops(tmp_path):
    res = tune(**TARGET, out=tmp_path / "run", trials=10)
    o = res.outcome
    meas = [r for r in records(o.study) if r.is_measured]
    assert len(o.study.trials) == len(meas)  # trials are measured runs only: no estimated-only trials
    assert meas[0].role == "baseline"
    want = _exhaustive_optimum(res.config)
    assert meas[1].label == want[1].label() and abs(meas[1].value - want[0]) < 1e-6 * want[0]
    assert o.best.label == want[1].label()
    # the sim runner is exact: once its optimum is measured nothing can beat it: the stop rule ends the study
    assert o.stop_kind == "rule" and len(meas) == 2 and o.remaining_regret == 0.0
    assert any(line.startswith("stopped by rule") for line in res.summary_lines())
    report = (tmp_path / "run" / "report.md").read_text()
    assert "Top 10 predicted layouts" in report and "memory margin GiB" in report
    assert len(o.top_predicted) == 10 and o.top_predicted[0]["label"] == want[1].label()
    assert all(t["margin_gib"] > 0 for t in o.top_predicted)


def test_busy_or_done_layouts_are_never_proposed(tmp_path):
    cfg = tune_config(**TARGET, out=tmp_path)
    from_study = optuna.create_study(direction="maximize")
    table = score_space(cfg.space, cfg.model, cfg.cluster, cfg.workload, cfg.engine, coefficients_for(cfg.cluster.gpu))
    ok = np.flatnonzero(table.host_fits & (table.peak_gib <= cfg.cluster.gpu.capacity_gib * 0.98)
                        & np.isfinite(table.tokens))
    top = ok[np.argmax(table.tokens[ok])]
    from_study.enqueue_trial(table.params[top])
    from_study.ask(cfg.space.distributions())  # a RUNNING trial holding the model's optimum
    assert params_key(table.params[top]) in busy_or_done_keys(from_study, cfg.model.num_layers)
    s = ModelGuidedSampler(table=table, shipped=coefficients_for(cfg.cluster.gpu),
                           capacity_gib=cfg.cluster.gpu.capacity_gib, exact=True)
    row = s.propose(from_study)
    assert row is not None and row != top and table.tokens[row] <= table.tokens[top]


def test_recalibration_moves_coefficients_toward_a_perturbed_truth(tmp_path):
    cfg = tune_config(**TARGET, out=tmp_path)
    shipped = coefficients_for(cfg.cluster.gpu)
    names = [n for n, _, _ in fitted_bounds(shipped)]
    assert "gemm_efficiency" in names  # bounds come from the coefficients' metadata (or the fallback list)
    truth = dataclasses.replace(shipped, gemm_efficiency=shipped.gemm_efficiency * 0.85)
    ctx = (cfg.model, cfg.cluster, cfg.workload, cfg.engine)
    pairs = cfg.space.enumerate(cfg.model, cfg.cluster.world_size, cfg.workload, cfg.engine)
    meas = []
    for _, lay in pairs[::150][:8]:
        e = estimate(cfg.model, cfg.cluster, lay, cfg.workload, cfg.engine, truth, check_layout=False)
        meas.append(Measurement(layout=lay, tokens_per_s_per_gpu=e.perf.tokens_per_s_per_gpu))
    cal = recalibrate(meas, shipped, ctx, cfg.cluster.gpu.capacity_gib)
    fitted = cal.coefficients.gemm_efficiency
    assert abs(fitted - truth.gemm_efficiency) < 0.5 * abs(shipped.gemm_efficiency - truth.gemm_efficiency)
    # and the refitted model predicts layouts it was not fitted to better than the shipped one
    test = [lay for _, lay in pairs[75::150][:6]]
    err = lambda c: np.mean([abs(np.log(estimate(cfg.model, cfg.cluster, lay, cfg.workload, cfg.engine, c,  # noqa: E731
                                                 check_layout=False).perf.tokens_per_s_per_gpu
                                        / estimate(cfg.model, cfg.cluster, lay, cfg.workload, cfg.engine, truth,
                                                   check_layout=False).perf.tokens_per_s_per_gpu)) for lay in test])
    assert err(cal.coefficients) < 0.5 * err(shipped)


def test_a_real_oom_raises_the_memory_offset_of_its_stage(tmp_path):
    cfg = tune_config(**TARGET, out=tmp_path)
    shipped = coefficients_for(cfg.cluster.gpu)
    ctx = (cfg.model, cfg.cluster, cfg.workload, cfg.engine)
    lay = cfg.baseline
    e = estimate(cfg.model, cfg.cluster, lay, cfg.workload, cfg.engine, shipped, check_layout=False)
    cal = recalibrate([Measurement(layout=lay, oom_stage=e.memory.peak_stage)], shipped, ctx,
                      cfg.cluster.gpu.capacity_gib)
    assert cal.stage_offset(e.memory.peak_stage, lay.pp) + e.memory.peak_gib > cfg.cluster.gpu.capacity_gib


@pytest.mark.parametrize("bad", [dict(min_gain=1.5), dict(sampler="grid"), dict(p_stop=0.0)])
def test_bad_stop_settings(tmp_path, bad):
    with pytest.raises(Exception, match="min gain|sampler 'grid'|stop probability"):
        tune_config(**TARGET, out=tmp_path, **bad)


def test_measured_peaks_of_a_two_stage_layout_set_the_middle_stages_offset_too(tmp_path):
    """A PP=2 baseline measures only a first and a last stage: the middle stages of deeper pipelines borrow the
    common offset, and the spread of every position shrinks below the unmeasured prior."""
    cfg = tune_config(**TARGET, out=tmp_path)
    shipped = coefficients_for(cfg.cluster.gpu)
    ctx = (cfg.model, cfg.cluster, cfg.workload, cfg.engine)
    cap = cfg.cluster.gpu.capacity_gib
    lay = cfg.baseline
    assert lay.pp == 2
    e = estimate(cfg.model, cfg.cluster, lay, cfg.workload, cfg.engine, shipped, check_layout=False)
    peaks = [s.total_gib + 6.0 for s in e.memory.stages]  # the truth: 6 GiB more on every stage
    cal = recalibrate([Measurement(layout=lay, tokens_per_s_per_gpu=e.perf.tokens_per_s_per_gpu, stage_peak_gib=peaks)],
                      shipped, ctx, cap)
    assert all(5.0 < cal.memory_offset_gib[p] < 6.5 for p in ("first", "middle", "last"))
    assert cal.memory_spread_gib["middle"] < MEMORY_PRIOR_FRACTION * cap  # below the unmeasured prior
    assert cal.memory_spread_gib["first"] < cal.memory_spread_gib["middle"]


def _optimum_measured(tmp_path):
    """The main target's scored space and a study in which the model's optimum was measured exactly as predicted:
    (config, shipped coefficients, table, the optimum's row, study)."""
    cfg = tune_config(**TARGET, out=tmp_path)
    shipped = coefficients_for(cfg.cluster.gpu)
    table = score_space(cfg.space, cfg.model, cfg.cluster, cfg.workload, cfg.engine, shipped)
    ok = np.flatnonzero(table.host_fits & (table.peak_gib <= cfg.cluster.gpu.capacity_gib * 0.98)
                        & np.isfinite(table.tokens))
    top = ok[np.argmax(table.tokens[ok])]
    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(
        params=table.params[top], distributions={k: v for k, v in cfg.space.distributions().items()
                                                 if k in table.params[top]},
        value=float(table.tokens[top]), user_attrs={"role": "candidate", "layout": table.layouts[top].to_dict()}))
    return cfg, shipped, table, top, study


def test_near_duplicates_of_a_measured_layout_are_not_proposed(tmp_path, monkeypatch):
    """After the model's optimum is measured exactly as predicted, the next proposal is more than one knob step
    away from it (its split / recompute neighbours are not predicted better by more than min_gain)."""
    cfg, shipped, table, top, study = _optimum_measured(tmp_path)

    def proposal():
        s = ModelGuidedSampler(table=table, shipped=shipped, capacity_gib=cfg.cluster.gpu.capacity_gib,
                               recalibrate=False)
        return float(np.abs(table.features[s.propose(study)] - table.features[top]).sum())

    assert proposal() > sampler_module.NEAR_DUPLICATE
    monkeypatch.setattr(sampler_module, "NEAR_DUPLICATE", -1.0)  # without the rule: a neighbour of the optimum
    assert proposal() <= 1.0


def test_the_near_duplicate_rule_keeps_structural_neighbours(tmp_path, monkeypatch):
    """The near-duplicate rule drops the split / recompute neighbours of a measured layout, never the ones one
    TP / PP / VPP / CP doubling, SP or tokens-per-microbatch doubling away: there the model's error is per knob
    step, and the posterior decides."""
    cfg, shipped, table, top, study = _optimum_measured(tmp_path)

    def candidates():
        s = ModelGuidedSampler(table=table, shipped=shipped, capacity_gib=cfg.cluster.gpu.capacity_gib,
                               recalibrate=False)
        return s.assess(study).candidates

    kept = candidates()
    monkeypatch.setattr(sampler_module, "_STRUCTURE_BATCH", np.array([], dtype=int))  # every neighbour counts
    assert candidates() < kept  # structural neighbours within one knob step were kept
    monkeypatch.setattr(sampler_module, "NEAR_DUPLICATE", -1.0)  # no rule at all
    assert candidates() > kept  # split / recompute neighbours were dropped


def test_the_claimed_regret_draws_correlated_layouts_jointly():
    """Drawn with their posterior covariance, layouts sharing one error claim less than independent draws (the
    largest of many independent draws overstates it); with a diagonal covariance the claim is the independent
    one."""
    n = 50
    gap, spread = np.full(n, -0.02), np.full(n, 0.05)
    p_fit, rows = np.ones(n), np.ones(n, dtype=bool)
    independent = sampler_module.remaining_regret(gap, spread, p_fit, rows)
    diagonal = sampler_module.remaining_regret(gap, spread, p_fit, rows, lambda r: np.diag(spread[r] ** 2))
    shared = sampler_module.remaining_regret(gap, spread, p_fit, rows, lambda r: np.full((len(r), len(r)), 0.05 ** 2))
    assert diagonal == pytest.approx(independent, rel=0.15)
    assert shared < 0.5 * independent
    # one shared N(0, 0.05) error on a -2% gap: E[max(exp(-0.02 + e) - 1, 0)], about 1.2%
    assert 0.008 < shared < 0.016
