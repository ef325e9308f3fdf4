"""Low-precision kernels beyond the GEMMs (issue 22): activations quantized in each orientation the GEMMs read,
FP8 dot-product attention and TE's fused MXFP8 grouped MLP as Megatron-Bridge's recipes turn them on, and the
corpus rows that carry them (the release's recipe), predicted by a fit that never saw a row running them."""

import re
from dataclasses import replace

import pytest

from attune.calibrate.corpus import default_corpus_dir, load_corpus, read_file, read_row
from attune.calibrate.fit import current
from attune.calibrate.precision_fit import fit_precision, groups_markdown
from attune.calibrate.report import predict_row
from attune.estimator import estimate
from attune.estimator import moe as moe_terms
from attune.estimator import precision as lp_terms
from attune.estimator.coefficients import coefficients_for
from attune.estimator.costs import BF16, Shape
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import load_model
from attune.spec.precision import fields_for, recipe_of

CORPUS = default_corpus_dir()
needs_corpus = pytest.mark.skipif(CORPUS is None, reason="shared/measurements is not beside this checkout")

MOE = load_model("Qwen3-30B-A3B")
MX = Layout(ep=8, dp=8, moe_grouped_gemm=True, moe_permute_fusion=True, distributed_optimizer=True,
            **fields_for("mxfp8"))
WL = Workload(seq_length=4096, global_batch=64)


def test_quantized_activations_are_written_in_each_orientation_the_gemms_read():
    b200, h100 = parse_cluster("8xB200").gpu, parse_cluster("8xH100").gpu
    lay = Layout()
    # MXFP8 1x32 scales run along one axis: row-wise and column-wise copies from the bf16 tensor (TE recipe docs)
    mx = lp_terms.plan(replace(lay, **fields_for("mxfp8")), b200, coefficients_for(b200))
    assert mx.act_copies == 2 and mx.quantize_bytes == pytest.approx(BF16 + 2 * (1 + 1 / 32))
    # Blackwell reads a tensor-scaled fp8 tensor in either layout: one copy (plus the amax read of current scaling)
    ts = lp_terms.plan(replace(lay, **fields_for("fp8-tensorwise")), b200, coefficients_for(b200))
    assert ts.act_copies == 1 and ts.quantize_bytes == pytest.approx(2 * BF16 + 1)
    # Hopper's fp8 GEMMs take TN only: the transpose is written too
    hop = lp_terms.plan(replace(lay, **fields_for("fp8-tensorwise")), h100, coefficients_for(h100))
    assert hop.act_copies == 2 and hop.quantize_bytes == pytest.approx(2 * BF16 + 2)
    bw = lp_terms.plan(replace(lay, **fields_for("fp8-blockwise")), h100, coefficients_for(h100))
    assert bw.quantize_bytes == pytest.approx(BF16 + 2 * (1 + 4 / 128))
    # NVFP4: half a byte and an E4M3 scale per 16 elements, both orientations, and the per-tensor amax read first
    fp4 = lp_terms.plan(replace(lay, **fields_for("nvfp4")), b200, coefficients_for(b200))
    assert fp4.quantize_bytes == pytest.approx(2 * BF16 + 2 * (0.5 + 1 / 16))


def _step(layout, engine, gpus="8xB200"):
    return estimate(MOE, parse_cluster(gpus), layout, WL, engine).perf


def test_fp8_attention_speeds_up_the_attention_kernels_only_with_low_precision():
    coef = coefficients_for(parse_cluster("8xB200").gpu)
    base = get_engine("megatron-bridge")
    fast = replace(base, fp8_attention=True)
    a, b = _step(MX, base).breakdown.compute_s, _step(MX, fast).breakdown.compute_s
    for k in ("fwd_attention", "bwd_attention"):
        assert b[k] == pytest.approx(a[k] / coef.fp8_attention_speedup)
    assert b["fwd_gemm"] == pytest.approx(a["fwd_gemm"])
    # a bf16 layout never enters the low-precision terms: the recipe flag changes nothing
    bf = replace(MX, **fields_for("bf16"))
    assert _step(bf, fast).step_time_s == _step(bf, base).step_time_s


def test_fused_grouped_mlp_drops_the_experts_activation_and_fc2_quantize_passes():
    cl = parse_cluster("8xB200")
    coef = coefficients_for(cl.gpu)
    shape = Shape(1, False, 1, 8192, 4096)
    moe_t = moe_terms.moe_layer_times(MOE, cl, MX, shape, coef)
    p = lp_terms.plan(MX, cl.gpu, coef)
    peak, hbm = cl.gpu.bf16_tflops * 1e12, cl.gpu.hbm_gbps * 1e9
    plain = lp_terms.moe_times(moe_t, MOE, MX, shape, p, peak, hbm, coef)
    fused = lp_terms.moe_times(moe_t, MOE, MX, shape, p, peak, hbm, coef, fused=True)
    R = moe_terms.routed_tokens(MX, shape, MOE.moe.top_k)
    fc2_quant = p.quantize_bytes * R * MOE.moe.expert_ffn / (hbm * coef.hbm_efficiency)
    assert plain["fwd_memory"] - fused["fwd_memory"] == pytest.approx(moe_t["fwd_act_memory"] + fc2_quant)
    assert fused["fwd_gemm"] == plain["fwd_gemm"] and fused["fwd_memory"] > 0
    # the fused kernel takes block-scaled MXFP8 / NVFP4 operands: not a tensor-scaled fp8 recipe
    eng = replace(get_engine("megatron-bridge"), fused_grouped_mlp=True)
    assert lp_terms.fused_grouped_mlp(p, eng) and not lp_terms.fused_grouped_mlp(p, get_engine("megatron-bridge"))
    ts = lp_terms.plan(replace(MX, **fields_for("fp8-tensorwise")), cl.gpu, coef)
    assert not lp_terms.fused_grouped_mlp(ts, eng)
    assert _step(MX, eng).step_time_s < _step(MX, get_engine("megatron-bridge")).step_time_s


