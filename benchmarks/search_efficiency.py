"""Search efficiency: measured trials (and GPU-hours) each strategy needs to find the best layout of a world
whose truth differs from the model the way reality does. Run by hand (minutes on 2 cores):

    python benchmarks/search_efficiency.py [--kind structural|coefficient] [--worlds 8] [--trials 10] [--jobs N]

Two kinds of worlds, reported apart.

**Structural worlds** (`--kind structural`, the default; issue 20): truths that are not the model. A world
is the model's predictions times knob effects the model does not have, of either sign and with interactions,
drawn from a generator seeded by (target, world) only (`make_structural_world`):

* per knob unit (a TP / PP / VPP / CP / EP doubling, SP, selective or full recompute and its fraction of a
  chunk, optimizer offload, tokens per microbatch, the split's shift, the dispatcher): exp(N(mean, 0.04)), the
  means of TP, PP and recompute negative (penalties the model lacks: -2%, -2%, -4% per unit);
* interactions: a recompute penalty growing with PP (N(-0.03, 0.02) per PP doubling x recompute level),
  TP efficiency depending on SP (N(0, 0.04) per TP doubling without SP), TP x PP (N(0, 0.02));
* a smooth random landscape: 3 bumps of N(0, 0.03) over knob distance (length 2 knob steps) around random
  layouts; the sum is centred on its median over the space (effects that re-rank, not a level);
* run-to-run noise 2-5% (log-normal) per layout; the strategies see the noisy table, the metrics judge the
  noise-free throughput;
* memory: every stage's predicted peak x (1 + U(0, 5%)) (memory runs 0-5% over the model) plus per-stage
  offsets: U(-4%, +4%) of capacity for each stage position (first, middle, last) and U(-3%, +3%) per PP
  degree, the total offset clipped to +-8% of capacity;
* best layouts near the edge: a world is redrawn (at most 30 times, same seed stream) until its best layout
  sits within EDGE_WORLD_MARGIN of capacity.

The targets: a dense model on 8 x H200 (Qwen3.6-27B, the default dense space), a dense model at 64 GPUs
(Llama-3.1-70B on 64 x H200, the reduced space benchmarks/spaces/dense64.yaml: the full dense space enumerates
slowly at 64 GPUs) and a MoE model (Qwen3-30B-A3B on 8 x H200, the bundled moe space). Strategies, all through
the replay runner: attune's default sampler with its stop rule (p_stop 0.05, min_gain 1%) up to --trials,
plain TPE with the predicted memory as a constraint (its proposals predicted out of memory are pruned without a
measurement; at most --trials measured trials, the report's horizon), random among the layouts predicted to fit, and
the grid in predicted order (FlagScale AutoTuner's order). A sampler that stopped keeps its best at 5 and 10 trials. Per
world it also reports the stop rule's claimed remaining regret against the actual regret at its stop.

**Coefficient worlds** (`--kind coefficient`, issue 11) are described below: the estimator itself with scaled
coefficients, small per-knob effects and memory offsets, so the model's own ranking stays nearly right.

A world is a complete table of measured outcomes over the default dense space, generated from the estimator
with a random generator seeded by (target, world number) only: nothing a strategy does changes it, and every
strategy replays the same table.

* perturbed coefficients: every bounded performance coefficient times exp(U(-0.2, 0.2)), clipped to its
  physical bounds (`Coefficients` field metadata);
* multiplicative effects the model does not have, by knob: per doubling of TP and of PP, per unit of full
  recompute, selective recompute, VPP and optimizer offload, each exp(N(0, EFFECT_SIGMA));
* run-to-run noise: one draw per layout, log-normal with a world-wide sigma drawn in [0.02, 0.05]; the
  strategies see the noisy table, the metrics judge the noise-free throughput of what they measured;
* memory (MEMORY_*): a world-wide offset U(-2%, +6%) of capacity, U(0, 2%) more on the first and on the last
  stage, and a fragmentation factor U(0, 3%) on the predicted peak: up to ~11% of capacity in all (the
  calibration's peak-memory MAPE is 4.9%), so in some worlds the model's predicted fits near the edge run
  out of memory, and in others layouts predicted just over capacity fit;
* cost: each trial pays STARTUP_S of start-up on every GPU, plus 20 steps (ok) or one step (OOM).

Layouts the shipped model predicts more than 10% over capacity get no throughput (OOM rows): the same cut the
sampler makes. Each strategy's trials go through the replay runner answering from the world's table; the first
trial is always the model's baseline layout. Strategies: attune's sampler with recalibration, without it, a
grid in predicted order after memory pruning (FlagScale AutoTuner's order), random among predicted fits, plain
Optuna TPE with the predicted memory as a constraint. The stop rule is switched off here (p_stop ~ 0) so every
strategy gets the same number of trials. Worlds run in parallel worker processes (--jobs).
"""

from __future__ import annotations  # entry point

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import pickle
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import optuna

