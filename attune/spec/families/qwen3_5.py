"""The Gated DeltaNet hybrids: the ``qwen3_5`` family (Qwen3.5 / Qwen3.6 text models, Qwen3-Next) and its MoE
variants ``qwen3_next`` (Qwen3-Next-80B-A3B) and ``qwen3_5_moe`` (Qwen3.5 / 3.6-35B-A3B).

Architecture (transformers ``models/qwen3_next``, ``qwen3_5``): Gated DeltaNet ("linear attention", layer kind
``LINEAR``) layers with every ``full_attention_interval``-th layer (or where ``layer_types`` says) a gated
full-attention layer (q_proj also emits a per-channel output gate), per-head q/k RMSNorm, zero-centred (1 + w)
RMSNorms, SwiGLU, rotary on part of the head. Text model only. MoE layers (``Qwen3NextSparseMoeBlock``) where
``mlp_only_layers`` / ``decoder_sparse_step`` say, with a shared expert of ``shared_expert_intermediate_size``
scaled by a sigmoid gate.

slime's MODEL_ARGS: scripts/models/qwen3.5-27B.sh (reference slime-and-qwen.md 1.1) in its order, with slime's
Megatron plugin spec (``slime_plugins.models.qwen3_5``, or ``qwen3_next`` for Qwen3-Next), plus slime's MoE
arguments (``attune.spec.moe.moe_model_args``). slime's script also passes ``--use-gated-attention``: its Megatron
patch registers it and nothing reads it (the flag table's no_effect), so the launch leaves it out; the gate itself
is ``--attention-output-gate``.

Layout rules: megatron-core's GDN splits the linear key and value heads over TP x CP (unless the engine replicates
GDN), and slime's Qwen3.5 spec refuses ``--pipeline-model-parallel-layout``.
"""

from __future__ import annotations

from attune.errors import ModelError
from attune.spec.families._hf import llama_style, moe_basics, n_experts, need, num, qwen_moe_pattern, without_experts
from attune.spec.family_registry import Family, register
from attune.spec.layer_kinds import FULL, LINEAR
from attune.spec.moe import MoESpec, moe_model_args

NAME = "qwen3_5"
DENSE_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next")  # qwen3_next without routed experts reads dense
MOE_TYPES = {"qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe"}


def _moe(cfg: dict, family: str, where: str) -> MoESpec:
    experts, top_k, ffn, layers = moe_basics(cfg, where)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    dense_ffn = int(cfg.get("intermediate_size") or 0)
    return MoESpec(family=family, experts=experts, top_k=top_k, expert_ffn=ffn, shared_ffn=shared,
                   shared_gate=shared > 0, dense_ffn=dense_ffn or shared, pattern=qwen_moe_pattern(cfg, layers))


def read(cfg: dict, where: str) -> dict:
    mt = cfg["model_type"]
    moe = None
    if mt in MOE_TYPES and (mt != "qwen3_next" or (n_experts(cfg) and n_experts(cfg) > 1)):
        without_experts(cfg, where)
        moe = _moe(cfg, MOE_TYPES[mt], where)
        cfg = {**cfg, "intermediate_size": moe.shared_ffn}  # the dense-MLP width is the shared expert's (0: none)
    common = llama_style(cfg, where, moe)
    layers = common["num_layers"]
    if "layer_types" in cfg and cfg["layer_types"]:
        kinds = tuple(FULL if t == "full_attention" else LINEAR for t in cfg["layer_types"])
        if len(kinds) != layers:
            raise ModelError(f"{where}: layer_types has {len(kinds)} entries for {layers} layers")
    else:
        every = cfg.get("full_attention_interval", 4)
        kinds = tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(layers))
    return dict(qk_norm=True, attn_output_gate=bool(cfg.get("attn_output_gate", True)), layer_types=kinds,
                lin_k_heads=need(cfg, "linear_num_key_heads", where), lin_v_heads=need(cfg, "linear_num_value_heads", where),
                lin_k_dim=need(cfg, "linear_key_head_dim", where), lin_v_dim=need(cfg, "linear_value_head_dim", where),
                conv_kernel=cfg.get("linear_conv_kernel_dim", 4), **common)


def model_args(m) -> list[str]:
    plugin = "qwen3_next" if m.moe is not None and m.moe.family == "qwen3_next" else "qwen3_5"
    a = ["--spec", f"slime_plugins.models.{plugin}", f"get_{plugin}_spec",
         "--disable-bias-linear", "--qk-layernorm", "--group-query-attention",
         "--num-attention-heads", str(m.heads), "--num-query-groups", str(m.kv_heads),
         "--kv-channels", str(m.head_dim), "--num-layers", str(m.num_layers),
         "--hidden-size", str(m.hidden), "--ffn-hidden-size", str(m.moe.dense_ffn if m.moe else m.ffn)]
    a += ["--normalization", "RMSNorm", "--apply-layernorm-1p", "--position-embedding-type", "rope",
          "--norm-epsilon", num(m.norm_eps), "--rotary-percent", num(m.rotary_percent), "--swiglu"]
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    a += ["--vocab-size", str(m.vocab), "--rotary-base", num(m.rope_theta)]
    if m.attn_output_gate:
        a.append("--attention-output-gate")
    if m.moe is not None:
        a += moe_model_args(m.moe, m.num_layers)
    return a


def layout_rules(layout, model, engine) -> list[str]:
    """megatron-core's GDN shards the linear key and value heads over TP x CP (unless the engine replicates it)."""
    e: list[str] = []
    if not engine.gdn_replicated:
        for n, v in (("linear key heads", model.lin_k_heads), ("linear value heads", model.lin_v_heads)):
            if v % (layout.tp * layout.cp):
                e.append(f"TP x CP = {layout.tp * layout.cp} must divide the {v} {n} (megatron-core GDN)")
    return e


def layout_string_refusal(engine) -> str | None:
    if engine.name == "slime":
        return ("--pipeline-model-parallel-layout: slime's Qwen3.5 spec asserts config.pipeline_model_parallel_layout "
                "is None (slime_plugins/models/qwen3_5.py); use first/last layer counts")
    return None


FAMILY = register(Family(
    name=NAME, hf_types=DENSE_TYPES + ("qwen3_5_moe", "qwen3_5_moe_text"), read=read, model_args=model_args,
    source="transformers models/qwen3_next, qwen3_5; slime 624b824a scripts/models/qwen3.5-27B.sh",
    moe_hf_types=tuple(MOE_TYPES), moe_families=("qwen3_next", "qwen3_5_moe"), zero_centred_norm=True,
    layout_rules=layout_rules, layout_string_refusal=layout_string_refusal,
    crosscheck_refusal="megatron-core's Gated DeltaNet spec needs Transformer Engine; not cross-checked on CPU"))