def _release(r) -> tuple[int, int]:
    m = re.search(r"mbridge-perf-summary-(\d+)\.(\d+)", r.series)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@needs_corpus
def test_corpus_rows_carry_their_release_recipe_and_a_fit_without_them_predicts_them():
    corpus = load_corpus(CORPUS, include_seed=False)
    by_id = {r.id: r for r in corpus.expressed}
    new = by_id["mbridge-26.06-pretrain-qwen3_235b_a22b-dgx-gb200-256g-mxfp8-gbs8192"]
    old = by_id["mbridge-26.04-pretrain-qwen3_235b_a22b-dgx-gb200-256g-mxfp8-gbs8192"]
    # Megatron-Bridge v0.5.0's QWEN3_235B_A22B_PRETRAIN_CONFIG_GB200_FP8_MX_V2 (the 256-GPU recipe the row ran)
    assert new.engine.fp8_attention and new.engine.fused_grouped_mlp and new.engine.cuda_graphs == "full"
    assert new.layout.moe_ep_overlap and new.layout.fp8_param_gather  # bf16_with_mxfp8_mixed: fp8_param_gather
    assert not old.engine.fp8_attention and not old.engine.fused_grouped_mlp and old.engine.cuda_graphs == "scoped"
    ds = by_id["mbridge-26.06-pretrain-deepseekv3-dgx-gb200-256g-mxfp8-gbs4096"]
    assert ds.engine.fused_grouped_mlp and not ds.engine.fp8_attention  # DeepSeek-V3's GB200 MXFP8 recipe
    # fitted on the releases before the kernels (26.04.01 and earlier), the rows of 26.06 on that follow their recipe
    low = [r for r in corpus.expressed if r.low_precision and r.has_throughput]
    before = [r for r in low if _release(r) < (26, 6)]
    res = fit_precision(corpus, current(), before)
    held = [r for r in low if _release(r) >= (26, 6) and "qwen3_235b" in r.id]
    assert len(held) >= 6 and all(r.engine.fp8_attention for r in held)
    errs = [predict_row(r, res.coefficients.for_row(r)).error for r in held]
    mape = sum(abs(e) for e in errs) / len(errs)
    assert mape < 0.12, f"Qwen3-235B-A22B MXFP8 on GB200 / GB300, 26.06 and later, held out: {100 * mape:.1f}%"


@needs_corpus
def test_a_figure_its_source_marks_as_a_known_regression_is_not_fitted():
    rows = {r["id"]: r for r in read_file(CORPUS / "moe.yaml")}
    bad = rows["mbridge-26.06.01-pretrain-gpt_oss_120b-dgx-gb200-64g-mxfp8-gbs1280"]
    r = read_row(bad, "moe.yaml")
    assert not r.expressed and r.reason.startswith("known performance regression") and "cudnn-frontend" in r.reason
    # the same figure without the source's footnote marker, or the next release's figure, is read as usual
    unmarked = {k: (v.replace("[^gpt-oss-note]", "") if isinstance(v, str) else v) for k, v in bad.items()}
    assert read_row(unmarked, "moe.yaml").expressed
    assert read_row(rows["mbridge-26.08-pretrain-gpt_oss_120b-dgx-gb200-64g-mxfp8-gbs1280"], "moe.yaml").expressed


@needs_corpus
def test_report_names_where_the_low_precision_error_is():
    corpus = load_corpus(CORPUS, include_seed=False)
    low = [r for r in corpus.expressed if r.low_precision and r.has_throughput and "qwen3_30b" in r.id]
    preds = [predict_row(r) for r in low]
    text = groups_markdown(preds)
    assert "## Low precision by class, model and GPU" in text
    lines = [x for x in text.splitlines() if x.startswith("| mxfp8 | Qwen3-30B-A3B |")]
    gpus = {x.split(" | ")[2] for x in lines}
    assert any("GB200" in g for g in gpus) and any("GB300" in g for g in gpus)
    shares = [float(x.split(" | ")[-1].rstrip("% |")) for x in lines]
    mx = [p for p in preds if recipe_of(p.row.layout) == "mxfp8"]
    mape = sum(abs(p.error) for p in mx) / len(mx)
    assert sum(shares) == pytest.approx(100 * mape, abs=0.1 * len(shares))  # the shares add up to the class's MAPE
    assert groups_markdown([predict_row(r) for r in corpus.expressed if not r.low_precision][:3]) == ""
