"""Benchmark: enumerate and estimate every distinct layout of the default dense search space for Qwen3.6-27B on
8 x H200 (slime engine, 8,192-token rows, global batch 128) and report layouts per second on one core, the
enumeration included. The enumeration is the search's own (`SearchSpace.enumerate`: knobs that cannot change
a layout are not expanded, layouts deduplicated by `layout_key`); each layout is estimated with `estimate`.

Run by hand: `python benchmarks/estimate_speed.py` (add `--limit N` for a quick look).
"""

from __future__ import annotations

import argparse
import os
import time

from attune.estimator import estimate
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
    layouts = [lay for _, lay in space.enumerate(model, cluster.world_size, wl, engine)][:args.limit]
    t_enum = time.perf_counter() - t0
    t0 = time.perf_counter()
    fits = 0
    best = None
    for lay in layouts:
        e = estimate(model, cluster, lay, wl, engine, check_layout=False)
        if e.fits:
            fits += 1
            if best is None or e.perf.tokens_per_s_per_gpu > best[0]:
                best = (e.perf.tokens_per_s_per_gpu, lay.label())
    dt = time.perf_counter() - t0
    print(f"{len(layouts):,} distinct valid layouts (enumerated and checked in {t_enum:.1f} s); "
          f"{fits:,} predicted to fit")
    print(f"estimated in {dt:.2f} s on one core: {len(layouts) / dt:,.0f} layouts/s "
          f"({1e6 * dt / len(layouts):.0f} us per layout: memory per stage + step time)")
    print(f"enumerated and estimated: {len(layouts) / (dt + t_enum):,.0f} layouts/s on one core")
    if best:
        print(f"fastest predicted layout that fits: {best[1]} at {best[0]:,.1f} tokens/s/GPU")


if __name__ == "__main__":
    main()
