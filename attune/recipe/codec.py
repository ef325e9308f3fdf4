"""The recipe's ``layout`` and ``workload`` blocks in and out of the typed ``Layout`` and ``Workload``."""

from __future__ import annotations

from dataclasses import replace

from attune.errors import LayoutError
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec
from attune.spec.placement import Batching, stage_layer_counts

_LAYOUT_DEFAULTS = Layout()


def from_recipe_blocks(layout_block: dict, workload_block: dict | None = None, base: Workload | None = None, *,
                       precision_aware_default: bool | None = None) -> tuple[Layout, Workload]:
    """Read the `layout` and `workload` blocks of a recipe (the seed's format).

    ``precision_aware_default``: the precision-aware optimizer setting when the layout block omits
    ``precision_aware_optimizer`` (``attune.recipe.target`` passes the run block's
    ``--use-precision-aware-optimizer``); None: ``Layout``'s default (off). An offloaded optimizer is
    always precision-aware.
    """
    b = layout_block or {}
    if not isinstance(b, dict):
        raise LayoutError("recipe layout block must be a mapping")
    split = b.get("layer_split") or {}
    rec = b.get("recompute") or {}
    off = b.get("offload")
    gran = rec.get("granularity") or "none"
    kw = dict(
        tp=int(b.get("tp", 1)), pp=int(b.get("pp", 1)), dp=int(b.get("dp", 1)), cp=int(b.get("cp", 1)),
        ep=int(b.get("ep", 1)), etp=int(b.get("etp") or 1), moe_dispatcher=b.get("dispatcher"),
        sp=bool(b.get("sequence_parallel", False)),
        first=split.get("first"), last=split.get("last"), vpp=int(b.get("vpp") or 1),
        micro_batch_size=int(b.get("rows_per_microbatch") or 1),
        max_tokens_per_gpu=b.get("max_tokens_per_gpu"),
        recompute_granularity=gran,
        recompute_method=rec.get("method") if gran == "full" else None,
        recompute_num_layers=rec.get("num_layers") if gran == "full" else None,
        distributed_optimizer=bool(b.get("distributed_optimizer", True)),
        precision_aware_optimizer=bool(b.get(
            "precision_aware_optimizer",
            _LAYOUT_DEFAULTS.precision_aware_optimizer if precision_aware_default is None else precision_aware_default)),
        precision=(workload_block or {}).get("precision", "bf16"),
        # issue 15 knobs (absent keys: off)
        pipeline_layout=b.get("pipeline_layout"),
        account_for_embedding=bool(b.get("account_for_embedding", False)),
        account_for_loss=bool(b.get("account_for_loss", False)),
        recompute_modules=tuple(rec.get("modules") or ()) if gran == "selective" else (),
        offload_modules=tuple(b.get("offload_modules") or ()),
    )
    if kw["pipeline_layout"] is not None or kw["account_for_embedding"] or kw["account_for_loss"]:
        kw.update(first=None, last=None)  # the layer split is then derived (the block's copy is informative)
    if isinstance(off, dict):
        kw.update(optimizer_cpu_offload=True, offload_fraction=float(off.get("fraction", 1.0)),
                  overlap_cpu_optimizer=bool(off.get("overlap", True)), precision_aware_optimizer=True)
    elif off not in (None, False, "none"):
        raise LayoutError(f"recipe layout.offload must be null or a mapping (got {off!r})")
    w = workload_block or {}
    wl = replace(base or Workload(), **{k: v for k, v in dict(
        seq_length=w.get("row_tokens"), global_batch=w.get("global_batch")).items() if v is not None})
    return Layout(**kw), wl


def to_recipe_block(layout: Layout, model: ModelSpec, batch: Batching | None = None) -> dict:
    """The recipe's `layout` block of ``layout`` (with its label, summary and highlights in words)."""
    L = layout
    counts = stage_layer_counts(L, model.num_layers)
    rec = ({"granularity": "full", "method": L.recompute_method, "num_layers": L.recompute_num_layers}
           if L.recompute_granularity == "full" else {"granularity": L.recompute_granularity, "method": None, "num_layers": None})
    if L.recompute_modules:
        rec["modules"] = list(L.recompute_modules)
    rec_text = {"none": "no recompute", "selective": f"selective recompute ({', '.join(L.effective_recompute_modules)})"}.get(
        L.recompute_granularity,
        f"full recompute of the first {L.recompute_num_layers} layers of each stage (block)" if L.recompute_method == "block"
        else f"full recompute in groups of {L.recompute_num_layers} layer(s) (uniform)")
    opt = "precision-aware distributed optimizer" if L.precision_aware_optimizer else (
        "distributed optimizer" if L.distributed_optimizer else "optimizer")
    off = (f"CPU optimizer offload (fraction {L.offload_fraction:g})" if L.optimizer_cpu_offload else "no offload")
    split = "/".join(map(str, counts))
    mb = (f"{batch.rows_per_microbatch} row(s) of {batch.tokens_per_microbatch // max(batch.rows_per_microbatch, 1):,} tokens per microbatch"
          if batch else "")
    summary = (f"TP {L.tp}{' with sequence parallelism' if L.sp else ''}, PP {L.pp}"
               f"{f' ({split} layers)' if L.pp > 1 else ''}{f', VPP {L.vpp}' if L.vpp > 1 else ''}, CP {L.cp}, DP {L.dp}; "
               f"{mb + '; ' if mb else ''}{rec_text}; {opt}; {off}; "
               + (f"experts over EP {L.ep} x ETP {L.etp}, {L.moe_dispatcher or 'allgather'} dispatcher"
                  if model.moe is not None else "dense model, no experts"))
    return {
        "label": f"TP{L.tp} PP{L.pp} DP{L.dp}" + (f" CP{L.cp}" if L.cp > 1 else "")
                 + (f" EP{L.ep}" if L.ep > 1 else "") + (f" ETP{L.etp}" if L.etp > 1 else ""),
        "summary": summary,
        "highlights": f"{split} layer split, {rec_text}, {off}",
        "tp": L.tp, "pp": L.pp, "vpp": L.vpp, "cp": L.cp, "ep": L.ep, "etp": L.etp, "dp": L.dp,
        "sequence_parallel": L.sp,
        "layer_split": ({"first": counts[0], "last": counts[-1]} if L.pp > 1 and L.pipeline_layout is None
                        and not (L.account_for_embedding or L.account_for_loss) else None),
        "max_tokens_per_gpu": L.max_tokens_per_gpu,
        "rows_per_microbatch": batch.rows_per_microbatch if batch else L.micro_batch_size,
        "recompute": rec,
        "offload": ({"fraction": L.offload_fraction, "overlap": L.overlap_cpu_optimizer} if L.optimizer_cpu_offload else None),
        "dispatcher": L.moe_dispatcher,
        "distributed_optimizer": L.distributed_optimizer,
        "precision_aware_optimizer": L.precision_aware_optimizer,
        **({"pipeline_layout": L.pipeline_layout} if L.pipeline_layout is not None else {}),
        **({"account_for_embedding": True} if L.account_for_embedding else {}),
        **({"account_for_loss": True} if L.account_for_loss else {}),
        **({"offload_modules": list(L.offload_modules)} if L.offload_modules else {}),
    }
