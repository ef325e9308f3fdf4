"""Layer kinds: the keys of ``attune.estimator.costs.layer_costs`` and of ``ModelSpec.kind_params``.

A kind is the layer's mixer, ``FULL`` (softmax or latent attention over the whole causal context), ``SLIDING``
(softmax attention over a window) or ``LINEAR`` (Gated DeltaNet), with ``DENSE`` appended for the dense-MLP layers
of an MoE model, and ``SHARED_INDEX`` before it for a DSA layer that reuses an earlier layer's top-k. A leaf, so the family plug-ins (``attune.spec.families``) name the kinds their configs build
without importing ``attune.spec.model``; ``attune.spec.model`` re-exports every name.
"""

from __future__ import annotations

FULL = "full"  # softmax attention layer
LINEAR = "linear"  # Gated DeltaNet layer
SLIDING = "sliding"  # softmax attention over a sliding window (GPT-OSS); a FULL layer for ``layer_type``
DENSE = "+dense"  # suffix of the layer kinds whose MLP is dense in an MoE model (DeepSeek-V3's first layers)
# suffix (before DENSE) of the latent-attention layers that reuse an earlier layer's DSA top-k indices and carry no
# indexer (GLM-5.2's cross-layer index sharing: attune.spec.mla.MLASpec.computes_index)
SHARED_INDEX = "~shared-index"


def mixer_of(kind: str) -> str:
    """The mixer of a layer kind as FULL or LINEAR (sliding-window attention is softmax attention)."""
    base = kind[: -len(DENSE)] if kind.endswith(DENSE) else kind
    base = base[: -len(SHARED_INDEX)] if base.endswith(SHARED_INDEX) else base
    return LINEAR if base == LINEAR else FULL


def shares_index(kind: str) -> bool:
    """Whether a layer kind reuses an earlier layer's sparse-attention indices (no indexer of its own)."""
    return SHARED_INDEX in kind


def is_dense_kind(kind: str) -> bool:
    """Whether a layer kind is a dense-MLP layer of an MoE model."""
    return kind.endswith(DENSE)
