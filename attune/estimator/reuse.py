"""What many layouts of one search share, derived once: the placement, and the parts of an estimate that do not
read the optimizer.

A search estimates tens of thousands of layouts of one (model, workload, engine). Their placements (stages,
chunks, batching, in-flight microbatches; ``attune.spec.placement.place``) depend on a handful of Layout fields
only, so layouts differing in recompute, offload, overlap or SP share one. ``placement`` returns the shared
Placement (frozen: nobody mutates it). ``PLACEMENT_FIELDS`` lists the fields ``place`` reads (batching,
chunk_ranges, inflight_microbatches, the MTP layers); tests/test_one_value.py checks that the shared placement
equals a fresh one over a whole enumerated space.
"""

from __future__ import annotations

import dataclasses
from operator import attrgetter
from typing import Callable

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


OPTIMIZER_FIELDS = ("optimizer_cpu_offload", "offload_fraction", "overlap_cpu_optimizer", "overlap_grad_reduce",
                    "overlap_param_gather", "distributed_optimizer", "precision_aware_optimizer")
"""Layout fields only the optimizer and DP-communication terms read (the tail of ``estimate_performance``, the
optimizer bytes of ``estimate_memory``): a search's offload variants share the per-stage pipeline and activation
terms. The per-stage helpers that ``shared`` memoises must not read them (tests/test_one_value.py and
benchmarks/estimate_equivalence.py check the results against fresh estimates)."""
# shared results kept: the enumeration puts a layout's optimizer variants next to each other, so a few thousand
# suffice, and a bound keeps a 300,000-layout search's workers small (an entry holds the per-stage terms)
SHARED_SIZE = 4096

_SHARED: dict[tuple, tuple] = {}
_GETTERS: dict[tuple, attrgetter] = {}


def shared(name: str, fn: Callable, args: tuple, layout: Layout, excluded: tuple[str, ...]):
    """``fn(*args)``, shared between calls whose other arguments are the same objects and whose ``layout`` agrees on
    every field but ``excluded``. The objects are held with the result, so an id reused after eviction misses."""
    get = _GETTERS.get(excluded)
    if get is None:
        get = _GETTERS[excluded] = attrgetter(*(f.name for f in dataclasses.fields(Layout) if f.name not in excluded))
    held = tuple(a for a in args if a is not layout)
    key = (name, *map(id, held), get(layout))
    hit = _SHARED.get(key)
    if hit is not None and all(x is y for x, y in zip(hit[0], held)):
        return hit[1]
    out = fn(*args)
    if len(_SHARED) >= SHARED_SIZE:
        _SHARED.clear()
    _SHARED[key] = (held, out)
    return out


def clear() -> None:
    """Forget every shared placement and term (tests compare shared results with fresh ones)."""
    _PLACEMENTS.clear()
    _SHARED.clear()