from attune.estimator import estimate
from attune.estimator.coefficients import coefficients_for
from attune.runners.base import TrialSpec
from attune.runners.replay import ReplayRow, ReplayRunner
from attune.search import sampler as sampler_module
from attune.search import scoring
from attune.search.recalibrate import fitted_bounds
from attune.search.records import records
from attune.search.sampler import layout_of
from attune.search.scoring import default_workers, score_space
from attune.search.space import FEATURES, layout_features, layout_key, load_space
from attune.search.tuner import TuneConfig, Tuner
from attune.spec.baselines import baseline_layout
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import load_model

TARGETS = (("Qwen3.6-27B", "8xH200", None), ("Llama-3.1-8B", "8xH100", None))
STRATEGIES = ("attune (recalibrated)", "attune (no recalibration)", "grid, predicted order", "random among fits",
              "TPE + memory constraint")
# structural worlds (issue 20): targets (model, GPUs, search space) and strategies
STRUCTURAL_TARGETS = (("Qwen3.6-27B", "8xH200", None),
                      ("Llama-3.1-70B", "64xH200", str(Path(__file__).parent / "spaces" / "dense64.yaml")),
                      ("Qwen3-30B-A3B", "8xH200", "moe"))
STRUCTURAL_STRATEGIES = ("attune (default, stop rule on)", "TPE + memory constraint", "random among fits",
                         "grid, predicted order")
# knob effects of a structural world: (feature, mean, sd) per knob unit (attune.search.space.FEATURES); the
# means of TP, PP and recompute are penalties the model lacks (the measured tables), the sds the
# corpus's per-series error (MAPE up to 9.5%, `attune calibrate`) spread over a few knob steps
STRUCT_EFFECTS = (("log2_tp", -0.02, 0.04), ("sp", 0.0, 0.03), ("log2_pp", -0.02, 0.04), ("first_shift", 0.0, 0.02),
                  ("last_shift", 0.0, 0.02), ("log2_vpp", 0.0, 0.04), ("log2_cp", 0.0, 0.04),
                  ("selective", -0.02, 0.03), ("full", -0.02, 0.04), ("recompute_fraction", -0.04, 0.04),
                  ("uniform", 0.0, 0.03), ("offload", 0.0, 0.04), ("log2_tokens", 0.0, 0.03), ("log2_ep", 0.0, 0.04),
                  ("log2_etp", 0.0, 0.04), ("allgather", 0.0, 0.04))
STRUCT_BUMPS, STRUCT_BUMP_SD, STRUCT_BUMP_LENGTH = 3, 0.03, 2.0
# memory of a structural world: scale on every predicted peak, offsets per stage position and per PP degree
# (fractions of capacity), clipped to +-STRUCT_MEMORY_CLIP of capacity
STRUCT_MEMORY_SCALE, STRUCT_MEMORY_POSITION, STRUCT_MEMORY_PP, STRUCT_MEMORY_CLIP = (0.0, 0.05), 0.04, 0.03, 0.08
# a structural world's best layout sits within this fraction of capacity of the edge (else it is redrawn)
EDGE_WORLD_MARGIN = 0.05
WITHIN = 0.02  # "reached": within 2% of the world's best layout
# knob effects the model does not have: log-normal sigma per knob unit (a 4% error per TP / PP doubling or per
# recompute unit, stacking to ~10% between distant layouts: the corpus's per-series MAPE reaches 9.5%,
# `attune calibrate`)
EFFECT_SIGMA = 0.04
# memory truth vs model, as fractions of capacity: a world-wide offset (allocator reserve, NCCL and CUDA-graph
# buffers the model does not itemise), extra on the first and on the last stage (embedding / logits buffers),
# and a fragmentation factor on the predicted peak. The calibration's peak-memory MAPE is 4.9% (`attune
# calibrate`, memory.yaml), so a peak near capacity is off by ~5% of capacity (7 GiB on H200, 4 GiB on H100);
# the ranges stay within ~10% of capacity in total.
MEMORY_OFFSET = (-0.02, 0.06)
MEMORY_POSITION = (0.0, 0.02)
MEMORY_FRAGMENTATION = (0.0, 0.03)
# every trial pays a start-up (process launch, model build, checkpoint load) before its first step, seconds:
# an assumption (a few minutes for a 27B checkpoint on one node); an OOM trial pays it and one step
STARTUP_S = 180.0
# where a study's journal lives while it runs: memory-backed /dev/shm where there is one (the journal storage
# fsyncs every write, ~1,400 per 10-trial TPE study: seconds idle, minutes on a loaded shared disk); else the
# system's temporary folder
SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def make_world(target, rng, shipped):
    """One world: (replay rows, noise-free tokens/s/GPU by replay key). Drawn from `rng` alone (seeded by
    target and world number), never from anything a strategy does, and the same table for every strategy."""
    model, cluster, workload, engine, space, table = target
    names = [n for n, _, _ in fitted_bounds(shipped)]
    bounds = {n: (lo, hi) for n, lo, hi in fitted_bounds(shipped)}
    coef = dataclasses.replace(shipped, **{n: float(np.clip(getattr(shipped, n) * math.exp(rng.uniform(-0.2, 0.2)),
                                                               *bounds[n])) for n in names})
    eff = {k: rng.normal(0, EFFECT_SIGMA) for k in ("tp", "pp", "full", "selective", "vpp", "offload")}
    noise = rng.uniform(0.02, 0.05)
    cap = cluster.gpu.capacity_gib
    mem_all = rng.uniform(*MEMORY_OFFSET) * cap
    mem_first, mem_last = rng.uniform(*MEMORY_POSITION) * cap, rng.uniform(*MEMORY_POSITION) * cap
    frag = rng.uniform(*MEMORY_FRAGMENTATION)
    gpus = cluster.world_size
    rows, truth = [], {}
    F = table.features
    for i, lay in enumerate(table.layouts):
        f = F[i]
        st = table.stage_gib[i]
        peaks = tuple(p * (1 + frag) + mem_all + (mem_first if s == 0 else 0.0)
                      + (mem_last if s == len(st) - 1 else 0.0) for s, p in enumerate(st))
        if not np.isfinite(table.tokens[i]) or max(peaks) > cap or not table.host_fits[i]:
            stage = int(np.argmax(peaks))
            step = table.step_time_s[i] if np.isfinite(table.step_time_s[i]) else 10.0
            rows.append(ReplayRow(line=i + 2, layout=lay, outcome="oom", peak_gib=peaks, oom_stage=stage,
                                  gpu_hours=gpus * (STARTUP_S + step) / 3600.0))
            continue
        t = estimate(model, cluster, lay, workload, engine, coef, check_layout=False).perf.tokens_per_s_per_gpu
        t *= math.exp(eff["tp"] * f[0] + eff["pp"] * f[2] + eff["full"] * f[9] + eff["selective"] * f[7]
                      + eff["vpp"] * f[5] + eff["offload"] * f[11])
        truth[layout_key(lay, model.num_layers)] = t
        t *= math.exp(rng.normal(0, noise))  # what a run measures
        step = workload.tokens_per_step / (t * gpus)
        rows.append(ReplayRow(line=i + 2, layout=lay, outcome="ok", tokens_per_s_per_gpu=t, step_time_s=step,
                              peak_gib=peaks, gpu_hours=gpus * (STARTUP_S + workload.steps * step) / 3600.0))
    return rows, truth


