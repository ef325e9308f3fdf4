"""What many layouts of one search share, derived once: the placement.

A search estimates tens of thousands of layouts of one (model, workload, engine). Their placements (stages,
chunks, batching, in-flight microbatches; ``attune.spec.placement.place``) depend on a handful of Layout fields
only, so layouts differing in recompute, offload, overlap or SP share one. ``placement`` returns the shared
Placement (frozen: nobody mutates it). ``PLACEMENT_FIELDS`` lists the fields ``place`` reads (batching,
chunk_ranges, inflight_microbatches, the MTP layers); tests/test_one_value.py checks that the shared placement
equals a fresh one over a whole enumerated space.
"""

from __future__ import annotations

from attune.spec.engine import Engine
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec
from attune.spec.placement import Placement, place

PLACEMENT_FIELDS = ("pp", "vpp", "first", "last", "pipeline_layout", "account_for_embedding", "account_for_loss",
                    "max_tokens_per_gpu", "micro_batch_size", "cp", "dp", "mtp_layers")
"""The Layout fields ``place`` reads (attune/spec/placement.py: batching, chunk_ranges, virtual_stage_counts,
inflight_microbatches, place)."""
# placements kept (a dense space has a few thousand distinct ones)
CACHE_SIZE = 16384

_PLACEMENTS: dict[tuple, tuple[ModelSpec, Placement]] = {}


def placement(model: ModelSpec, layout: Layout, workload: Workload, engine: Engine) -> Placement:
    """``place(model, layout, workload, engine)``, shared between layouts with the same PLACEMENT_FIELDS."""
    key = (id(model), workload.seq_length, workload.global_batch, engine.dynamic_batching,
           layout.pp, layout.vpp, layout.first, layout.last, layout.pipeline_layout, layout.account_for_embedding,
           layout.account_for_loss, layout.max_tokens_per_gpu, layout.micro_batch_size, layout.cp, layout.dp,
           layout.mtp_layers)
    hit = _PLACEMENTS.get(key)
    if hit is not None and hit[0] is model:  # the held model makes an id reused after eviction a miss
        return hit[1]
    pl = place(model, layout, workload, engine)
    if len(_PLACEMENTS) >= CACHE_SIZE:
        _PLACEMENTS.clear()
    _PLACEMENTS[key] = (model, pl)
    return pl
