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
}


def _mlp_internal_bytes(c: LayerCost) -> float:
    return sum(t.bytes for t in c.saved if t.name.startswith(_MLP_INTERNAL) or _MLP_SUFFIX in t.name)


def recompute_freed_bytes(c: LayerCost, kind: str, layout: Layout, model: ModelSpec, engine: Engine) -> float:
    """Saved bytes of one layer (one microbatch) that selective recompute of the layout's modules frees."""
    freed = 0.0
    for m in layout.effective_recompute_modules:
        if not honoured(m, kind, model, engine):
            continue
        if m == "core_attn":
            freed += c.selective_freed_bytes
        elif m == "mlp":
            freed += _mlp_internal_bytes(c)
    return freed


def recompute_seconds(c: LayerCost, t: dict[str, float], kind: str, layout: Layout, model: ModelSpec,
                      engine: Engine) -> float:
    """Extra backward seconds of one layer (one microbatch): the recomputed modules' forward again.

    ``t`` is the layer's per-part times of ``attune.estimator.performance`` (fwd_gemm, fwd_attention, ...);
    the MLP's share of the forward GEMM time is its share of the forward GEMM FLOPs (the last two GEMMs
    of ``LayerCost.gemm`` are fc1 and fc2).
    """
    s = 0.0
    for m in layout.effective_recompute_modules:
        if not honoured(m, kind, model, engine):
            continue
        if m == "core_attn":
            s += t["fwd_attention"]
        elif m == "mlp":
            total = sum(f for f, _ in c.gemm) or 1.0
            s += t["fwd_gemm"] * sum(f for f, _ in c.gemm[-2:]) / total
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
