"""The baseline layout of a model (data in baselines.yaml), adapted to a cluster."""

from __future__ import annotations

import shlex
from dataclasses import replace
from importlib import resources

from attune.errors import LayoutError
from attune.spec.engine import Engine
from attune.spec.flags import flag_parser, from_flags
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec
from attune.spec.placement import stage_layer_counts
from attune.spec.rules import check
from attune.spec.textio import load_package_yaml


def load_baselines() -> dict:
    return load_package_yaml(resources.files("attune.spec").joinpath("baselines.yaml").read_text())


def baseline_entry(model_name: str, moe: bool = False) -> dict:
    """The model's entry, else ``default-moe`` for a mixture-of-experts model, else ``default``."""
    table = load_baselines()
    by_lower = {k.lower(): k for k in table}
    return table[by_lower.get(model_name.lower(), "default-moe" if moe else "default")]


def baseline_layout(model: ModelSpec, cluster: Cluster, workload: Workload, engine: Engine,
                    max_tp: int | None = None, max_cp: int | None = None) -> tuple[Layout, str]:
    """The model's baseline layout adapted to the cluster, and a note saying what was adapted.

    Adaptation, in order, until the layout is valid: CP down to 1 (the seed ran slime's CP 4 as CP 1 on one
    node), then EP halved while EP x ETP does not divide a stage's GPUs (MoE), then TP halved, then PP halved. Rows per microbatch never exceed one row when the baseline asks for
    more tokens per GPU than a row holds.
    """
    entry = baseline_entry(model.name, moe=model.moe is not None)
    flags = entry["flags"]
    world = cluster.world_size
    # read the flags without deriving DP (the script's cluster may be larger than this one)
    parsed = from_flags(flags, model, world_size=_mp(flags, model), base=workload)
    lay = parsed.layout
    notes = [f"baseline from {entry['source']}"]
    if lay.max_tokens_per_gpu and lay.max_tokens_per_gpu > workload.seq_length * lay.cp:
        lay = replace(lay, max_tokens_per_gpu=workload.seq_length * lay.cp)
    if max_tp is not None and lay.tp > max_tp:
        notes.append(f"TP {lay.tp} -> {max_tp} (runner limit)")
        lay = replace(lay, tp=max_tp, sp=lay.sp and max_tp > 1)
    if max_cp is not None and lay.cp > max_cp:
        notes.append(f"CP {lay.cp} -> {max_cp} (runner limit)")
        lay = replace(lay, cp=max_cp)
    broken: list[str] = []
    for _ in range(12):
        mp = lay.tp * lay.pp * lay.cp
        if world % mp == 0:
            cand = replace(lay, dp=world // mp)
            broken = check(cand, model, world, workload, engine)
            if not broken:
                if cand.pp > 1:  # spell the split out, as the recipe's layout block does
                    counts = stage_layer_counts(cand, model.num_layers)
                    cand = replace(cand, first=counts[0], last=counts[-1])
                return cand, "; ".join(notes)
        if lay.cp > 1:
            notes.append(f"CP {lay.cp} -> 1 for {cluster.spec}")
            lay = replace(lay, cp=1)
        elif lay.ep > 1 and (world // lay.pp) % (lay.ep * lay.etp):  # MoE: EP x ETP within a stage's GPUs
            notes.append(f"EP {lay.ep} -> {lay.ep // 2} for {cluster.spec}")
            lay = replace(lay, ep=lay.ep // 2)
        elif lay.tp > 1:
            notes.append(f"TP {lay.tp} -> {lay.tp // 2} for {cluster.spec}")
            lay = replace(lay, tp=lay.tp // 2, sp=lay.sp and lay.tp // 2 > 1)
        elif lay.pp > 1:
            notes.append(f"PP {lay.pp} -> {lay.pp // 2} for {cluster.spec}")
            lay = replace(lay, pp=lay.pp // 2, first=None, last=None)
        else:
            break
    why = f" (last try: {broken[0]})" if broken else ""
    raise LayoutError(f"the baseline layout of {model.name} cannot be adapted to {cluster.spec}{why}: {'; '.join(notes)}; "
                      f"give the layout with --flags or a larger --global-batch")


def _mp(flags: str, model: ModelSpec) -> int:
    """TP x PP x CP of a flag string (the world size at DP 1), read by the one flag parser."""
    ns, _ = flag_parser().parse_known_args(shlex.split(flags))
    get = vars(ns)
    return (get.get("--tensor-model-parallel-size") or 1) * (get.get("--pipeline-model-parallel-size") or 1) * (
        get.get("--context-parallel-size") or 1)
