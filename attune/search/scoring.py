"""The whole search space scored by the model, once per target: the batched entry point of the search.

`score_space` enumerates every distinct valid layout of a space as columns (`attune.search.enumeration`: knobs
that cannot change the layout are not expanded, equivalent layouts are deduplicated; no `Layout` object is built),
estimates them through one function over the columns (`_estimate_columns`: `estimate_batch` in slices of
BATCH_ROWS), and keeps arrays: predicted tokens/s/GPU, peak memory per stage, the host-memory
verdict and the knob-distance features; a row's `Layout` and parameter set are built when something reads them.
Memory is predicted first for every layout; throughput only for those within MEMORY_SCORING_MARGIN of capacity.
The table is cached in this process per (model, cluster, workload, engine, space, coefficients), so a study, a resumed
study and the benchmark's worlds score a space once.

`ScoredSpace.sensitivities` gives d log(tokens/s/GPU) / d log(coefficient) by finite differences for the
layouts that matter (those fitting in memory and predicted within `SENSITIVE_FRACTION` of the best), so a
recalibrated model rescores the space as a matrix product; `exact_tokens` re-estimates a few layouts exactly.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from attune.estimator import estimate_batch
from attune.estimator.coefficients import Coefficients
from attune.search.enumeration import EnumeratedSpace, enumerate_columns
from attune.search.space import SearchSpace
from attune.spec.columns import LayoutColumns
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.identity import IDENTITY_ITEMS
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
# tables kept in this process (a table of the dense space is ~30 MB)
CACHE_SIZE = 6

_CACHE: dict[tuple, "ScoredSpace"] = {}
# rows per estimate_batch call: the array engine's intermediates are a few hundred bytes per row and stage, so the
# table is estimated in slices of this many rows to bound the peak memory (Llama-3.1-70B on 64 x H100 with
# communication overlap searched, 646,392 layouts: benchmarks/RESULTS.md); a slice this large keeps numpy's
# per-call overhead negligible
BATCH_ROWS = 65536


class _Lazy(Sequence):
    """A read-only sequence whose items are built on demand (and kept: a study reads a few rows many times)."""

    __slots__ = ("_n", "_make", "_memo")

    def __init__(self, n: int, make) -> None:
        self._n, self._make, self._memo = n, make, {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        v = self._memo.get(i)
        if v is None:
            v = self._memo[i] = self._make(i)
        return v


@dataclass(kw_only=True)
class ScoredSpace:
    """Every distinct valid layout of a space with the model's prediction, as columns (arrays indexed like the
    rows of `space`; `layouts`, `params` and `stage_gib` build a row's objects on demand)."""

    space: EnumeratedSpace
    """The layouts as columns, their parameter sets, keys and knob-distance features."""
    tokens: np.ndarray
    """Predicted tokens/s/GPU with the table's coefficients (NaN: predicted far over memory, not estimated)."""
    step_time_s: np.ndarray
    """Predicted step time, seconds."""
    stage_peaks_gib: np.ndarray
    """Predicted peak memory per pipeline stage, GiB per GPU, stage 0 first (rows x largest PP; NaN past a
    layout's last stage)."""
    peak_gib: np.ndarray
    """Predicted peak memory of the fullest stage, GiB per GPU."""
    host_fits: np.ndarray
    """Whether the host memory (CPU optimizer offload) fits, per layout (bool)."""
    coefficients: Coefficients
    """The coefficients the predictions were made with."""
    context: tuple
    """(model, cluster, workload, engine) the layouts were estimated for."""
    _sens: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.space)
        if not (len(self.tokens) == len(self.peak_gib) == len(self.stage_peaks_gib) == n):
            raise ValueError("ScoredSpace: tokens, peak_gib and stage peaks must have one entry per layout")
        self.layouts: Sequence[Layout] = _Lazy(n, self.space.cols.layout)
        """The layouts (each built on first use)."""
        self.params: Sequence[dict] = _Lazy(n, self.space.params)
        """One Optuna parameter set per layout (the first in knob order that maps to it)."""
        pp = self.space.cols["pp"]
        self.stage_gib: Sequence[tuple[float, ...]] = _Lazy(
            n, lambda i: tuple(float(x) for x in self.stage_peaks_gib[i, :int(pp[i])]))
        """Predicted peak memory per pipeline stage of one layout, GiB per GPU, stage 0 first."""

    def __getstate__(self) -> dict:
        # the lazy sequences hold closures (not picklable); they are rebuilt on load
        return {k: v for k, v in self.__dict__.items() if k not in ("layouts", "params", "stage_gib")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    @property
    def cols(self) -> LayoutColumns:
        """The layouts as columns."""
        return self.space.cols

    @property
    def features(self) -> np.ndarray:
        """Knob-distance features (`attune.search.space.FEATURES`), one row per layout."""
        return self.space.features

    def __len__(self) -> int:
        return len(self.space)

    def row(self, key: tuple) -> int | None:
        """Row of a layout_key or params_key (None when the space does not hold it)."""
        if len(key) == len(IDENTITY_ITEMS) and key and key[0][0] == IDENTITY_ITEMS[0]:
            return self.space.row_of_key(key)
        try:
            return self.space.row_of_params(dict(key))
        except (TypeError, ValueError):
            return None

    def position_gib(self) -> np.ndarray:
        """Predicted stage peaks by position (rows x 3: first, largest middle, last; -inf where a layout has no
        middle stage)."""
        st, pp = self.stage_peaks_gib, self.space.cols["pp"]
        out = np.full((len(self), 3), -np.inf)
        out[:, 0] = st[:, 0]
        out[:, 2] = st[np.arange(len(self)), pp - 1]
        if st.shape[1] > 2:
            mid = np.where(np.arange(st.shape[1])[None, :] < (pp - 1)[:, None], st, -np.inf)[:, 1:]
            has = pp > 2
            out[has, 1] = mid[has].max(axis=1)
        return out

    def exact_tokens(self, rows, coef: Coefficients) -> np.ndarray:
        """Predicted tokens/s/GPU of some rows with other coefficients (exact estimates)."""
        model, cluster, workload, engine = self.context
        rows = np.asarray(rows, dtype=int)
        if not rows.size:
            return np.zeros(0)
        return estimate_batch(model, cluster, self.cols.take(rows), workload, engine, coef).tokens_per_s_per_gpu

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


def _estimate_columns(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, workload: Workload, engine: Engine,
                      coef: Coefficients) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The table's predictions for a batch of layouts: (tokens/s/GPU, step time s, stage peaks GiB (rows x largest
    PP, NaN past the last stage), peak GiB, host fits). Tokens and step time are NaN for a layout more than
    MEMORY_SCORING_MARGIN over capacity or whose host memory does not fit (memory first: no throughput far over
    memory)."""
    n = len(cols)
    limit = cluster.gpu.capacity_gib * (1.0 + MEMORY_SCORING_MARGIN)
    width = int(cols["pp"].max()) if n else 1
    tokens, step = np.full(n, np.nan), np.full(n, np.nan)
    stages, peak, host = np.full((n, width), np.nan), np.zeros(n), np.zeros(n, dtype=bool)
    rows = np.arange(n)
    for a in range(0, rows.size, BATCH_ROWS):
        part = rows[a:a + BATCH_ROWS]
        b = estimate_batch(model, cluster, cols if part.size == n else cols.take(part), workload, engine, coef)
        ok = (b.peak_gib <= limit) & b.host_fits
        tokens[part] = np.where(ok, b.tokens_per_s_per_gpu, np.nan)
        step[part] = np.where(ok, b.step.step_time_s, np.nan)
        st = np.where(b.stage, b.stage_values("total_gib"), np.nan)
        stages[part, :st.shape[1]] = st
        peak[part], host[part] = b.peak_gib, b.host_fits
        del b, st
    return tokens, step, stages, peak, host


def default_workers() -> int:
    """Worker processes for scoring: the cores this process may use (1 where fork is unavailable)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def score_space(space: SearchSpace, model: ModelSpec, cluster: Cluster, workload: Workload, engine: Engine,
                coef: Coefficients) -> ScoredSpace:
    """The scored table of `space` for this target (cached in this process; see the module docstring)."""
    key = (model.name, model.num_layers, cluster.spec, repr(workload), engine.name, space.path,
           repr(sorted(space.knobs.items())), repr(sorted(space.fixed.items())), repr(coef))
    if key in _CACHE:
        return _CACHE[key]
    es = enumerate_columns(space, model, cluster.world_size, workload, engine)
    cols = es.cols
    tokens, step, stages, peak, host = _estimate_columns(model, cluster, cols, workload, engine, coef)
    table = ScoredSpace(space=es, tokens=tokens, step_time_s=step, stage_peaks_gib=stages, peak_gib=peak,
                        host_fits=host, coefficients=coef, context=(model, cluster, workload, engine))
    while len(_CACHE) >= CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = table
    return table
