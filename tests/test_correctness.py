"""Tests of attune.correctness: convergence metrics, optimizer component test, numerics rules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attune.correctness.convergence import MIN_POINTS, Thresholds, compare_curves
from attune.correctness.rules import (
    UnknownArgumentWarning,
    diff_args,
    load_rules,
    parse_args,
    required_tests,
    unverified_reasons,
)
from attune.errors import UserInputError

# --------------------------------------------------------------------------------------------
# convergence


def _loss_curve(n: int = 20, floor: float = 2.5, seed: int = 0) -> list[float]:
    """A decaying SFT-like loss curve with step-to-step noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return list(floor + 1.5 * np.exp(-t / 6.0) + 0.05 * rng.standard_normal(n))


def _failed(result) -> set[str]:
    return {f.check for f in result.failures}


def test_identical_curves_pass_with_perfect_metrics():
    ref = _loss_curve()
    res = compare_curves(ref, list(ref))
    assert res.passed and not res.failures
    assert res.correlation == pytest.approx(1.0)
    assert res.final_loss_difference == 0.0
    assert res.pointwise_failures == 0 and res.outliers == 0
    assert res.steps == tuple(range(20)) and res.steps_compared == tuple(range(20))


def test_reduction_order_noise_passes():
    ref = _loss_curve()
    rng = np.random.default_rng(1)
    cand = [x * (1 + 1e-5 * rng.standard_normal()) for x in ref]
    res = compare_curves(ref, cand)
    assert res.passed
    assert res.correlation > 0.9999
    assert res.final_loss_difference < 1e-4


def test_shifted_curve_fails_pointwise_but_not_correlation():
    ref = _loss_curve()
    cand = [x * 1.15 for x in ref]  # 15% above a loss > 2: beyond the 0.10 band tolerance
    res = compare_curves(ref, cand)
    assert not res.passed
    assert "pointwise" in _failed(res)
    assert "correlation" not in _failed(res)
    assert res.pointwise_failures == 20


def test_pointwise_tolerance_adapts_to_loss_magnitude():
    lenient_final = Thresholds(final_loss_tolerance=1.0)  # isolate the point-wise check
    high = _loss_curve(floor=2.5)  # every point > 2.0: tolerance 0.10
    medium = [x * 0.45 for x in high]  # every point in (0.5, 2.0]: tolerance 0.05
    assert min(high) > 2.0 and 0.5 < min(medium) and max(medium) <= 2.0
    res_high = compare_curves(high, [x * 1.07 for x in high], lenient_final)
    res_medium = compare_curves(medium, [x * 1.07 for x in medium], lenient_final)
    assert res_high.passed and res_high.pointwise_failures == 0
    assert not res_medium.passed and _failed(res_medium) == {"pointwise"}
    th = Thresholds()
    assert th.tolerance_for(2.0) == 0.05 and th.tolerance_for(2.01) == 0.10
    assert th.tolerance_for(0.5) == 0.02 and th.tolerance_for(0.51) == 0.05


def test_curve_diverging_at_the_end_fails_final_loss_only():
    ref = _loss_curve()
    cand = list(ref)
    cand[-1] = ref[-1] * 1.08  # inside the 0.10 point-wise band, outside the 0.05 final band
    res = compare_curves(ref, cand)
    assert _failed(res) == {"final_loss"}
    assert res.final_loss_difference == pytest.approx(0.08)
    assert res.pointwise_failures == 0


def test_anticorrelated_curve_fails_correlation():
    ref = _loss_curve()
    mean = float(np.mean(ref))
    cand = [2 * mean - x for x in ref]
    res = compare_curves(ref, cand)
    assert "correlation" in _failed(res)
    assert res.correlation < -0.99


def test_single_spike_is_an_outlier_that_fails_only_past_the_ratio():
    ref = _loss_curve()
    cand = list(ref)
    cand[10] = ref[10] + 0.05  # ~2% on a loss near 2.7: inside the point-wise band
    res = compare_curves(ref, cand)
    assert res.outliers == 1 and res.pointwise_failures == 0
    assert res.passed  # 1 of 20 = 0.05 <= 0.1
    strict = compare_curves(ref, cand, Thresholds(max_outlier_ratio=0.04))
    assert _failed(strict) == {"outliers"}  # 0.05 > 0.04


def test_nan_or_inf_in_candidate_fails_with_reason():
    ref = _loss_curve()
    for bad in (math.nan, math.inf):
        cand = list(ref)
        cand[5] = bad
        res = compare_curves(ref, cand)
        assert not res.passed
        assert "data" in _failed(res)
        assert any("NaN or inf" in r and "5" in r for r in res.reasons)


