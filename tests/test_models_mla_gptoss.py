"""DeepSeek-V3 / Kimi K2 (multi-head latent attention) and GPT-OSS: parameter counts against the published
figures, per-layer dense/MoE split, stage parameters under PP, MLA and sliding-window FLOPs, slime MoE/MLA
arguments and the CLI's per-stage breakdown."""

from __future__ import annotations

import json

import pytest

from attune.cli import main
from attune.estimator import moe as moe_terms
from attune.estimator.costs import Shape, attended_keys, layer_costs
from attune.runners.slime.launch import LaunchError, model_args
from attune.spec.engine import get_engine
from attune.spec.layout import Layout, Workload
from attune.spec.model import DENSE, FULL, SLIDING, from_hf_config, load_model
from attune.spec.moe import moe_model_args
from attune.spec.placement import place, stage_params

B = 1e9
SLIME = get_engine("slime")


# ---------------------------------------------------------------------- parameter counts
def test_deepseek_v3_reproduces_671b_total_and_37b_activated():
    m = load_model("DeepSeek-V3")
    main_model = m.total_params - m.mtp_params
    # DeepSeek-V3 Technical Report (arXiv 2412.19437), abstract: "671B total parameters with 37B activated for
    # each token"; attune: 671,026,419,200 exactly (no MTP)
    assert main_model == 671_026_419_200
    assert abs(main_model - 671 * B) / (671 * B) < 0.005
    unused = 58 * (256 - 8) * 3 * 7168 * 2048
    activated = main_model - unused
    assert activated == 37_552_297_472  # with the input embedding; 36,625,618,432 without
    # the source rounds to whole billions: 37B within its rounding once the input embedding is left out
    assert abs(activated - m.embedding_params - 37 * B) <= 0.5 * B
    # the HF checkpoint's one MTP module: enorm/hnorm, eh_proj Linear(2h, h), one MoE decoder layer, final norm
    assert m.mtp_layers == 1 and m.mtp_params == 2 * 7168 + 2 * 7168 * 7168 + m.layer(60).total + 7168
    assert 11 * B < m.mtp_params < 14 * B  # model card: 14B MTP with the embedding/head copies attune shares


