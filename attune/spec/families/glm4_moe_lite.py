"""GLM-4.7-Flash (30B-A3B): the ``glm4_moe_lite`` family, GLM's MoE with multi-head latent attention.

Architecture (transformers ``models/glm4_moe_lite``: ``Glm4MoeLiteConfig``, ``Glm4MoeLiteAttention``): the
DeepSeek-V3 layout (``attune.spec.mla``: q LoRA, a compressed key/value latent, q_a / kv_a RMSNorms, no
attention biases), ``first_k_dense_replace`` dense first layers of ``intermediate_size``, then MoE layers with a
sigmoid router and ``e_score_correction_bias``, ``n_shared_experts`` ungated shared experts and
``routed_scaling_factor``; RMSNorm, untied output; ``num_nextn_predict_layers`` MTP modules (counted).

slime's MODEL_ARGS: scripts/models/glm4.7-30B-A3B.sh at 624b824a, in its order (the layout writes
``--moe-grouped-gemm`` and ``--moe-permute-fusion``). slime passes ``--add-qkv-bias`` with
``--multi-latent-attention``, as written there; the parameter count follows the checkpoint (no biases).
"""

from __future__ import annotations

from attune.spec.families._hf import deepseek_style_moe, glm_moe_router_args, need, num, rope_theta, silu_only
from attune.spec.family_registry import Family, register
from attune.spec.mla import mla_from_hf

NAME = "glm4_moe_lite"


def read(cfg: dict, where: str) -> dict:
    silu_only(cfg, where)
    mla = mla_from_hf(cfg, where)
    moe = deepseek_style_moe(cfg, NAME, where)
    heads = int(need(cfg, "num_attention_heads", where))
    return dict(num_layers=int(need(cfg, "num_hidden_layers", where)), hidden=int(need(cfg, "hidden_size", where)),
                ffn=moe.shared_ffn, heads=heads, kv_heads=heads, head_dim=mla.qk_head_dim,
                vocab=int(need(cfg, "vocab_size", where)), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                moe=moe, mla=mla, max_positions=int(cfg.get("max_position_embeddings") or 202752),
                rope_theta=rope_theta(cfg), norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))


def model_args(m) -> list[str]:
    moe, mla = m.moe, m.mla
    a = glm_moe_router_args(m)
    a += ["--make-vocab-size-divisible-by", "64",
          "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden), "--ffn-hidden-size", str(moe.dense_ffn),
          "--num-attention-heads", str(m.heads), "--disable-bias-linear", "--add-qkv-bias", "--swiglu"]
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    a += ["--position-embedding-type", "rope", "--no-position-embedding", "--normalization", "RMSNorm",
          "--qk-layernorm", "--multi-latent-attention"]
    if mla.q_lora_rank:
        a += ["--q-lora-rank", str(mla.q_lora_rank)]
    a += ["--kv-lora-rank", str(mla.kv_lora_rank), "--qk-head-dim", str(mla.qk_nope_head_dim),
          "--v-head-dim", str(mla.v_head_dim), "--kv-channels", str(mla.qk_nope_head_dim),
          "--qk-pos-emb-head-dim", str(mla.qk_rope_head_dim), "--vocab-size", str(m.vocab),
          "--rotary-base", num(m.rope_theta), "--no-rope-fusion"]
    return a


FAMILY = register(Family(name=NAME, hf_types=("glm4_moe_lite",), moe_hf_types=("glm4_moe_lite",), read=read, model_args=model_args,
                         source="transformers models/glm4_moe_lite; slime 624b824a scripts/models/glm4.7-30B-A3B.sh"))