def test_missing_step_fails_with_reason():
    ref = {step: loss for step, loss in enumerate(_loss_curve(), start=1)}
    cand = {s: v for s, v in ref.items() if s != 7}
    res = compare_curves(ref, cand)
    assert not res.passed
    assert any("lacks 1 reference step" in r and "7" in r for r in res.reasons)
    # The other 19 points still get metrics, for diagnosis.
    assert res.correlation == pytest.approx(1.0)
    # A truncated candidate (run died early) fails the same way.
    short = compare_curves(ref, {s: v for s, v in ref.items() if s <= 15})
    assert not short.passed and "data" in _failed(short)


def test_too_few_points_fail():
    assert MIN_POINTS == 3
    res = compare_curves([3.0, 2.9], [3.0, 2.9])
    assert not res.passed and res.correlation is None
    assert "at least 3" in res.reasons[0]
    assert compare_curves([3.0, 2.9, 2.8], [3.0, 2.9, 2.8]).passed


def test_warmup_skip_changes_the_verdict():
    ref = _loss_curve()
    cand = list(ref)
    for i in range(4):  # differs by 30% in the first 4 of 20 steps only
        cand[i] = ref[i] * 1.3
    assert not compare_curves(ref, cand).passed
    res = compare_curves(ref, cand, Thresholds(skip_first_fraction=0.2))
    assert res.passed
    assert res.steps_compared == tuple(range(4, 20))
    # NaN during warm-up still fails: it is a broken run, not warm-up noise.
    cand[0] = math.nan
    assert not compare_curves(ref, cand, Thresholds(skip_first_fraction=0.2)).passed


def test_thresholds_defaults_and_record_shape():
    th = Thresholds()
    assert (th.correlation, th.high_loss_tolerance, th.medium_loss_tolerance,
            th.low_loss_tolerance) == (0.95, 0.10, 0.05, 0.02)
    assert (th.final_loss_tolerance, th.max_outlier_ratio, th.outlier_sigma,
            th.skip_first_fraction) == (0.05, 0.1, 3.0, 0.0)
    ref = {str(s): v for s, v in enumerate(_loss_curve())}  # JSON-style string keys
    rec = compare_curves(ref, _loss_curve()).to_record(note="candidate arm: test")
    assert set(rec) == {"steps", "result", "correlation", "final_loss_difference",
                        "pointwise_failures", "thresholds", "note"}
    assert rec["steps"] == 20 and rec["result"] == "pass" and rec["pointwise_failures"] == 0
    assert rec["thresholds"]["final_loss_tolerance"] == 0.05
    assert rec["note"].startswith("candidate arm: test")
    bad = compare_curves(_loss_curve(), [x * 2 for x in _loss_curve()]).to_record()
    assert bad["result"] == "fail" and "pointwise" in bad["note"]


def test_statistics_are_the_textbook_ones():
    """r is Pearson's (numpy's corrcoef agrees); outliers are population-std z-scores beyond the sigma."""
    ref = _loss_curve(n=30, seed=3)
    rng = np.random.default_rng(4)
    cand = [x + 0.02 * rng.standard_normal() for x in ref]
    cand[7] += 0.5  # one large residual
    res = compare_curves(ref, cand, Thresholds(final_loss_tolerance=1.0))
    assert res.correlation == pytest.approx(float(np.corrcoef(ref, cand)[0, 1]), rel=1e-12)
    resid = np.array(cand) - np.array(ref)
    z = np.abs(resid - resid.mean()) / resid.std()  # ddof=0, as Bridge's np.std
    assert res.outliers == int((z > 3.0).sum()) == 1
    assert res.max_pointwise_difference == pytest.approx(float(np.max(np.abs(resid) / np.array(ref))))
    # a constant curve against a varying one: r is undefined, which fails, never passes silently
    flat = compare_curves([3.0] * 5, [3.0, 3.1, 2.9, 3.0, 3.05])
    assert flat.correlation is None and "correlation" in _failed(flat)
    # identical constant curves match perfectly; every residual equal means no outlier
    same = compare_curves([3.0] * 5, [3.0] * 5)
    assert same.passed and same.correlation == 1.0 and same.outliers == 0


def test_bad_thresholds_and_curves_are_user_errors():
    for bad in (dict(skip_first_fraction=1.0), dict(skip_first_fraction=-0.1), dict(outlier_sigma=0.0)):
        with pytest.raises(UserInputError):
            Thresholds(**bad)
    with pytest.raises(UserInputError, match="step 3 twice"):
        compare_curves({3: 1.0, "3": 1.0, 4: 1.0}, [1.0, 1.0, 1.0])
    with pytest.raises(TypeError):
        Thresholds(0.9)  # keyword-only: a bare number could be any threshold


