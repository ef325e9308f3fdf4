"""Llama-style decoders: the ``llama`` family (Llama 3, Mistral, Qwen2 / Qwen2.5, Qwen3) and its MoE variants
``qwen3_moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B) and ``mixtral`` (Mixtral 8x7B).

Architecture (transformers ``models/llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``mixtral``): GQA, SwiGLU, RMSNorm,
rotary positions (Llama-3.1 ``rope_scaling`` rope_type llama3), q/k/v biases for qwen2, per-head q/k RMSNorm for
qwen3 and qwen3_moe. MoE (``MoESpec.family``): ``qwen3_moe`` has no shared expert and MoE layers where
``mlp_only_layers`` / ``decoder_sparse_step`` say (``Qwen3MoeSparseMoeBlock``); ``mixtral`` routes every layer to
experts of ``intermediate_size`` (``MixtralSparseMoeBlock``); ``ffn`` is then the shared expert's width (0).

slime's MODEL_ARGS: Megatron's llama flags as in scripts/models/llama3-8B.sh, qwen3-4B.sh,
llama3.1-8B-Instruct.sh and llama3.2-3B-Instruct.sh at 624b824a, plus slime's MoE arguments
(``attune.spec.moe.moe_model_args``; scripts/models/qwen3-30B-A3B.sh).
"""

from __future__ import annotations

from attune.spec.families._hf import flt, llama_style, moe_basics, num, qwen_moe_pattern, without_experts
from attune.spec.family_registry import Family, register
from attune.spec.moe import MoESpec, moe_model_args

NAME = "llama"
DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = {"qwen3_moe": "qwen3", "mixtral": "mistral"}  # MoE model_type -> the dense type of its decoder


def _moe(cfg: dict, mt: str, where: str) -> MoESpec:
    without_experts(cfg, where)
    if mt == "mixtral":  # every layer MoE; Megatron's Mixtral: the dense width is the expert width
        experts, top_k, ffn, layers = moe_basics(cfg, where, "intermediate_size")
        return MoESpec(family="mixtral", experts=experts, top_k=top_k, expert_ffn=ffn, dense_ffn=ffn)
    experts, top_k, ffn, layers = moe_basics(cfg, where)
    return MoESpec(family="qwen3_moe", experts=experts, top_k=top_k, expert_ffn=ffn,
                   dense_ffn=int(cfg.get("intermediate_size") or 0), pattern=qwen_moe_pattern(cfg, layers))


def read(cfg: dict, where: str) -> dict:
    mt = cfg["model_type"]
    moe = None
    if mt in MOE_TYPES:
        moe = _moe(cfg, mt, where)
        cfg = {**cfg, "intermediate_size": moe.shared_ffn}  # the dense-MLP width is the shared expert's (0: none)
        mt = MOE_TYPES[mt]
    common = llama_style(cfg, where, moe)
    scaling = cfg.get("rope_scaling") or {}
    factor = float(scaling.get("factor") or 0.0) if scaling.get("rope_type") == "llama3" else 0.0
    return dict(qk_norm=mt == "qwen3", attn_bias=mt == "qwen2", rope_scaling_factor=factor, **common)


def geometry(common: dict, positions: str | None, tied_embeddings: bool | None) -> dict:
    """A SwiGLU decoder from a bare geometry: RMSNorm, rotary, no biases, untied."""
    return dict(common, model_type="llama", positions=positions or "rope",
                tied_embeddings=False if tied_embeddings is None else tied_embeddings)


def model_args(m) -> list[str]:
    a = ["--swiglu", "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden),
         "--ffn-hidden-size", str(m.moe.dense_ffn if m.moe else m.ffn), "--num-attention-heads", str(m.heads)]
    if m.kv_heads != m.heads:
        a += ["--group-query-attention", "--num-query-groups", str(m.kv_heads)]
    a += ["--kv-channels", str(m.head_dim), "--position-embedding-type", "rope", "--rotary-base", num(m.rope_theta)]
    if m.rope_scaling_factor:  # Llama 3.1 / 3.2 (slime scripts/models/llama3.1-8B-Instruct.sh, llama3.2-3B-Instruct.sh)
        a += ["--max-position-embeddings", str(m.max_positions), "--use-rope-scaling",
              "--rotary-scaling-factor", flt(m.rope_scaling_factor)]
    if m.rotary_percent != 1.0:
        a += ["--rotary-percent", num(m.rotary_percent)]
    a += ["--disable-bias-linear"]
    if m.attn_bias:
        a.append("--add-qkv-bias")  # qwen2: q/k/v biases only
    a += ["--normalization", "RMSNorm", "--norm-epsilon", num(m.norm_eps), "--vocab-size", str(m.vocab)]
    if m.qk_norm:
        a.append("--qk-layernorm")
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    if m.moe is not None:
        a += moe_model_args(m.moe, m.num_layers)
    return a


FAMILY = register(Family(name=NAME, hf_types=DENSE_TYPES + tuple(MOE_TYPES), read=read, model_args=model_args,
                         source="transformers models/llama, qwen2, qwen3, qwen3_moe, mixtral; slime 624b824a "
                                "scripts/models/llama3-8B.sh, qwen3-4B.sh, qwen3-30B-A3B.sh",
                         moe_hf_types=tuple(MOE_TYPES), moe_families=("qwen3_moe", "mixtral"), mlp="swiglu",
                         geometry=geometry))
