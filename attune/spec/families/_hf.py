"""Helpers the family plug-ins share: reading Hugging Face config fields and writing Megatron flag values."""

from __future__ import annotations

from attune.errors import ModelError
from attune.spec import flag_text
from attune.spec.moe import MoESpec


def need(cfg: dict, key: str, where: str):
    """cfg[key], or a one-line ModelError naming the missing field."""
    if cfg.get(key) is None:
        raise ModelError(f"{where}: config is missing the field '{key}'")
    return cfg[key]


def rope_theta(cfg: dict, default: float = 10000.0) -> float:
    """``rope_theta``, or transformers 5's ``rope_parameters.rope_theta``."""
    return float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or default)


def rope_base(cfg: dict) -> float:
    """``rope_theta`` as the families built before the registry read it (a ``rope_parameters`` base of 0 kept)."""
    return float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def silu_only(cfg: dict, where: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelError(f"{where}: hidden_act '{act}' is not supported; allowed: silu (SwiGLU)")


def dense_geometry(cfg: dict, where: str) -> dict:
    """The decoder geometry a Llama-style config states (SwiGLU only): layers, hidden, FFN, heads, KV heads,
    head dim, vocabulary, tied embeddings, positions, rope base, norm epsilon and the QKV bias; a family adds or
    overrides what its own config says."""
    silu_only(cfg, where)
    h, heads = int(need(cfg, "hidden_size", where)), int(need(cfg, "num_attention_heads", where))
    return dict(num_layers=int(need(cfg, "num_hidden_layers", where)), hidden=h,
                ffn=int(need(cfg, "intermediate_size", where)), heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or h // heads),
                vocab=int(need(cfg, "vocab_size", where)), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_positions=int(cfg.get("max_position_embeddings") or 32768), rope_theta=rope_theta(cfg),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), attn_bias=bool(cfg.get("attention_bias", True)))


def llama_style(cfg: dict, where: str, moe: MoESpec | None) -> dict:
    """The fields a Llama-style config states (llama and qwen3_5 families), ``moe`` included; SwiGLU only."""
    h = need(cfg, "hidden_size", where)
    heads = need(cfg, "num_attention_heads", where)
    layers = need(cfg, "num_hidden_layers", where)
    common = dict(
        num_layers=layers, hidden=h, ffn=need(cfg, "intermediate_size", where), heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or h // heads,
        vocab=need(cfg, "vocab_size", where), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), moe=moe,
        max_positions=cfg.get("max_position_embeddings", 4096), rope_theta=rope_base(cfg),
        rotary_percent=float(cfg.get("partial_rotary_factor", 1.0)), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)))
    silu_only(cfg, where)
    return common


# ---------------------------------------------------------------------- mixture of experts
def n_experts(cfg: dict) -> int:
    """Routed experts a config states (``num_experts``, ``num_local_experts`` or ``n_routed_experts``); 0: none."""
    return cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0


def without_experts(cfg: dict, where: str) -> None:
    """A config of an MoE-only model_type without routed experts: a one-line ModelError."""
    if not n_experts(cfg) or n_experts(cfg) <= 1:
        mt = cfg.get("model_type")
        raise ModelError(f"{where}: {mt} without routed experts is not modelled; allowed: its mixture-of-experts "
                         f"configs (n_routed_experts / num_local_experts > 1)")


def moe_basics(cfg: dict, where: str, width_key: str = "moe_intermediate_size") -> tuple[int, int, int, int]:
    """(experts, top-k, expert width, layers) of an MoE config, each missing one a one-line ModelError."""
    experts = n_experts(cfg)
    if not experts:
        raise ModelError(f"{where}: MoE config is missing the field 'num_experts'")
    top_k = cfg.get("num_experts_per_tok")
    if not top_k:
        raise ModelError(f"{where}: MoE config is missing the field 'num_experts_per_tok'")
    ffn = cfg.get(width_key)
    if not ffn:
        raise ModelError(f"{where}: MoE config is missing the expert width ('moe_intermediate_size')")
    layers = cfg.get("num_hidden_layers")
    if not layers:
        raise ModelError(f"{where}: MoE config is missing the field 'num_hidden_layers'")
    return int(experts), int(top_k), int(ffn), int(layers)


def moe_pattern(flags) -> tuple[int, ...]:
    """Per-layer MoE flags as ``MoESpec.pattern``: () when every layer is MoE."""
    pat = tuple(flags)
    return () if all(pat) else pat


