"""Where the layers, tokens and parameters of a layout sit: per-stage and per-chunk layer ranges,
batching and per-stage parameter counts. Derived once per estimate and shared by memory, performance,
runners and reports, so they never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from attune.errors import LayoutError
from .engine import Engine
from .layout import Layout, Workload
from .model import ModelSpec


def stage_layer_counts(layout: Layout, num_layers: int) -> list[int]:
    """Layers per pipeline rank, Megatron's rule: first/last as given, the middle stages even."""
    p = layout.pp
    if p == 1:
        return [num_layers]
    first, last = layout.first, layout.last
    fixed = (first is not None) + (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    n_mid = p - fixed
    if n_mid == 0:
        if rest != 0:
            raise LayoutError(f"layer split {first}/{last} sums to {first + last}, the model has {num_layers} layers")
        return [first, last]
    if rest <= 0 or rest % n_mid:
        raise LayoutError(
            f"layer split: {rest} layers left for {n_mid} middle stage(s) after first={first} last={last} "
            f"(model has {num_layers}); they must divide evenly and leave each stage at least one layer")
    mid = rest // n_mid
    counts = [mid] * p
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def chunk_ranges(layout: Layout, num_layers: int) -> list[list[tuple[int, int]]]:
    """For each pipeline rank, the [start, stop) layer ranges of its virtual chunks (Megatron order)."""
    counts = stage_layer_counts(layout, num_layers)
    v, p = layout.vpp, layout.pp
    sizes = [c // v for c in counts]
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    start = 0
    for chunk in range(v):
        for r in range(p):
            ranges[r].append((start, start + sizes[r]))
            start += sizes[r]
    return ranges


@dataclass(frozen=True)
class Batching:
    rows_per_microbatch: int
    tokens_per_microbatch: int  # tokens of one microbatch of the whole CP group
    tokens_per_gpu: int  # tokens one GPU processes per microbatch (after CP)
    microbatches: int  # per DP rank per optimizer step


def batching(layout: Layout, workload: Workload, engine: Engine) -> Batching:
    s = workload.seq_length
    if engine.dynamic_batching and layout.max_tokens_per_gpu:
        # slime packs rows into bins of max_tokens_per_gpu * CP tokens; a longer row forms its own bin
        rows = max(1, (layout.max_tokens_per_gpu * layout.cp) // s)
    else:
        rows = layout.micro_batch_size
    rows_per_dp = workload.global_batch / layout.dp
    m = max(1, math.ceil(rows_per_dp / rows))
    tokens = rows * s
    return Batching(rows, tokens, tokens // layout.cp, m)


def stage_params(model: ModelSpec, layout: Layout, rank: int, *, tp_sharded=None) -> float:
    """Parameters one GPU of pipeline rank ``rank`` holds: the one stage-parameter count.

    Layers of the rank's chunks (each layer's own TP sharding, given by ``tp_sharded(kind)`` as the
    per-layer parameters on one GPU, or the unsharded count when None), the input embedding and learned
    positions on the first stage (embedding split by TP), the output layer and final norm on the last
    stage. A tied output layer is a second copy only when the first and last stages differ (PP > 1):
    Megatron keeps the copy on the last stage and all-reduces the two gradients.
    """
    p = layout.pp
    n = 0.0
    for (a, z) in chunk_ranges(layout, model.num_layers)[rank]:
        if tp_sharded is None:
            n += sum(model.layer(i).total for i in range(a, z))
        else:
            full, lin = model.count_types(a, z)
            n += full * tp_sharded("full") + (lin * tp_sharded("linear") if lin else 0)
    tp = layout.tp if tp_sharded is not None else 1
    if rank == 0:
        n += model.embedding_params / tp + model.position_params
    if rank == p - 1:
        if not (rank == 0 and model.tied_embeddings):
            n += model.output_params / tp
        n += model.final_norm_params
    return n
