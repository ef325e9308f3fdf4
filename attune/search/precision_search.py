"""Low precision in the search (issue 22): searched only when the user allows the numerics change.

``attune tune ... --allow-numerics fp8`` (or a recipe: ``fp8-delayed``, ``fp8-tensorwise``, ``fp8-blockwise``,
``mxfp8``, ``nvfp4``) keeps the study in bf16, as before, and then prices the space's layouts again with each
allowed recipe the GPU runs (``attune.spec.precision.hardware_refusal``), with and without ``--fp8-param-gather``
where the rules allow it. The candidates are the bf16 table's layouts (``attune.search.scoring``, cached from the
study) predicted within ``CANDIDATE_FRACTION`` of the bf16 best and within ``CANDIDATE_MEMORY`` of the GPU's
memory (fp8 changes memory both ways: weight caches add, fp8 activations and fp8 parameters save). The report
shows the best bf16 layout and the best low-precision layout side by side with the gain and the memory terms that
changed. A low-precision layout stays ``predicted``: it changes the arithmetic, so only ``attune verify`` against
a bf16 reference run can make it ``verified``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from attune.errors import UserInputError
from attune.estimator import Estimate, estimate, estimate_batch
from attune.estimator.batch_tables import group_ids, object_ids
from attune.estimator.coefficients import Coefficients, coefficients_for
from attune.estimator.precision import plan as lp_plan
from attune.search.scoring import BATCH_ROWS, score_space
from attune.search.space import SearchSpace
from attune.spec.columns import LayoutColumns
from attune.spec.engine import Engine
from attune.spec.flags import to_flags
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec
from attune.spec.precision import (
    LOW_PRECISION,
    PRECISION_RULE_FIELDS,
    fields_for,
    hardware_refusal,
    precision_rules,
    recipe_of,
)

ALLOW_CHOICES = ("fp8",) + LOW_PRECISION
"""What ``--allow-numerics`` takes: ``fp8`` (every fp8 recipe the GPU runs, MXFP8 on Blackwell) or one recipe."""
CANDIDATE_FRACTION = 0.7
"""bf16 layouts predicted at least this fraction of the bf16 best are re-priced in low precision: fp8 speeds a
whole step up by 1.3-1.5x (the corpus' bf16 / fp8 pairs of one layout: 1.27-1.59x), so a layout slower than this
cannot win by more than a few percent."""
FINALISTS = 64
"""Layouts priced in every allowed recipe: the fastest fitting ones after a first pass in one recipe (with and
without fp8 parameters, the two memory extremes)."""
CANDIDATE_MEMORY = 1.2
"""...and predicted at most this multiple of the GPU's usable memory in bf16 (fp8 parameters and activations save
at most about a sixth of a stage's memory)."""
MEMORY_TERMS = ("weights_gib", "grads_gib", "optimizer_gib", "activations_gib", "logits_gib")


def allowed_recipes(values: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The recipes ``--allow-numerics`` opens (in RECIPES order); a one-line error for an unknown value."""
    out: list[str] = []
    for v in values or ():
        for item in str(v).split(","):
            item = item.strip().lower()
            if not item:
                continue
            if item not in ALLOW_CHOICES:
                raise UserInputError(f"--allow-numerics '{item}': allowed {', '.join(ALLOW_CHOICES)}")
            out += [r for r in LOW_PRECISION if r != "nvfp4"] if item == "fp8" else [item]
    return tuple(r for r in LOW_PRECISION if r in out)


def variant_fields(recipes: tuple[str, ...]) -> list[dict]:
    """The precision fields of each variant ``variants`` makes, in its order."""
    out = []
    for r in recipes:
        out.append(fields_for(r))
        if r != "nvfp4":
            out.append(fields_for(r, param_gather=True))
    return out


def variants(layout: Layout, recipes: tuple[str, ...]) -> list[Layout]:
    """The layout in each recipe, with and without fp8 parameter all-gather (fp8 recipes only)."""
    return [replace(layout, **f) for f in variant_fields(recipes)]


def variant_columns(base: LayoutColumns, recipes: tuple[str, ...]) -> tuple[LayoutColumns, int]:
    """(every row of ``base`` in each of its V ``variants``, row-major: row r's are rows r x V to r x V + V - 1; V)."""
    specs = variant_fields(recipes)
    V = len(specs)
    cols = base.take(np.repeat(np.arange(len(base)), V)).columns()
    for name in specs[0] if specs else ():
        cols[name] = [f[name] for f in specs] * len(base)
    return LayoutColumns(cols, n=len(base) * V), V


def rules_ok(cols: LayoutColumns) -> np.ndarray:
    """[N] the row breaks no precision rule (``precision_rules``, on one row per distinct value of the fields it
    reads: ``PRECISION_RULE_FIELDS``). The rows are otherwise valid layouts (the bf16 table's), and no other rule
    reads a precision field."""
    keys = [object_ids(cols[f]) if cols[f].dtype == object else cols[f] for f in PRECISION_RULE_FIELDS]
    gid, first = group_ids(*keys)
    ok = np.array([not precision_rules(cols.layout(int(i))) for i in first], dtype=bool)
    return ok[gid]


def price(model: ModelSpec, cluster: Cluster, workload: Workload, engine: Engine, coef: Coefficients,
          base: LayoutColumns, recipes: tuple[str, ...], usable_gib: float) -> tuple[np.ndarray, ...]:
    """Every row of ``base`` in each variant of ``recipes``, ``[rows, variants]``: (tokens/s/GPU, the variant breaks
    no rule (priced), it fits in ``usable_gib`` and in host memory), by ``estimate_batch`` (the terms of
    ``estimate()``) in slices of ``BATCH_ROWS``."""
    cols, V = variant_columns(base, recipes)
    ok = rules_ok(cols) if len(cols) else np.zeros(0, dtype=bool)
    tokens, fits = np.full(len(cols), np.nan), np.zeros(len(cols), dtype=bool)
    rows = np.flatnonzero(ok)
    for a in range(0, rows.size, BATCH_ROWS):
        part = rows[a:a + BATCH_ROWS]
        b = estimate_batch(model, cluster, cols.take(part), workload, engine, coef)
        tokens[part] = b.tokens_per_s_per_gpu
        fits[part] = (b.peak_gib <= usable_gib) & b.host_fits
    return tuple(x.reshape(len(base), V) for x in (tokens, ok, fits))


@dataclass(frozen=True)
class PrecisionComparison:
    """The best bf16 layout and the best low-precision layout of the space, predicted."""

    recipes: tuple[str, ...]
    """The recipes searched (those allowed that the GPU runs)."""
    refused: tuple[str, ...]
    """Allowed recipes the GPU cannot run, with the reason."""
    bf16: Estimate
    """The bf16 best (the study's winner, predicted)."""
    low: Estimate | None
    """The best fitting low-precision layout (None: none fits)."""
    same_layout_bf16: Estimate | None
    """The low-precision winner's layout in bf16 (what the precision alone changes)."""
    candidates: int
    """Low-precision layouts priced."""

    @property
    def gain(self) -> float | None:
        """Predicted tokens/s/GPU of the low-precision best over the bf16 best, minus 1."""
        if self.low is None:
            return None
        return self.low.perf.tokens_per_s_per_gpu / self.bf16.perf.tokens_per_s_per_gpu - 1

    def memory_changes(self) -> list[tuple[str, float, float]]:
        """(term, GiB in bf16, GiB in low precision) on the low-precision winner's peak stage, for the same layout
        in bf16 and in its recipe: the terms that changed (|difference| >= 0.01 GiB), then the device total."""
        if self.low is None or self.same_layout_bf16 is None:
            return []
        k = self.low.memory.peak_stage
        a, b = self.same_layout_bf16.memory.stages[k], self.low.memory.stages[k]
        rows = [(t.removesuffix("_gib"), getattr(a, t), getattr(b, t)) for t in MEMORY_TERMS]
        for name in sorted(set(a.overheads) | set(b.overheads)):
            rows.append((name, a.overheads.get(name, 0.0), b.overheads.get(name, 0.0)))
        changed = [r for r in rows if abs(r[2] - r[1]) >= 0.01]
        return changed + [("device total (peak stage)", a.total_gib, b.total_gib)]

    def summary_lines(self) -> list[str]:
        """What ``attune tune`` prints."""
        b = self.bf16.perf.tokens_per_s_per_gpu
        lines = [f"best bf16: {self.bf16.layout.label()}: {b:,.1f} tokens/s/GPU (predicted)"]
        if self.low is None:
            lines.append(f"best low precision ({', '.join(self.recipes) or 'none allowed on this GPU'}): no layout "
                         f"fits" + (f"; refused: {'; '.join(self.refused)}" if self.refused else ""))
            return lines
        lo = self.low
        lines.append(f"best low precision: {lo.layout.label()}: {lo.perf.tokens_per_s_per_gpu:,.1f} tokens/s/GPU "
                     f"(predicted; gain {100 * self.gain:+.1f}% over bf16; peak {lo.memory.peak_gib:.1f} of "
                     f"{lo.memory.capacity_gib:.1f} GiB; status predicted until verified against bf16)")
        changed = [f"{n} {x:+.2f}" if n.startswith("low_precision") and abs(a) < 1e-9 else f"{n} {a:.2f} -> {x:.2f}"
                   for n, a, x in self.memory_changes()]
        if changed:
            lines.append("memory that changed (GiB, same layout bf16 -> " + recipe_of(lo.layout) + "): "
                         + "; ".join(changed))
        return lines

    def markdown(self) -> list[str]:
        """The report's section."""
        L = ["## Low precision (allowed with --allow-numerics; predicted)\n",
             f"Recipes searched: {', '.join(self.recipes) or 'none'}"
             + (f"; refused on this GPU: {'; '.join(self.refused)}" if self.refused else "")
             + f". {self.candidates} low-precision layouts priced.\n"]
        cols = [("best bf16", self.bf16)] + ([("best low precision", self.low),
                                               ("its layout in bf16", self.same_layout_bf16)] if self.low else [])
        L.append("| | " + " | ".join(c for c, _ in cols) + " |")
        L.append("|---|" + "---|" * len(cols))
        L.append("| layout | " + " | ".join(f"`{e.layout.label()}`" for _, e in cols) + " |")
        L.append("| tokens/s/GPU | " + " | ".join(f"{e.perf.tokens_per_s_per_gpu:,.1f}" for _, e in cols) + " |")
        L.append("| step time (s) | " + " | ".join(f"{e.perf.step_time_s:.3f}" for _, e in cols) + " |")
        L.append("| peak memory (GiB) | " + " | ".join(f"{e.memory.peak_gib:.1f}" for _, e in cols) + " |")
        if self.low is None:
            L.append("\nNo low-precision layout fits.\n")
            return L
        L.append(f"\nGain over the bf16 best: {100 * self.gain:+.1f}% (predicted). Flags of the low-precision best:\n")
        L.append("```\n" + " ".join(to_flags(self.low.layout, self.low.workload)) + "\n```\n")
        L.append("Memory terms that changed on its peak stage, same layout in bf16 and in "
                 f"{recipe_of(self.low.layout)} (GiB):\n")
        L.append("| term | bf16 | " + recipe_of(self.low.layout) + " |\n|---|---|---|")
        L += [f"| {n} | {a:.2f} | {b:.2f} |" for n, a, b in self.memory_changes()]
        L.append("\nIt changes the arithmetic: `attune verify` against a bf16 reference run of the same model and "
                 "data (numerics tolerance: attune/correctness/numerics_rules.yaml) makes it `verified`.\n")
        return L


def compare(space: SearchSpace, model: ModelSpec, cluster: Cluster, workload: Workload, engine: Engine,
            best_bf16: Layout, recipes: tuple[str, ...], headroom: float = 0.02) -> PrecisionComparison:
    """Price the space's candidate layouts in the allowed recipes; the best fitting one against the bf16 best."""
    gpu = cluster.gpu
    refused = tuple(f"{r}: {why}" for r in recipes
                    if (why := hardware_refusal(Layout(**fields_for(r)), gpu.generation, gpu.is_cpu)))
    runnable = tuple(r for r in recipes if not hardware_refusal(Layout(**fields_for(r)), gpu.generation, gpu.is_cpu))
    coef = coefficients_for(gpu)
    bf = estimate(model, cluster, best_bf16, workload, engine, coef)
    usable = gpu.capacity_gib * (1 - headroom)
    table = score_space(space, model, cluster, workload, engine, coef)
    ok = table.host_fits & np.isfinite(table.tokens)
    top = max(bf.perf.tokens_per_s_per_gpu, float(np.nanmax(np.where(ok & (table.peak_gib <= usable), table.tokens,
                                                                      np.nan))) if ok.any() else 0.0)
    rows = np.flatnonzero(ok & (table.tokens >= CANDIDATE_FRACTION * top) & (table.peak_gib <= CANDIDATE_MEMORY * usable))
    one = LayoutColumns.from_layouts([best_bf16])
    base = LayoutColumns({k: np.concatenate([a, table.cols[k][rows]]) for k, a in one.columns().items()},
                         n=1 + len(rows))
    bf16_tokens = [bf.perf.tokens_per_s_per_gpu] + [float(table.tokens[i]) for i in rows]
    best, n = None, 0
    if runnable:
        n, finalists = _first_pass(model, cluster, workload, engine, coef, base, bf16_tokens, runnable, usable)
        tok, priced, fits = price(model, cluster, workload, engine, coef, base.take(finalists), runnable, usable)
        n += int(priced.sum())
        if fits.any():  # the first fastest in (finalist, variant) order, as a scan keeping only a faster one
            f, v = np.unravel_index(int(np.argmax(np.where(fits, tok, -np.inf))), tok.shape)
            lay = variants(base.layout(int(finalists[f])), runnable)[v]
            best = estimate(model, cluster, lay, workload, engine, coef)
    same = estimate(model, cluster, replace(best.layout, **fields_for("bf16")), workload, engine, coef) if best else None
    return PrecisionComparison(recipes=runnable, refused=refused, bf16=bf, low=best, same_layout_bf16=same, candidates=n)


def _first_pass(model: ModelSpec, cluster: Cluster, workload: Workload, engine: Engine, coef: Coefficients,
                base: LayoutColumns, bf16_tokens: list[float], runnable: tuple[str, ...],
                usable: float) -> tuple[int, np.ndarray]:
    """(variants priced, finalists: rows of ``base``) of the first pass: one recipe (its fp8-parameter variant too),
    fastest bf16 first, until no layout left can win: a layout's low-precision speed-up is at most its GEMMs' (peak x
    efficiency over bf16's; quantize passes only slow it down), so one whose bf16 prediction times that bound is
    below the best found is skipped. Every candidate is priced in one batch; the scan reads it."""
    gpu = cluster.gpu
    bound = max(p.peak * p.efficiency for p in (lp_plan(Layout(**fields_for(r)), gpu, coef) for r in runnable)) / (
        gpu.bf16_tflops * 1e12 * coef.gemm_efficiency)
    tok, priced, fits = price(model, cluster, workload, engine, coef, base, runnable[:1], usable)
    first: dict[int, float] = {}
    n = 0
    for i in sorted(range(len(base)), key=lambda i: -bf16_tokens[i]):
        if first and bf16_tokens[i] * max(bound, 1.0) < max(first.values()):
            break
        n += int(priced[i].sum())
        if fits[i].any():
            first[i] = float(np.max(tok[i][fits[i]]))
    return n, np.array(sorted(first, key=lambda i: -first[i])[:FINALISTS], dtype=np.int64)


__all__ = ["ALLOW_CHOICES", "allowed_recipes", "variants", "variant_fields", "variant_columns", "rules_ok", "price",
           "compare", "PrecisionComparison"]
