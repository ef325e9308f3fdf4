"""One trial per unmeasured TP x PP family that could hold the best (attune.search.family_probe), and the
acquisition per expected trial when an OOM costs half a trial (sampler.OOM_HALF_TRIAL). Both ship off
(benchmarks/RESULTS.md, issue 20 fifth follow-up); these tests switch them on."""

import math
from pathlib import Path

import numpy as np
import optuna
import pytest

from attune.api.tune import tune_config
from attune.estimator.coefficients import coefficients_for
from attune.search import family_probe as fp
from attune.search import sampler as sampler_module
from attune.search.sampler import ModelGuidedSampler
from attune.search.scoring import score_space
from attune.search.space import FEATURES

SMALL = str(Path(__file__).parent / "fixtures" / "spaces" / "dense_small.yaml")
TP, PP = FEATURES.index("log2_tp"), FEATURES.index("log2_pp")


def _features(tp_pp):
    f = np.zeros((len(tp_pp), len(FEATURES)))
    f[:, TP] = np.log2([t for t, _ in tp_pp])
    f[:, PP] = np.log2([p for _, p in tp_pp])
    return f


def test_the_probe_takes_the_open_family_most_likely_to_beat_the_best():
    # rows: two of the measured family (TP1 PP4), two of TP2 PP2, one of TP4 PP1
    F = _features([(1, 4), (1, 4), (2, 2), (2, 2), (4, 1)])
    measured = _features([(1, 4)] * 3)
    pi = np.array([0.5, 0.4, 0.12, 0.20, 0.15])
    ei = np.array([0.03, 0.02, 0.011, 0.010, 0.012])
    avail = np.ones(5, dtype=bool)
    p = fp.family_probe(F, measured, 0, pi, ei, avail, 3, chosen=0)
    # the family with the largest P(improve) is TP2 PP2 (0.20); its candidate with the largest EI is row 2
    assert p == {"row": 2, "family": (2, 2), "p_improve": 0.2}
    # no probe: before FAMILY_AFTER measured, after FAMILY_MAX probes, when the acquisition already left the
    # measured families, or when no open family reaches FAMILY_P
    assert fp.family_probe(F, measured, 0, pi, ei, avail, fp.FAMILY_AFTER - 1, chosen=0) is None
    assert fp.family_probe(F, measured, fp.FAMILY_MAX, pi, ei, avail, 3, chosen=0) is None
    assert fp.family_probe(F, measured, 0, pi, ei, avail, 3, chosen=4) is None
    low = np.where(F[:, PP] < 2, fp.FAMILY_P - 0.01, pi)
    assert fp.family_probe(F, measured, 0, low, ei, avail, 3, chosen=0) is None
    # a family with a measured OOM (any measured layout) is not open
    assert fp.family_probe(F, _features([(1, 4), (1, 4), (2, 2)]), 0, pi, ei, avail, 3, chosen=0)["family"] == (4, 1)


@pytest.fixture(scope="module")
def small_table(tmp_path_factory):
    cfg = tune_config(model="Qwen3.6-27B", gpus="8xH200", search_space=SMALL, out=tmp_path_factory.mktemp("t"))
    return cfg, score_space(cfg.space, cfg.model, cfg.cluster, cfg.workload, cfg.engine,
                            coefficients_for(cfg.cluster.gpu))


def _study(cfg, table, rows, over=0.03):
    """The rows measured `over` above their prediction (log)."""
    study = optuna.create_study(direction="maximize")
    dists = cfg.space.distributions()
    for r in rows:
        study.add_trial(optuna.trial.create_trial(
            params=table.params[r], distributions={n: v for n, v in dists.items() if n in table.params[r]},
            value=float(table.tokens[r]) * math.exp(over), state=optuna.trial.TrialState.COMPLETE,
            user_attrs={"role": "candidate", "layout": table.layouts[r].to_dict()}))
    return study


