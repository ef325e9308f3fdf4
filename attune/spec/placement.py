"""Where the layers, tokens and parameters of a layout sit.

Per-stage and per-chunk layer ranges with their layer-type mix, batching, the microbatches in flight at
each rank's peak, and the one per-stage parameter count. ``place`` derives all of it once per estimate;
memory, performance, runners and reports read the result, so they never disagree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from attune.errors import LayoutError

from .engine import Engine
from .layout import Layout, Workload
from .model import ModelSpec
from .pipeline_layout import accounted_stage_counts, layout_stage_counts


# ---------------------------------------------------------------------- layer ranges
def virtual_stage_counts(layout: Layout, num_layers: int) -> list[int] | None:
    """Layers per virtual stage (PP x VPP, Megatron order) when the layout sets them one by one: an explicit
    ``pipeline_layout`` string or the embedding / loss accounting; None for the first/last/even split."""
    if layout.pipeline_layout is not None:
        return layout_stage_counts(layout.pipeline_layout, layout.pp, layout.vpp, num_layers)
    if layout.account_for_embedding or layout.account_for_loss:
        return accounted_stage_counts(num_layers, layout.pp, layout.vpp, layout.account_for_embedding,
                                      layout.account_for_loss)
    return None


def stage_layer_counts(layout: Layout, num_layers: int) -> list[int]:
    """Layers per pipeline rank, Megatron's rule: first/last as given, the middle stages even (or the sum of
    the rank's virtual stages when a layout string / embedding-loss accounting sets them)."""
    p = layout.pp
    vs = virtual_stage_counts(layout, num_layers)
    if vs is not None:
        return [sum(vs[i] for i in range(r, len(vs), p)) for r in range(p)]
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
    v, p = layout.vpp, layout.pp
    vs = virtual_stage_counts(layout, num_layers)
    if vs is None:
        vs = [c // v for _chunk in range(v) for c in stage_layer_counts(layout, num_layers)]
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    start = 0
    for i, n in enumerate(vs):
        ranges[i % p].append((start, start + n))
        start += n
    return ranges


# ---------------------------------------------------------------------- batching
@dataclass(frozen=True, kw_only=True)
class Batching:
    """How a global batch is cut into microbatches on one data-parallel rank."""

    rows_per_microbatch: int
    """Packed rows in one microbatch."""
    tokens_per_microbatch: int
    """Tokens of one microbatch of the whole CP group."""
    tokens_per_gpu: int
    """Tokens one GPU processes per microbatch (after CP)."""
    microbatches: int
    """Microbatches per DP rank per optimizer step."""


def batching(layout: Layout, workload: Workload, engine: Engine) -> Batching:
    """Microbatching of a layout: slime's dynamic bins or Megatron's static micro-batch size."""
    s = workload.seq_length
    if engine.dynamic_batching and layout.max_tokens_per_gpu:
        # slime packs rows into bins of max_tokens_per_gpu * CP tokens; a longer row forms its own bin
        rows = max(1, (layout.max_tokens_per_gpu * layout.cp) // s)
    else:
        rows = layout.micro_batch_size
    rows_per_dp = workload.global_batch / layout.dp
    m = max(1, math.ceil(rows_per_dp / rows))
    tokens = rows * s
    return Batching(rows_per_microbatch=rows, tokens_per_microbatch=tokens,
                    tokens_per_gpu=tokens // layout.cp, microbatches=m)


def inflight_microbatches(layout: Layout, rank: int, microbatches: int) -> float:
    """Microbatches whose activations a rank holds at its peak, in whole-rank equivalents.

    1F1B: min(p - r, M). Interleaved: warm-up 2(p - r - 1) + (v - 1) p chunks plus the running one, capped
    at M v, divided by v (megatron-core pipeline_parallel/schedules.py; reference
    megatron-memory-and-performance.md section 3).
    """
    p, v = layout.pp, layout.vpp
    if v == 1:
        return float(min(p - rank, microbatches))
    chunks = min(2 * (p - rank - 1) + (v - 1) * p + 1, microbatches * v)
    return chunks / v


# ---------------------------------------------------------------------- parameters
def stage_params(model: ModelSpec, layout: Layout, rank: int,
                 per_layer: Callable[[str], float] | None = None,
                 chunks: Sequence[tuple[int, int]] | None = None) -> float:
    """Parameters one GPU of pipeline rank ``rank`` holds: the one stage-parameter count.

    ``per_layer(kind)`` gives one layer's parameters on one GPU for each layer kind (``ModelSpec.layer_kind``:
    FULL, SLIDING, LINEAR, and their dense-MLP variants in MoE models, so a stage holding DeepSeek-V3's dense
    first layers counts their dense MLPs), with the engine's TP sharding; None counts unsharded layers (and
    TP = 1 for the embedding and output). Routed-expert parameters are not in ``per_layer`` (the estimator adds
    them for the stage's MoE layers only: ``attune.estimator.moe.stage_expert_params``).
    ``chunks``: the rank's [start, stop) layer ranges when the caller has them (``Placement``).
    The input embedding and learned positions sit on the first stage (embedding split by TP), the
    output layer and final norm on the last. A tied output layer is a second copy only when the first
    and last stages differ: Megatron keeps the copy on the last stage and all-reduces the two gradients.
    The layout's multi-token-prediction layers (``Layout.mtp_layers``) sit on the last stage too
    (``mtp_layer_params``).
    """
    if chunks is None:
        chunks = chunk_ranges(layout, model.num_layers)[rank]
    n = 0.0
    for (a, z) in chunks:
        if per_layer is None:
            n += sum(model.layer(i).total for i in range(a, z))
        else:
            n += sum(k * per_layer(kind) for kind, k in model.count_kinds(a, z))
    tp = layout.tp if per_layer is not None else 1
    if rank == 0:
        n += model.embedding_params / tp + model.position_params
    if rank == layout.pp - 1:
        if not (rank == 0 and model.tied_embeddings):
            n += model.output_params / tp
        n += model.final_norm_params
        n += layout.mtp_layers * mtp_layer_params(model, layout, per_layer)
    return n


def mtp_kind(model: ModelSpec) -> str:
    """The layer kind of a multi-token-prediction layer: the main model's last layer's (megatron-core builds the
    MTP block's transformer layer from the decoder's last layer spec)."""
    return model.mtp_kind


def mtp_layer_params(model: ModelSpec, layout: Layout, per_layer: Callable[[str], float] | None = None) -> float:
    """Parameters of one multi-token-prediction layer on one GPU of the last stage (megatron-core
    multi_token_prediction.py MultiTokenPredictionLayer): the enorm and hnorm, eh_proj Linear(2h, h)
    (column-parallel: split by TP), one transformer layer of the last layer's kind and the block's final norm;
    the embedding and the output layer are the main model's (shared, not counted again). ``per_layer`` as in
    ``stage_params`` (None: unsharded, routed experts included, so the layout's MTP layers add
    ``ModelSpec.mtp_params`` / ``mtp_layers`` each)."""
    h = model.hidden
    if per_layer is None:
        return model.kind_params(model.mtp_kind).total + 2 * h * h + 3 * model.norm_vectors
    return per_layer(mtp_kind(model)) + 2 * h * h / layout.tp + 3 * model.norm_vectors


# ---------------------------------------------------------------------- the placement, derived once
@dataclass(frozen=True, kw_only=True)
class Chunk:
    """One virtual pipeline chunk: a contiguous range of layers and its layer-type mix."""

    start: int
    """First layer (0-based)."""
    stop: int
    """One past the last layer."""
    full: int
    """Softmax-attention layers in the chunk (sliding-window and latent attention included)."""
    linear: int
    """Gated DeltaNet layers in the chunk."""
    kinds: tuple[tuple[str, int], ...] = ()
    """(layer kind, layers) of the chunk (``ModelSpec.count_kinds``): what the per-kind costs multiply."""
    moe: int = 0
    """MoE layers in the chunk (their routed experts are costed by attune.estimator.moe); 0 for dense models."""

    def __post_init__(self) -> None:
        if self.full + self.linear != self.layers or (self.kinds and sum(n for _, n in self.kinds) != self.layers):
            raise LayoutError(f"chunk [{self.start}, {self.stop}): layer counts do not add up")
        if not 0 <= self.moe <= self.layers:
            raise LayoutError(f"chunk [{self.start}, {self.stop}): {self.moe} MoE layers out of {self.layers}")

    @property
    def layers(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, kw_only=True)
class StagePlacement:
    """What one pipeline rank holds and how many microbatches it keeps alive at its peak."""

    rank: int
    """Pipeline rank, 0-based."""
    chunks: tuple[Chunk, ...]
    """The rank's virtual chunks in Megatron order (one chunk without VPP)."""
    inflight: float
    """Microbatches in flight at the rank's activation peak (1F1B or interleaved)."""
    is_first: bool
    """Holds the input embedding."""
    is_last: bool
    """Holds the output layer and the loss."""
    mtp: int = 0
    """Multi-token-prediction layers the rank holds: the layout's ``mtp_layers`` on the last rank, else 0."""
    mtp_moe: int = 0
    """Of ``mtp``, the layers whose MLP is an MoE block (the model's last layer is one): their routed experts."""

    @cached_property  # (computed once: the estimator reads it per stage of every layout sharing the placement)
    def layers(self) -> int:
        return sum(c.layers for c in self.chunks)

    @cached_property
    def moe_layers(self) -> int:
        """MoE layers of the rank (routed experts held): the dense layers of an MoE model hold none."""
        return sum(c.moe for c in self.chunks)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The chunks' [start, stop) layer ranges."""
        return [(c.start, c.stop) for c in self.chunks]


@dataclass(frozen=True, kw_only=True)
class Placement:
    """A layout placed on a model: stages, chunks, batching. Computed once by ``place``."""

    stages: tuple[StagePlacement, ...]
    """One entry per pipeline rank."""
    batch: Batching
    """Microbatching of the step."""


def place(model: ModelSpec, layout: Layout, workload: Workload, engine: Engine) -> Placement:
    """Per-stage and per-chunk layer ranges with their layer-type mix, batching and in-flight microbatches."""
    b = batching(layout, workload, engine)
    ranges = chunk_ranges(layout, model.num_layers)
    p = layout.pp
    stages = []
    for r, chunks in enumerate(ranges):
        cs = tuple(Chunk(start=a, stop=z, full=model.count_types(a, z)[0], linear=model.count_types(a, z)[1],
                         kinds=model.count_kinds(a, z), moe=model.count_moe(a, z))
                   for (a, z) in chunks)
        mtp = layout.mtp_layers if r == p - 1 else 0
        stages.append(StagePlacement(rank=r, chunks=cs, inflight=inflight_microbatches(layout, r, b.microbatches),
                                     is_first=r == 0, is_last=r == p - 1, mtp=mtp,
                                     mtp_moe=mtp if model.is_moe_layer(model.num_layers - 1) else 0))
    return Placement(stages=tuple(stages), batch=b)
