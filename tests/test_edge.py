"""Walking the memory edge (issue 20): after a real OOM the tuner takes the cheapest step that takes memory
off the stage that ran out, and the stop rule does not fire while such a step is predicted better than the
best measured."""

import dataclasses
from pathlib import Path

import numpy as np
import optuna

from attune.api.tune import tune_config
from attune.estimator.coefficients import coefficients_for
from attune.reporting.edge import edge_section
from attune.runners.replay import ReplayRow, ReplayRunner
from attune.search import edge as edge_module
from attune.search.records import records
from attune.search.sampler import ModelGuidedSampler
from attune.search.scoring import score_space
from attune.search.tuner import Tuner

SMALL = str(Path(__file__).parent / "fixtures" / "spaces" / "dense_small.yaml")
TARGET = dict(model="Qwen3.6-27B", gpus="8xH200", search_space=SMALL)


def _setup(tmp_path):
    cfg = tune_config(**TARGET, out=tmp_path)
    table = score_space(cfg.space, cfg.model, cfg.cluster, cfg.workload, cfg.engine, coefficients_for(cfg.cluster.gpu))
    return cfg, table


def _row(table, label):
    return next(i for i, lay in enumerate(table.layouts) if lay.label() == label)


def test_the_best_one_recompute_step_past_an_oom_is_found_within_two_trials(tmp_path):
    """The issue's table, in miniature: the model's top layout (TP1 PP4 16/14 Rb11) runs out of memory on
    stage 0 (stage 0 of every PP4 layout uses 8 GiB more than modelled), and the best layout is one recompute
    layer more (Rb12); every other layout runs 5% slower than predicted. The study starts from the OOM
    (measured first), and again from the usual baseline (modelled right: its peaks give no warning)."""
    cfg, table = _setup(tmp_path)
    cap = cfg.cluster.gpu.capacity_gib
    oom_label, best_label = "TP1 PP4 16/14 DP2 Rb11 mt8192", "TP1 PP4 16/14 DP2 Rb12 mt8192"
    best_row = _row(table, best_label)
    rows = []
    for i, lay in enumerate(table.layouts):
        peaks = tuple(p + (8.0 if lay.pp == 4 and s == 0 else 0.0) for s, p in enumerate(table.stage_gib[i]))
        if not np.isfinite(table.tokens[i]) or max(peaks) > cap or not table.host_fits[i]:
            rows.append(ReplayRow(line=i + 2, layout=lay, outcome="oom", peak_gib=peaks,
                                  oom_stage=int(np.argmax(np.array(peaks) - cap))))
            continue
        t = float(table.tokens[i]) * (1.0 if i == best_row else 0.95)
        rows.append(ReplayRow(line=i + 2, layout=lay, outcome="ok", tokens_per_s_per_gpu=t, step_time_s=1.0,
                              peak_gib=peaks))
    runner = ReplayRunner("the test table", model=cfg.model, world_size=8, rows=rows)
    for start in (table.layouts[_row(table, oom_label)], cfg.baseline):
        d = tmp_path / start.slug()
        c = dataclasses.replace(cfg, runner=runner, trials=6, storage=str(d / "s.journal"), out_dir=d, p_stop=1e-9,
                                baseline=start)
        d.mkdir()
        out = Tuner(c).run()
        meas = [r for r in records(out.study) if r.is_measured]
        labels = [r.label for r in meas]
        assert best_label in labels, labels
        if start.label() == oom_label:  # the OOM first: the edge step after it is the best layout
            assert meas[0].outcome == "oom" and meas[0].oom_stage == 0
            assert best_label in labels[1:3], labels  # found within 2 trials after that OOM
            steps = out.study.user_attrs.get("edge_steps")
            assert steps and steps[0]["after_trial"] == meas[0].number and "stage 0" in steps[0]["why"]
            # report.md shows the step and the winner's per-stage margin against its measured peaks
            text = "\n".join(edge_section(c, out))
            assert f"| {meas[0].number} | {oom_label} | out of memory on stage 0 | more recompute |" in text
            assert out.best.label == best_label and "margin GiB" in text
            margin0 = c.cluster.gpu.capacity_gib - out.best.measured_peak_gib[0]
            assert f"| 0 | {out.best.measured_peak_gib[0]:.2f} |" in text and f"{margin0:.2f} |" in text
        elif oom_label in labels:  # from the usual baseline: never more than 2 trials after the OOM
            assert labels.index(best_label) <= labels.index(oom_label) + 2, labels


