"""GPT-OSS-120B / -20B: the ``gpt_oss`` family.

Architecture (transformers ``models/gpt_oss``: ``GptOssConfig``, ``GptOssAttention``, ``GptOssExperts``,
``GptOssTopKRouter``): GQA with q/k/v/o biases and learned per-head attention sinks, alternating sliding-window
(layer kind ``SLIDING``, ``window``) and full layers (``layer_types``), every layer MoE with experts of
``intermediate_size`` with biases (``gate_up_proj_bias`` 2 x ffn, ``down_proj_bias`` hidden), a router with a
bias, clamped SwiGLU (``swiglu_limit``: numerics, plus the clamp's HBM passes), no shared expert, RMSNorm, untied output.

No slime launch: its Megatron flags (sliding window, learnable attention sinks, output-projection bias, clamped
SwiGLU) are not in attune's flag table's sources to check.
"""

from __future__ import annotations

from attune.errors import ModelError
from attune.spec.families._hf import moe_basics, need, rope_base, without_experts
from attune.spec.family_registry import Family, register
from attune.spec.moe import MoESpec

NAME = "gpt_oss"


def read(cfg: dict, where: str) -> dict:
    """GPT-OSS (transformers GptOssConfig): GQA with q/k/v/o biases and sinks, alternating sliding-window and
    full attention (``layer_types``), biased experts and router, RMSNorm, untied output."""
    without_experts(cfg, where)
    experts, top_k, ffn, _ = moe_basics(cfg, where, "intermediate_size")
    # Megatron's GPT-OSS: the dense width is the expert width
    moe = MoESpec(family=NAME, experts=experts, top_k=top_k, expert_ffn=ffn, dense_ffn=ffn, router_bias=True,
                  expert_bias=True, activation_clamp=float(cfg.get("swiglu_limit") or 0.0))
    h = need(cfg, "hidden_size", where)
    heads = need(cfg, "num_attention_heads", where)
    layers = need(cfg, "num_hidden_layers", where)
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ModelError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad:
        raise ModelError(f"{where}: layer_types {bad} are not modelled; allowed: sliding_attention, full_attention")
    window = int(cfg.get("sliding_window") or 0)
    if "sliding_attention" in types and window < 1:
        raise ModelError(f"{where}: sliding_attention layers need 'sliding_window' >= 1")
    return dict(
        num_layers=layers, hidden=h, ffn=0, heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or h // heads, vocab=need(cfg, "vocab_size", where),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), moe=moe,
        max_positions=cfg.get("max_position_embeddings", 4096), rope_theta=rope_base(cfg),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), attn_bias=bool(cfg.get("attention_bias", True)),
        attn_out_bias=bool(cfg.get("attention_bias", True)), attn_sinks=True, window=window,
        window_layers=tuple(t == "sliding_attention" for t in types))


FAMILY = register(Family(
    name=NAME, hf_types=("gpt_oss",), read=read, model_args=None, source="transformers models/gpt_oss",
    moe_hf_types=("gpt_oss",),
    launch_refusal="the slime launch of gpt_oss is not written: its Megatron flags (sliding window, learnable "
                   "attention sinks, output-projection bias, clamped SwiGLU) are not in attune's flag table's sources "
                   "to check"))