def make_structural_world(target, rng, baseline):
    """One structural world (module docstring): (replay rows, noise-free tokens/s/GPU by layout key, margin of
    its best layout to capacity as a fraction). Drawn from `rng` alone."""
    model, cluster, workload, engine, space, table = target
    L = model.num_layers
    layouts, stage_gib = list(table.layouts), list(table.stage_gib)
    tokens, host = table.tokens.copy(), table.host_fits.copy()
    F = table.features
    if table.row(layout_key(baseline, L)) is None:  # the baseline outside the space: one more row
        e = estimate(model, cluster, baseline, workload, engine, table.coefficients, check_layout=False)
        layouts.append(baseline)
        stage_gib.append(tuple(x.total_gib for x in e.memory.stages))
        tokens = np.append(tokens, e.perf.tokens_per_s_per_gpu)
        host = np.append(host, e.memory.host_fits)
        F = np.vstack([F, layout_features(baseline, L)])
    cap = cluster.gpu.capacity_gib
    idx = {f: i for i, f in enumerate(FEATURES)}
    pp = np.array([lay.pp for lay in layouts])
    stages = np.full((len(layouts), int(pp.max())), np.nan)  # predicted peak per stage, GiB (NaN past the last)
    stages[:len(table), :table.stage_peaks_gib.shape[1]] = table.stage_peaks_gib
    if len(layouts) > len(table):
        stages[-1, :len(stage_gib[-1])] = stage_gib[-1]
    s_idx = np.arange(stages.shape[1])[None, :]
    has_stage = s_idx < pp[:, None]
    for _ in range(30):
        eff = sum(F[:, idx[f]] * rng.normal(m, sd) for f, m, sd in STRUCT_EFFECTS)
        rec = F[:, idx["selective"]] + F[:, idx["full"]] * (1 + F[:, idx["recompute_fraction"]])
        eff = eff + rng.normal(-0.03, 0.02) * F[:, idx["log2_pp"]] * rec
        eff = eff + rng.normal(0, 0.04) * F[:, idx["log2_tp"]] * (1 - F[:, idx["sp"]])
        eff = eff + rng.normal(0, 0.02) * F[:, idx["log2_tp"]] * F[:, idx["log2_pp"]]
        for _b in range(STRUCT_BUMPS):
            c = F[rng.integers(len(F))]
            eff = eff + rng.normal(0, STRUCT_BUMP_SD) * np.exp(-np.abs(F - c).sum(1) / STRUCT_BUMP_LENGTH)
        eff = eff - np.median(eff[np.isfinite(tokens)])  # knob effects, not a level: the model's level stays
        scale = rng.uniform(*STRUCT_MEMORY_SCALE)
        by_pos = rng.uniform(-STRUCT_MEMORY_POSITION, STRUCT_MEMORY_POSITION, 3) * cap
        by_pp = {p: rng.uniform(-STRUCT_MEMORY_PP, STRUCT_MEMORY_PP) * cap for p in sorted(set(pp))}
        noise = rng.uniform(0.02, 0.05)
        true = np.exp(np.log(np.nan_to_num(tokens, nan=1e-9)) + eff)
        # every stage's peak x (1 + scale) + its position's and its PP degree's offset, clipped (as columns:
        # rows x stages, -inf past a layout's last stage)
        where = np.where(s_idx == 0, 0, np.where(s_idx == pp[:, None] - 1, 2, 1))
        off = np.clip(by_pos[where] + np.array([by_pp[p] for p in pp])[:, None], -STRUCT_MEMORY_CLIP * cap,
                      STRUCT_MEMORY_CLIP * cap)
        peaks = np.where(has_stage, stages * (1 + scale) + off, -np.inf)
        top = peaks.max(axis=1)
        fit = np.isfinite(tokens) & host & (top <= cap)
        if not fit.any():
            continue
        b = int(np.argmax(np.where(fit, true, -np.inf)))
        margin = (cap - top[b]) / cap
        if margin <= EDGE_WORLD_MARGIN:
            break
    rows, truth = [], {}
    gpus = cluster.world_size
    oom_stage = np.where(has_stage, peaks - cap, -np.inf).argmax(axis=1).tolist()
    peak_rows = [tuple(r[:n]) for r, n in zip(peaks.tolist(), pp.tolist())]
    keys = _layout_keys(table, layouts, L)
    for i, lay in enumerate(layouts):
        st = table.step_time_s[i] if i < len(table) and np.isfinite(table.step_time_s[i]) else 10.0
        if not fit[i]:
            rows.append(ReplayRow(line=i + 2, layout=lay, outcome="oom", peak_gib=peak_rows[i], oom_stage=oom_stage[i],
                                  gpu_hours=gpus * (STARTUP_S + st) / 3600.0))
            continue
        truth[keys[i]] = float(true[i])
        t = float(true[i]) * math.exp(rng.normal(0, noise))
        step = workload.tokens_per_step / (t * gpus)
        rows.append(ReplayRow(line=i + 2, layout=lay, outcome="ok", tokens_per_s_per_gpu=t, step_time_s=step,
                              peak_gib=peak_rows[i], gpu_hours=gpus * (STARTUP_S + workload.steps * step) / 3600.0))
    return rows, truth, margin


