"""What attune knows about Megatron-LM's module-level memory knobs: the module names of selective recompute
(``--recompute-modules``) and fine-grained activation offloading (``--offload-modules``), and which of them
take effect in which layer type of which engine.

Sources: reference megatron-memory-and-performance.md section 2.2 (the ``--recompute-modules`` names,
default ``core_attn``), issue 15 (the ``--offload-modules`` names at Megatron-LM 1dcf0daf with slime's
patch), slime-and-qwen.md section 1.6 (slime's Qwen3.5 Gated DeltaNet layer replaces Megatron's
self-attention with its own ``HuggingfaceAttention`` module and its own Python RMSNorm, so Megatron's
attention-side checkpoints and offload hooks never see it).
"""

from __future__ import annotations

from attune.spec.engine import Engine
from attune.spec.model import FULL, LINEAR, ModelSpec

RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
"""``--recompute-modules`` names attune accepts (Megatron's list; the GDN / MHC names belong to
megatron-core's own layers, which slime's Qwen3.5 plugin does not use)."""
MOE_ONLY = frozenset({"moe_act", "moe", "shared_experts", "expert_fc1"})
"""Module names that exist only in mixture-of-experts layers."""
MLA_ONLY = frozenset({"mla_up_proj"})
"""Module names that exist only in multi-latent attention."""
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
"""``--offload-modules`` names (fine-grained activation offloading)."""


def honoured(module: str, kind: str, model: ModelSpec, engine: Engine, *, fused_norm: bool = True) -> bool:
    """Whether recomputing / offloading ``module`` acts in a layer of type ``kind`` (FULL or LINEAR).

    * MoE and MLA modules: only in such layers; attune's dense models have none.
    * ``layernorm`` / ``attn_norm`` / ``mlp_norm``: with Transformer Engine the norm is fused into the next
      linear (TE LayerNormLinear; the layer's norm slot is an IdentityOp), so there is no separate norm to
      checkpoint or hook (``fused_norm``); counted as not acting.
    * attention-side modules (``core_attn``, ``qkv_linear``, ``attn_proj``) in a Gated DeltaNet layer under
      slime: the mixer is slime's own module, not Megatron's SelfAttention, so they do not act.
    * ``mlp``: Megatron's MLP in every layer type.
    """
    if module in MOE_ONLY or module in MLA_ONLY:
        return False
    if module in ("layernorm", "attn_norm", "mlp_norm"):
        return not fused_norm
    if kind == LINEAR and module in ("core_attn", "qkv_linear", "attn_proj"):
        return not engine.gdn_replicated  # slime's HF GDN module (engine.gdn_replicated) is not Megatron's
    return kind in (FULL, LINEAR)


def not_honoured_summary(modules: tuple[str, ...], model: ModelSpec, engine: Engine) -> list[str]:
    """``not_honoured`` grouped: one line per (where, why) naming all its modules."""
    groups: dict[str, list[str]] = {}
    for line in not_honoured(modules, model, engine):
        name, _, rest = line.partition(" has no effect in ")
        groups.setdefault(rest, []).append(name)
    return [f"{', '.join(names)} {'has' if len(names) == 1 else 'have'} no effect in {rest}" for rest, names in groups.items()]


def not_honoured(modules: tuple[str, ...], model: ModelSpec, engine: Engine) -> list[str]:
    """One line per named module that does not act in some layer type of this model and engine."""
    kinds = [FULL] + ([LINEAR] if model.family == "qwen3_5" else [])
    out = []
    for m in modules:
        dead = [k for k in kinds if not honoured(m, k, model, engine)]
        if not dead:
            continue
        where = "any layer" if len(dead) == len(kinds) else ("the Gated DeltaNet layers" if dead == [LINEAR] else "the attention layers")
        why = ("a mixture-of-experts / MLA module; the model has none" if m in MOE_ONLY | MLA_ONLY else
               "Transformer Engine fuses the norm into the next linear" if m in ("layernorm", "attn_norm", "mlp_norm") else
               "slime's Gated DeltaNet is its own module, not Megatron's attention")
        out.append(f"{m} has no effect in {where} ({why}); attune models it as not recomputed/offloaded there")
    return out
