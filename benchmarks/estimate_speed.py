"""Benchmark: enumerate and estimate every distinct layout of the default dense search space for Qwen3.6-27B on
8 x H200 (slime engine, 8,192-token rows, global batch 128) and report layouts per second on one core, the
enumeration included. The enumeration is the search's own, as columns (`attune.search.enumeration`: knobs that
cannot change a layout are not expanded, layouts deduplicated by `layout_key`, no `Layout` built); each layout
is estimated by the array engine over the columns (`estimate_batch`, what the search's scoring calls; `--scalar`:
`estimate` one layout at a time, the path before it). Wall and CPU time are both printed (on a loaded machine
the CPU time is the comparable figure).

Run by hand: `python benchmarks/estimate_speed.py` (add `--limit N` for a quick look, `--scalar` to compare;
`--model M --gpus SPEC` another model and cluster, with the space `attune tune` would take for it: `moe` for an MoE
model, and the rows per step grown to the cluster as the tune does, `attune.api.target.batch_for_cluster`;
`--recipe R` / `--mtp N`: every layout in precision class R / with N multi-token-prediction layers).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from attune.api.target import batch_for_cluster
from attune.estimator import estimate, estimate_batch
from attune.search.enumeration import enumerate_columns
from attune.search.space import load_space
from attune.spec.columns import LayoutColumns
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import load_model
from attune.spec.precision import fields_for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--scalar", action="store_true", help="estimate one layout at a time (the path before the array engine)")
    ap.add_argument("--model", default="Qwen3.6-27B")
    ap.add_argument("--gpus", default="8xH200")
    ap.add_argument("--recipe", default=None, help="every layout in this precision class (fp8-delayed, mxfp8, ...)")
    ap.add_argument("--mtp", type=int, default=0, help="every layout with this many multi-token-prediction layers")
    args = ap.parse_args()
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    except (AttributeError, OSError):
        pass
    model, cluster, engine = load_model(args.model), parse_cluster(args.gpus), get_engine("slime")
    wl, _ = batch_for_cluster(Workload(), cluster.world_size)
    space = load_space("moe" if model.moe is not None else None)  # the bundled space a tune takes (package data)
    c0 = time.process_time()
    t0 = time.perf_counter()
    cols = enumerate_columns(space, model, cluster.world_size, wl, engine).cols
    if args.recipe or args.mtp:  # the same layouts in a precision class / with MTP layers (no rule re-checked)
        kw = dict(fields_for(args.recipe) if args.recipe else {}, **({"mtp_layers": args.mtp} if args.mtp else {}))
        cols = LayoutColumns({**cols.columns(), **{k: np.array([v] * len(cols), dtype=np.asarray(cols[k]).dtype)
                                                   for k, v in kw.items()}}, n=len(cols))
    t_enum, c_enum = time.perf_counter() - t0, time.process_time() - c0
    n = len(cols) if args.limit is None else min(args.limit, len(cols))
    print(f"enumeration alone: {len(cols):,} layouts in {t_enum:.3f} s: {len(cols) / t_enum:,.0f} layouts/s")
    c0 = time.process_time()
    t0 = time.perf_counter()
    if args.scalar:  # the per-layout path (estimate), for comparison
        tokens, fits = np.full(n, np.nan), np.zeros(n, dtype=bool)
        for i in range(n):
            e = estimate(model, cluster, cols.layout(i), wl, engine, check_layout=False)
            tokens[i], fits[i] = e.perf.tokens_per_s_per_gpu, e.fits
    else:  # what the search's scoring calls: the array engine over the columns
        b = estimate_batch(model, cluster, cols if n == len(cols) else cols.take(slice(0, n)), wl, engine)
        tokens, fits = b.tokens_per_s_per_gpu, b.fits
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    t_enum_n, c_enum_n = t_enum * n / len(cols), c_enum * n / len(cols)  # the enumeration's share of n layouts
    path = "estimate, one layout at a time" if args.scalar else "estimate_batch"
    print(f"{n:,} distinct valid layouts (enumerated and checked in {t_enum:.2f} s); {int(fits.sum()):,} predicted to fit")
    print(f"estimated ({path}) in {dt:.2f} s wall, {cpu:.2f} s CPU on one core: {n / dt:,.0f} layouts/s wall, "
          f"{n / cpu:,.0f} layouts/s CPU")
    print(f"enumerated and estimated: {n / (dt + t_enum_n):,.0f} layouts/s wall, "
          f"{n / (cpu + c_enum_n):,.0f} layouts/s CPU, on one core")
    if fits.any():
        i = int(np.nanargmax(np.where(fits, tokens, np.nan)))
        print(f"fastest predicted layout that fits: {cols.layout(i).label()} at {tokens[i]:,.1f} tokens/s/GPU")


if __name__ == "__main__":
    main()