# --------------------------------------------------------------------------------------------
# optimizer component test

torch = pytest.importorskip("torch")

from attune.correctness import component as comp  # noqa: E402

# A small real layer: hidden 256, FFN 704, 4 heads of 64, 2 KV heads (GQA), q/k norms.
SHAPES = comp.decoder_layer_shapes(hidden=256, ffn=704, heads=4, kv_heads=2, head_dim=64)
HYPER = dict(lr=1e-5, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1, seed=7)


def test_decoder_layer_shapes():
    assert SHAPES["self_attn.q_proj.weight"] == (256, 256)
    assert SHAPES["self_attn.k_proj.weight"] == (128, 256)
    assert SHAPES["mlp.down_proj.weight"] == (256, 704)
    assert SHAPES["self_attn.q_norm.weight"] == (64,)
    assert sum(math.prod(s) for s in SHAPES.values()) == 737_920
    gated = comp.decoder_layer_shapes(256, 704, 4, 2, 64, attention_output_gate=True)
    assert gated["self_attn.q_proj.weight"] == (512, 256)
    with pytest.raises(ValueError):
        comp.decoder_layer_shapes(256, 704, 4, 3, 64)


def test_remainder_split_merge_is_bitwise_exact():
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(200_000, generator=gen) * torch.logspace(-30, 30, 200_000)
    bits = torch.randint(-2**31, 2**31 - 1, (200_000,), generator=gen, dtype=torch.int32)
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan,
                             3.4028234663852886e38, -3.4028234663852886e38, 1e-45])
    for x in (normal, bits.view(torch.float32), specials):
        high, rem = comp.split_fp32(x)
        assert high.dtype == torch.bfloat16 and rem.dtype == torch.int16
        back = comp.merge_fp32(high, rem)
        assert torch.equal(back.view(torch.int32), x.view(torch.int32))
    # The high half is the round-to-nearest bf16 param, except at exact ties (RNE vs away).
    high, _ = comp.split_fp32(normal)
    not_tie = (normal.view(torch.int32) & 0xFFFF) != 0x8000
    assert torch.equal(high[not_tie].float(), normal[not_tie].to(torch.bfloat16).float())


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("config", ["default", "precision_aware", "cpu_offload"])
def test_optimizer_configs_match_fp64(config, steps):
    res = comp.run_component_test(config, SHAPES, steps=steps, **HYPER)
    assert res.passed, res.to_record()["detail"]
    assert 0.0 < res.worst_error <= res.bound
    assert res.bound == pytest.approx(2 * res.default_worst_error + 1e-3)
    # fp32 rounding of a 0.02-sized master against a 1e-5 update: ~1e-4 relative, not less
    # than the fp32 ulp would allow and far from the negative controls.
    assert res.worst_error < 5e-4
    assert res.checks["bf16 params equal their rounded masters"]
    if config == "precision_aware":
        assert res.checks["masters bitwise equal to the default's fp32 masters"]
    rec = res.to_record()
    assert set(rec) == {"test", "shape", "result", "detail"} and rec["result"] == "pass"


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("config", comp.NEGATIVE_CONTROLS)
def test_broken_optimizers_fail(config, steps):
    res = comp.run_component_test(config, SHAPES, steps=steps, **HYPER)
    assert not res.passed
    assert res.worst_error > res.bound
    assert res.to_record()["result"] == "fail"


def test_partial_offload_and_16bit_moments():
    half = comp.run_component_test("cpu_offload", SHAPES, steps=3, offload_fraction=0.5, **HYPER)
    assert half.passed
    n_off = int(half.checks["offloaded tensors"].split("/")[0])
    assert 0 < n_off < len(SHAPES)
    # bf16 m/v lose precision: worse than fp32 m/v, measurably.
    bf16_mv = comp.run_component_test("precision_aware", SHAPES, steps=3, exp_avg_dtype="bf16",
                                      exp_avg_sq_dtype="bf16", **HYPER)
    assert not bf16_mv.checks["masters bitwise equal to the default's fp32 masters"]
    assert bf16_mv.worst_error > 2 * bf16_mv.default_worst_error
    with pytest.raises(ValueError):
        comp.run_component_test("nope", SHAPES)


# --------------------------------------------------------------------------------------------
# numerics rules

