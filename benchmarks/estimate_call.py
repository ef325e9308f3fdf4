"""Benchmark: the cost of one `estimate()` call (issue 18: a single layout is a batch of one).

What the tuner, `--explain`, the recalibration and the calibration fit pay per layout: `estimate()` on the seed's
model (Qwen3.6-27B on 8 x H200, slime engine, the default workload), (a) the same layout again and again (what a
caller that re-asks pays) and (b) 300 distinct layouts of the default dense space, each asked once, and (c) the same
300 layouts as one `estimate_batch` call, per layout. Milliseconds per layout, wall and process CPU time.

Run by hand: `python benchmarks/estimate_call.py` (`--repeat N`, `--layouts N`).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from attune.estimator import estimate, estimate_batch
from attune.search.space import load_space
from attune.spec.baselines import baseline_layout
from attune.spec.columns import LayoutColumns
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import load_model


def timed(fn, n: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per call of fn over n calls."""
    w, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn()
    return 1e3 * (time.perf_counter() - w) / n, 1e3 * (time.process_time() - c) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--layouts", type=int, default=300)
    args = ap.parse_args()
    model, cluster, wl, engine = load_model("Qwen3.6-27B"), parse_cluster("8xH200"), Workload(), get_engine("slime")
    seed, _ = baseline_layout(model, cluster, wl, engine)
    estimate(model, cluster, seed, wl, engine)  # warm: coefficients, model tables
    same = timed(lambda: estimate(model, cluster, seed, wl, engine), args.repeat)
    lays = [lay for _, lay in load_space(None).enumerate(model, cluster.world_size, wl, engine)]
    pick = [lays[i] for i in np.random.default_rng(0).choice(len(lays), min(args.layouts, len(lays)), replace=False)]
    it = iter(pick)
    distinct = timed(lambda: estimate(model, cluster, next(it), wl, engine, check_layout=False), len(pick))
    w, c = time.perf_counter(), time.process_time()
    estimate_batch(model, cluster, LayoutColumns.from_layouts(pick), wl, engine)
    batch = 1e3 * (time.perf_counter() - w) / len(pick), 1e3 * (time.process_time() - c) / len(pick)
    print(f"estimate(), the seed layout again ({args.repeat:,} calls): {same[0]:.4f} ms wall, {same[1]:.4f} ms CPU "
          "per call")
    print(f"estimate(), {len(pick)} distinct layouts once each: {distinct[0]:.4f} ms wall, {distinct[1]:.4f} ms CPU "
          "per call")
    print(f"estimate_batch, the same {len(pick)} layouts as one batch: {batch[0]:.4f} ms wall, {batch[1]:.4f} ms CPU "
          "per layout")


if __name__ == "__main__":
    main()