_KEYS: dict = {}  # (id of a target's scored table, rows) -> the layout keys of its worlds' rows (per process)


def _layout_keys(table, layouts, num_layers):
    """layout_key of every layout of a world (the same for every world of a target: computed once per process)."""
    k = (id(table), len(layouts))
    if k not in _KEYS:
        _KEYS[k] = [layout_key(lay, num_layers) for lay in layouts]
    return _KEYS[k]


def trace_of(runner, target, layouts):
    """(tokens or None, gpu_hours, oom) per layout, measured through the replay runner."""
    model, cluster, workload, engine, _, _ = target
    out = []
    for lay in layouts:
        r = runner.run(TrialSpec(model=model, cluster=cluster, layout=lay, workload=workload, engine=engine))
        out.append((lay, r.gpu_hours, r.status == "oom"))
    return out


def run_tuner(target, runner, baseline, note, trials, sampler, recal, seed, stop_rule=False, info=None):
    model, cluster, workload, engine, space, _ = target
    with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
        cfg = TuneConfig(model=model, cluster=cluster, engine=engine, workload=workload, space=space, runner=runner,
                         baseline=baseline, baseline_note=note, trials=trials, candidates=32, seed=seed,
                         storage=str(Path(d) / "s.journal"), out_dir=Path(d), sampler=sampler, recalibrate=recal,
                         p_stop=0.05 if stop_rule else 1e-9)
        out = Tuner(cfg).run()
        meas = [r for r in records(out.study) if r.is_measured]
        if info is not None:
            info.update(stop_kind=out.stop_kind, claimed=out.remaining_regret,
                        edge_steps=len(out.study.user_attrs.get("edge_steps", [])))
    return [(layout_of(r.layout), r.gpu_hours or 0.0, r.outcome == "oom") for r in meas][:trials]


def metrics(trace, truth, num_layers):
    """Judged on the world's noise-free throughput of the layouts a strategy measured."""
    best = max(truth.values())
    so_far, hours, reached, reached_h = 0.0, 0.0, None, None
    regret = {}
    for k, (lay, h, oom) in enumerate(trace, start=1):
        hours += h
        so_far = max(so_far, 0.0 if oom else truth.get(layout_key(lay, num_layers), 0.0))
        if reached is None and so_far >= (1 - WITHIN) * best:
            reached, reached_h = k, hours
        if k in (5, 10):
            regret[k] = 1 - so_far / best
    for k in (5, 10):
        regret.setdefault(k, 1 - so_far / best)
    return dict(trials=reached, hours=reached_h, r5=regret[5], r10=regret[10], ooms=sum(o for _, _, o in trace),
                final=1 - so_far / best, n=len(trace))


