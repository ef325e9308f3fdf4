"""MiniMax-M2 / M2.5 (229B, 62 layers, 256 experts, top-8): the ``minimax_m2`` family.

Architecture (transformers ``models/minimax_m2``: ``MiniMaxM2Config``, ``MiniMaxM2Attention``,
``MiniMaxM2SparseMoeBlock``): GQA without biases, q/k RMSNorm over the whole projection (``q_norm`` of heads x
head_dim, ``k_norm`` of kv_heads x head_dim: ``qk_norm_type`` per_layer), rotary on ``rotary_dim`` of each
head (64 of 128), RMSNorm, untied output layer; every layer MoE: a sigmoid router with
``e_score_correction_bias`` (a buffer in transformers; counted with the router, as attune does for
DeepSeek-V3), ``num_local_experts`` SwiGLU experts of ``intermediate_size``, no shared expert. The released
configs name multi-token-prediction modules (``num_mtp_modules``) that transformers does not build and slime's
MODEL_ARGS do not train; they are not counted.

slime's MODEL_ARGS: scripts/models/minimax-m2.sh at 624b824a, in its order, with slime's Megatron plugin spec
(``slime_plugins.models.minimax_m2``). Layout flags (dispatcher, grouped GEMM, permute fusion) come from the
layout; ``--attention-softmax-in-fp32`` is in every attune launch already (the runtime flags), so it is not
repeated here.
"""

from __future__ import annotations

from attune.errors import ModelError
from attune.spec.families._hf import need, num, rope_theta, silu_only
from attune.spec.family_registry import Family, register
from attune.spec.moe import MoESpec

NAME = "minimax_m2"


def read(cfg: dict, where: str) -> dict:
    silu_only(cfg, where)
    h, heads = int(need(cfg, "hidden_size", where)), int(need(cfg, "num_attention_heads", where))
    head_dim = int(cfg.get("head_dim") or h // heads)
    layers = int(need(cfg, "num_hidden_layers", where))
    if int(cfg.get("shared_intermediate_size") or 0):
        raise ModelError(f"{where}: minimax_m2 with a shared expert is not modelled; allowed: shared_intermediate_size 0")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ModelError(f"{where}: minimax_m2 scoring_func '{cfg.get('scoring_func')}'; allowed: sigmoid")
    rotary = cfg.get("rotary_dim")
    partial = float(rotary) / head_dim if rotary else float(cfg.get("partial_rotary_factor", 1.0))
    ffn = int(need(cfg, "intermediate_size", where))
    moe = MoESpec(family=NAME, experts=int(need(cfg, "num_local_experts", where)),
                  top_k=int(need(cfg, "num_experts_per_tok", where)), expert_ffn=ffn, dense_ffn=ffn, score="sigmoid",
                  router_bias=bool(cfg.get("use_routing_bias", True)))
    return dict(num_layers=layers, hidden=h, ffn=0, heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim, vocab=int(need(cfg, "vocab_size", where)),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), moe=moe,
                max_positions=int(cfg.get("max_position_embeddings") or 196608), rope_theta=rope_theta(cfg),
                rotary_percent=partial, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                qk_norm=bool(cfg.get("use_qk_norm", True)), qk_norm_full=cfg.get("qk_norm_type", "per_layer") == "per_layer")


def model_args(m) -> list[str]:
    moe = m.moe
    a = ["--spec", "slime_plugins.models.minimax_m2", "get_minimax_m2_layer_spec", "--disable-bias-linear",
         "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden), "--ffn-hidden-size", str(moe.dense_ffn),
         "--num-attention-heads", str(m.heads), "--kv-channels", str(m.head_dim), "--num-query-groups", str(m.kv_heads),
         "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--norm-epsilon", num(m.norm_eps),
         "--swiglu"]
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    a += ["--vocab-size", str(m.vocab), "--group-query-attention", "--rotary-percent", num(m.rotary_percent),
          "--rotary-base", num(m.rope_theta)]
    if m.qk_norm:
        a.append("--qk-layernorm")
    a += ["--no-rope-fusion", "--num-experts", str(moe.experts), "--moe-ffn-hidden-size", str(moe.expert_ffn),
          "--moe-router-topk", str(moe.top_k), "--moe-layer-freq", f"[1]*{m.num_layers}", "--moe-router-pre-softmax",
          "--moe-router-score-function", moe.score]
    if moe.router_bias:
        a.append("--moe-router-enable-expert-bias")
    a += ["--moe-router-load-balancing-type", "none", "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0"]
    return a


FAMILY = register(Family(name=NAME, hf_types=("minimax_m2",), moe_hf_types=("minimax_m2",), read=read, model_args=model_args,
                         source="transformers models/minimax_m2; slime 624b824a scripts/models/minimax-m2.sh"))