def test_the_stop_rule_does_not_fire_while_a_neighbour_of_an_oom_is_predicted_better(tmp_path, monkeypatch):
    cfg, table = _setup(tmp_path)
    study = optuna.create_study(direction="maximize")
    dists = cfg.space.distributions()
    best = _row(table, "TP1 PP4 16/14 DP2 Rb13 mt8192")
    oom = _row(table, "TP1 PP4 16/14 DP2 Rb11 mt8192")
    for r, value in ((best, float(table.tokens[best])), (oom, None)):
        attrs = {"role": "candidate", "layout": table.layouts[r].to_dict(), "measured": True}
        if value is None:
            attrs.update(outcome="oom", oom_stage=0)
        study.add_trial(optuna.trial.create_trial(
            params=table.params[r], distributions={k: v for k, v in dists.items() if k in table.params[r]},
            value=value, state=optuna.trial.TrialState.COMPLETE if value else optuna.trial.TrialState.PRUNED,
            user_attrs=attrs))

    def assess():
        s = ModelGuidedSampler(table=table, shipped=coefficients_for(cfg.cluster.gpu),
                               capacity_gib=cfg.cluster.gpu.capacity_gib, recalibrate=False)
        return s.assess(study)

    a = assess()
    # Rb12 takes 6.5 GiB off stage 0 and is predicted 1.5% faster than the best measured (Rb13)
    assert a.oom_neighbour is not None
    n = a.oom_neighbour
    assert table.layouts[n].label() == "TP1 PP4 16/14 DP2 Rb12 mt8192" and a.mean_log[n] > np.log(table.tokens[best])
    assert a.peak_gib[n] < cfg.cluster.gpu.capacity_gib
    # everything else says stop (p_stop and min_gain this loose): the neighbour alone keeps the study going
    assert not a.should_stop(p_stop=0.99, min_gain=0.5)
    monkeypatch.setattr(edge_module, "EDGE_RADIUS", -1.0)  # no layout is a neighbour of the OOM any more
    a = assess()
    assert a.oom_neighbour is None and a.should_stop(p_stop=0.99, min_gain=0.5)


def test_the_memory_model_learns_from_peaks_and_ooms_and_is_least_sure_near_capacity(tmp_path):
    """Measured stage peaks 6% over the model (a scale error) move the prediction of an unmeasured stage near
    capacity by about that much; its spread is larger there than at the measured peaks; a real OOM puts its
    stage over capacity."""
    from attune.estimator import estimate
    from attune.search.recalibrate import Measurement, memory_model
    cfg, table = _setup(tmp_path)
    shipped = coefficients_for(cfg.cluster.gpu)
    ctx = (cfg.model, cfg.cluster, cfg.workload, cfg.engine)
    cap = cfg.cluster.gpu.capacity_gib
    lay = cfg.baseline
    e = estimate(cfg.model, cfg.cluster, lay, cfg.workload, cfg.engine, shipped, check_layout=False)
    peaks = [s.total_gib * 1.06 for s in e.memory.stages]
    mm = memory_model([Measurement(layout=lay, tokens_per_s_per_gpu=e.perf.tokens_per_s_per_gpu,
                                   stage_peak_gib=peaks)], ctx, cap, shipped)
    low, _ = mm.predict([e.memory.stages[0].total_gib], 0, pp=lay.pp)
    assert abs(low[0] - peaks[0]) < 1.0  # the measured stage is predicted as measured
    at = np.array([peaks[0] / 1.06, 0.95 * cap])
    mu, sd = mm.predict(at, 0, pp=lay.pp)
    assert sd[1] > 1.5 * sd[0]  # least sure near capacity (extrapolated, and the allocator's edge spread)
    assert mu[1] > at[1] + 0.5 * 0.06 * at[1] - 3.0  # the scale error carried toward capacity
    oom = _row(table, "TP1 PP4 16/14 DP2 Rb11 mt8192")
    mm = memory_model([Measurement(layout=table.layouts[oom], oom_stage=0)], ctx, cap, shipped)
    mu, _ = mm.predict([table.stage_gib[oom][0]], 0, pp=4)
    assert mu[0] > cap


def test_an_oom_is_a_censored_peak_the_stage_needed_the_expected_excess_over_capacity(tmp_path):
    """A stage predicted under capacity that ran out of memory: the memory model takes the expected excess of a
    peak known only to exceed capacity (the prior's predictive truncated at capacity: several GiB with a ~5%
    prior), not just capacity, so a neighbour a GiB or two lighter is still predicted over capacity; a stage
    the model already puts well over capacity learns (almost) nothing from running out."""
    from attune.search.recalibrate import Measurement, memory_model
    cfg, table = _setup(tmp_path)
    shipped = coefficients_for(cfg.cluster.gpu)
    ctx = (cfg.model, cfg.cluster, cfg.workload, cfg.engine)
    cap = cfg.cluster.gpu.capacity_gib
    oom = _row(table, "TP1 PP4 16/14 DP2 Rb11 mt8192")
    p0 = table.stage_gib[oom][0]
    assert p0 < cap  # predicted to fit
    mm = memory_model([Measurement(layout=table.layouts[oom], oom_stage=0)], ctx, cap, shipped)
    mu, sd = mm.predict([p0, p0 - 2.0], 0, pp=4)
    assert mu[0] > cap + 3.0 and mu[1] > cap
    assert sd[0] > 2.0  # how far over is not measured: the spread stays wide
    # a stage predicted 30 GiB over capacity: running out says nothing new
    far = [r for r in range(len(table)) if table.layouts[r].pp == 4 and table.stage_gib[r][0] > cap + 30.0]
    assert far
    p1 = table.stage_gib[far[0]][0]
    mm1 = memory_model([Measurement(layout=table.layouts[far[0]], oom_stage=0)], ctx, cap, shipped)
    assert abs(mm1.predict([p0], 0, pp=4)[0][0] - p0) < 1.0 < p1 - cap