def pct(xs, q, cap):
    vals = sorted(cap if x is None else x for x in xs)
    v = vals[min(len(vals) - 1, int(math.ceil(q * len(vals))) - 1)]
    return "not reached" if v == cap else (f"{v:.0f}" if isinstance(v, int) else f"{v:.2f}")


_TARGETS: dict = {}  # target number -> (target, baseline, note, order, fits, shipped); inherited by forked workers
_SELECTED: set = set()  # structural strategies to run (empty: all); set before the workers fork
# short names of the structural strategies (--strategies)
SHORT = dict(zip(("default", "tpe", "random", "grid"), STRUCTURAL_STRATEGIES))


def grid_and_random(runner, target, baseline, order, fits, trials: int, rng):
    """The baseline, then the predicted-order grid and random layouts among predicted fits: their traces."""
    table = target[5]
    base_trace = trace_of(runner, target, [baseline])
    grid = base_trace + trace_of(runner, target, [table.layouts[i] for i in order[:trials - 1]])
    pick = rng.choice(fits, size=trials - 1, replace=False)
    return grid, base_trace + trace_of(runner, target, [table.layouts[i] for i in pick])


def run_world(job):
    """One world of one target: every strategy's metrics (run in a worker process)."""
    ti, w, trials = job
    target, baseline, note, order, fits, shipped = _TARGETS[ti]
    model, cluster = target[0], target[1]
    rng = np.random.default_rng([ti, w])
    rows, truth = make_world(target, rng, shipped)
    runner = ReplayRunner(f"world {ti}/{w}", model=model, world_size=cluster.world_size, rows=rows)
    grid, rand = grid_and_random(runner, target, baseline, order, fits, trials, rng)
    traces = {
        STRATEGIES[0]: run_tuner(target, runner, baseline, note, trials, "model", True, w),
        STRATEGIES[1]: run_tuner(target, runner, baseline, note, trials, "model", False, w),
        STRATEGIES[2]: grid, STRATEGIES[3]: rand,
        STRATEGIES[4]: run_tuner(target, runner, baseline, note, trials, "tpe", False, w),
    }
    return ti, w, max(truth.values()), {s: metrics(tr, truth, model.num_layers) for s, tr in traces.items()}


def run_structural_world(job):
    """One structural world of one target: every strategy's metrics, and the stop rule's claim."""
    ti, w, trials = job
    target, baseline, note, order, fits, shipped = _TARGETS[ti]
    model, cluster = target[0], target[1]
    rng = np.random.default_rng([100 + ti, w])
    rows, truth, margin = make_structural_world(target, rng, baseline)
    runner = ReplayRunner(f"structural world {ti}/{w}", model=model, world_size=cluster.world_size, rows=rows)
    grid, rand = grid_and_random(runner, target, baseline, order, fits, trials, rng)
    info: dict = {"claimed": None, "stop_kind": "", "edge_steps": 0}
    t0 = time.time()
    run = _SELECTED or set(STRUCTURAL_STRATEGIES)
    traces = {}
    if STRUCTURAL_STRATEGIES[0] in run:
        traces[STRUCTURAL_STRATEGIES[0]] = run_tuner(target, runner, baseline, note, trials, "model", True, w, True,
                                                     info)
    if STRUCTURAL_STRATEGIES[1] in run:
        traces[STRUCTURAL_STRATEGIES[1]] = run_tuner(target, runner, baseline, note, trials, "tpe", False, w)
    traces.update({k: v for k, v in ((STRUCTURAL_STRATEGIES[2], rand), (STRUCTURAL_STRATEGIES[3], grid)) if k in run})
    info["wall_s"] = time.time() - t0
    m = {s: metrics(tr, truth, model.num_layers) for s, tr in traces.items()}
    info["margin"] = margin
    return ti, w, max(truth.values()), m, info