def test_deepseek_v3_layers_dense_then_moe():
    m = load_model("DeepSeek-V3")
    kinds = [m.layer_kind(i) for i in range(m.num_layers)]
    assert kinds[:3] == [FULL + DENSE] * 3 and kinds[3:] == [FULL] * 58
    assert [m.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    dense, moe = m.layer(0), m.layer(3)
    assert dense.expert_matrix == 0 and dense.mlp_matrix == 3 * 7168 * 18432
    # MLA: q_a 7168x1536, q_b 1536x(128x192), kv_a 7168x576, kv_b 512x(128x256), o (128x128)x7168
    mla = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert dense.mixer_matrix == moe.mixer_matrix == mla
    assert moe.mixer_replicated == 7168 * 1536 + 7168 * 576  # the down projections: not TP-split
    # MoE layer: 256 routed experts, one ungated shared expert, router weight + e_score_correction_bias
    assert moe.expert_matrix == 256 * 3 * 7168 * 2048 and moe.active_expert_matrix == 8 * 3 * 7168 * 2048
    assert moe.mlp_matrix == 3 * 7168 * 2048 + 256 * 7168
    assert moe.vectors == 1536 + 512 + 256 + 2 * 7168
    assert m.count_moe(0, 61) == 58 and m.count_types(0, 61) == (61, 0)


def test_kimi_k2_is_the_deepseek_architecture():
    k = load_model("Kimi-K2")
    assert k.model_type == "kimi_k2" and k.family == "deepseek_v3" and k.moe.experts == 384
    assert [k.is_moe_layer(i) for i in range(3)] == [False, True, True] and k.mtp_layers == 0
    # model card: 1T total (about 1.04T), 32B activated; attune 1,026,408,232,448 and 31.7B without the embedding
    assert 1.00e12 < k.total_params < 1.05e12
    assert abs(k.activated_nonembedding_params - 32 * B) <= 0.5 * B


def test_moonlight_mla_without_q_lora():
    # Moonlight-16B-A3B (the corpus's MLA memory rows): q_lora_rank null -> a plain q_proj; published 16B / 3B
    m = load_model("Moonlight-16B-A3B")
    assert m.mla.q_lora_rank == 0 and abs(m.total_params - 16 * B) <= 0.5 * B
    assert abs(m.activated_params - 3 * B) <= 0.5 * B
    assert m.layer(1).mixer_matrix == 2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048
    assert m.layer(1).mixer_replicated == 2048 * 576  # only kv_a is replicated without q LoRA
    c = layer_costs(m, SLIME, Shape(2, True, 1, 4096, 4096))[FULL]
    assert len(c.gemm) == 6 and not any("q latent" in t.name for t in c.saved)
    assert "--q-lora-rank" not in model_args(m)


@pytest.mark.parametrize("name,total,active", [("GPT-OSS-120B", 116.83, 5.13), ("GPT-OSS-20B", 20.91, 3.61)])
def test_gpt_oss_reproduces_the_model_card(name, total, active):
    # OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card" (Aug 2025), Table 1: total 116.83B / 20.91B, active per
    # token 5.13B / 3.61B (active: no input embedding, the unembedding counted)
    m = load_model(name)
    assert round(m.total_params / B, 2) == total
    assert round(m.activated_nonembedding_params / B, 2) == active
    assert m.total_params == {"GPT-OSS-120B": 116_829_156_672, "GPT-OSS-20B": 20_914_757_184}[name]
    lay = m.layer(0)
    # q/k/v/o biases and 64 sinks; router bias; experts with gate_up (2 x 2880) and down (2880) biases
    assert lay.vectors == (4096 + 512 + 512 + 2880) + 64 + m.moe.experts + 2 * 2880
    assert lay.expert_matrix == m.moe.experts * (3 * 2880 * 2880 + 2 * 2880 + 2880)
    assert m.layer_kind(0) == SLIDING and m.layer_kind(1) == FULL and m.window == 128
    assert not m.tied_embeddings and m.vocab == 201088


def test_dense_layers_for_every_family():
    # Qwen3 MoE with mlp_only_layers / decoder_sparse_step: the refusal is gone, the dense layers use intermediate_size
    cfg = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
           "intermediate_size": 32, "mlp_only_layers": [0], "decoder_sparse_step": 1, "hidden_size": 16,
           "num_attention_heads": 2, "num_hidden_layers": 4, "vocab_size": 10}
    m = from_hf_config(cfg)
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert m.layer(0).mlp_matrix == 3 * 16 * 32 and m.layer(0).expert_matrix == 0
    assert m.layer(1).expert_matrix == 8 * 3 * 16 * 8
    assert moe_model_args(m.moe, 4)[-1] == "([0]*1+[1]*3)"
    step2 = from_hf_config({**cfg, "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert [step2.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert moe_model_args(step2.moe, 4)[-1] == "[0,1,0,1]"  # no spaces: Megatron's _eval_pattern refuses them


# ---------------------------------------------------------------------- stages
def test_stage_params_put_the_dense_layers_on_stage_0():
    m = load_model("DeepSeek-V3")
    lay = Layout(pp=4, dp=64, ep=64, first=16, last=15)
    assert sum(stage_params(m, lay, r) for r in range(4)) == m.total_params - m.mtp_params
    pl = place(m, lay, Workload(seq_length=4096, global_batch=256), SLIME)
    assert [s.moe_layers for s in pl.stages] == [13, 15, 15, 15]
    ex = [moe_terms.stage_expert_params(m, lay, s.moe_layers) for s in pl.stages]
    assert ex[0] == 13 * 256 * 3 * 7168 * 2048 / 64 and ex[1] == 15 * 256 * 3 * 7168 * 2048 / 64
    # the dense part of stage 0 carries the three 18432-wide MLPs
    costs = layer_costs(m, SLIME, Shape(1, False, 1, 4096, 4096))
    per = [stage_params(m, lay, r, lambda k: costs[k].params_on_gpu, pl.stages[r].ranges) for r in range(4)]
    dense_mlp, moe_dense = 3 * 7168 * 18432, m.layer(3).matrix - m.layer(3).mixer_matrix
    assert per[0] - m.embedding_params > per[1] + 3 * (dense_mlp - moe_dense) - 16 * 1e6


def test_mla_tp_keeps_the_down_projections_whole():
    m = load_model("DeepSeek-V3")
    c1 = layer_costs(m, SLIME, Shape(1, True, 1, 4096, 4096))[FULL]
    c8 = layer_costs(m, SLIME, Shape(8, True, 1, 4096, 4096))[FULL]
    p = m.layer(3)
    rep = p.mixer_replicated
    assert c8.params_on_gpu == pytest.approx((p.matrix - rep) / 8 + rep + p.vectors)
    assert c1.params_on_gpu == pytest.approx(p.matrix + p.vectors)


# ---------------------------------------------------------------------- FLOPs
def test_mla_attention_flops_use_qk_192_and_v_128():
    m = load_model("DeepSeek-V3")
    T = seq = 4096
    c = layer_costs(m, SLIME, Shape(1, False, 1, T, seq))[FULL]
    # QK^T over 192 and PV over 128 per head, causal (seq / 2 keys on average), 2 FLOPs per multiply-add
    assert c.attn_flops == pytest.approx(2 * T * 128 * (192 + 128) * seq / 2)
    names = " ".join(t.name for t in c.saved)
    assert "compressed kv latent" in names and "q latent" in names and "head dim 192" in names
    # the FlashAttention q, k, v tensors: 128 heads x (2 x 192 + 128)
    qkv = next(t for t in c.saved if t.name.startswith("FlashAttention q, k"))
    assert qkv.bytes == 2 * T * 128 * (2 * 192 + 128)
    # GEMMs: q_a, q_b, kv_a, kv_b, o and the shared expert's fc1, fc2
    assert len(c.gemm) == 7
    assert c.gemm[0][0] == 2 * T * 7168 * 1536 and c.gemm[2][0] == 2 * T * 7168 * 576
    # the dense first layers' MLP is the 18432-wide SwiGLU, the MoE layers' the 2048-wide shared expert
    d = layer_costs(m, SLIME, Shape(1, False, 1, T, seq))[FULL + DENSE]
    assert d.gemm[-1][0] == 2 * T * 18432 * 7168 and c.gemm[-1][0] == 2 * T * 2048 * 7168


def test_sliding_window_flops_smaller_than_full():
    m = load_model("GPT-OSS-120B")
    seq = 8192
    costs = layer_costs(m, SLIME, Shape(1, False, 1, seq, seq))
    full, slide = costs[FULL].attn_flops, costs[SLIDING].attn_flops
    assert full == pytest.approx(4 * seq * 64 * 64 * seq / 2)
    assert slide < full / 30  # about window 128 keys per query against 4096 on average
    assert attended_keys(m, SLIDING, seq) == pytest.approx(128 - 128 * 127 / (2 * seq))
    assert attended_keys(m, SLIDING, 100) == 50  # a row shorter than the window: the causal half
    # memory is unchanged: FlashAttention saves the same tensors either way
    assert costs[FULL].act_bytes == costs[SLIDING].act_bytes


# ---------------------------------------------------------------------- slime arguments
def test_deepseek_v3_slime_arguments():
    a = model_args(load_model("DeepSeek-V3"))
    want = {"--q-lora-rank": "1536", "--kv-lora-rank": "512", "--qk-head-dim": "128", "--qk-pos-emb-head-dim": "64",
            "--v-head-dim": "128", "--moe-router-score-function": "sigmoid", "--moe-router-topk-scaling-factor": "2.5",
            "--moe-router-num-groups": "8", "--moe-router-group-topk": "4", "--moe-layer-freq": "([0]*3+[1]*58)",
            "--ffn-hidden-size": "18432", "--moe-shared-expert-intermediate-size": "2048", "--num-experts": "256"}
    for flag, value in want.items():
        assert a.count(flag) == 1 and a[a.index(flag) + 1] == value, flag
    for s in ("--multi-latent-attention", "--moe-router-enable-expert-bias", "--qk-layernorm"):
        assert s in a
    assert "--moe-shared-expert-gate" not in a
    k = model_args(load_model("Kimi-K2"))
    assert "--moe-router-num-groups" not in k and k[k.index("--moe-layer-freq") + 1] == "([0]*1+[1]*60)"


def test_gpt_oss_slime_launch_is_refused_clearly():
    with pytest.raises(LaunchError, match="gpt_oss is not written"):
        model_args(load_model("GPT-OSS-120B"))


# ---------------------------------------------------------------------- CLI
def test_cli_estimate_deepseek_v3_per_stage_breakdown(capsys):
    main(["estimate", "--model", "DeepSeek-V3", "--gpus", "256xGB200", "--engine", "megatron-bridge", "--seq", "4096",
          "--global-batch", "1024", "--json", "--", "--pipeline-model-parallel-size", "4",
          "--decoder-first-pipeline-num-layers", "16", "--decoder-last-pipeline-num-layers", "15",
          "--expert-model-parallel-size", "64", "--use-distributed-optimizer", "--moe-grouped-gemm",
          "--moe-token-dispatcher-type", "alltoall", "--recompute-granularity", "full", "--recompute-method",
          "uniform", "--recompute-num-layers", "1"])
    out = json.loads(capsys.readouterr().out)
    stages = out["stages"]
    assert len(stages) == 4 and [s["layers"] for s in stages] == [16, 15, 15, 15]
    # stage 0 holds 13 MoE layers' experts, the others 15; every stage has a dense part
    e = [s["experts"]["params"] for s in stages]
    assert e[0] == pytest.approx(e[1] * 13 / 15, rel=1e-9) and e[1] == e[2] == e[3]
    assert all(s["breakdown"]["weights_gib"] > 0 for s in stages)


def test_cli_estimate_gpt_oss_runs(capsys):
    main(["estimate", "--model", "GPT-OSS-120B", "--gpus", "64xH100", "--engine", "megatron-bridge", "--seq", "4096",
          "--global-batch", "512", "--", "--expert-model-parallel-size", "8", "--use-distributed-optimizer",
          "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall", "--recompute-granularity", "full",
          "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    out = capsys.readouterr().out
    assert "expert" in out and "dense" in out and "GPT-OSS-120B" in out
