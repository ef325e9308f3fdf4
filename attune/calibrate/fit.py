"""The global fit of the estimator's coefficients to the corpus and the seed, and the data file it writes.

What moves: every ``Coefficients`` field whose metadata gives ``bounds`` (one value per GPU generation
present in the data where the metadata says ``per_generation``, else one shared value). What it minimises
(``scipy.optimize.least_squares``, bounded, trust-region reflective):

* log(predicted / measured) throughput, each row weighted 1 / (throughput rows of its series), so every
  series counts once however many near-duplicate rows its releases repeat; the seed is one series;
* log(predicted / measured) memory components and peaks, weighted the same way within their series;
* the memory verdicts as hinge penalties (``VERDICT_WEIGHT``): a layout that ran must be predicted to fit
  with the tuner's default headroom, one that ran out of memory must be predicted over capacity on the
  stage that overflowed;
* a weak prior (``PRIOR_WEIGHT``) towards the starting values (the fields' source values), scaled by each field's bounds, so a
  coefficient the data cannot see (a generation with one row) stays where its source puts it.

Nothing in the estimator imports this module.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

import attune
from attune.calibrate.report import Prediction, SeriesScore, predict_rows, scores
from attune.calibrate.rows import Corpus, CorpusRow
from attune.errors import AttuneError
from attune.estimator.coefficients import BY_GENERATION, DEFAULT, Coefficients

GENERATIONS = ("ampere", "hopper", "blackwell")
"""GPU generations that may get their own value of a ``per_generation`` coefficient."""

VERDICT_WEIGHT = 100.0
"""Weight of one violated memory verdict (squared log-ratio units): a 1% miss costs as much as a whole
series 10% off in throughput, so the fit never trades a verdict for speed accuracy."""

VERDICT_HEADROOM = 0.02
"""A layout that ran must be predicted to fit with this fraction of memory free: the tuner's default
``--memory-headroom`` (attune/api/tune.py), or the tuner would never try it."""

PRIOR_WEIGHT = 1e-3
"""Weight of the pull towards the starting value, per coefficient, in units of (change / bound width)^2."""


class FitError(AttuneError):
    """The corpus gives the fit nothing to fit (exit code 1)."""


@dataclass(frozen=True, kw_only=True)
class FitParam:
    """One free value of the fit."""

    name: str
    """The ``Coefficients`` field."""
    generation: str | None
    """The GPU generation it applies to (None: shared by all)."""
    lo: float
    """Lower bound (the field's metadata)."""
    hi: float
    """Upper bound."""
    start: float
    """Value before the fit (clipped into the bounds)."""
    unit: str = ""
    """The field's unit."""

    def __post_init__(self) -> None:
        if not self.lo < self.hi:
            raise ValueError(f"{self.name}: bounds ({self.lo}, {self.hi}) must have lo < hi")
        if not self.lo <= self.start <= self.hi:
            raise ValueError(f"{self.name}: start {self.start} outside its bounds ({self.lo}, {self.hi})")

    @property
    def key(self) -> str:
        return self.name if self.generation is None else f"{self.name}[{self.generation}]"


@dataclass(frozen=True, kw_only=True)
class CoefficientSet:
    """Coefficients shared by all GPUs and per generation: what the data file holds."""

    shared: Coefficients
    """For GPUs of a generation without its own set (and CPU workers)."""
    by_generation: dict[str, Coefficients] = field(default_factory=dict)
    """Per GPU generation."""

    def for_row(self, row: CorpusRow) -> Coefficients:
        return self.by_generation.get(row.generation, self.shared)


def current() -> CoefficientSet:
    """The coefficients the package ships (field defaults overridden by coefficients.yaml)."""
    return CoefficientSet(shared=DEFAULT, by_generation=dict(BY_GENERATION))


def source_values() -> CoefficientSet:
    """The field defaults, each from its source: where a fit starts and what its prior pulls towards, so a
    refit does not depend on the previous one."""
    return CoefficientSet(shared=Coefficients())


def is_moe_row(r: CorpusRow) -> bool:
    """The row's model is a mixture of experts (its error is fitted by the MoE coefficients only)."""
    return r.model is not None and r.model.moe is not None


def by_model(rows: Sequence[CorpusRow]) -> list[CorpusRow]:
    """MoE rows regrouped by model for the MoE stage's weights (series ``MoE <model>``): each MoE model counts once,
    however many releases repeat it (GPT-OSS-120B fills five of the corpus's series, DeepSeek-V3 and Qwen3-235B
    share one), so the shared MoE coefficients are not one model's."""
    return [dataclasses.replace(r, series=f"MoE {r.model.name}") for r in rows]


def fit_params(corpus: Corpus, start: CoefficientSet | None = None, moe: bool = False) -> list[FitParam]:
    """The free values: fields with ``bounds``, per generation present in the corpus where ``per_generation``;
    the dense fields (``moe`` False) or the MoE kernels' fields (``moe`` True, generations of the MoE rows)."""
    start = start or source_values()
    gens = [g for g in GENERATIONS if any(r.generation == g and is_moe_row(r) == moe and not r.low_precision
                                          for r in corpus.expressed)]
    out = []
    for f in dataclasses.fields(Coefficients):
        b = f.metadata.get("bounds")
        if not b or bool(f.metadata.get("moe")) != moe or f.metadata.get("precision"):
            continue  # (the low-precision fields: attune.calibrate.precision_fit's stage)
        lo, hi = float(b[0]), float(b[1])
        unit = str(f.metadata.get("unit", ""))
        if f.metadata.get("per_generation"):
            for g in gens:
                v = getattr(start.by_generation.get(g, start.shared), f.name)
                out.append(FitParam(name=f.name, generation=g, lo=lo, hi=hi, start=min(max(v, lo), hi), unit=unit))
        else:
            v = getattr(start.shared, f.name)
            out.append(FitParam(name=f.name, generation=None, lo=lo, hi=hi, start=min(max(v, lo), hi), unit=unit))
    return out


def apply(x: Sequence[float], params: Sequence[FitParam], start: CoefficientSet) -> CoefficientSet:
    """The coefficient set with the free values x."""
    shared = dataclasses.replace(start.shared, **{p.name: float(v) for p, v in zip(params, x) if p.generation is None})
    gens = {p.generation for p in params if p.generation is not None} | set(start.by_generation)
    per_gen_names = {f.name for f in dataclasses.fields(Coefficients) if f.metadata.get("per_generation")}
    by_gen = {}
    for g in sorted(gens):
        base = start.by_generation.get(g, start.shared)
        # shared fields follow the new shared values; per-generation ones keep the generation's own
        keep = {n: getattr(base, n) for n in per_gen_names}
        vals = {p.name: float(v) for p, v in zip(params, x) if p.generation == g}
        by_gen[g] = dataclasses.replace(shared, **{**keep, **vals})
    return CoefficientSet(shared=shared, by_generation=by_gen)


# ---------------------------------------------------------------------- residuals
def _weights(rows: Sequence[CorpusRow]) -> dict[tuple[str, str], float]:
    """Weight of one observation of each kind per series: 1 / (observations of that kind in the series)."""
    count: dict[tuple[str, str], int] = {}
    for r in rows:
        if r.has_throughput:
            count[(r.series, "tps")] = count.get((r.series, "tps"), 0) + 1
        if r.memory:
            n = (len(r.memory.components_gib) + (r.memory.peak_reserved_gib is not None)
                 + (r.memory.peak_allocated_gib is not None))
            if n:
                count[(r.series, "mem")] = count.get((r.series, "mem"), 0) + n
    return {k: 1.0 / v for k, v in count.items()}


def _log_ratio(pred: float, meas: float) -> float:
    return math.log(max(pred, 1e-12) / meas)


def row_residuals(p: Prediction, w: dict[tuple[str, str], float]) -> list[float]:
    """Weighted residuals of one prediction (fixed length per row, whatever the values)."""
    r, mem = p.row, p.row.memory
    out = []
    failed = p.failure is not None
    if r.has_throughput:
        out.append(0.0 if failed else math.sqrt(w[(r.series, "tps")]) * _log_ratio(p.tokens_per_s_per_gpu,
                                                                                     r.tokens_per_s_per_gpu))
    if mem:
        wm = math.sqrt(w.get((r.series, "mem"), 0.0))
        for k, v in mem.components_gib.items():
            out.append(0.0 if failed or k not in p.components_gib else wm * _log_ratio(p.components_gib[k], v))
        for kind, meas_peak in (("reserved", mem.peak_reserved_gib), ("allocated", mem.peak_allocated_gib)):
            if meas_peak is not None:
                pred = None if failed else (p.reserved_gib if kind == "reserved" else p.allocated_gib)
                out.append(0.0 if pred is None else wm * _log_ratio(pred, meas_peak))
        if mem.fits is not None:
            hinge = 0.0
            if not failed:
                if mem.fits:
                    hinge = max(0.0, _log_ratio(p.peak_gib, p.capacity_gib * (1 - VERDICT_HEADROOM)))
                else:
                    hinge = max(0.0, _log_ratio(p.capacity_gib, p.peak_gib))
            out.append(math.sqrt(VERDICT_WEIGHT) * hinge)
    return out


# ---------------------------------------------------------------------- the fit
@dataclass(frozen=True, kw_only=True)
class FitResult:
    """What the fit moved, where to, and how well the result predicts what it was fitted to."""

    params: tuple[FitParam, ...]
    """The free values, with their bounds and starting values."""
    values: tuple[float, ...]
    """The fitted values, in the order of ``params``."""
    coefficients: CoefficientSet
    """The fitted coefficients."""
    rows: tuple[str, ...]
    """Ids of the rows fitted to."""
    series: tuple[str, ...]
    """Series fitted to."""
    scores: tuple[SeriesScore, ...]
    """Per-series scores of the fitted coefficients on the rows fitted to."""
    cost: float
    """Half the sum of squared weighted residuals at the optimum."""
    start_cost: float
    """The same at the starting values."""
    message: str
    """The optimiser's status message."""
    evaluations: int
    """Residual evaluations."""

    def changes(self) -> list[tuple[FitParam, float, float]]:
        """(param, fitted value, relative change from the start), largest change first."""
        out = [(p, v, v / p.start - 1 if p.start else math.inf) for p, v in zip(self.params, self.values)]
        return sorted(out, key=lambda t: -abs(t[2]))


def fit(corpus: Corpus, start: CoefficientSet | None = None, params: Sequence[FitParam] | None = None,
        max_evaluations: int = 400, moe: bool = False) -> FitResult:
    """Fit the bounded coefficients to the expressed rows of ``corpus`` (the seed included when present),
    starting from ``start`` (default: the fields' source values): the dense fields to the dense rows, or with
    ``moe`` the MoE kernels' fields to the MoE rows (the dense fields held at ``start``), so a MoE row's error
    never pulls the shared dense coefficients of its GPU generation."""
    start = start or source_values()
    rows = [r for r in corpus.expressed if (r.has_throughput or (r.memory is not None)) and is_moe_row(r) == moe
            and not r.low_precision]
    if not rows:
        raise FitError(f"corpus {corpus.directory}: no expressed {'MoE' if moe else 'dense'} row with a throughput "
                       f"or a memory observation")
    params = list(params) if params is not None else fit_params(corpus, start, moe=moe)
    if not params:
        raise FitError("no coefficient declares bounds in its metadata: nothing to fit")
    if moe:
        rows = by_model(rows)
    return solve(rows, params, start, max_evaluations)


def solve(rows: Sequence[CorpusRow], params: Sequence[FitParam], start: CoefficientSet,
          max_evaluations: int) -> FitResult:
    """The one bounded least-squares fit of every stage (dense, MoE, low precision): ``params`` over ``start``
    against ``rows``' log residuals, each series weighing 1, with a small prior towards the starting values."""
    params = list(params)
    w = _weights(rows)
    x0 = np.array([p.start for p in params])
    lo = np.array([p.lo for p in params])
    hi = np.array([p.hi for p in params])
    width = hi - lo

    def residuals(x: np.ndarray) -> np.ndarray:
        cs = apply(x, params, start)
        res: list[float] = []
        for p in predict_rows(rows, cs.for_row):
            res.extend(row_residuals(p, w))
        res.extend(math.sqrt(PRIOR_WEIGHT) * (x - x0) / width)
        return np.asarray(res)

    r0 = residuals(x0)
    # tight tolerances: the default ftol (1e-8) stops after a dozen evaluations on this flat, hinge-penalised
    # cost and left single-series coefficients (GDN, host optimizer) short of their optimum
    from scipy.optimize import least_squares  # loaded when a fit runs (a second to import)

    sol = least_squares(residuals, x0, bounds=(lo, hi), method="trf", x_scale=width, diff_step=1e-4,
                        ftol=1e-12, xtol=1e-10, gtol=1e-12, max_nfev=max_evaluations)
    cs = apply(sol.x, params, start)
    preds = predict_rows(rows, cs.for_row)
    return FitResult(
        params=tuple(params), values=tuple(float(v) for v in sol.x), coefficients=cs,
        rows=tuple(r.id for r in rows), series=tuple(dict.fromkeys(r.series for r in rows)),
        scores=tuple(scores(preds)), cost=float(sol.cost), start_cost=0.5 * float(r0 @ r0),
        message=str(sol.message), evaluations=int(sol.nfev),
    )


def fit_all(corpus: Corpus, start: CoefficientSet | None = None) -> FitResult:
    """The dense fit, then (when the corpus has expressed MoE rows) the MoE kernels' fit on top of it: one
    result holding both (params, values, rows and scores of the two, costs summed)."""
    dense = fit(corpus, start)
    if not any(is_moe_row(r) and r.has_throughput and not r.low_precision for r in corpus.expressed):
        return dense
    m = fit(corpus, dense.coefficients, moe=True)
    cs = m.coefficients
    fitted = set(dense.rows + m.rows)
    preds = predict_rows([r for r in corpus.expressed if r.id in fitted], cs.for_row)
    return FitResult(params=dense.params + m.params, values=dense.values + m.values, coefficients=m.coefficients,
                     rows=dense.rows + m.rows, series=tuple(dict.fromkeys(dense.series + m.series)),
                     scores=tuple(scores(preds)), cost=dense.cost + m.cost, start_cost=dense.start_cost + m.start_cost,
                     message=f"dense: {dense.message} MoE: {m.message}", evaluations=dense.evaluations + m.evaluations)


def leave_one_series_out(corpus: Corpus, series: str, start: CoefficientSet | None = None
                         ) -> tuple[FitResult, list[Prediction]]:
    """Fit without ``series``, then predict its rows with the fitted coefficients."""
    held = [r for r in corpus.expressed if r.series == series]
    if not held:
        raise FitError(f"series '{series}' has no expressed row in {corpus.directory}")
    res = fit(corpus.without_series(series), start)
    return res, predict_rows(held, res.coefficients.for_row)


# ---------------------------------------------------------------------- MoE: leave one model out (issue 21)
def _bf16_moe_row(r: CorpusRow) -> bool:
    """A bf16 MoE throughput row: what the MoE stage fits (low-precision rows belong to the third stage)."""
    return is_moe_row(r) and r.has_throughput and not r.low_precision


def moe_models(corpus: Corpus) -> list[str]:
    """Bundled MoE models with expressed bf16 throughput rows in the corpus, in first-seen order."""
    return list(dict.fromkeys(r.model.name for r in corpus.expressed if _bf16_moe_row(r)))


def _moe_fields() -> dict[str, float]:
    src = Coefficients()
    return {f.name: getattr(src, f.name) for f in dataclasses.fields(Coefficients) if f.metadata.get("moe")}


def reset_moe(cs: CoefficientSet) -> CoefficientSet:
    """``cs`` with every MoE field back at its source value: the dense stage's result, where a MoE fit starts
    (and what its prior pulls towards), whatever MoE values ``cs`` held."""
    src = _moe_fields()
    return CoefficientSet(shared=dataclasses.replace(cs.shared, **src),
                          by_generation={g: dataclasses.replace(c, **src) for g, c in cs.by_generation.items()})


def leave_one_model_out(corpus: Corpus, model: str, dense: CoefficientSet) -> tuple[FitResult, list[Prediction]]:
    """The MoE stage fitted without ``model``'s rows (the dense coefficients ``dense`` held, as in ``fit_all``),
    then ``model``'s throughput rows predicted with the result: how the MoE coefficients transfer to a model
    they never saw."""
    held = [r for r in corpus.expressed if _bf16_moe_row(r) and r.model.name == model]
    if not held:
        raise FitError(f"MoE model '{model}' has no expressed throughput row in {corpus.directory}")
    rest = Corpus(rows=tuple(r for r in corpus.rows if not (r.model is not None and r.model.name == model)),
                  directory=corpus.directory)
    res = fit(rest, reset_moe(dense), moe=True)
    return res, predict_rows(held, res.coefficients.for_row)


def moe_transfer_table(corpus: Corpus, fitted: CoefficientSet, dense: CoefficientSet | None = None) -> list[dict]:
    """Per MoE model: rows, in-sample MAPE / bias (``fitted``: the full fit, or the shipped coefficients) and
    leave-one-model-out MAPE / bias (the MoE stage refitted without the model on top of ``dense``, default
    ``fitted``'s dense fields), fractions (0.05 = 5%). Empty when the corpus has fewer than two MoE models."""
    dense = dense if dense is not None else fitted
    if len(moe_models(corpus)) < 2:
        return []
    out = []
    for name in moe_models(corpus):
        rows = [r for r in corpus.expressed if _bf16_moe_row(r) and r.model.name == name]
        ins = predict_rows(rows, fitted.for_row)
        _, lomo = leave_one_model_out(corpus, name, dense)
        e_in = [p.error for p in ins if p.error is not None]
        e_out = [p.error for p in lomo if p.error is not None]
        mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
        out.append({"model": name, "rows": len(rows), "in_sample_mape": mean([abs(e) for e in e_in]),
                    "in_sample_bias": mean(e_in), "lomo_mape": mean([abs(e) for e in e_out]), "lomo_bias": mean(e_out)})
    return out


# ---------------------------------------------------------------------- the data file
def _round(v: float) -> float:
    return float(f"{v:.5g}")


def to_data(result: FitResult, corpus_dir: str, today: _dt.date | None = None,
            moe_transfer: Sequence[dict] = ()) -> dict:
    """The coefficient data file's content: fitted values, what they were fitted to, residuals per series."""
    cs = result.coefficients
    shared_names = [p.name for p in result.params if p.generation is None]
    gens = sorted({p.generation for p in result.params if p.generation is not None})
    pct = lambda v: None if v is None else round(100 * v, 2)  # noqa: E731
    return {
        "fitted": {
            "by": "attune calibrate --fit",
            "date": (today or _dt.datetime.now(_dt.timezone.utc).date()).isoformat(),
            "attune_version": attune.__version__,
            "corpus": corpus_dir,
            "method": ("scipy.optimize.least_squares (trf, bounded) on log throughput / memory residuals, each series "
                       f"weight 1; memory verdicts as hinge penalties (weight {VERDICT_WEIGHT:g}, headroom "
                       f"{VERDICT_HEADROOM:g}); prior weight {PRIOR_WEIGHT:g} towards the fields' source values"),
            "cost": _round(result.cost), "start_cost": _round(result.start_cost), "optimizer": result.message,
            "series": list(result.series),
            "rows": list(result.rows),
        },
        "bounds": {p.name: [p.lo, p.hi] for p in result.params},
        "shared": {n: _round(getattr(cs.shared, n)) for n in dict.fromkeys(shared_names)},
        "per_generation": {g: {p.name: _round(v) for p, v in zip(result.params, result.values) if p.generation == g}
                           for g in gens},
        "residuals": {s.series: {"rows": s.rows, "throughput_rows": s.throughput_rows, "mape_pct": pct(s.mape),
                                 "bias_pct": pct(s.bias),
                                 "spearman": None if s.spearman is None else round(s.spearman, 3),
                                 "verdicts_right": f"{s.verdicts_right}/{s.verdicts}" if s.verdicts else None,
                                 "component_mape_pct": pct(s.component_mape)} for s in result.scores},
        **({"moe_transfer": {t["model"]: {"rows": t["rows"], "in_sample_mape_pct": pct(t["in_sample_mape"]),
                                          "in_sample_bias_pct": pct(t["in_sample_bias"]),
                                          "leave_one_model_out_mape_pct": pct(t["lomo_mape"]),
                                          "leave_one_model_out_bias_pct": pct(t["lomo_bias"])}
                             for t in moe_transfer}} if moe_transfer else {}),
    }


HEADER = ("# The estimator's fitted coefficients (attune/estimator/coefficients.py reads `shared` and\n"
          "# `per_generation`). Written by `attune calibrate --fit`; refit rather than edit by hand.\n")


def write_data(result: FitResult, path: Path, corpus_dir: str, moe_transfer: Sequence[dict] = ()) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER + yaml.safe_dump(to_data(result, corpus_dir, moe_transfer=moe_transfer), sort_keys=False,
                                            width=120))
    return path