def load_targets(targets, only=None, cache=None):
    """Score every target's space once (inherited by forked workers through _TARGETS); `only`: the target
    numbers to load (all when None); `cache`: a folder keeping each scored table (pickled, keyed by the tree's
    estimator inputs) between runs, so iterating on a few worlds does not rescore the spaces."""
    t0 = time.time()
    for ti, (mname, gpus, space_name) in enumerate(targets):
        if only is not None and ti not in only:
            continue
        model, cluster, engine, workload = load_model(mname), parse_cluster(gpus), get_engine("slime"), Workload()
        space = load_space(space_name)
        shipped = coefficients_for(cluster.gpu)
        table = cached_table(cache, space, model, cluster, workload, engine, shipped)
        target = (model, cluster, workload, engine, space, table)
        baseline, note = baseline_layout(model, cluster, workload, engine)
        fits = np.flatnonzero(table.host_fits & (table.peak_gib <= cluster.gpu.capacity_gib * 0.98)
                              & np.isfinite(table.tokens))
        order = fits[np.argsort(-table.tokens[fits])]
        # the sampler's coefficient sensitivities, once per target before the workers fork (they inherit them)
        had = len(getattr(table, "_sens", {}))
        table.sensitivities(tuple(n for n, _, _ in fitted_bounds(shipped)), table.sensitive_rows(cluster.gpu.capacity_gib))
        if cache is not None and len(getattr(table, "_sens", {})) != had:  # keep the sensitivities with the cached table
            cached_table(cache, space, model, cluster, workload, engine, shipped, rewrite=table)
        _TARGETS[ti] = (target, baseline, note, order, fits, shipped)
        print(f"{mname} on {gpus} ({space.name} space): {len(table):,} layouts, {len(fits):,} predicted to fit "
              f"({time.time() - t0:.0f} s)", flush=True)


def cached_table(cache, space, model, cluster, workload, engine, shipped, rewrite=None):
    """score_space, through a pickle in `cache` (None: no cache) named by a hash of what the table depends on
    (the target, the space file's knobs and the coefficients); the table enters score_space's own in-process
    cache, where the tuner finds it."""
    if cache is None:
        return score_space(space, model, cluster, workload, engine, shipped)
    key = repr((model.name, model.num_layers, cluster.spec, repr(workload), engine.name, space.path,
                sorted(space.knobs.items()), sorted(space.fixed.items()), repr(shipped)))
    path = Path(cache) / f"table-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pkl"
    if rewrite is not None:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(rewrite))
        tmp.replace(path)
        return rewrite
    if path.exists():
        table = pickle.loads(path.read_bytes())
        scoring._CACHE[(model.name, model.num_layers, cluster.spec, repr(workload), engine.name, space.path,
                        repr(sorted(space.knobs.items())), repr(sorted(space.fixed.items())), repr(shipped))] = table
        assert score_space(space, model, cluster, workload, engine, shipped) is table
        return table
    table = score_space(space, model, cluster, workload, engine, shipped)
    path.parent.mkdir(parents=True, exist_ok=True)
    return cached_table(cache, space, model, cluster, workload, engine, shipped, rewrite=table)


def summary(results, strategies, trials) -> str:
    cap = trials + 1
    lines = ["| strategy | median trials to 2% | p90 trials | reached | median GPU-h to 2% | p90 GPU-h | "
             "mean regret @5 | mean regret @10 | OOM trials (mean) |", "|---|---|---|---|---|---|---|---|---|"]
    for s in strategies:
        m = results[s]
        tr = [x["trials"] for x in m]
        hs = [x["hours"] for x in m]
        hcap = max((h for h in hs if h is not None), default=1.0) * 10
        lines.append(f"| {s} | {pct(tr, 0.5, cap)} | {pct(tr, 0.9, cap)} | {sum(t is not None for t in tr)} of {len(tr)} | "
                     f"{pct([h for h in hs], 0.5, hcap) if any(h is not None for h in hs) else '-'} | "
                     f"{pct([h for h in hs], 0.9, hcap) if any(h is not None for h in hs) else '-'} | "
                     f"{100 * statistics.mean(x['r5'] for x in m):.2f}% | {100 * statistics.mean(x['r10'] for x in m):.2f}% | "
                     f"{statistics.mean(x['ooms'] for x in m):.2f} |")
    return "\n".join(lines)


def world_groups(text: str) -> tuple[tuple[int, int], ...]:
    """`--groups`: comma-separated world ranges "LO-HI" or single numbers, as (lo, hi) pairs; argparse's one-line
    error names a range that is not one."""
    out = []
    for g in text.split(","):
        lo, dash, hi = g.strip().partition("-")
        try:
            pair = (int(lo), int(hi if dash else lo))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{g!r} is not a world range: give LO-HI or N, e.g. 0-7,8-14") from None
        if pair[0] > pair[1] or pair[0] < 0:
            raise argparse.ArgumentTypeError(f"{g!r}: a range runs from a world number up to one not below it")
        out.append(pair)
    return tuple(out)


