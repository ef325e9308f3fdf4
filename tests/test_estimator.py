import pytest

from attune.estimator.coefficients import DEFAULT
from attune.estimator.fit import OBSERVATIONS, fit
from attune.estimator import estimate
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.estimator.memory import estimate_memory
from attune.spec.model import load_model
from attune.estimator.performance import estimate_performance


def test_seed_memory_verdicts(qwen, h200x8, slime, seed_cases, seed_workload):
    est = {k: estimate_memory(qwen, h200x8, v, seed_workload, slime) for k, v in seed_cases.items()}
    assert est["rb12"].fits and est["rb12"].peak_stage == 0
    assert est["rb12"].peak_gib > 0.9 * est["rb12"].capacity_gib  # near the limit
    assert not est["rb10"].fits and est["rb10"].stages[0].total_gib > est["rb10"].capacity_gib
    assert est["rb10"].stages[-1].total_gib < est["rb10"].capacity_gib  # stage 0 is the one that overflows
    assert not est["tp1pp2"].fits and est["tp1pp2"].peak_stage == 1
    assert est["tp1pp2"].stages[0].total_gib < est["tp1pp2"].capacity_gib
    assert est["tp1pp2"].stages[1].logits_gib > 15  # the FP32 logits of a 248,320-token vocabulary
    assert est["slime"].fits and est["slime"].host_needed_gib > 100  # optimizer on the host


def test_seed_throughput_within_10_percent(qwen, h200x8, slime, seed_cases, seed_workload):
    tuned = estimate_performance(qwen, h200x8, seed_cases["rb12"], seed_workload, slime)
    base = estimate_performance(qwen, h200x8, seed_cases["slime"], seed_workload, slime)
    assert tuned.tokens_per_s_per_gpu == pytest.approx(2499.5, rel=0.10)
    assert base.tokens_per_s_per_gpu == pytest.approx(948.7, rel=0.10)
    assert tuned.mfu == pytest.approx(0.3886, rel=0.10)
    assert tuned.usd_per_million_tokens == pytest.approx(0.88, rel=0.10)


def test_fit_reproduces_stored_coefficients():
    coef, report = fit()
    assert coef.gemm_efficiency == pytest.approx(DEFAULT.gemm_efficiency, rel=0.02)
    assert coef.host_optimizer_efficiency == pytest.approx(DEFAULT.host_optimizer_efficiency, rel=0.02)
    assert all(0 < v <= 1 for v in (coef.gemm_efficiency, coef.host_optimizer_efficiency, coef.attention_efficiency))
    for r, o in zip(report, OBSERVATIONS):
        assert r["fits"] == o["fits"]


def test_physics_monotone(qwen, h200x8, slime, seed_workload):
    """More recompute: less memory, more time. More microbatch tokens: more activation memory."""
    base = dict(tp=1, pp=4, dp=2, first=16, last=14, recompute_granularity="full", recompute_method="block",
                max_tokens_per_gpu=8192, precision_aware_optimizer=True)
    prev_mem, prev_t = 1e9, 0
    for n in (4, 8, 12, 16):
        lay = Layout(recompute_num_layers=n, **base)
        m = estimate_memory(qwen, h200x8, lay, seed_workload, slime).peak_gib
        t = estimate_performance(qwen, h200x8, lay, seed_workload, slime).step_time_s
        assert m < prev_mem and t > prev_t
        prev_mem, prev_t = m, t


def test_megatron_engine_shards_gdn(qwen, h200x8, seed_workload):
    from attune.spec.engine import get_engine
    lay = Layout(tp=4, sp=True, pp=2, dp=1, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    s = estimate_memory(qwen, h200x8, lay, seed_workload, get_engine("slime")).stages[0].params
    m = estimate_memory(qwen, h200x8, lay, seed_workload, get_engine("megatron")).stages[0].params
    assert s > 1.5 * m  # slime replicates the GDN mixer on every TP rank


def test_other_models_plausible():
    """Published regime: dense Llama training on H100 in bf16 reaches roughly 35-55% MFU."""
    from attune.spec.engine import get_engine
    m = load_model("Llama-3.1-70B")
    c = parse_cluster("64xH100")
    lay = Layout(tp=8, sp=True, pp=4, dp=2, recompute_granularity="none", max_tokens_per_gpu=8192)
    e = estimate(m, c, lay, Workload(seq_length=8192, global_batch=256), get_engine("megatron"))
    assert 0.30 < e.perf.mfu < 0.60
