"""An honest stop rule (issue 20): the residual GP's scales come from the study's own residuals (empirical
Bayes), and its spread is checked against the study's own out-of-sample predictions (attune.search.spread_check),
so the claimed remaining regret widens where the model mis-priced what was measured and narrows where it held."""

import math
from pathlib import Path

import numpy as np
import optuna
import pytest

from attune.api.tune import tune_config
from attune.estimator.coefficients import coefficients_for
from attune.search import sampler as sampler_module
from attune.search import spread_check
from attune.search.sampler import ModelGuidedSampler
from attune.search.scoring import score_space

SMALL = str(Path(__file__).parent / "fixtures" / "spaces" / "dense_small.yaml")


def _gp_inputs(r):
    x = np.arange(len(r), dtype=float)[:, None] * np.eye(1, 3)  # one knob, a step per layout
    d = np.abs(x[:, None, :] - x[None, :, :]).sum(-1)
    xc = x - x[0]
    return np.asarray(r, dtype=float), np.exp(-d / sampler_module.KERNEL_LENGTH), xc @ xc.T


def test_the_gp_scales_follow_the_studys_residuals(monkeypatch):
    """A trend of 2.7 prior standard deviations per knob step (the model mis-prices that knob) raises the linear
    scale above its prior;
    residuals within the noise lower the local scale and leave the linear one at its prior (it only grows);
    switched off, the priors stay whatever was measured."""
    monkeypatch.setattr(sampler_module, "EMPIRICAL_SCALES", True)
    s2 = sampler_module.PRIOR_SPREAD ** 2
    lin0 = sampler_module.KNOB_EFFECT_SD ** 2
    trend = _gp_inputs([2.7 * sampler_module.KNOB_EFFECT_SD * k for k in range(6)])
    local, lin = ModelGuidedSampler._scales(trend[0], trend[1], trend[2], s2)
    assert lin > 2 * lin0
    flat = _gp_inputs([0.004, -0.003, 0.002, -0.004, 0.001, 0.0])
    local, lin = ModelGuidedSampler._scales(flat[0], flat[1], flat[2], s2)
    assert lin == lin0 and local < s2
    monkeypatch.setattr(sampler_module, "EMPIRICAL_SCALES", False)
    assert ModelGuidedSampler._scales(trend[0], trend[1], trend[2], s2) == (s2, lin0)


def test_the_spread_factor_is_the_studys_own_out_of_sample_check():
    assert spread_check.spread_factor([]) == 1.0
    hit = spread_check.spread_factor([0.2, -0.3, 0.1, -0.2, 0.3, 0.0])
    miss = spread_check.spread_factor([2.5, -3.0, 2.0])
    assert hit == 1.0 and miss > 1.8  # predictions that held never narrow the spread
    assert spread_check.spread_factor([50.0] * 20) == spread_check.KAPPA_RANGE[1]


@pytest.fixture(scope="module")
def small_table(tmp_path_factory):
    cfg = tune_config(model="Qwen3.6-27B", gpus="8xH200", search_space=SMALL, out=tmp_path_factory.mktemp("t"))
    return cfg, score_space(cfg.space, cfg.model, cfg.cluster, cfg.workload, cfg.engine,
                            coefficients_for(cfg.cluster.gpu))


def _study(cfg, table, misses: bool):
    """Five measured candidates, each proposed with a posterior mean and a 2% spread; measured as predicted (to
    within 1%) or 12% off it, alternating in sign."""
    study = optuna.create_study(direction="maximize")
    dists = cfg.space.distributions()
    fits = np.flatnonzero(table.host_fits & (table.peak_gib < 0.9 * cfg.cluster.gpu.capacity_gib)
                          & np.isfinite(table.tokens))
    rows = fits[np.argsort(-table.tokens[fits])][[0, 5, 10, 20, 40]]
    for k, r in enumerate(rows):
        pred = float(table.tokens[r])
        off = (0.12 if misses else 0.01) * (1 if k % 2 else -1)
        study.add_trial(optuna.trial.create_trial(
            params=table.params[r], distributions={n: v for n, v in dists.items() if n in table.params[r]},
            value=pred * math.exp(off), state=optuna.trial.TrialState.COMPLETE,
            user_attrs={"role": "candidate", "layout": table.layouts[r].to_dict(),
                        "predicted_model_tokens_per_s_per_gpu": pred, "predicted_spread_percent": 2.0}))
    return study


def test_a_study_whose_predictions_missed_claims_more_remaining_regret(small_table, monkeypatch):
    """The same measured layouts: where the proposals' predictions missed by 12% (six standard deviations), the
    spread factor widens the claim; where they held, it changes nothing."""
    cfg, table = small_table

    def assess(misses, check=True):
        monkeypatch.setattr(sampler_module, "SPREAD_CHECK", check)
        s = ModelGuidedSampler(table=table, shipped=coefficients_for(cfg.cluster.gpu),
                               capacity_gib=cfg.cluster.gpu.capacity_gib)
        return s.assess(_study(cfg, table, misses))

    missed, missed_off = assess(True), assess(True, check=False)
    assert missed.spread_factor > 2.0 and missed_off.spread_factor == 1.0
    assert missed.remaining_regret > 2 * missed_off.remaining_regret
    held, held_off = assess(False), assess(False, check=False)
    assert held.spread_factor == 1.0 and held.remaining_regret == held_off.remaining_regret
