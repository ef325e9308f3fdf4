"""Issue 14, round 3: multi-token-prediction layers (``--mtp-num-layers``) on the last pipeline stage, and the
MoE / MLA selective-recompute modules (``moe``, ``moe_act``, ``shared_experts``, ``mla_up_proj``) in memory and
time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from attune.errors import LayoutError
from attune.estimator import estimate
from attune.estimator import moe as moe_terms
from attune.estimator.costs import FP32, Shape, layer_costs
from attune.estimator.metrics import model_flops_utilization
from attune.estimator.offload import recompute_freed_bytes
from attune.runners.slime.launch import slime_command
from attune.spec.engine import get_engine
from attune.spec.flags import from_flags, to_flags
from attune.spec.hardware import GiB, parse_cluster
from attune.spec.knobs import honoured, not_honoured
from attune.spec.layout import Layout, Workload
from attune.spec.model import DENSE, FULL, load_model
from attune.spec.placement import mtp_layer_params, stage_params
from attune.spec.rules import check, validate

SLIME = get_engine("slime")
WL_DS = Workload(seq_length=4096, global_batch=512)
WL = Workload(seq_length=8192, global_batch=128)
# DeepSeek-V3 on 256 H200: TP 2 with SP, PP 8 (7 / 8 x 6 / 6 layers), EP 32
DS_LAYOUT = Layout(tp=2, sp=True, pp=8, first=7, last=6, dp=16, ep=32, moe_dispatcher="alltoall",
                   moe_grouped_gemm=True, max_tokens_per_gpu=4096, precision_aware_optimizer=True)
QWEN_MOE_LAYOUT = Layout(dp=8, ep=8, moe_dispatcher="alltoall", moe_grouped_gemm=True, max_tokens_per_gpu=8192,
                         precision_aware_optimizer=True)


@pytest.fixture(scope="module")
def ds():
    return load_model("DeepSeek-V3")


@pytest.fixture(scope="module")
def qwen_moe():
    return load_model("Qwen3-30B-A3B")


@pytest.fixture(scope="module")
def dense():
    return load_model("Qwen3.6-27B")


@pytest.fixture(scope="module")
def c256():
    return parse_cluster("256xH200")


@pytest.fixture(scope="module")
def c8():
    return parse_cluster("8xH200")


# ---------------------------------------------------------------------- multi-token prediction
def test_mtp_adds_parameters_and_activations_on_the_last_stage_only(ds, c256):
    base = estimate(ds, c256, DS_LAYOUT, WL_DS, SLIME)
    mtp = estimate(ds, c256, replace(DS_LAYOUT, mtp_layers=1), WL_DS, SLIME)
    last = DS_LAYOUT.pp - 1
    for a, b in zip(base.memory.stages[:last], mtp.memory.stages[:last]):
        assert b.to_dict() == a.to_dict()  # every stage but the last is untouched
    a, b = base.memory.stages[last], mtp.memory.stages[last]
    # parameters: one MTP layer's dense part (eh_proj split by TP, the norms, the MoE decoder layer's dense part)
    costs = layer_costs(ds, SLIME, Shape(2, True, 1, 4096, 4096))
    per_gpu = costs[FULL].params_on_gpu + 2 * ds.hidden * ds.hidden / 2 + 3 * ds.norm_vectors
    assert b.params - a.params == pytest.approx(per_gpu)
    assert mtp_layer_params(ds, DS_LAYOUT, lambda k: costs[k].params_on_gpu) == pytest.approx(per_gpu)
    # its routed experts (DeepSeek-V3's last layer is an MoE layer): all experts / EP
    assert b.expert_params - a.expert_params == pytest.approx(moe_terms.expert_params_per_layer(ds, DS_LAYOUT))
    # activations: the MTP layer's saved tensors; logits: a second fp32 [tokens, vocab / TP] tensor
    assert b.activations_gib > a.activations_gib + 0.1
    assert b.logits_gib - a.logits_gib == pytest.approx(FP32 * 4096 * ds.vocab / 2 / GiB)
    assert b.total_gib > a.total_gib + 1.0
    # time: the last stage does more per microbatch, the others the same; MFU stays on the main model
    pa, pb = base.perf.stages, mtp.perf.stages
    assert [s.forward_s for s in pb[:last]] == [s.forward_s for s in pa[:last]]
    assert pb[last].forward_s > pa[last].forward_s and pb[last].backward_s > pa[last].backward_s
    assert mtp.perf.mfu == pytest.approx(
        model_flops_utilization(mtp.perf.tokens_per_s_per_gpu, ds, c256.gpu))


def test_mtp_stage_parameters_add_up_to_the_checkpoint(ds):
    lay = replace(DS_LAYOUT, mtp_layers=1)
    # unsharded: the layers, embedding, output layer and the MTP module: every parameter of the HF config
    assert sum(stage_params(ds, lay, r) for r in range(lay.pp)) == ds.total_params
    assert sum(stage_params(ds, DS_LAYOUT, r) for r in range(lay.pp)) == ds.total_params - ds.mtp_params


def test_mtp_is_refused_on_a_model_without_mtp_modules(qwen_moe, ds):
    lay = replace(QWEN_MOE_LAYOUT, mtp_layers=1)
    msgs = check(lay, qwen_moe, 8, WL, SLIME)
    assert len(msgs) == 1 and "\n" not in msgs[0]
    assert msgs[0].startswith("--mtp-num-layers 1 needs a model with that many multi-token-prediction modules")
    assert "Qwen3-30B-A3B has 0" in msgs[0] and msgs[0].endswith("allowed: 0")
    with pytest.raises(LayoutError):
        validate(lay, qwen_moe, 8, WL, SLIME)
    # at most the model's count (DeepSeek-V3 ships one)
    assert any("allowed: 0 or 1" in m for m in check(replace(DS_LAYOUT, mtp_layers=2), ds, 256, WL_DS, SLIME))
    assert check(replace(DS_LAYOUT, mtp_layers=1), ds, 256, WL_DS, SLIME) == []
    with pytest.raises(LayoutError):
        Layout(mtp_layers=-1)


def test_mtp_flag_round_trips_and_reaches_the_slime_launch(ds, c256):
    lay = replace(DS_LAYOUT, mtp_layers=1)
    argv = to_flags(lay)
    assert argv[argv.index("--mtp-num-layers") + 1] == "1"
    assert "--mtp-num-layers" not in to_flags(DS_LAYOUT)  # absent: none
    assert from_flags(argv, ds, 256).layout == lay
    cmd = slime_command(ds, c256, lay, WL_DS)
    assert cmd.argv[cmd.argv.index("--mtp-num-layers") + 1] == "1"
    assert "--mtp-num-layers" not in slime_command(ds, c256, DS_LAYOUT, WL_DS).argv


# ---------------------------------------------------------------------- MoE / MLA recompute modules
def _selective(layout: Layout, *modules: str) -> Layout:
    return replace(layout, recompute_granularity="selective", recompute_modules=("core_attn", *modules))


def _peak_acts(est) -> float:
    return max(s.activations_gib for s in est.memory.stages)


@pytest.mark.parametrize("model_name, module", [
    ("Qwen3-30B-A3B", "moe"), ("Qwen3-30B-A3B", "moe_act"),
    ("DeepSeek-V3", "moe"), ("DeepSeek-V3", "moe_act"), ("DeepSeek-V3", "shared_experts"),
    ("DeepSeek-V3", "mla_up_proj"),
])
def test_moe_and_mla_modules_trade_memory_for_time(model_name, module, c8, c256):
    m = load_model(model_name)
    cluster, lay, wl = (c8, QWEN_MOE_LAYOUT, WL) if model_name.startswith("Qwen") else (c256, DS_LAYOUT, WL_DS)
    base = estimate(m, cluster, _selective(lay), wl, SLIME)
    rec = estimate(m, cluster, _selective(lay, module), wl, SLIME)
    assert _peak_acts(rec) < _peak_acts(base)
    assert rec.memory.peak_gib < base.memory.peak_gib
    assert rec.perf.step_time_s > base.perf.step_time_s
    assert rec.perf.breakdown.compute_s["recompute"] > base.perf.breakdown.compute_s["recompute"]
    if module in ("moe", "moe_act"):  # the memory breakdown's expert activations shrink too
        assert max(s.expert_activations_gib for s in rec.memory.stages) < max(
            s.expert_activations_gib for s in base.memory.stages)


def test_moe_recompute_frees_what_moe_act_and_shared_experts_free(ds):
    costs = moe_terms.with_expert_activations(layer_costs(ds, SLIME, Shape(2, True, 1, 4096, 4096)), ds, DS_LAYOUT,
                                              Shape(2, True, 1, 4096, 4096))

    def freed(*mods):
        return recompute_freed_bytes(costs[FULL], FULL, _selective(DS_LAYOUT, *mods), ds, SLIME)

    assert freed("moe") > freed("moe_act") + freed("shared_experts") > freed() == 0.0
    assert freed("moe", "moe_act", "shared_experts") == freed("moe")  # the whole layer covers its parts
    assert freed("moe_act") == pytest.approx(sum(t.bytes for t in costs[FULL].saved
                                                 if t.name.startswith("expert SwiGLU output")))
    # DeepSeek-V3's three dense first layers have no experts: the MoE modules free nothing there, mlp does
    dk = FULL + DENSE
    assert recompute_freed_bytes(costs[dk], dk, _selective(DS_LAYOUT, "moe", "moe_act"), ds, SLIME) == 0.0
    assert recompute_freed_bytes(costs[dk], dk, _selective(DS_LAYOUT, "mlp"), ds, SLIME) > 0.0
    assert recompute_freed_bytes(costs[dk], dk, _selective(DS_LAYOUT, "mla_up_proj"), ds, SLIME) > 0.0


def test_where_the_modules_act(ds, qwen_moe, dense):
    assert honoured("moe", FULL, ds, SLIME) and not honoured("moe", FULL + DENSE, ds, SLIME)
    assert honoured("shared_experts", FULL, ds, SLIME) and not honoured("shared_experts", FULL, qwen_moe, SLIME)
    assert honoured("mla_up_proj", FULL + DENSE, ds, SLIME) and not honoured("mla_up_proj", FULL, qwen_moe, SLIME)
    # megatron-core recomputes a dense MLP only: mlp acts in DeepSeek-V3's dense layers, not in its MoE layers
    assert honoured("mlp", FULL + DENSE, ds, SLIME) and not honoured("mlp", FULL, ds, SLIME)
    assert not_honoured(("mlp",), ds, SLIME) == [
        "mlp has no effect in the MoE layers (megatron-core recomputes dense MLPs only; the MoE layers take moe, "
        "moe_act, shared_experts); attune models it as not recomputed/offloaded there"]
    assert "the dense-MLP layers" in not_honoured(("moe_act",), ds, SLIME)[0]
    assert "MoE layers have no shared expert" in not_honoured(("shared_experts",), qwen_moe, SLIME)[0]
    assert not_honoured(("moe", "mla_up_proj", "core_attn"), ds, SLIME) == [not_honoured(("moe",), ds, SLIME)[0]]


@pytest.mark.parametrize("module", ["moe", "moe_act", "shared_experts", "mla_up_proj"])
def test_moe_and_mla_modules_do_nothing_on_a_dense_model(module, dense, c8):
    lay = Layout(tp=2, pp=2, dp=2, max_tokens_per_gpu=8192, precision_aware_optimizer=True)
    base = estimate(dense, c8, _selective(lay), WL, SLIME, check_layout=False)
    rec = estimate(dense, c8, _selective(lay, module), WL, SLIME, check_layout=False)
    assert rec.memory.peak_gib == base.memory.peak_gib and rec.perf.step_time_s == base.perf.step_time_s
    note = not_honoured((module,), dense, SLIME)
    assert len(note) == 1 and note[0].startswith(f"{module} has no effect in any layer (a ")
    # refused outright on a dense model (rules.check_knobs; megatron-core TransformerConfig raises for mla_up_proj)
    want = "needs a multi-latent-attention model" if module == "mla_up_proj" else "need a mixture-of-experts model"
    assert any(want in x for x in check(_selective(lay, module), dense, 8, WL, SLIME))


def test_megatron_refusals_of_the_moe_modules(qwen_moe, ds):
    overlap = replace(_selective(DS_LAYOUT, "shared_experts"), moe_shared_expert_overlap=True)
    assert "recompute module shared_experts cannot work with --moe-shared-expert-overlap" in check(
        overlap, ds, 256, WL_DS, SLIME)
    # MTP under uniform full recompute: megatron-core asserts one layer per group; block recompute skips MTP
    uni = replace(DS_LAYOUT, mtp_layers=1, recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=2)
    assert any("needs --recompute-num-layers 1" in x for x in check(uni, ds, 256, WL_DS, SLIME))
    assert check(replace(uni, recompute_num_layers=1), ds, 256, WL_DS, SLIME) == []


def test_mtp_under_full_recompute_keeps_its_inputs_only_with_the_uniform_method(ds, c256):
    def added(**rec):
        lay = replace(DS_LAYOUT, **rec)
        a = estimate(ds, c256, lay, WL_DS, SLIME).memory.stages[-1].activations_gib
        return estimate(ds, c256, replace(lay, mtp_layers=1), WL_DS, SLIME).memory.stages[-1].activations_gib - a

    none = added()
    uniform = added(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    block = added(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    # uniform: the MTP layer keeps its two inputs; block: megatron-core skips MTP recompute (the layer keeps all)
    assert 0 < uniform < none / 4
    assert block > uniform