def qwen_moe_pattern(cfg: dict, layers: int) -> tuple[int, ...]:
    """Qwen3MoeDecoderLayer (and Qwen3-Next's): MoE iff layer_idx not in mlp_only_layers and
    (layer_idx + 1) % decoder_sparse_step == 0."""
    only = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    return moe_pattern(int(i not in only and (i + 1) % step == 0) for i in range(layers))


def num(x: float | int) -> str:
    """A number as a flag value (``attune.spec.flag_text.number``); a bad one is a ModelError."""
    return flag_text.number(x, ModelError)


def flt(x: float) -> str:
    """A float flag value that stays a float (``attune.spec.flag_text.floating``)."""
    return flag_text.floating(x, ModelError)


def deepseek_style_moe(cfg: dict, family: str, where: str) -> MoESpec:
    """The MoE part of a DeepSeek-style config (GLM-4.5, GLM-4.7-Flash): ``first_k_dense_replace`` dense first
    layers, ``n_shared_experts`` ungated shared experts of ``moe_intermediate_size`` each, a sigmoid router with
    the ``e_score_correction_bias`` vector, group-limited top-k and ``routed_scaling_factor``."""
    layers = int(need(cfg, "num_hidden_layers", where))
    k = int(cfg.get("first_k_dense_replace") or 0)
    if not 0 <= k < layers:
        raise ModelError(f"{where}: first_k_dense_replace {k} must leave at least one of the {layers} layers MoE")
    ffn = int(need(cfg, "moe_intermediate_size", where))
    n_shared = int(cfg.get("n_shared_experts") or 0)
    return MoESpec(family=family, experts=int(need(cfg, "n_routed_experts", where)),
                   top_k=int(need(cfg, "num_experts_per_tok", where)), expert_ffn=ffn, shared_ffn=n_shared * ffn,
                   dense_ffn=int(need(cfg, "intermediate_size", where)),
                   pattern=(0,) * k + (1,) * (layers - k) if k else (), shared_experts=n_shared, score="sigmoid",
                   router_bias=True, num_groups=int(cfg.get("n_group") or 0), group_topk=int(cfg.get("topk_group") or 0),
                   topk_scaling=float(cfg.get("routed_scaling_factor") or 0.0))


def slime_layer_freq(moe: MoESpec, layers: int) -> str:
    """``--moe-layer-freq`` as slime's GLM scripts write it: ``[0]*N_DENSE+[1]*N_MOE`` (or ``[1]*N``), in
    Megatron's accepted characters (arguments.py ``_eval_pattern``)."""
    dense = moe.pattern.count(0) if moe.pattern else 0
    if moe.pattern and moe.pattern != (0,) * dense + (1,) * (layers - dense):
        raise ModelError(f"MoE pattern {moe.pattern} is not dense-first; slime's scripts write [0]*N+[1]*M only")
    return f"[0]*{dense}+[1]*{layers - dense}" if dense else f"[1]*{layers}"


def glm_moe_router_args(m) -> list[str]:
    """The MoE block of slime's GLM-4.7-Flash and GLM-5 MODEL_ARGS, in their order (scripts/models/glm4.7-30B-A3B.sh
    and glm5-744B-A40B.sh at 624b824a): layer pattern, experts, shared expert, top-k with the sigmoid pre-softmax
    router and its frozen expert bias, sequence aux loss, scaling, no aux loss coefficient, fp32 router."""
    moe = m.moe
    a = ["--moe-layer-freq", slime_layer_freq(moe, m.num_layers), "--num-experts", str(moe.experts)]
    if moe.shared_ffn:
        a += ["--moe-shared-expert-intermediate-size", str(moe.shared_ffn)]
    a += ["--moe-router-topk", str(moe.top_k), "--moe-ffn-hidden-size", str(moe.expert_ffn),
          "--moe-router-score-function", moe.score, "--moe-router-pre-softmax", "--moe-router-enable-expert-bias",
          "--moe-router-bias-update-rate", "0", "--moe-router-load-balancing-type", "seq_aux_loss"]
    if moe.topk_scaling and moe.topk_scaling != 1.0:
        a += ["--moe-router-topk-scaling-factor", num(moe.topk_scaling)]
    return a + ["--moe-aux-loss-coeff", "0", "--moe-router-dtype", "fp32"]
