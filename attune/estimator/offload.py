"""Module-level memory knobs in the estimator (issue 15): selective recompute by module and fine-grained
activation offloading, priced from the named saved tensors of ``attune.estimator.costs``.

* Selective recompute (``--recompute-modules``): a recomputed module keeps only its input; the tensors it
  saves inside are rebuilt by one more forward of the module in backward. ``core_attn`` frees what the
  layer cost names as ``selective_freed_bytes`` (nothing with FlashAttention, the s x s tensors with the
  unfused kernel) at the cost of the attention core forward; ``mlp`` frees every MLP tensor but its input
  (the residual stream, which the layer keeps anyway) at the cost of the MLP GEMMs' forward. Modules that
  do not act in a layer type (``attune.spec.knobs.honoured``) free nothing and cost nothing there.
* Fine-grained activation offloading (``--offload-modules``): the named modules' saved inputs go to pinned
  host memory during forward (device -> host) and come back before the module's backward (host -> device),
  on side streams: the traffic is hidden under the microbatch's forward / backward compute and only the
  excess over it is exposed. The last layer of each chunk stays on the GPU (its backward follows at once).
  With block recompute only the layers that keep their activations offload. Module -> tensors (attune's
  reading of megatron-core 0.16.1 ``offload_modules``, "the input of" each module): ``qkv_linear`` the TE
  LayerNormLinear's saved norm input, norm output and statistics (the norm is fused into it, so
  ``attn_norm`` / ``mlp_norm`` have no separate module), ``core_attn`` FlashAttention's q, k, v and LSE,
  ``attn_proj`` the out-projection input. ``min_offloaded_tensor_size`` (default 1 MiB) is not modelled:
  every such tensor of a microbatch of thousands of tokens is far larger.
"""

from __future__ import annotations

from attune.estimator.costs import LayerCost
from attune.spec.engine import Engine
from attune.spec.knobs import honoured
from attune.spec.layout import Layout
from attune.spec.model import ModelSpec

# Saved-tensor names (attune.estimator.costs) each module owns, by name prefix.
_MLP_INTERNAL = ("MLP norm output", "MLP norm statistics", "fc1 output")
_MLP_SUFFIX = "= fc2 input"
_OFFLOADED = {
    "qkv_linear": ("attention norm input", "attention norm output", "attention norm statistics"),
    "core_attn": ("FlashAttention q, k, v", "FlashAttention softmax log-sum-exp"),
    "attn_proj": ("FlashAttention output", "gated attention output"),
    "expert_fc1": ("permuted expert input",),  # the grouped fc1 GEMM's input
    "moe_act": ("expert fc1 output",),  # the experts' activation input
}
# MoE layers (attune.estimator.moe.with_expert_activations names the routed tensors): ``moe`` checkpoints the
# whole MoE layer (router, dispatch, experts, combine and the shared expert: megatron-core moe_layer.py), keeping
# its input, the pre-MLP norm output; ``moe_act`` drops the experts' activation output (fc2 input) and rebuilds it
# from the kept fc1 output (experts.py, CheckpointWithoutOutput); ``shared_experts`` checkpoints the shared
# expert (shared_experts.py): its fc1 and activation outputs go.
_ROUTED = ("router logits", "permutation maps", "permuted expert input", "expert ")
_MOE_ACT = ("expert SwiGLU output",)
# ``mla_up_proj`` (multi_latent_attention.py): the q / kv up projections (TE LayerNormLinear with the latent norms
# fused) and rotary run under CheckpointWithoutOutput from the kept latents and k_pe: their norm outputs and
# statistics are not saved, and the up-projected q, k, v FlashAttention keeps are freed and rebuilt
_MLA_UP = ("q latent normalised", "q latent norm statistics", "compressed kv latent normalised",
           "kv latent norm statistics", "FlashAttention q, k, v after up-projection")


def _mlp_internal_bytes(c: LayerCost) -> float:
    return sum(t.bytes for t in c.saved if t.name.startswith(_MLP_INTERNAL) or _MLP_SUFFIX in t.name)


def _shared_expert_bytes(c: LayerCost) -> float:
    """An MoE layer's shared-expert tensors (its fc1 and activation outputs; ``costs._te_mlp`` of ``ffn``)."""
    return sum(t.bytes for t in c.saved if not t.name.startswith(_ROUTED)
               and (t.name.startswith("fc1 output") or _MLP_SUFFIX in t.name))


def _named_bytes(c: LayerCost, prefixes: tuple[str, ...]) -> float:
    return sum(t.bytes for t in c.saved if t.name.startswith(prefixes))


