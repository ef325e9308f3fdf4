"""Benchmark (issue 15): what the knobs beyond the seed cost the search, and what they buy.

Scores the default dense space for Qwen3.6-27B on 8 x H200 (slime, 8,192-token rows, global batch 128) on
one core, with and without the issue-15 knobs (recompute_modules, offload_fraction, activation_offload,
comm_overlap, stage_layout), and prints the layouts, the seconds and the ablation table.

Run by hand: `python benchmarks/knobs_space.py [--model M --gpus G --engine E]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from attune.estimator.coefficients import coefficients_for
from attune.search.ablation import ablation_of_table
from attune.search.scoring import score_space
from attune.search.space import load_space
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import load_model

NEW_KNOBS = ("recompute_modules", "offload_fraction", "activation_offload", "comm_overlap", "stage_layout")


def main() -> None:  # entry point
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen3.6-27B")
    ap.add_argument("--gpus", default="8xH200")
    ap.add_argument("--engine", default="slime")
    a = ap.parse_args()
    model, cluster, engine, wl = load_model(a.model), parse_cluster(a.gpus), get_engine(a.engine), Workload()
    coef = coefficients_for(cluster.gpu)
    full = load_space(None)
    seed_only = dataclasses.replace(full, knobs={k: v for k, v in full.knobs.items() if k not in NEW_KNOBS},
                                    path=full.path + "#without-issue-15-knobs")
    for name, sp in (("without the issue-15 knobs", seed_only), ("with them (dense.yaml)", full)):
        t = time.perf_counter()
        table = score_space(sp, model, cluster, wl, engine, coef)
        print(f"{name}: {len(table.layouts):,} layouts scored in {time.perf_counter() - t:.1f} s on one core")
    ab = ablation_of_table(table, full, cluster.gpu.capacity_gib * 0.98)
    print(f"best fitting (2% headroom): {ab.best_label} at {ab.best_tokens:,.1f} tokens/s/GPU; with none of the "
          f"issue-15 knobs: {ab.seed_label} at {ab.seed_tokens or 0:,.1f}")
    for r in ab.rows:
        print(f"- {r.knob}: without it {r.without_label} {r.without_tokens or 0:,.1f}; using it "
              f"{r.using_label or '-'} {r.using_tokens or 0:,.1f}; {r.limit}")


if __name__ == "__main__":
    main()
