"""The one identity of a layout (`layout_key`): what makes two layouts the same run.

It lives in `attune.spec` because both the search (sampler, scoring table, coordination claims) and the
runners (the replay runner's table) use it, and runners sit below search in the layer map.
"""

from __future__ import annotations

import dataclasses

from .layout import Layout
from .placement import stage_layer_counts, virtual_stage_counts

# Layout fields the key does not carry as such: the layer split (first / last / layout string) is carried as the
# layers of every (virtual) stage, which is what the engines run; every other field is in the key (normalised
# where a value cannot change the run). tests/test_replay.py checks that every Layout field is accounted for.
KEY_DERIVED_FIELDS = ("first", "last", "pipeline_layout")


def layout_from_dict(d: dict) -> Layout:
    """A Layout from its `to_dict()` as stored on a trial (JSON turns tuples into lists; fields an older attune
    did not have take their defaults, fields it had and this one lacks are dropped)."""
    names = {f.name for f in dataclasses.fields(Layout)}
    return Layout(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})


def layout_key(layout: dict | Layout, num_layers: int) -> tuple:
    """THE identity of a layout: two layouts with the same key run the same way and use the same memory, so a
    measurement of one answers the other. Used by the sampler ("already measured", near-duplicates), the
    scoring table's index and the enumeration's deduplication, the coordination claims, and the replay runner.

    Every Layout field that can change a measurement (memory included) is in it, normalised where the value
    cannot change the run: the split as the layers of every stage and virtual stage (first/last or a layout
    string giving the same counts are one layout), SP only at TP > 1, TP communication overlap only with SP,
    the recompute method and its layer count only with full recompute and the count capped at a chunk's layers
    (block recompute of N >= a chunk's layers recomputes the whole chunk; uniform groups of N >= it are one
    group), the recomputed modules only with selective recompute, the offload fraction and the CPU optimizer
    overlap only with optimizer offload, the microbatch size only without dynamic batching. The group size
    of uniform full recompute IS part of it: every group keeps its input and one group is rebuilt in backward
    (attune/estimator/memory.py, uniform branch), so groups of 2 and of 3 use different memory."""
    lay = layout if isinstance(layout, Layout) else layout_from_dict(layout)
    counts = tuple(stage_layer_counts(lay, num_layers))
    virt = tuple(virtual_stage_counts(lay, num_layers) or ())
    if lay.vpp == 1:
        virt = ()  # one chunk per stage: the stage layers say it all
    full = lay.recompute_granularity == "full"
    offload = bool(lay.optimizer_cpu_offload)
    sp = bool(lay.sp) and lay.tp > 1
    n = None
    if full:
        chunk = max(virt) if virt else -(-max(counts) // lay.vpp)
        n = max(1, min(lay.recompute_num_layers or 1, chunk))
    k = dict(
        tp=lay.tp, sp=sp, pp=lay.pp, dp=lay.dp, cp=lay.cp, vpp=lay.vpp, stage_layers=counts,
        virtual_stage_layers=virt, account_for_embedding=bool(lay.account_for_embedding),
        account_for_loss=bool(lay.account_for_loss),
        recompute_granularity=lay.recompute_granularity, recompute_method=lay.recompute_method if full else None,
        recompute_num_layers=n, recompute_modules=tuple(sorted(lay.effective_recompute_modules)),
        offload_modules=tuple(sorted(lay.offload_modules)), mtp_layers=lay.mtp_layers,
        distributed_optimizer=bool(lay.distributed_optimizer),
        precision_aware_optimizer=bool(lay.precision_aware_optimizer), optimizer_cpu_offload=offload,
        offload_fraction=float(lay.offload_fraction) if offload else None,
        overlap_cpu_optimizer=bool(lay.overlap_cpu_optimizer) if offload else None, precision=lay.precision,
        overlap_grad_reduce=bool(lay.overlap_grad_reduce), overlap_param_gather=bool(lay.overlap_param_gather),
        tp_comm_overlap=bool(lay.tp_comm_overlap) and sp, max_tokens_per_gpu=lay.max_tokens_per_gpu or None,
        micro_batch_size=None if lay.max_tokens_per_gpu else lay.micro_batch_size,
        ep=lay.ep, etp=lay.etp, moe_dispatcher=lay.moe_dispatcher, moe_grouped_gemm=bool(lay.moe_grouped_gemm),
        moe_permute_fusion=bool(lay.moe_permute_fusion), moe_shared_expert_overlap=bool(lay.moe_shared_expert_overlap),
        moe_capacity_factor=lay.moe_capacity_factor, moe_force_balance=bool(lay.moe_force_balance),
        moe_ep_overlap=bool(lay.moe_ep_overlap),
        # low precision (issue 22): the recipe only where a format is set, as the flags say
        fp8_format=lay.fp8_format, fp8_recipe=lay.fp8_recipe if lay.fp8_format else None,
        fp8_param_gather=bool(lay.fp8_param_gather), fp4_format=lay.fp4_format)
    return tuple(k.items())  # the fields in their fixed order above: deterministic, and no sort per layout
