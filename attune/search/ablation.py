"""What each knob beyond the seed buys (issue 15): the best predicted layout of the scored space with each
knob pinned off, next to the best with everything.

The scored table (``attune.search.scoring.score_space``, cached per target) already holds every layout of
the space with its predicted throughput and memory, so pinning a knob off is a filter on it: the best
layout that fits (predicted peak within the usable memory, host memory fitting) among those not using the
knob. When the knob is not in the winner, the row says why: the best layout using it and the limit it hits
(over memory, slower than the winner, or refused by the engine). A knob the space does not search is
priced on the winner directly (the winner with the knob turned on).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from attune.estimator import estimate
from attune.estimator.coefficients import Coefficients
from attune.search.scoring import ScoredSpace, score_space
from attune.search.space import SearchSpace
from attune.spec.columns import LayoutColumns
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.knobs import not_honoured_summary
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec
from attune.spec.rules import check, layout_string_refusal


@dataclass(frozen=True, kw_only=True)
class Knob:
    """One knob beyond the seed, as the ablation sees it."""

    name: str
    """What the report calls it."""
    flags: str
    """The Megatron-LM flags it is."""
    space_knob: str
    """Its knob in ``attune.search.space`` (KNOBS)."""
    uses: Callable[[Layout], bool]
    """Whether a layout uses it."""
    uses_columns: Callable[[LayoutColumns], np.ndarray]
    """The same for every row of a batch (a bool array)."""
    cost: str
    """What it costs, in words (the usual reason it loses)."""


def _nonempty(col: np.ndarray) -> np.ndarray:
    """Which rows of a module-tuple column name a module."""
    return np.fromiter((bool(v) for v in col), dtype=bool, count=len(col))


KNOBS = (
    Knob(name="pipeline layout string", flags="--pipeline-model-parallel-layout", space_knob="stage_layout",
         uses=lambda L: L.pipeline_layout is not None, uses_columns=lambda c: c["pipeline_layout"] != None,  # noqa: E711
         cost="moves layers between middle stages; the slowest stage sets the 1F1B step"),
    Knob(name="module recompute", flags="--recompute-modules core_attn mlp", space_knob="recompute_modules",
         uses=lambda L: bool(L.recompute_modules), uses_columns=lambda c: _nonempty(c["recompute_modules"]),
         cost="re-runs the MLP GEMMs (fc1, fc2) of every layer in backward"),
    Knob(name="partial optimizer offload", flags="--optimizer-offload-fraction < 1", space_knob="offload_fraction",
         uses=lambda L: L.optimizer_cpu_offload and L.offload_fraction < 1.0,
         uses_columns=lambda c: c["optimizer_cpu_offload"] & (c["offload_fraction"] < 1.0),
         cost="CPU Adam step and PCIe copies of the offloaded shard each step"),
    Knob(name="activation offload", flags="--fine-grained-activation-offloading --offload-modules",
         space_knob="activation_offload", uses=lambda L: bool(L.offload_modules),
         uses_columns=lambda c: _nonempty(c["offload_modules"]),
         cost="PCIe traffic of the offloaded inputs beyond what the microbatch's compute hides"),
    Knob(name="communication overlap", flags="--overlap-grad-reduce --overlap-param-gather (--tp-comm-overlap)",
         space_knob="comm_overlap",
         uses=lambda L: L.overlap_grad_reduce or L.overlap_param_gather or L.tp_comm_overlap,
         uses_columns=lambda c: c["overlap_grad_reduce"] | c["overlap_param_gather"] | c["tp_comm_overlap"],
         cost="hides DP (and TP) communication that the step exposes"),
)
"""The issue-15 knobs, in report order."""


@dataclass(frozen=True, kw_only=True)
class AblationRow:
    """The best layout without one knob, and why the knob does (not) win."""

    knob: str
    """The knob's name."""
    flags: str
    """Its flags."""
    searched: bool
    """Whether the space searches it (else it was priced on the winner)."""
    without_label: str | None
    """Best fitting layout that does not use the knob (None: none fits)."""
    without_tokens: float | None
    """Its predicted tokens/s/GPU."""
    loss_percent: float | None
    """How much slower than the best with every knob, percent (0: the knob buys nothing)."""
    using_label: str | None
    """Best layout that uses the knob (fitting if one does, else the fastest over memory)."""
    using_tokens: float | None
    """Its predicted tokens/s/GPU."""
    limit: str
    """What it buys, or which limit it hits, in one line."""


@dataclass(frozen=True, kw_only=True)
class Ablation:
    """The ablation of one target."""

    best_label: str | None
    """Best fitting layout with every knob."""
    best_tokens: float | None
    """Its predicted tokens/s/GPU."""
    usable_gib: float
    """Memory a layout may use, GiB per GPU (capacity less the headroom)."""
    seed_label: str | None
    """Best fitting layout that uses none of the knobs (the seed's space)."""
    seed_tokens: float | None
    """Its predicted tokens/s/GPU."""
    rows: tuple[AblationRow, ...]
    """One row per knob, in ``KNOBS`` order."""


