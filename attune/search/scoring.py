"""The whole search space scored by the model, once per target: the batched entry point of the search.

`score_space` enumerates every distinct valid layout of a space (`SearchSpace.enumerate`: knobs that cannot
change the layout are not expanded, equivalent layouts are deduplicated), estimates each with
`attune.estimator.estimate_parts`, the composition `estimate` uses (in worker processes when there are several cores), and keeps arrays: predicted
tokens/s/GPU, peak memory per stage, the host-memory verdict and the knob-distance features. Memory is predicted first for every layout; throughput only for those within MEMORY_SCORING_MARGIN of
capacity. The table is
cached in this process per (model, cluster, workload, engine, space, coefficients), so a study, a resumed
study and the benchmark's worlds score a space once.

`ScoredSpace.sensitivities` gives d log(tokens/s/GPU) / d log(coefficient) by finite differences for the
layouts that matter (those fitting in memory and predicted within `SENSITIVE_FRACTION` of the best), so a
recalibrated model rescores the space as a matrix product; `exact_tokens` re-estimates a few layouts exactly.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from attune.errors import SearchSpaceError
from attune.estimator import estimate, estimate_parts
from attune.estimator.coefficients import Coefficients
from attune.search.space import SearchSpace, layout_features, layout_key, params_key
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec

# layouts whose predicted throughput is below this fraction of the best predicted fit are left out of the
# coefficient sensitivities (no plausible recalibration, a few tens of percent per coefficient, lifts them to
# the top; they keep their shipped-coefficient prediction)
SENSITIVE_FRACTION = 0.5
# relative step of the finite differences for the sensitivities (5% of the coefficient)
SENSITIVITY_STEP = 0.05
# layouts predicted over capacity by more than this fraction are not given a throughput (tokens = NaN): no
# plausible memory recalibration brings them under capacity
MEMORY_SCORING_MARGIN = 0.10
# shards per worker process: small shards balance the uneven (TP, PP, CP) groups
SHARDS_PER_WORKER = 4
# tables kept in this process (a table of the dense space is ~30 MB)
CACHE_SIZE = 6

_CACHE: dict[tuple, "ScoredSpace"] = {}


@dataclass(kw_only=True)
class ScoredSpace:
    """Every distinct valid layout of a space with the model's prediction (arrays indexed like `layouts`)."""

    params: list[dict]
    """One Optuna parameter set per layout (the first in knob order that maps to it)."""
    layouts: list[Layout]
    """The layouts."""
    tokens: np.ndarray
    """Predicted tokens/s/GPU with the table's coefficients (NaN: predicted far over memory, not estimated)."""
    step_time_s: np.ndarray
    """Predicted step time, seconds."""
    stage_gib: list[tuple[float, ...]]
    """Predicted peak memory per pipeline stage, GiB per GPU, stage 0 first."""
    peak_gib: np.ndarray
    """Predicted peak memory of the fullest stage, GiB per GPU."""
    host_fits: np.ndarray
    """Whether the host memory (CPU optimizer offload) fits, per layout (bool)."""
    features: np.ndarray
    """Knob-distance features (`attune.search.space.FEATURES`), one row per layout."""
    coefficients: Coefficients
    """The coefficients the predictions were made with."""
    context: tuple
    """(model, cluster, workload, engine) the layouts were estimated for."""
    index: dict = field(default_factory=dict)
    """layout_key and params_key -> row."""
    _sens: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (len(self.params) == len(self.layouts) == len(self.tokens) == len(self.peak_gib)):
            raise ValueError("ScoredSpace: params, layouts, tokens and peak_gib must have one entry per layout")
        if not self.index:
            L = self.context[0].num_layers
            for i, (p, lay) in enumerate(zip(self.params, self.layouts)):
                self.index.setdefault(layout_key(lay, L), i)
                self.index.setdefault(params_key(p), i)

    def __len__(self) -> int:
        return len(self.layouts)

    def row(self, key: tuple) -> int | None:
        """Row of a layout_key or params_key (None when the space does not hold it)."""
        return self.index.get(key)

    def exact_tokens(self, rows, coef: Coefficients) -> np.ndarray:
        """Predicted tokens/s/GPU of some rows with other coefficients (exact estimates)."""
        model, cluster, workload, engine = self.context
        return np.array([estimate(model, cluster, self.layouts[i], workload, engine, coef,
                                  check_layout=False).perf.tokens_per_s_per_gpu for i in rows], dtype=float)

    def sensitive_rows(self, usable_gib: float) -> np.ndarray:
        """Rows that fit `usable_gib` and are predicted within SENSITIVE_FRACTION of the best of them."""
        ok = self.host_fits & (self.peak_gib <= usable_gib) & np.isfinite(self.tokens)
        if not ok.any():
            return np.zeros(0, dtype=int)
        top = self.tokens[ok].max()
        return np.flatnonzero(ok & (self.tokens >= SENSITIVE_FRACTION * top))

    def sensitivities(self, names: tuple[str, ...], rows: np.ndarray) -> np.ndarray:
        """d log(tokens/s/GPU) / d log(coefficient) for `rows` (len(rows) x len(names)), by forward differences
        of SENSITIVITY_STEP; cached per (name, row)."""
        out = np.zeros((len(rows), len(names)))
        for j, name in enumerate(names):
            have = self._sens.setdefault(name, {})
            todo = [int(i) for i in rows if int(i) not in have]
            if todo:
                base = getattr(self.coefficients, name)
                bumped = dataclasses.replace(self.coefficients, **{name: base * (1 + SENSITIVITY_STEP)})
                t1 = self.exact_tokens(todo, bumped)
                d = (np.log(t1) - np.log(self.tokens[todo])) / np.log1p(SENSITIVITY_STEP)
                have.update(zip(todo, d))
            out[:, j] = [have[int(i)] for i in rows]
        return out


