"""DeepSeek-V3 and Kimi K2 (``kimi_k2``), Moonlight: the ``deepseek_v3`` family.

Architecture (transformers ``models/deepseek_v3``: ``DeepseekV3Config``, ``DeepseekV3MoE``,
``DeepseekV3TopkRouter``): multi-head latent attention (``attune.spec.mla``), SwiGLU, RMSNorm, untied output;
``first_k_dense_replace`` dense first layers (and ``moe_layer_freq``), then MoE layers with ``n_shared_experts``
ungated shared experts of ``moe_intermediate_size`` each, a router with ``scoring_func``, the
``e_score_correction_bias`` vector (``topk_method: noaux_tc``), group-limited top-k (``n_group``,
``topk_group``) and ``routed_scaling_factor``; YaRN rope scaling; ``num_nextn_predict_layers``
multi-token-prediction modules (counted in ``total_params``; Megatron ``--mtp-num-layers``).

slime's MODEL_ARGS: scripts/models/deepseek-v3.sh, kimi-k2.sh, moonlight.sh at 624b824a: Megatron's MLA
(``attune.spec.mla.mla_model_args``), ``--ffn-hidden-size`` the dense layers' width, ``--kv-channels`` the value
head dim; YaRN from the config's rope_scaling (``--rotary-scaling-factor``, ``--mscale``, ``--mscale-all-dim``;
slime sets ``--rope-type yarn`` for MLA models in _set_default_megatron_args) and ``--no-rope-fusion``; slime's
MoE arguments with the frozen expert bias (``attune.spec.moe.moe_model_args``).
"""

from __future__ import annotations

from attune.errors import ModelError
from attune.spec.families._hf import flt, moe_basics, moe_pattern, need, num, rope_base, without_experts
from attune.spec.family_registry import Family, register
from attune.spec.mla import mla_from_hf, mla_model_args
from attune.spec.moe import MoESpec, moe_model_args

NAME = "deepseek_v3"


def _moe(cfg: dict, where: str) -> MoESpec:
    experts, top_k, ffn, layers = moe_basics(cfg, where)
    # DeepseekV3DecoderLayer: MoE iff layer_idx >= first_k_dense_replace and layer_idx % moe_layer_freq == 0
    k, f = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
    pattern = moe_pattern(int(i >= k and i % f == 0) for i in range(layers))
    n_shared = int(cfg.get("n_shared_experts") or 0)
    shared = n_shared * ffn  # DeepseekV3MoE.shared_experts: one MLP of moe_intermediate_size x n_shared
    scoring = cfg.get("scoring_func", "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise ModelError(f"{where}: scoring_func '{scoring}' is not modelled; allowed: softmax, sigmoid")
    return MoESpec(family=NAME, experts=experts, top_k=top_k, expert_ffn=ffn, shared_ffn=shared,
                   dense_ffn=int(cfg.get("intermediate_size") or 0) or shared, pattern=pattern, score=scoring,
                   router_bias=cfg.get("topk_method") == "noaux_tc", num_groups=int(cfg.get("n_group") or 0),
                   group_topk=int(cfg.get("topk_group") or 0),
                   topk_scaling=float(cfg.get("routed_scaling_factor") or 0.0), shared_experts=n_shared)


def read(cfg: dict, where: str) -> dict:
    """DeepSeek-V3 / Kimi K2 (transformers DeepseekV3Config): MLA, SwiGLU experts, RMSNorm, untied output."""
    without_experts(cfg, where)
    moe = _moe(cfg, where)
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelError(f"{where}: hidden_act '{act}' is not supported; allowed: silu (SwiGLU)")
    if cfg.get("attention_bias"):
        raise ModelError(f"{where}: {cfg['model_type']} with attention_bias is not modelled; allowed: no attention biases")
    mla = mla_from_hf(cfg, where)
    h = need(cfg, "hidden_size", where)
    heads = need(cfg, "num_attention_heads", where)
    yarn = cfg.get("rope_scaling") or {}
    yarn = yarn if (yarn.get("type") or yarn.get("rope_type")) == "yarn" else {}
    return dict(
        rope_scaling_factor=float(yarn.get("factor") or 0.0),
        rope_mscale=(float(yarn.get("mscale", 1.0)), float(yarn.get("mscale_all_dim", 0.0))) if yarn else (),
        num_layers=need(cfg, "num_hidden_layers", where), hidden=h, ffn=moe.shared_ffn, heads=heads, kv_heads=heads,
        head_dim=mla.qk_head_dim, vocab=need(cfg, "vocab_size", where),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), moe=moe, mla=mla,
        max_positions=cfg.get("max_position_embeddings", 4096), rope_theta=rope_base(cfg),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))


def model_args(m) -> list[str]:
    a = ["--swiglu", "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden),
         "--ffn-hidden-size", str(m.moe.dense_ffn), "--num-attention-heads", str(m.heads),
         "--kv-channels", str(m.mla.v_head_dim), "--position-embedding-type", "rope",
         "--rotary-base", num(m.rope_theta), "--disable-bias-linear", "--normalization", "RMSNorm",
         "--norm-epsilon", num(m.norm_eps), "--vocab-size", str(m.vocab)]
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    a += mla_model_args(m.mla)
    if m.rope_scaling_factor:
        a += ["--rotary-scaling-factor", num(m.rope_scaling_factor), "--mscale", flt(m.rope_mscale[0]),
              "--mscale-all-dim", flt(m.rope_mscale[1])]
    return a + ["--no-rope-fusion"] + moe_model_args(m.moe, m.num_layers, frozen_expert_bias=m.moe.router_bias)


FAMILY = register(Family(name=NAME, hf_types=("deepseek_v3", "kimi_k2"), read=read, model_args=model_args,
                         source="transformers models/deepseek_v3; slime 624b824a scripts/models/deepseek-v3.sh, "
                                "kimi-k2.sh, moonlight.sh",
                         moe_hf_types=("deepseek_v3", "kimi_k2")))