def numbers(text: str) -> tuple[int, ...]:
    """`--targets` and `--world-list`: comma-separated non-negative numbers; argparse's one-line error names one that
    is not."""
    out = []
    for x in text.split(","):
        try:
            n = int(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{x.strip()!r} is not a number: give e.g. 0,1,2") from None
        if n < 0:
            raise argparse.ArgumentTypeError(f"{n}: numbers start at 0")
        out.append(n)
    return tuple(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("structural", "coefficient"), default="structural",
                    help="structural worlds (issue 20) or coefficient-scaling worlds (issue 11)")
    ap.add_argument("--worlds", type=int, default=8, help="worlds per target")
    ap.add_argument("--first-world", type=int, default=0,
                    help="number of the first world per target (worlds are seeded by target and number: a held-out "
                         "check runs numbers past those the default run reports)")
    ap.add_argument("--held-out-from", type=int, default=None,
                    help="also report the worlds numbered below this and from this on apart (tuned and held-out "
                         "worlds of one run: the targets' spaces are scored once)")
    ap.add_argument("--groups", type=world_groups, default=(),
                    help="also report these groups of world numbers apart: comma-separated ranges, e.g. "
                         "0-7,8-14,15-19,20-24 (tuned, held out, new and fresh worlds)")
    ap.add_argument("--trials", type=int, default=10, help="measured trials per strategy and world")
    ap.add_argument("--targets", type=numbers, default=None,
                    help="comma-separated target numbers to run (structural: 0 Qwen3.6-27B, 1 Llama-3.1-70B, "
                         "2 Qwen3-30B-A3B); all by default")
    ap.add_argument("--world-list", type=numbers, default=None,
                    help="comma-separated world numbers to run instead of --first-world/--worlds (iterate on a few)")
    ap.add_argument("--cache", default=None,
                    help="folder keeping the scored tables between runs (pickles; e.g. /tmp/attune-tables)")
    ap.add_argument("--strategies", default=None,
                    help="structural: comma-separated strategies to run (default, tpe, random, grid); all by default. "
                         "Runs of different strategies over the same worlds combine with --save and --merge")
    ap.add_argument("--honest-spread", action="store_true",
                    help="the default sampler with its empirical-Bayes GP scales and out-of-sample spread check on "
                         "(attune.search.sampler EMPIRICAL_SCALES, SPREAD_CHECK; off by default)")
    ap.add_argument("--structural-refit", action="store_true",
                    help="the default sampler with its coefficient refit weighed with the model's structural error and "
                         "its priors capped by their effect on the candidates (attune.search.sampler EFFECT_PRIORS; off "
                         "by default)")
    ap.add_argument("--family-probe", action="store_true",
                    help="the default sampler with one trial per unmeasured TP x PP family whose best candidate could "
                         "beat the best measured (attune.search.sampler FAMILY_PROBE; attune.search.family_probe)")
    ap.add_argument("--baseline-out-of-linear", action="store_true",
                    help="anchor the residual GP's linear term at the first measured proposal and leave the baseline "
                         "out of it (attune.search.sampler BASELINE_OUT_OF_LINEAR)")
    ap.add_argument("--oom-half-trial", action="store_true",
                    help="the default sampler's acquisition per expected trial, an OOM costing half a trial "
                         "(attune.search.sampler OOM_HALF_TRIAL)")
    ap.add_argument("--save", default=None, help="write every world's metrics to this JSON file")
    ap.add_argument("--merge", nargs="+", default=None,
                    help="report the worlds of saved runs (--save files, later files adding strategies to the same "
                         "worlds) instead of running anything")
    ap.add_argument("--jobs", type=int, default=default_workers(), help="worker processes (one world each); 1: the worlds run in this process (so "
                         "`python -m cProfile` sees the studies)")
    ap.add_argument("--out", default=str(Path(__file__).parent))
    a = ap.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t0 = time.time()
    structural = a.kind == "structural"
    targets = STRUCTURAL_TARGETS if structural else TARGETS
    strategies = STRUCTURAL_STRATEGIES if structural else STRATEGIES
    only = None if a.targets is None else set(a.targets)
    if a.merge:  # --targets and --world-list select among the saved worlds
        sel = [x for x in merged(a.merge) if (only is None or x[0] in only)
               and (a.world_list is None or x[1] in a.world_list)]
        return report(sel, targets, strategies, structural, a, t0)
    if structural and a.strategies:
        _SELECTED.update(SHORT[x] for x in a.strategies.split(","))
        strategies = tuple(x for x in strategies if x in _SELECTED)
    if a.honest_spread:  # before the workers fork: they inherit the module state
        sampler_module.EMPIRICAL_SCALES = sampler_module.SPREAD_CHECK = True
    if a.structural_refit:
        sampler_module.EFFECT_PRIORS = True
    if a.family_probe:
        sampler_module.FAMILY_PROBE = True
    if a.oom_half_trial:
        sampler_module.OOM_HALF_TRIAL = True
    if a.baseline_out_of_linear:
        sampler_module.BASELINE_OUT_OF_LINEAR = True
    load_targets(targets, only, a.cache)
    per_world = []  # (target number, world number, {strategy: metrics}, claim tuple or None)
    wl = range(a.first_world, a.first_world + a.worlds) if a.world_list is None else a.world_list
    jobs = [(ti, w, a.trials) for ti in range(len(targets)) if only is None or ti in only for w in wl]
    fn = run_structural_world if structural else run_world
    pool = (None if a.jobs <= 1 else  # --jobs 1: in this process (cProfile sees the studies)
            ProcessPoolExecutor(max_workers=a.jobs, mp_context=multiprocessing.get_context("fork")))
    with pool or contextlib.nullcontext():
        for out in (pool.map(fn, jobs) if pool else map(fn, jobs)):
            ti, w, best, m = out[:4]
            extra, claim = "", None
            if structural and STRUCTURAL_STRATEGIES[0] in m:
                info = out[4]
                d = m[STRUCTURAL_STRATEGIES[0]]
                claim = (info["claimed"], d["final"], d["n"], info["stop_kind"], ti)
                extra = (f"; default: {d['n']} trials, stop {info['stop_kind']}, claimed regret "
                         f"{100 * (info['claimed'] or 0):.2f}% vs actual {100 * d['final']:.2f}%, "
                         f"{info['edge_steps']} edge steps, {info['wall_s']:.0f} s; best's margin "
                         f"{100 * info['margin']:.1f}% of capacity")
            per_world.append((ti, w, m, claim))
            print(f"  {targets[ti][0]} world {w}: best {best:,.0f} tokens/s/GPU; trials to 2% / regret@5 / regret@10 / "
                  "OOMs: " + ", ".join(f"{s.split(' ')[0]}={m[s]['trials']}/{100 * m[s]['r5']:.2f}%/"
                                       f"{100 * m[s]['r10']:.2f}%/{m[s]['ooms']}oom" for s in strategies)
                  + extra + f" ({time.time() - t0:.0f} s)", flush=True)
    if a.save:
        Path(a.save).write_text(json.dumps([[ti, w, m, claim] for ti, w, m, claim in per_world], indent=1))
    return report(per_world, targets, strategies, structural, a, t0)


def merged(paths):
    """The worlds of saved runs (--save), the strategies of later files added to the same (target, world)."""
    out: dict = {}
    for p in paths:
        for ti, w, m, claim in json.loads(Path(p).read_text()):
            prev = out.setdefault((ti, w), [ti, w, {}, None])
            prev[2].update(m)
            prev[3] = claim if claim is not None else prev[3]
    return [tuple(v) for _, v in sorted(out.items())]


def report(per_world, targets, strategies, structural, a, t0) -> int:
    """The summary tables (all worlds; tuned and held-out apart with --held-out-from; per target) and the plot."""
    for s in strategies:
        missing = sum(1 for x in per_world if s not in x[2])
        if 0 < missing < len(per_world):
            print(f"not reported: {s}, missing in {missing} of {len(per_world)} worlds (select the worlds every "
                  "strategy ran with --targets / --world-list)")
    strategies = tuple(s for s in strategies if all(s in x[2] for x in per_world))
    groups = [("all", per_world)]
    if a.held_out_from is not None:
        groups += [(f"worlds below {a.held_out_from} (tuned on)", [x for x in per_world if x[1] < a.held_out_from]),
                   (f"worlds {a.held_out_from} and above (held out)", [x for x in per_world if x[1] >= a.held_out_from])]
    for lo, hi in a.groups:
        groups.append((f"worlds {lo}-{hi}", [x for x in per_world if lo <= x[1] <= hi]))
    for gname, sel in groups:
        if not sel:
            continue
        results = {s: [x[2][s] for x in sel] for s in strategies}
        print(f"\n{gname}: {len(sel)} {a.kind} worlds, {a.trials} trials each, {time.time() - t0:.0f} s\n\n"
              + summary(results, strategies, a.trials))
        claims = [x[3] for x in sel if x[3] is not None]
        if structural:
            for ti, (mname, gpus, _) in enumerate(targets):
                sub = {s: [x[2][s] for x in sel if x[0] == ti] for s in strategies}
                if sub[strategies[0]]:
                    print(f"\n{mname} on {gpus}:\n" + summary(sub, strategies, a.trials))
            ok = sum(1 for c, act, *_ in claims if c is not None and c >= act - 0.01)
            if claims:
                print(f"\nstop rule: claimed remaining regret >= actual regret - 1% in {ok} of {len(claims)} worlds; "
                      f"stopped by rule in {sum(1 for c in claims if c[3] == 'rule')}; trials used: median "
                      f"{statistics.median(c[2] for c in claims):.0f}, max {max(c[2] for c in claims)}; claimed "
                      f"regret mean {100 * statistics.mean(c[0] or 0 for c in claims):.2f}%, actual mean "
                      f"{100 * statistics.mean(c[1] for c in claims):.2f}%")
    results = {s: [x[2][s] for x in per_world] for s in strategies}
    name = "search_efficiency_structural" if structural else "search_efficiency"
    plot(results, Path(a.out) / (name + (f"_from{a.first_world}" if a.first_world else "") + ".png"), a.trials)
    return 0


def plot(results, path, trials):
    from matplotlib.figure import Figure  # heavy optional import, only when plotting
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for s, m in results.items():
        xs = list(range(1, trials + 1))
        ys = [sum(1 for x in m if x["trials"] is not None and x["trials"] <= k) / len(m) for k in xs]
        ax.step(xs, ys, where="post", label=s)
    ax.set_xlabel("measured trials")
    ax.set_ylabel("fraction of worlds within 2% of the best")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
