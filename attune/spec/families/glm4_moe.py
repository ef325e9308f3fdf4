"""GLM-4.5 / GLM-4.6 / GLM-4.7 (355B-A32B) and GLM-4.5-Air (106B-A12B): the ``glm4_moe`` family.

Architecture (transformers ``models/glm4_moe``: ``Glm4MoeConfig``, ``Glm4MoeAttention``, ``Glm4MoeMoE``): GQA
with q/k/v biases (``attention_bias``) and no o_proj bias, optional per-head q/k RMSNorm (``use_qk_norm``),
rotary on half of each head (``partial_rotary_factor`` 0.5), RMSNorm, untied output layer;
``first_k_dense_replace`` dense SwiGLU layers of ``intermediate_size``, then MoE layers: a sigmoid router with
``e_score_correction_bias``, ``n_routed_experts`` SwiGLU experts of ``moe_intermediate_size`` (top
``num_experts_per_tok``), ``n_shared_experts`` ungated shared experts, ``routed_scaling_factor``;
``num_nextn_predict_layers`` multi-token-prediction modules (counted in the total, as for DeepSeek-V3).

slime's MODEL_ARGS (scripts/models/glm4.5-106B-A12B.sh and glm4.5-355B-A32B.sh at 624b824a), in their order;
``--moe-token-dispatcher-type``, ``--moe-grouped-gemm`` and ``--moe-permute-fusion`` are layout flags (the
layout writes them). Flags slime leaves at Megatron-LM's default (``--norm-epsilon`` 1e-5, no
``--moe-router-topk-scaling-factor`` for a factor of 1) are written only when the config differs.
"""

from __future__ import annotations

from attune.errors import ModelError
from attune.spec.families._hf import deepseek_style_moe, need, num, rope_theta, silu_only, slime_layer_freq
from attune.spec.family_registry import Family, register

NAME = "glm4_moe"
MEGATRON_NORM_EPS = 1e-5  # Megatron-LM --norm-epsilon default (arguments.py _add_network_size_args)


def read(cfg: dict, where: str) -> dict:
    silu_only(cfg, where)
    h, heads = int(need(cfg, "hidden_size", where)), int(need(cfg, "num_attention_heads", where))
    if cfg.get("n_group") not in (None, 1) or cfg.get("topk_group") not in (None, 1):
        raise ModelError(f"{where}: glm4_moe with group-limited routing is not modelled; allowed: n_group 1")
    moe = deepseek_style_moe(cfg, NAME, where)
    return dict(num_layers=int(need(cfg, "num_hidden_layers", where)), hidden=h, ffn=moe.shared_ffn, heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or h // heads),
                vocab=int(need(cfg, "vocab_size", where)), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                moe=moe, max_positions=int(cfg.get("max_position_embeddings") or 131072),
                rope_theta=rope_theta(cfg), rotary_percent=float(cfg.get("partial_rotary_factor", 0.5)),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), qk_norm=bool(cfg.get("use_qk_norm", False)),
                attn_bias=bool(cfg.get("attention_bias", False)),
                mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))


def model_args(m) -> list[str]:
    moe = m.moe
    a = ["--disable-bias-linear"]
    if m.qk_norm:
        a.append("--qk-layernorm")
    a += ["--group-query-attention", "--num-attention-heads", str(m.heads), "--num-query-groups", str(m.kv_heads),
          "--kv-channels", str(m.head_dim), "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden),
          "--ffn-hidden-size", str(moe.dense_ffn)]
    if m.attn_bias:
        a.append("--add-qkv-bias")
    a += ["--normalization", "RMSNorm"]
    if m.norm_eps != MEGATRON_NORM_EPS:
        a += ["--norm-epsilon", num(m.norm_eps)]
    a += ["--position-embedding-type", "rope", "--rotary-percent", num(m.rotary_percent), "--swiglu"]
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    a += ["--vocab-size", str(m.vocab), "--rotary-base", num(m.rope_theta),
          "--moe-ffn-hidden-size", str(moe.expert_ffn)]
    if moe.shared_ffn:
        a += ["--moe-shared-expert-intermediate-size", str(moe.shared_ffn)]
    a += ["--moe-router-pre-softmax", "--moe-router-score-function", moe.score, "--moe-router-enable-expert-bias",
          "--moe-router-bias-update-rate", "0", "--moe-router-load-balancing-type", "seq_aux_loss",
          "--moe-router-topk", str(moe.top_k)]
    if moe.topk_scaling and moe.topk_scaling != 1.0:
        a += ["--moe-router-topk-scaling-factor", num(moe.topk_scaling)]
    a += ["--moe-layer-freq", slime_layer_freq(moe, m.num_layers), "--num-experts", str(moe.experts),
          "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0"]
    return a


FAMILY = register(Family(name=NAME, hf_types=("glm4_moe",), moe_hf_types=("glm4_moe",), read=read, model_args=model_args,
                         source="transformers models/glm4_moe; slime 624b824a scripts/models/glm4.5-106B-A12B.sh, "
                                "glm4.5-355B-A32B.sh"))