def test_a_study_refining_one_family_probes_another_once_the_posterior_allows(small_table, monkeypatch):
    """Three layouts of the model's best family measured 3% over prediction: the acquisition refines that family;
    with the probe on, the next proposal is the best candidate of an unmeasured family instead, and once
    FAMILY_MAX probes are measured the acquisition's choice stands again. (In this small space the best open
    family, TP2 PP4, beats the best measured by more than min_gain with probability 0.09: the threshold is set
    under it, then just over it.)"""
    cfg, table = small_table
    monkeypatch.setattr(fp, "FAMILY_P", 0.04)
    keys = fp.family_keys(table.features)
    fits = np.flatnonzero(table.host_fits & (table.peak_gib < 0.9 * cfg.cluster.gpu.capacity_gib)
                          & np.isfinite(table.tokens))
    order = fits[np.argsort(-table.tokens[fits])]
    top = order[keys[order] == keys[order[0]]][:3]

    def assess(rows, on):
        monkeypatch.setattr(sampler_module, "FAMILY_PROBE", on)
        s = ModelGuidedSampler(table=table, shipped=coefficients_for(cfg.cluster.gpu),
                               capacity_gib=cfg.cluster.gpu.capacity_gib)
        return s, s.assess(_study(cfg, table, rows))

    _, off = assess(top, False)
    assert off.family_probe is None and keys[off.candidate] == keys[top[0]]  # refining the measured family
    s, on = assess(top, True)
    assert on.family_probe is not None and on.candidate == on.family_probe["row"]
    assert keys[on.candidate] != keys[top[0]] and on.family_probe["p_improve"] >= fp.FAMILY_P
    assert on.family_probe["family"] == (2, 4)
    monkeypatch.setattr(fp, "FAMILY_P", on.family_probe["p_improve"] + 0.01)  # no open family that likely: no probe
    assert assess(top, True)[1].family_probe is None
    monkeypatch.setattr(fp, "FAMILY_P", 0.04)
    # the probe measured: with FAMILY_MAX 1 no further probe (even at a threshold every open family passes),
    # with 2 another family
    rows = [*top, on.candidate]
    monkeypatch.setattr(fp, "FAMILY_P", 1e-9)
    monkeypatch.setattr(fp, "FAMILY_MAX", 1)
    assert s.assess(_study(cfg, table, rows)).family_probe is None
    monkeypatch.setattr(fp, "FAMILY_MAX", 2)
    s._sig = None  # the same measurements: assess again (not the kept assessment)
    again = s.assess(_study(cfg, table, rows)).family_probe
    assert again is not None and again["family"] not in ((1, 4), (2, 4))


def test_an_oom_costing_half_a_trial_makes_a_risky_large_gain_worth_a_trial_first(small_table, monkeypatch):
    """Two candidates: a safe one 3% over the best measured and one 5% over it that fits with probability 0.5.
    Per trial the safe one is worth more (EI 0.030 against 0.025); per expected trial, an OOM costing half a
    trial, the risky one is (0.025 / 0.75 = 0.033)."""
    cfg, table = small_table
    s = ModelGuidedSampler(table=table, shipped=coefficients_for(cfg.cluster.gpu),
                           capacity_gib=cfg.cluster.gpu.capacity_gib, exact=True)
    gap = np.array([0.03, 0.05])
    sd, p_fit, avail = np.full(2, 1e-6), np.array([1.0, 0.5]), np.ones(2, dtype=bool)
    monkeypatch.setattr(sampler_module, "OOM_HALF_TRIAL", False)
    acq, *_ = s._acquisition(gap, sd, 1.0, p_fit, avail, avail)
    assert int(np.argmax(acq)) == 0
    monkeypatch.setattr(sampler_module, "OOM_HALF_TRIAL", True)
    acq, *_ = s._acquisition(gap, sd, 1.0, p_fit, avail, avail)
    assert int(np.argmax(acq)) == 1
    assert acq[1] == pytest.approx(0.05 * 0.5 / (0.5 + 0.5 * sampler_module.OOM_TRIAL_COST), rel=1e-3)