def recompute_freed_bytes(c: LayerCost, kind: str, layout: Layout, model: ModelSpec, engine: Engine) -> float:
    """Saved bytes of one layer (one microbatch) that selective recompute of the layout's modules frees.
    ``kind``: the layer kind (``ModelSpec.layer_kind``), so the dense-MLP layers of an MoE model are told apart."""
    mods = layout.effective_recompute_modules
    freed = 0.0
    for m in mods:
        if not honoured(m, kind, model, engine):
            continue
        if m == "core_attn":
            freed += c.selective_freed_bytes
        elif m == "mlp":
            freed += _mlp_internal_bytes(c)
        elif m == "moe":
            freed += _named_bytes(c, _ROUTED) + _shared_expert_bytes(c)
        elif m == "moe_act" and "moe" not in mods:
            freed += _named_bytes(c, _MOE_ACT)
        elif m == "shared_experts" and "moe" not in mods and not layout.moe_shared_expert_overlap:
            # megatron-core moe_layer.py shared_experts_compute: checkpointed only when not overlapped
            freed += _shared_expert_bytes(c)
        elif m == "mla_up_proj":
            freed += _named_bytes(c, _MLA_UP)
    return freed


def routed_freed_bytes(c: LayerCost, kind: str, layout: Layout, model: ModelSpec, engine: Engine) -> float:
    """Of ``recompute_freed_bytes``: the routed experts' tensors (the memory breakdown's expert activations)."""
    mods = layout.effective_recompute_modules
    if "moe" in mods and honoured("moe", kind, model, engine):
        return _named_bytes(c, _ROUTED)
    if "moe_act" in mods and honoured("moe_act", kind, model, engine):
        return _named_bytes(c, _MOE_ACT)
    return 0.0


def recompute_seconds(c: LayerCost, t: dict[str, float], kind: str, layout: Layout, model: ModelSpec,
                      engine: Engine, moe_t: dict[str, float] | None = None) -> float:
    """Extra backward seconds of one layer (one microbatch): the recomputed modules' forward again.

    ``t`` is the layer's per-part times of ``attune.estimator.performance`` (fwd_gemm, fwd_attention, ...);
    the MLP's (in an MoE layer: the shared expert's) share of the forward GEMM time is its share of the forward
    GEMM FLOPs (the last two GEMMs of ``LayerCost.gemm`` are fc1 and fc2), MLA's up projections' share is
    ``LayerCost.mla_up_flops``'. ``moe_t``: the routed part's times of an MoE layer
    (``attune.estimator.moe.moe_layer_times``): ``moe`` runs it again, dispatch and combine included, and
    ``moe_act`` the experts' activation (an HBM pass).
    """
    mods = layout.effective_recompute_modules
    total = sum(f for f, _ in c.gemm) or 1.0
    mlp_share = t["fwd_gemm"] * sum(f for f, _ in c.gemm[-2:]) / total
    s = 0.0
    for m in mods:
        if not honoured(m, kind, model, engine):
            continue
        if m == "core_attn":
            # the checkpointed core attention re-runs whole: QK^T and PV (fwd_attention) and, with the unfused
            # kernel, the scale-mask-softmax and dropout passes over the a x s x s scores it had freed (Megatron-LM
            # megatron/legacy/model/transformer.py lines 625-645 checkpoint CoreAttention.forward, lines 363-436:
            # baddbmm, scale_mask_softmax, attention_dropout, bmm; Korthikanti et al. 2022 section 5): the freed
            # tensors' share of the layer's forward HBM passes (FlashAttention frees nothing: no extra pass)
            s += t["fwd_attention"] + (t["fwd_memory"] * c.selective_freed_bytes / c.act_bytes if c.act_bytes else 0.0)
        elif m == "mlp":
            s += mlp_share
        elif m == "moe":
            s += mlp_share + (moe_t["fwd_gemm"] + moe_t["fwd_memory"] + moe_t["ep_fwd"] if moe_t else 0.0)
        elif m == "moe_act" and "moe" not in mods:
            s += moe_t["fwd_act_memory"] if moe_t else 0.0
        elif m == "shared_experts" and "moe" not in mods and not layout.moe_shared_expert_overlap:
            s += mlp_share
        elif m == "mla_up_proj":
            s += t["fwd_gemm"] * c.mla_up_flops / total
    return s


def offloaded_bytes(c: LayerCost, kind: str, layout: Layout, model: ModelSpec, engine: Engine) -> float:
    """Saved bytes of one layer (one microbatch) that fine-grained activation offloading sends to the host."""
    names: tuple[str, ...] = ()
    for m in layout.offload_modules:
        if m in _OFFLOADED and honoured(m, kind, model, engine):
            names += _OFFLOADED[m]
    if not names:
        return 0.0
    # a tensor recomputed by selective recompute is not saved, so not offloaded: offload only what stays saved
    return sum(t.bytes for t in c.saved if t.name.startswith(names))


def offload_exposed_seconds(bytes_per_microbatch: float, fwd_s: float, bwd_s: float, pcie_gbps: float) -> float:
    """Exposed seconds per microbatch of offloading ``bytes_per_microbatch`` down in forward and up in
    backward over a ``pcie_gbps`` GB/s host link per direction, overlapped with ``fwd_s`` / ``bwd_s``."""
    if bytes_per_microbatch <= 0:
        return 0.0
    link = bytes_per_microbatch / (pcie_gbps * 1e9)
    return max(0.0, link - fwd_s) + max(0.0, link - bwd_s)
