"""Benchmark: enumerate and estimate every distinct layout of the default dense search space for Qwen3.6-27B on
8 x H200 (slime engine, 8,192-token rows, global batch 128) and report layouts per second on one core, the
enumeration included. The enumeration is the search's own, as columns (`attune.search.enumeration`: knobs that
cannot change a layout are not expanded, layouts deduplicated by `layout_key`, no `Layout` built); each layout
is estimated with `estimate` (built from its row).

Run by hand: `python benchmarks/estimate_speed.py` (add `--limit N` for a quick look).
"""

from __future__ import annotations

import argparse
import os
import time

from attune.estimator import estimate
from attune.search.enumeration import enumerate_columns
from attune.search.space import load_space
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    except (AttributeError, OSError):
        pass
    model, cluster, engine, wl = load_model("Qwen3.6-27B"), parse_cluster("8xH200"), get_engine("slime"), Workload()
    space = load_space(None)  # the bundled dense space (package data)
    t0 = time.perf_counter()
    cols = enumerate_columns(space, model, cluster.world_size, wl, engine).cols
    t_enum = time.perf_counter() - t0
    n = len(cols) if args.limit is None else min(args.limit, len(cols))
    print(f"enumeration alone: {len(cols):,} layouts in {t_enum:.3f} s: {len(cols) / t_enum:,.0f} layouts/s")
    t0 = time.perf_counter()
    fits = 0
    best = None
    for i in range(n):
        lay = cols.layout(i)
        e = estimate(model, cluster, lay, wl, engine, check_layout=False)
        if e.fits:
            fits += 1
            if best is None or e.perf.tokens_per_s_per_gpu > best[0]:
                best = (e.perf.tokens_per_s_per_gpu, lay.label())
    dt = time.perf_counter() - t0
    t_enum_n = t_enum * n / len(cols)  # the enumeration's share for the layouts estimated
    print(f"{n:,} distinct valid layouts (enumerated and checked in {t_enum:.2f} s); {fits:,} predicted to fit")
    print(f"estimated in {dt:.2f} s on one core: {n / dt:,.0f} layouts/s "
          f"({1e6 * dt / n:.0f} us per layout: memory per stage + step time)")
    print(f"enumerated and estimated: {n / (dt + t_enum_n):,.0f} layouts/s on one core")
    if best:
        print(f"fastest predicted layout that fits: {best[1]} at {best[0]:,.1f} tokens/s/GPU")


if __name__ == "__main__":
    main()
