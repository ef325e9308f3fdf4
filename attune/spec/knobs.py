"""What attune knows about Megatron-LM's module-level memory knobs: the module names of selective recompute
(``--recompute-modules``) and fine-grained activation offloading (``--offload-modules``), and which of them
take effect in which layer type of which engine.

Sources: reference megatron-memory-and-performance.md section 2.2 (the ``--recompute-modules`` names,
default ``core_attn``), issue 15 (the ``--offload-modules`` names at Megatron-LM 1dcf0daf with slime's
patch), slime-and-qwen.md section 1.6 (slime's Qwen3.5 Gated DeltaNet layer replaces Megatron's
self-attention with its own ``HuggingfaceAttention`` module and its own Python RMSNorm, so Megatron's
attention-side checkpoints and offload hooks never see it). MoE and MLA modules: megatron-core
transformer_layer.py (``mlp`` recompute skips an ``MoELayer``), moe/moe_layer.py (``moe``: the whole MoE layer
under ``tensor_parallel.checkpoint``), moe/experts.py (``moe_act``: the experts' activation under
``CheckpointWithoutOutput``), moe/shared_experts.py (``shared_experts``), multi_latent_attention.py
(``mla_up_proj``: the q / kv up projections and rotary under ``CheckpointWithoutOutput``).
"""

from __future__ import annotations

from attune.spec.engine import Engine
from attune.spec.model import FULL, LINEAR, ModelSpec, is_dense_kind, mixer_of

RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
"""``--recompute-modules`` names attune accepts (Megatron's list; the GDN / MHC names belong to
megatron-core's own layers, which slime's Qwen3.5 plugin does not use)."""
MOE_ONLY = frozenset({"moe_act", "moe", "shared_experts", "expert_fc1"})
"""Module names that exist only in the MoE layers of mixture-of-experts models (``honoured``)."""
MLA_ONLY = frozenset({"mla_up_proj"})
"""Module names that exist only in multi-latent attention (DeepSeek-V3, Kimi K2)."""
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
"""``--offload-modules`` names (fine-grained activation offloading)."""


def honoured(module: str, kind: str, model: ModelSpec, engine: Engine, *, fused_norm: bool = True) -> bool:
    """Whether recomputing / offloading ``module`` acts in a layer of kind ``kind`` (``ModelSpec.layer_kind``:
    FULL, SLIDING or LINEAR, with ``DENSE`` appended for the dense-MLP layers of an MoE model; a bare mixer kind
    of an MoE model is one of its MoE layers).

    * MoE modules (megatron-core moe_layer.py / experts.py / shared_experts.py): ``moe`` (the whole MoE layer
      checkpointed), ``moe_act`` (the experts' activation), ``expert_fc1`` (offload only) act in MoE layers;
      ``shared_experts`` in MoE layers that have a shared expert. Not in the dense-MLP layers of an MoE model,
      nor in a dense model.
    * ``mla_up_proj`` (multi_latent_attention.py): in multi-latent-attention layers (every layer of an MLA model).
    * ``mlp``: megatron-core's TransformerLayer recomputes a dense MLP only (it skips an ``MoELayer``), so every
      layer but the MoE layers.
    * ``layernorm`` / ``attn_norm`` / ``mlp_norm``: with Transformer Engine the norm is fused into the next
      linear (TE LayerNormLinear; the layer's norm slot is an IdentityOp), so there is no separate norm to
      checkpoint or hook (``fused_norm``); counted as not acting.
    * attention-side modules (``core_attn``, ``qkv_linear``, ``attn_proj``) in a Gated DeltaNet layer under
      slime: the mixer is slime's own module, not Megatron's SelfAttention, so they do not act.
    """
    moe_layer = model.moe is not None and not is_dense_kind(kind)
    if module in MOE_ONLY:
        return moe_layer and (module != "shared_experts" or model.ffn > 0)
    if module in MLA_ONLY:
        return model.mla is not None and mixer_of(kind) == FULL
    if module == "mlp":
        return not moe_layer
    if module in ("layernorm", "attn_norm", "mlp_norm"):
        return not fused_norm
    if mixer_of(kind) == LINEAR and module in ("core_attn", "qkv_linear", "attn_proj"):
        return not engine.gdn_replicated  # slime's HF GDN module (engine.gdn_replicated) is not Megatron's
    return True


def not_honoured_summary(modules: tuple[str, ...], model: ModelSpec, engine: Engine) -> list[str]:
    """``not_honoured`` grouped: one line per (where, why) naming all its modules."""
    groups: dict[str, list[str]] = {}
    for line in not_honoured(modules, model, engine):
        name, _, rest = line.partition(" has no effect in ")
        groups.setdefault(rest, []).append(name)
    return [f"{', '.join(names)} {'has' if len(names) == 1 else 'have'} no effect in {rest}" for rest, names in groups.items()]


def _why(module: str, model: ModelSpec) -> str:
    if module in MOE_ONLY:
        if model.moe is None:
            return "a mixture-of-experts module; the model has none"
        if module == "shared_experts" and not model.ffn:
            return "the model's MoE layers have no shared expert"
        return "a mixture-of-experts module; these layers have a dense MLP"
    if module in MLA_ONLY:
        return "a multi-latent-attention module; the model has none"
    if module == "mlp":
        return "megatron-core recomputes dense MLPs only; the MoE layers take moe, moe_act, shared_experts"
    if module in ("layernorm", "attn_norm", "mlp_norm"):
        return "Transformer Engine fuses the norm into the next linear"
    return "slime's Gated DeltaNet is its own module, not Megatron's attention"


def not_honoured(modules: tuple[str, ...], model: ModelSpec, engine: Engine) -> list[str]:
    """One line per named module that does not act in some layer kind of this model and engine."""
    kinds = model.kinds
    out = []
    for m in modules:
        dead = [k for k in kinds if not honoured(m, k, model, engine)]
        if not dead:
            continue
        if len(dead) == len(kinds):
            where = "any layer"
        elif all(mixer_of(k) == LINEAR for k in dead):
            where = "the Gated DeltaNet layers"
        elif all(is_dense_kind(k) for k in dead):
            where = "the dense-MLP layers"
        elif model.moe is not None and not any(is_dense_kind(k) for k in dead):
            where = "the MoE layers"
        else:
            where = "the attention layers"
        out.append(f"{m} has no effect in {where} ({_why(m, model)}); attune models it as not recomputed/offloaded there")
    return out