SEED_ARGS = """python3 train.py --actor-num-nodes 1 --actor-num-gpus-per-node 8 \\
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 \\
  --decoder-first-pipeline-num-layers 16 --decoder-last-pipeline-num-layers 14 \\
  --recompute-granularity full --recompute-method block --recompute-num-layers 12 \\
  --optimizer adam --lr 1e-5 --lr-decay-style cosine --min-lr 1e-6 --weight-decay 0.1 \\
  --adam-beta1 0.9 --adam-beta2 0.98 --use-distributed-optimizer \\
  --use-precision-aware-optimizer --prompt-data "$SFT_DATA" --global-batch-size 128"""


def test_rules_load_and_every_entry_is_classed():
    rules = load_rules()
    assert len(rules.args) > 50 and rules.patterns
    for rule in list(rules.args.values()) + list(rules.patterns):
        assert rule.cls in ("layout", "numerics")
        assert all(t in rules.tests for t in rule.requires)
    assert rules.lookup("--recompute-granularity").cls == "layout"
    assert rules.lookup("--lr-warmup-fraction").cls == "numerics"
    assert rules.lookup("--expert-model-parallel-size").cls == "layout"
    assert rules.lookup("--totally-new-flag") is None


def test_parse_args_forms_agree():
    from_str = parse_args(SEED_ARGS)
    assert from_str["--lr"] == "1e-5" and from_str["--use-distributed-optimizer"] == "true"
    assert from_str["--prompt-data"] == "$SFT_DATA"
    assert "train.py" not in from_str.values()
    assert parse_args(["--lr=1e-5", "--bf16"]) == {"--lr": "1e-5", "--bf16": "true"}
    assert parse_args({"tensor_model_parallel_size": 2}) == {"--tensor-model-parallel-size": "2"}


def test_lr_change_requires_a_numerics_test():
    diffs = diff_args(SEED_ARGS, SEED_ARGS.replace("--lr 1e-5", "--lr 2e-5"))
    assert [(d.flag, d.reference, d.candidate, d.cls) for d in diffs] == [
        ("--lr", "1e-5", "2e-5", "numerics")]
    need = required_tests(diffs)
    assert "convergence" in need and need - {"convergence"}
    reasons = unverified_reasons(diffs, {"convergence": True})
    assert len(reasons) == 1 and "--lr" in reasons[0] and "did not run" in reasons[0]
    # The same value written differently is no difference.
    assert diff_args(SEED_ARGS, SEED_ARGS.replace("--lr 1e-5", "--lr 0.00001")) == []


def test_tp_change_requires_only_convergence():
    cand = SEED_ARGS.replace("--tensor-model-parallel-size 1", "--tensor-model-parallel-size 4"
                             " --sequence-parallel")
    diffs = diff_args(SEED_ARGS, cand)
    assert {d.flag for d in diffs} == {"--tensor-model-parallel-size", "--sequence-parallel"}
    assert all(d.cls == "layout" for d in diffs)
    assert required_tests(diffs) == {"convergence"}
    assert unverified_reasons(diffs, {"convergence": True}) == []
    assert unverified_reasons(diffs, {"convergence": False}) == ["the convergence check failed"]
    assert "did not run" in unverified_reasons(diffs, {})[0]
    # No difference at all still needs the convergence check.
    assert required_tests([]) == {"convergence"}


def test_defaults_absent_flags_and_optimizer_changes():
    # An absent flag equals its default; a dropped switch is a difference.
    assert diff_args(SEED_ARGS, SEED_ARGS + " --context-parallel-size 1") == []
    diffs = diff_args(SEED_ARGS, SEED_ARGS.replace("--use-precision-aware-optimizer", ""))
    assert [(d.flag, d.reference, d.candidate) for d in diffs] == [
        ("--use-precision-aware-optimizer", "true", "false")]
    assert required_tests(diffs) == {"convergence", "component:optimizer"}
    assert unverified_reasons(diffs, {"convergence": True, "component:optimizer": True}) == []
    assert "failed" in unverified_reasons(
        diffs, {"convergence": True, "component:optimizer": False})[0]
    offload = diff_args(SEED_ARGS, SEED_ARGS + " --optimizer-cpu-offload")
    assert offload[0].cls == "layout" and "component:optimizer" in required_tests(offload)


def test_unknown_flag_warns_and_needs_convergence():
    with pytest.warns(UnknownArgumentWarning, match="--brand-new-knob"):
        diffs = diff_args(SEED_ARGS, SEED_ARGS + " --brand-new-knob 3")
    assert len(diffs) == 1 and diffs[0].cls == "unknown" and diffs[0].warning
    assert required_tests(diffs) == {"convergence"}
    assert unverified_reasons(diffs, {"convergence": True}) == []