def ablation_of_table(table: ScoredSpace, space: SearchSpace, usable_gib: float) -> Ablation:
    """The ablation of a scored space (see the module docstring)."""
    model, cluster, workload, engine = table.context
    tokens = np.nan_to_num(table.tokens, nan=-1.0)
    fits = (table.peak_gib <= usable_gib) & table.host_fits & (table.tokens > 0)
    best_i = int(np.argmax(np.where(fits, tokens, -1.0))) if fits.any() else None
    best_t = float(tokens[best_i]) if best_i is not None else None
    best_layout = table.layouts[best_i] if best_i is not None else None
    rows = []
    any_use = np.zeros(len(table), dtype=bool)
    for k in KNOBS:
        uses = np.asarray(k.uses_columns(table.cols), dtype=bool)
        any_use |= uses
        searched = k.space_knob in space.knobs and len(space.domain(k.space_knob)) > 1
        wo = fits & ~uses
        wo_i = int(np.argmax(np.where(wo, tokens, -1.0))) if wo.any() else None
        wo_t = float(tokens[wo_i]) if wo_i is not None else None
        loss = 100.0 * (best_t - wo_t) / best_t if (best_t and wo_t is not None) else None
        using_label = using_t = None
        if k.space_knob == "stage_layout" and layout_string_refusal(model, engine):
            limit = "refused: " + layout_string_refusal(model, engine)
        elif not searched:
            using_label, using_t, limit = _priced_on_top(k, table, fits, tokens, best_t, usable_gib)
        elif not uses.any():
            limit = "no layout of the space can use it here"
        else:
            fit_use = fits & uses
            if fit_use.any():
                u = int(np.argmax(np.where(fit_use, tokens, -1.0)))
                using_label, using_t = table.layouts[u].label(), float(tokens[u])
                if best_t is not None and using_t >= best_t:
                    limit = f"buys {loss:+.1f}%: the winner uses it" if loss else "in the winner, ties without it"
                else:
                    limit = (f"fits but is slower ({100 * (using_t - best_t) / best_t:+.1f}% vs the winner): "
                             f"{k.cost}")
            else:
                over = uses & (table.tokens > 0)
                pool = over if over.any() else uses
                u = int(np.argmin(np.where(pool, table.peak_gib, np.inf)))
                using_label = table.layouts[u].label()
                using_t = float(table.tokens[u]) if np.isfinite(table.tokens[u]) else None
                limit = (f"nothing using it fits: the leanest needs {table.peak_gib[u]:.1f} GiB > {usable_gib:.1f} GiB "
                         f"usable")
            if k.space_knob in ("recompute_modules", "activation_offload"):
                dead = not_honoured_summary(_knob_modules(table.layouts, uses), model, engine)
                if dead:
                    limit += "; " + "; ".join(dead)
        rows.append(AblationRow(knob=k.name, flags=k.flags, searched=searched,
                                without_label=table.layouts[wo_i].label() if wo_i is not None else None,
                                without_tokens=wo_t, loss_percent=loss, using_label=using_label,
                                using_tokens=using_t, limit=limit))
    none = fits & ~any_use
    seed_i = int(np.argmax(np.where(none, tokens, -1.0))) if none.any() else None
    return Ablation(best_label=best_layout.label() if best_layout else None, best_tokens=best_t,
                    usable_gib=usable_gib, rows=tuple(rows),
                    seed_label=table.layouts[seed_i].label() if seed_i is not None else None,
                    seed_tokens=float(tokens[seed_i]) if seed_i is not None else None)


def _knob_modules(layouts, uses: np.ndarray) -> tuple[str, ...]:
    """The modules the knob's layouts name (recompute or offload), for the not-honoured note."""
    for i in np.flatnonzero(uses):
        L = layouts[int(i)]
        if L.recompute_modules or L.offload_modules:
            return L.recompute_modules or L.offload_modules
    return ()


TOP_PRICED = 400
"""Fitting layouts (best first) a knob the space does not search is priced on."""


def _priced_on_top(k: Knob, table: ScoredSpace, fits: np.ndarray, tokens: np.ndarray, best_t: float | None,
                   usable_gib: float) -> tuple[str | None, float | None, str]:
    """A knob the space does not search, turned on in the TOP_PRICED best fitting layouts (communication
    overlap: where there is DP x CP or TP communication); the best that still fits."""
    if best_t is None or k.space_knob != "comm_overlap":
        return None, None, "not searched by this space"
    model, cluster, workload, engine = table.context
    order = [int(i) for i in np.argsort(-np.where(fits, tokens, -1.0))[:TOP_PRICED] if fits[i]]
    best: tuple[float, Layout] | None = None
    for i in order:
        L = table.layouts[i]
        if not (L.dp * L.cp > 1 or (L.tp > 1 and L.sp)):
            continue
        lay = replace(L, overlap_grad_reduce=True, overlap_param_gather=L.distributed_optimizer,
                      tp_comm_overlap=L.tp > 1 and L.sp)
        if check(lay, model, cluster.world_size, workload, engine):
            continue
        e = estimate(model, cluster, lay, workload, engine, table.coefficients)
        if e.memory.peak_gib <= usable_gib and (best is None or e.perf.tokens_per_s_per_gpu > best[0]):
            best = (e.perf.tokens_per_s_per_gpu, lay)
    if best is None:
        return None, None, (f"not searched by this space; none of the {len(order)} best fitting layouts has DP x CP "
                            f"or TP communication to hide")
    gain = 100 * (best[0] - best_t) / best_t
    return best[1].label() + " + overlap", best[0], (f"not searched by this space; turned on in the {len(order)} best fitting layouts, "
                                      f"the best is {gain:+.1f}% vs the winner: {k.cost}")


def ablation(space: SearchSpace, model: ModelSpec, cluster: Cluster, workload: Workload, engine: Engine,
             coef: Coefficients, headroom: float = 0.02) -> Ablation:
    """The ablation of ``space`` for this target (the scored table is cached per target)."""
    table = score_space(space, model, cluster, workload, engine, coef)
    return ablation_of_table(table, space, cluster.gpu.capacity_gib * (1.0 - headroom))
