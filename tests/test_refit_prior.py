"""The study's coefficient refit is bounded by what it does to the candidates (issue 20, fourth follow-up): a
coefficient's prior is capped so that a one-standard-deviation move changes no candidate's predicted throughput by
more than the calibration's own error (`recalibrate.effect_prior_caps`), and each measurement is weighed with the
model's structural error (`FIT_RESIDUAL_SD`), so one measurement far from the candidates (the baseline) cannot move
their predictions by its whole error or more."""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from attune.api.tune import tune_config
from attune.estimator import estimate
from attune.estimator.coefficients import DEFAULT, coefficients_for
from attune.search import recalibrate as rc
from attune.search.scoring import score_space

SMALL = str(Path(__file__).parent / "fixtures" / "spaces" / "dense_small.yaml")


def test_a_hidden_term_is_capped_by_its_effect_not_its_derivative():
    """A coefficient whose term hides behind another at the shipped value (zero derivative there) still gets its
    prior capped once a prior move makes it set the step; one that barely moves throughput is not capped."""
    shipped = DEFAULT
    name, hidden = "host_optimizer_efficiency", "gemm_efficiency"
    c0 = getattr(shipped, name)

    def log_tokens(c):  # step = max(compute, optimizer): the optimizer hidden at the shipped value (60% of compute)
        compute = 1.0 / getattr(c, hidden)
        opt = 0.6 * compute * c0 / getattr(c, name)
        return np.array([-math.log(max(compute, opt))])

    caps = rc.effect_prior_caps(shipped, log_tokens, effect_sd=0.1)
    bumped = dataclasses.replace(shipped, **{name: c0 * 1.01})
    assert log_tokens(bumped)[0] == log_tokens(shipped)[0]  # no derivative at the shipped value
    assert name in caps and caps[name] < 0.5 * rc.PRIOR_WIDTH_FRACTION * math.log(0.5 / 0.01)
    assert caps[hidden] == pytest.approx(0.1, rel=1e-3)  # compute sets the step one for one: 0.1 of log throughput
    assert "attention_efficiency" not in caps  # not in log_tokens: no effect, no cap


def test_one_far_measurement_moves_the_candidates_less_than_its_error(tmp_path):
    """The baseline measured 30% over its prediction: the refit moves the best predicted layouts by well under that,
    and by less than the unweighted, uncapped refit did (0.12 of log throughput on this space)."""
    cfg = tune_config(model="Qwen3.6-27B", gpus="8xH200", search_space=SMALL, out=tmp_path)
    shipped = coefficients_for(cfg.cluster.gpu)
    ctx = (cfg.model, cfg.cluster, cfg.workload, cfg.engine)
    table = score_space(cfg.space, cfg.model, cfg.cluster, cfg.workload, cfg.engine, shipped)
    rows = table.sensitive_rows(cfg.cluster.gpu.capacity_gib)
    rows = rows[np.argsort(-table.tokens[rows])[:32]]
    caps = rc.effect_prior_caps(shipped, lambda c: np.log(table.exact_tokens(rows, c)))
    e = estimate(cfg.model, cfg.cluster, cfg.baseline, cfg.workload, cfg.engine, shipped, check_layout=False)
    meas = [rc.Measurement(layout=cfg.baseline, tokens_per_s_per_gpu=1.3 * e.perf.tokens_per_s_per_gpu)]

    def moved(prior_cap, sd):
        cal = rc.recalibrate(meas, shipped, ctx, cfg.cluster.gpu.capacity_gib, prior_cap, sd)
        return float(np.max(np.abs(np.log(table.exact_tokens(rows, cal.coefficients) / table.tokens[rows]))))

    bounded = moved(caps, rc.FIT_RESIDUAL_SD)
    unbounded = moved(None, rc.THROUGHPUT_NOISE)
    assert bounded < 0.25 * math.log(1.3) < unbounded < math.log(1.3)
