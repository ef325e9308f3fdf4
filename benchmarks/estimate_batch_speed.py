"""Benchmark: the array engine (`estimate_batch`) over every distinct layout of the default dense search space, on one
core: Qwen3.6-27B on 8 x H200 (slime engine, 8,192-token rows, global batch 128) and Llama-3.1-70B on 64 x H100.

The layouts are enumerated as the search does today (`SearchSpace.enumerate`) and converted once to columns
(`LayoutColumns.from_layouts`); both are timed and reported apart from `estimate_batch` itself, which is the figure
the issue's 200,000 layouts/s target reads (wall time and the process's CPU time: on a shared machine the wall time
includes waiting for the core). `--check N` also compares N random rows term by term with `estimate()`.

Run by hand: `python benchmarks/estimate_batch_speed.py` (`--models Qwen3.6-27B:8xH200` for one case).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from attune.estimator import estimate, estimate_batch
from attune.search.space import load_space
from attune.spec.columns import LayoutColumns
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import load_model

CASES = ("Qwen3.6-27B:8xH200", "Llama-3.1-70B:64xH100")


def check(model, cluster, layouts, b, wl, engine, n: int, seed: int = 0) -> float:
    """Largest relative difference of step time, tokens/s/GPU and peak memory against estimate() on n random rows."""
    worst = 0.0
    for i in np.random.default_rng(seed).choice(len(layouts), min(n, len(layouts)), replace=False):
        e = estimate(model, cluster, layouts[i], wl, engine, check_layout=False)
        pairs = ((b.step.step_time_s[i], e.perf.step_time_s), (b.tokens_per_s_per_gpu[i], e.perf.tokens_per_s_per_gpu),
                 (b.peak_gib[i], e.memory.peak_gib))
        for a, s in pairs:
            worst = max(worst, abs(a - s) / max(abs(a), abs(s)))
    return worst


def run(case: str, repeat: int, n_check: int) -> None:
    name, gpus = case.split(":")
    model, cluster, engine, wl = load_model(name), parse_cluster(gpus), get_engine("slime"), Workload()
    space = load_space(None)
    t0 = time.perf_counter()
    layouts = [lay for _, lay in space.enumerate(model, cluster.world_size, wl, engine)]
    t_enum = time.perf_counter() - t0
    t0 = time.perf_counter()
    cols = LayoutColumns.from_layouts(layouts)
    t_cols = time.perf_counter() - t0
    times, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        b = estimate_batch(model, cluster, cols, wl, engine)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    dt = min(times)
    n = len(layouts)
    best = int(np.argmax(np.where(b.fits, b.tokens_per_s_per_gpu, -np.inf)))
    print(f"{name} on {gpus}: {n:,} layouts (enumerated in {t_enum:.1f} s, to columns in {t_cols:.2f} s); "
          f"{int(b.fits.sum()):,} predicted to fit")
    print(f"  estimate_batch: {dt:.3f} s on one core (best of {repeat}): {n / dt:,.0f} layouts/s "
          f"({1e6 * dt / n:.1f} us per layout); CPU time {min(cpu):.3f} s: {n / min(cpu):,.0f} layouts/s")
    print(f"  fastest that fits: {layouts[best].label()} at {b.tokens_per_s_per_gpu[best]:,.1f} tokens/s/GPU")
    if n_check:
        print(f"  against estimate() on {n_check} random rows: largest relative difference "
              f"{check(model, cluster, layouts, b, wl, engine, n_check):.3g}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(CASES), help="comma-separated MODEL:GPUS cases")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--check", type=int, default=200)
    args = ap.parse_args()
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    except (AttributeError, OSError):
        pass
    for case in args.models.split(","):
        run(case, args.repeat, args.check)


if __name__ == "__main__":
    main()
