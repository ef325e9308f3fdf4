"""Benchmark: estimate every distinct layout of the default dense search space for Qwen3.6-27B on 8 x H200
(slime engine, 8,192-token rows, global batch 128) and report layouts per second on one core.

Run by hand: `python benchmarks/estimate_speed.py` (add `--limit N` for a quick look).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

from attune.spec.engine import get_engine
from attune.estimator import estimate
from attune.spec.hardware import parse_cluster
from attune.errors import LayoutError
from attune.spec.layout import Workload
from attune.spec.model import load_model
from attune.search.space import load_space


def distinct_layouts(space, model, world, wl, engine):
    """Every distinct layout the space maps to, skipping parameters that do not apply (e.g. SP at TP 1)."""
    k = space.knobs
    seen = set()
    for tp, pp, vpp, cp, off, rows in itertools.product(k["tp"], k["pp"], k["vpp"], k["cp"], k["optimizer_cpu_offload"],
                                                        k["tokens_per_microbatch_rows"]):
        sps = k["sequence_parallel"] if tp > 1 else (False,)
        fos = range(k["first_offset"][0], k["first_offset"][1] + 1) if pp > 1 else (0,)
        los = range(k["last_offset"][0], k["last_offset"][1] + 1) if pp > 2 else (0,)
        recs = [("none", "block", 1), ("selective", "block", 1)] + [
            ("full", m, n) for m in k["recompute_method"] for n in range(k["recompute_layers"][0], k["recompute_layers"][1] + 1)]
        for sp, fo, lo, (rec, meth, n) in itertools.product(sps, fos, los, recs):
            params = dict(tp=tp, sequence_parallel=sp, pp=pp, first_offset=fo, last_offset=lo, vpp=vpp, cp=cp,
                          recompute=rec, recompute_method=meth, recompute_layers=n, optimizer_cpu_offload=off,
                          tokens_per_microbatch_rows=rows)
            try:
                lay = space.to_layout(params, model, world, wl, engine)
            except LayoutError:
                continue
            if lay not in seen:
                seen.add(lay)
                yield lay


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
    layouts = list(itertools.islice(distinct_layouts(space, model, cluster.world_size, wl, engine), args.limit))
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
    if best:
        print(f"fastest predicted layout that fits: {best[1]} at {best[0]:,.1f} tokens/s/GPU")


if __name__ == "__main__":
    main()