def _score_shard(args) -> list:
    """Memory first (placement + memory model, a quarter of an estimate); the full estimate only for layouts
    within MEMORY_SCORING_MARGIN of capacity."""
    space, model, cluster, workload, engine, coef, shard = args
    rows = []
    limit = cluster.gpu.capacity_gib * (1.0 + MEMORY_SCORING_MARGIN)
    for order, params, lay, key in space.enumerate(model, cluster.world_size, workload, engine, shard=shard):
        kf = (key, layout_features(lay, model.num_layers))  # layout_key and features, computed in the workers
        mem, perf = estimate_parts(model, cluster, lay, workload, engine, coef, perf_below_gib=limit)
        stages = tuple(s.total_gib for s in mem.stages)
        if perf is None:
            rows.append((order, params, lay, math.nan, math.nan, stages, mem.peak_gib, mem.host_fits, kf))
            continue
        rows.append((order, params, lay, perf.tokens_per_s_per_gpu, perf.step_time_s, stages,
                     mem.peak_gib, mem.host_fits, kf))
    return rows


def default_workers() -> int:
    """Worker processes for scoring: the cores this process may use (1 where fork is unavailable)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def score_space(space: SearchSpace, model: ModelSpec, cluster: Cluster, workload: Workload, engine: Engine,
                coef: Coefficients, workers: int | None = None) -> ScoredSpace:
    """The scored table of `space` for this target (cached in this process; see the module docstring)."""
    key = (model.name, model.num_layers, cluster.spec, repr(workload), engine.name, space.path,
           repr(sorted(space.knobs.items())), repr(sorted(space.fixed.items())), repr(coef))
    if key in _CACHE:
        return _CACHE[key]
    workers = default_workers() if workers is None else max(1, workers)
    if workers == 1:
        shards = [_score_shard((space, model, cluster, workload, engine, coef, (0, 1)))]
    else:
        n = workers * SHARDS_PER_WORKER
        jobs = [(space, model, cluster, workload, engine, coef, (k, n)) for k in range(n)]
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork")) as pool:
            shards = list(pool.map(_score_shard, jobs))
    merged, index = [], {}
    for r in sorted((r for s in shards for r in s), key=lambda r: r[0]):
        if r[8][0] not in index:  # the layout_key the enumeration computed
            index[r[8][0]] = len(merged)
            merged.append(r)
    for i, r in enumerate(merged):
        index.setdefault(params_key(r[1]), i)
    if not merged:
        raise SearchSpaceError(f"search space {space.name}: no layout of it passes the rules for {model.name} on "
                               f"{cluster.spec} (check the parallel sizes against the model's layers and GPUs)")
    table = ScoredSpace(
        params=[r[1] for r in merged], layouts=[r[2] for r in merged],
        tokens=np.array([r[3] for r in merged], dtype=float), step_time_s=np.array([r[4] for r in merged]),
        stage_gib=[r[5] for r in merged], peak_gib=np.array([r[6] for r in merged], dtype=float),
        host_fits=np.array([r[7] for r in merged], dtype=bool),
        features=np.array([r[8][1] for r in merged]).reshape(len(merged), -1),
        coefficients=coef, context=(model, cluster, workload, engine), index=index)
    while len(_CACHE) >= CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = table
    return table
