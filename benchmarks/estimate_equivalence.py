"""Benchmark check: every estimate term of this tree equals the one of a reference commit (default f11c0fc, the
estimator before issue 18's speed work) within 1e-9 relative, on random layouts of every bundled model.

Run by hand: `python benchmarks/estimate_equivalence.py` (20,000 layouts per bundled model; `--per-model N`
for a quick look, `--models A,B` for a few). The reference tree is extracted with `git archive` into a
temporary folder and run in a subprocess; the layouts are drawn here (the dense space's knobs plus
communication overlap and, for MoE models, EP / ETP / dispatcher) and handed to both sides as dictionaries,
so both estimate the same layouts. What is compared: every figure of `Estimate.memory` and `Estimate.perf`
(stages, per-stage parts and overheads, breakdown) by the names both trees read them under (`canonical`). Exit
status 1 when a term differs. `--reference bb2a96d` compares with the tree before `estimate()` became a batch of one
(issue 18: the scalar composition then, the array engine now).

`--batch`: instead of a reference commit, this tree's batches against its batches of one: the same random layouts
are estimated one by one with `estimate()` and as one `LayoutColumns` batch per (model, cluster) with `estimate_batch`,
and every term (`estimate_terms` / `BatchEstimate.terms`: per-stage time parts and memory terms, named overheads, the
step, tokens/s/GPU, peaks, the verdict) must agree within 1e-9 relative, per model too.
MoE models draw from the dense space's knobs and the `moe` space's (EP, ETP, dispatcher, the expert all-to-all overlap).
`--batch --low-precision`: the same with every layout given a precision class drawn among those its GPU runs (bf16,
fp8 delayed / tensorwise / blockwise with or without --fp8-param-gather on Hopper and Blackwell, mxfp8 and nvfp4 on
Blackwell: a 16xB200 cluster joins the draw) and, on a model with multi-token-prediction modules, its MTP layers on
half the layouts; the largest relative difference is printed per model and recipe. `--low-precision` without
`--batch` draws the same layouts for the comparison with the reference commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
REFERENCE = "f11c0fc"
CLUSTERS = ("8xH200", "64xH100", "16xH100")
RTOL = 1e-9


def flatten(obj, prefix: str, out: dict) -> dict:
    """Every number inside an estimate (dataclasses, dicts, lists), by path."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if type(obj).__name__ in ("Layout", "ModelSpec", "Cluster", "Workload", "Engine", "Batching"):
            return out
        for f in dataclasses.fields(obj):
            flatten(getattr(obj, f.name), f"{prefix}.{f.name}", out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            flatten(v, f"{prefix}.{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flatten(v, f"{prefix}[{i}]", out)
    elif isinstance(obj, bool):
        out[prefix] = float(obj)
    elif isinstance(obj, (int, float)):
        out[prefix] = float(obj)
    return out


MEMORY_STAGE = ("stage", "layers", "params", "weights_gib", "grads_gib", "optimizer_gib", "activations_gib",
                "logits_gib", "overhead_gib", "host_optimizer_gib", "inflight_microbatches", "expert_params",
                "expert_weights_gib", "expert_grads_gib", "expert_optimizer_gib", "expert_activations_gib",
                "allocated_gib", "reserved_gib", "total_gib", "overheads")
PERF = ("step_time_s", "tokens_per_s_per_gpu", "mfu", "usd_per_million_tokens", "pipeline_s", "bubble_s", "dp_comm_s",
        "optimizer_s", "overhead_s")
BREAKDOWN = ("critical_stage", "microbatches", "compute_s", "exposed_comm_s", "bubble_s", "optimizer_s", "overhead_s",
             "total_s")


def canonical(e) -> dict:
    """The figures of an `Estimate` by the names every tree since f11c0fc reads them under (the scalar records of
    older trees and the typed row views of `attune.estimator.terms` alike): memory per stage with its named overheads,
    the peaks and host figures, the step, each stage's time parts and the step breakdown."""
    m, p = e.memory, e.perf
    return {
        "memory": {"capacity_gib": m.capacity_gib, "host_capacity_gib": m.host_capacity_gib,
                   "host_needed_gib": m.host_needed_gib, "peak_gib": m.peak_gib, "peak_stage": m.peak_stage,
                   "peak_allocated_gib": m.peak_allocated_gib, "peak_reserved_gib": m.peak_reserved_gib,
                   "fits": m.fits, "microbatches": m.batch.microbatches,
                   "stages": [{k: getattr(s, k) for k in MEMORY_STAGE} for s in m.stages]},
        "perf": {**{k: getattr(p, k) for k in PERF},
                 "stages": [{"stage": s.stage, "forward_s": s.forward_s, "backward_s": s.backward_s,
                             "compute_s": s.compute_s, "comm_s": s.comm_s, "parts": s.parts} for s in p.stages],
                 "breakdown": {k: getattr(p.breakdown, k) for k in BREAKDOWN}},
    }


def dump(cases_path: str, out_path: str) -> None:
    """Estimate every case of `cases_path` with the attune on PYTHONPATH and write the flattened terms."""
    from attune.estimator import estimate
    from attune.spec.engine import get_engine
    from attune.spec.hardware import parse_cluster
    from attune.spec.identity import layout_from_dict
    from attune.spec.layout import Workload
    from attune.spec.model import load_model

    cases = json.loads(Path(cases_path).read_text())
    models, clusters = {}, {}
    engine, wl = get_engine("slime"), Workload()
    rows = []
    for c in cases:
        model = models.get(c["model"]) or models.setdefault(c["model"], load_model(c["model"]))
        cluster = clusters.get(c["gpus"]) or clusters.setdefault(c["gpus"], parse_cluster(c["gpus"]))
        lay = layout_from_dict(c["layout"])
        try:
            e = estimate(model, cluster, lay, wl, engine, check_layout=False)
        except Exception as err:  # noqa: BLE001 (recorded: both sides must fail alike)
            rows.append({"error": type(err).__name__})
            continue
        out: dict = {}
        flatten(canonical(e), "", out)
        rows.append(out)
    Path(out_path).write_text(json.dumps(rows))


def random_params(space, rng) -> dict:
    """One value of every knob of the space, uniformly."""
    return {k: (lambda d: d[int(rng.integers(len(d)))])(space.domain(k)) for k in space.knobs}


def draw_cases(names: list[str], per_model: int, seed: int, clusters: tuple[str, ...] = CLUSTERS) -> list[dict]:
    """`per_model` random valid layouts per model (rejection sampling over the knobs)."""
    from attune.errors import AttuneError
    from attune.search.space import SearchSpace, load_space
    from attune.spec.engine import get_engine
    from attune.spec.hardware import parse_cluster
    from attune.spec.layout import Workload
    from attune.spec.model import load_model

    base = load_space(None)
    engine, wl = get_engine("slime"), Workload()
    rng = np.random.default_rng(seed)
    cases = []
    for name in names:
        model = load_model(name)
        knobs, fixed = dict(base.knobs, comm_overlap=(False, True)), dict(base.fixed)
        if model.moe is not None:  # the moe space's knobs too (EP, ETP, dispatcher, the a2a overlap, optimizer offload)
            moe = load_space("moe")
            knobs.update(moe.knobs)
            fixed = {k: v for k, v in {**fixed, **moe.fixed}.items() if k not in knobs}
        space = SearchSpace(name="equivalence", path="", knobs=knobs, fixed=fixed)
        got, tries = 0, 0
        while got < per_model and tries < 50 * per_model:
            tries += 1
            gpus = clusters[int(rng.integers(len(clusters)))]
            try:
                lay = space.to_layout(random_params(space, rng), model, parse_cluster(gpus).world_size, wl, engine)
            except AttuneError:
                continue
            cases.append({"model": name, "gpus": gpus, "layout": lay.to_dict()})
            got += 1
    return cases


def compare(a: list[dict], b: list[dict], cases: list[dict]) -> tuple[int, float, list[str]]:
    """(terms compared, largest relative difference, first disagreements)."""
    n, worst, bad = 0, 0.0, []
    for i, (x, y) in enumerate(zip(a, b)):
        if set(x) != set(y):
            bad.append(f"case {i} ({cases[i]['model']}): terms differ: {sorted(set(x) ^ set(y))[:5]}")
            continue
        for k, v in x.items():
            w = y[k]
            n += 1
            if v == w or (isinstance(v, float) and math.isnan(v) and math.isnan(w)):
                continue
            rel = abs(v - w) / max(abs(v), abs(w))
            worst = max(worst, rel)
            if rel > RTOL and len(bad) < 20:
                bad.append(f"case {i} ({cases[i]['model']} {cases[i]['gpus']}): {k}: {v!r} vs {w!r}")
    return n, worst, bad


def batch_check(cases: list[dict]) -> tuple[int, float, list[str], dict]:
    """(terms compared, largest relative difference, first disagreements, per model (layouts, terms, largest relative
    difference)): estimate_batch per (model, cluster) against estimate() row by row, on this tree."""
    from attune.estimator import estimate, estimate_batch
    from attune.estimator.terms import estimate_terms
    from attune.spec.columns import LayoutColumns
    from attune.spec.engine import get_engine
    from attune.spec.hardware import parse_cluster
    from attune.spec.identity import layout_from_dict
    from attune.spec.layout import Workload
    from attune.spec.model import load_model

    engine, wl = get_engine("slime"), Workload()
    groups: dict[tuple[str, str], list[int]] = {}
    for i, c in enumerate(cases):
        groups.setdefault((c["model"], c["gpus"]), []).append(i)
    n = 0
    worst, bad = 0.0, []
    per: dict[str, list] = {}
    per_recipe: dict[tuple[str, str], float] = {}  # largest relative difference per (model, recipe)
    for (name, gpus), idx in groups.items():
        model, cluster = load_model(name), parse_cluster(gpus)
        lays = [layout_from_dict(cases[i]["layout"]) for i in idx]
        b = estimate_batch(model, cluster, LayoutColumns.from_layouts(lays), wl, engine)
        row = per.setdefault(name, [0, 0, 0.0])
        n0, w0 = n, worst
        worst = 0.0
        for j, lay in enumerate(lays):
            e = estimate(model, cluster, lay, wl, engine, check_layout=False)
            x, y = estimate_terms(e.memory, e.perf), b.terms(j)
            key = (name, cases[idx[j]].get("recipe", "bf16") + (" +MTP" if lay.mtp_layers else ""))
            per_recipe.setdefault(key, 0.0)
            for k, v in x.items():
                w = y.get(k, 0.0 if k.startswith("overhead.") else math.nan)
                n += 1
                if v == w:
                    continue
                rel = abs(v - w) / max(abs(v), abs(w)) if not math.isnan(w) else math.inf
                worst = max(worst, rel)
                per_recipe[key] = max(per_recipe[key], rel)
                if rel > RTOL and len(bad) < 20:
                    bad.append(f"{name} {gpus} {lay.label()}: {k}: scalar {v!r} batch {w!r}")
        row[0] += len(lays)
        row[1] += n - n0
        row[2] = max(row[2], worst)
        worst = max(worst, w0)
    batch_check.per_recipe = per_recipe  # (model, recipe) -> largest relative difference, for --low-precision's table
    return n, worst, bad, per


def low_precision_cases(cases: list[dict], seed: int) -> list[dict]:
    """Each case with a precision class its GPU runs (and bf16) and, for a model with MTP modules, its MTP layers
    on half the cases (uniform full recompute then recomputes 1 layer per group, as the MTP rule asks)."""
    from attune.spec.hardware import parse_cluster
    from attune.spec.identity import layout_from_dict
    from attune.spec.model import load_model
    from attune.spec.precision import RECIPES, fields_for, hardware_refusal

    rng = np.random.default_rng(seed + 1)
    out = []
    for c in cases:
        lay, gpu = layout_from_dict(c["layout"]), parse_cluster(c["gpus"]).gpu
        allowed = [r for r in RECIPES if not hardware_refusal(dataclasses.replace(lay, **fields_for(r)),
                                                                 gpu.generation, gpu.is_cpu)]
        recipe = allowed[int(rng.integers(len(allowed)))]
        kw = fields_for(recipe, param_gather=recipe.startswith("fp8") and bool(rng.integers(2)))
        mtp = load_model(c["model"]).mtp_layers
        if mtp and rng.integers(2):
            kw["mtp_layers"] = mtp
            if lay.recompute_method == "uniform":
                kw["recompute_num_layers"] = 1
        out.append(dict(c, layout=dataclasses.replace(lay, **kw).to_dict(), recipe=recipe))
    return out


def run_side(tree: Path, cases_file: str, out_file: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "estimate_equivalence.py"), "--dump",
                             cases_file, out_file], env=env, cwd=str(tree))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-model", type=int, default=20_000)
    ap.add_argument("--models", default=None, help="comma-separated model names (default: every bundled model)")
    ap.add_argument("--reference", default=REFERENCE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", action="store_true", help="whole batches against batches of one, on this tree")
    ap.add_argument("--low-precision", action="store_true",
                    help="every precision class the GPU runs, and MTP layers where the model has them")
    ap.add_argument("--dump", nargs=2, metavar=("CASES", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dump:
        dump(*args.dump)
        return
    from attune.spec.model import bundled_names

    names = args.models.split(",") if args.models else bundled_names()
    t0 = time.perf_counter()
    if args.batch:
        cases = draw_cases(names, args.per_model, args.seed,
                           CLUSTERS + ("16xB200",) if args.low_precision else CLUSTERS)
        if args.low_precision:
            cases = low_precision_cases(cases, args.seed)
        n, worst, bad, per = batch_check(cases)
        for name, (rows, terms, w) in per.items():
            print(f"  {name}: {rows:,} layouts, {terms:,} terms, largest relative difference {w:.3g}")
        print(f"{len(cases):,} layouts of {len(names)} models, {n:,} terms: "
              f"estimate_batch against estimate(), largest relative difference {worst:.3g} (tolerance {RTOL:g}); "
              f"{time.perf_counter() - t0:.0f} s")
        if args.low_precision:
            for (name, recipe), w in sorted(batch_check.per_recipe.items()):
                print(f"  {name:28s} {recipe:22s} largest relative difference {w:.3g}")
        for line in bad:
            print("  " + line)
        sys.exit(1 if bad else 0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        old = tmp / "old"
        old.mkdir()
        arch = subprocess.run(["git", "-C", str(REPO), "archive", args.reference, "attune"], check=True,
                              capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=arch, check=True)
        cases = draw_cases(names, args.per_model, args.seed,
                           CLUSTERS + ("16xB200",) if args.low_precision else CLUSTERS)
        if args.low_precision:
            cases = low_precision_cases(cases, args.seed)
        (tmp / "cases.json").write_text(json.dumps(cases))
        procs = [run_side(old, str(tmp / "cases.json"), str(tmp / "old.json")),
                 run_side(REPO, str(tmp / "cases.json"), str(tmp / "new.json"))]
        if any(p.wait() for p in procs):
            sys.exit("a side failed")
        a = json.loads((tmp / "old.json").read_text())
        b = json.loads((tmp / "new.json").read_text())
    n, worst, bad = compare(a, b, cases)
    print(f"{len(cases):,} layouts of {len(names)} models ({args.per_model:,} per model asked), {n:,} terms compared "
          f"against {args.reference}: largest relative difference {worst:.3g} (tolerance {RTOL:g}); "
          f"{time.perf_counter() - t0:.0f} s")
    for line in bad:
        print("  " + line)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
