"""Resolve what a command works on: model, cluster, engine, layout and workload.

A layout comes from exactly one of: a recipe (which also names its model and GPUs), Megatron/slime flags,
or the model's baseline (slime's own launch, adapted to the cluster). This is the one place the CLI,
tests and notebooks turn user input into typed values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from attune.errors import UserInputError
from attune.recipe.io import load_recipe
from attune.recipe.target import RecipeTarget, recipe_target
from attune.spec.baselines import baseline_layout
from attune.spec.engine import DEFAULT_ENGINE, get_engine
from attune.spec.flags import from_flags
from attune.spec.hardware import Cluster, parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import load_model


@dataclass(frozen=True, kw_only=True)
class Target(RecipeTarget):
    """Everything an estimate or a run needs, resolved and typed: a recipe's target (``RecipeTarget``: model,
    cluster, engine, layout, workload, source) or the same built from flags or the model's baseline."""

    ignored_flags: tuple[str, ...] = field(default=())
    """Flags after ``--`` that are neither layout nor workload flags."""


def workload_with(base: Workload, *, seq: int | None = None, global_batch: int | None = None,
                  steps: int | None = None) -> Workload:
    """``base`` with the command line's overrides (None keeps the base's value)."""
    kw = {}
    if seq is not None:
        kw["seq_length"] = seq
    if global_batch is not None:
        kw["global_batch"] = global_batch
    w = replace(base, **kw) if kw else base
    return w.with_steps(steps) if steps is not None else w


def batch_for_cluster(wl: Workload, world_size: int) -> tuple[Workload, str]:
    """The default workload grown to the cluster: when its global batch is not a multiple of the world size
    (a layout of DP = world size could not split it), the rows per step grow to the least common multiple, so
    every DP size the cluster allows divides it. slime's scripts grow the rows per step with the cluster the
    same way: run-deepseek-r1.sh (slime 624b824a, lines 46-47 and 169) trains 128 prompts x 8 samples = 1,024
    rows per rollout on 16 nodes x 8 GPUs. Returns the workload and a sentence for the report ("" if
    unchanged)."""
    gb = wl.global_batch
    if gb % world_size == 0:
        return wl, ""
    grown = math.lcm(gb, world_size)
    return replace(wl, global_batch=grown), (
        f"grown from the default {gb} rows so that every data-parallel size of {world_size} GPUs divides it; "
        f"--global-batch sets it")


def resolve_target(*, model: str | None = None, gpus: str | None = None, gpus_per_node: int | None = None,
                   price: float | None = None, engine: str | None = None, seq: int | None = None,
                   global_batch: int | None = None, steps: int | None = None, recipe: str | Path | None = None,
                   flags: Sequence[str] | None = None, base_workload: Workload | None = None,
                   max_tp: int | None = None, max_cp: int | None = None) -> Target:
    """The target of a command from its options.

    ``recipe`` and ``flags`` are exclusive; with neither, the model's baseline layout adapted to the
    cluster (TP and CP capped at ``max_tp``/``max_cp`` for runners that cannot split tensors). A recipe
    supplies the model and GPUs unless ``model``/``gpus`` override them.
    """
    if recipe is not None and flags:
        raise UserInputError("give a layout by --recipe or by flags after --, not both")
    base = base_workload or Workload()
    if recipe is not None:
        data = load_recipe(recipe)
        cluster_arg: str | Cluster | None = gpus
        if gpus_per_node is not None or price is not None:
            first = recipe_target(data, engine=engine, base_workload=base, gpus=gpus, model=model,
                                  source=str(recipe), check_rules=False)
            cluster_arg = parse_cluster(gpus or first.cluster.spec, gpus_per_node, price)
        rt = recipe_target(data, engine=engine, base_workload=base, gpus=cluster_arg, model=model,
                           source=str(recipe), check_rules=False)
        wl = workload_with(rt.workload, seq=seq, global_batch=global_batch, steps=steps)
        return Target(model=rt.model, cluster=rt.cluster, engine=rt.engine, layout=rt.layout, workload=wl,
                      source=f"recipe {recipe}")
    if not model or not gpus:
        missing = " and ".join(n for n, v in (("--model", model), ("--gpus", gpus)) if not v)
        raise UserInputError(f"{missing} required (or --recipe FILE, which names both)")
    m = load_model(model)
    cluster = parse_cluster(gpus, gpus_per_node, price)
    eng = get_engine(engine or DEFAULT_ENGINE)
    wl = workload_with(base, seq=seq, global_batch=global_batch)
    ignored: tuple[str, ...] = ()
    if flags:
        parsed = from_flags(list(flags), m, cluster.world_size, wl)
        layout, ignored = parsed.layout, tuple(parsed.ignored)
        wl = workload_with(parsed.workload, seq=seq, global_batch=global_batch)
        source = "flags"
    else:
        layout, source = baseline_layout(m, cluster, wl, eng, max_tp=max_tp, max_cp=max_cp)
    if engine_forces := eng.forces_distributed_optimizer:
        if not layout.distributed_optimizer:
            layout = replace(layout, distributed_optimizer=engine_forces)
    if steps is not None:
        wl = wl.with_steps(steps)
    return Target(model=m, cluster=cluster, engine=eng, layout=layout, workload=wl, source=source,
                  ignored_flags=ignored)
