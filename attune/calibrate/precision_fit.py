"""Low-precision rows of the corpus (issue 22): the recipe each published run used, their fit stage and scores.

* The recipe of each row: ``attune.calibrate.precision_rows`` (read by the corpus).
* ``fit_precision``: the third fit stage. After the dense and the MoE stages (``attune.calibrate.fit.fit_all``),
  with every coefficient they fitted held, the low-precision GEMM coefficients (``precision`` in their metadata:
  ``fp8_gemm_efficiency`` per GPU generation, ``fp8_blockwise_gemm_ratio``, ``mxfp8_gemm_efficiency``) are fitted
  to the fp8 and mxfp8 rows only, by the same weighted log residuals, so a low-precision row never moves a bf16
  coefficient.
* ``fit_all_stages``: what ``attune calibrate --fit`` runs: ``fit_all`` (dense, then MoE), then this stage.

The report scores the low-precision rows per class apart from bf16 (``attune.calibrate.report.scores``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from attune.calibrate.fit import GENERATIONS, CoefficientSet, FitError, FitParam, FitResult, fit_all, solve
from attune.calibrate.report import Prediction, predict_rows, scores
from attune.calibrate.rows import Corpus, CorpusRow
from attune.estimator.coefficients import Coefficients
from attune.spec.precision import fields_for, recipe_of

CORPUS_CLASSES = ("fp8", "mxfp8")
"""Precision classes of the corpus the estimator expresses (nvfp4 rows: Nemotron 3 hybrids only, not modelled)."""

def is_low_precision_row(r: CorpusRow) -> bool:
    """The row ran its GEMMs in fp8 / fp4 (its layout's precision)."""
    return r.low_precision


# ---------------------------------------------------------------------- the fit stage
def precision_params(corpus: Corpus, start: CoefficientSet) -> list[FitParam]:
    """The low-precision GEMM coefficients, per generation of the low-precision rows where ``per_generation``;
    a coefficient no expressed row uses (mxfp8 without Blackwell rows, blockwise without blockwise rows) is left
    out."""
    rows = [r for r in corpus.expressed if is_low_precision_row(r) and r.has_throughput]
    gens = [g for g in GENERATIONS if any(r.generation == g for r in rows)]
    recipes = {r.layout.fp8_recipe for r in rows if r.layout.fp8_format is not None}
    use = {"fp8_gemm_efficiency": bool(recipes & {"delayed", "tensorwise", "blockwise"}),
           "fp8_blockwise_gemm_ratio": "blockwise" in recipes, "mxfp8_gemm_efficiency": "mxfp8" in recipes,
           "fp8_attention_speedup": any(r.engine.fp8_attention for r in rows)}
    out = []
    for f in dataclasses.fields(Coefficients):
        b = f.metadata.get("bounds")
        if not b or not f.metadata.get("precision") or not use.get(f.name, True):
            continue
        lo, hi = float(b[0]), float(b[1])
        if f.metadata.get("per_generation"):
            for g in gens:
                v = getattr(start.by_generation.get(g, start.shared), f.name)
                out.append(FitParam(name=f.name, generation=g, lo=lo, hi=hi, start=min(max(v, lo), hi),
                                    unit=str(f.metadata.get("unit", ""))))
        else:
            v = getattr(start.shared, f.name)
            out.append(FitParam(name=f.name, generation=None, lo=lo, hi=hi, start=min(max(v, lo), hi),
                                unit=str(f.metadata.get("unit", ""))))
    return out


def fit_precision(corpus: Corpus, start: CoefficientSet, rows: Sequence[CorpusRow] | None = None,
                  max_evaluations: int = 200) -> FitResult:
    """Fit the low-precision coefficients to the expressed fp8 / mxfp8 rows (or ``rows``), everything else held
    at ``start`` (the dense and MoE stages' result)."""
    rows = [r for r in (rows if rows is not None else corpus.expressed)
            if is_low_precision_row(r) and r.has_throughput]
    if not rows:
        raise FitError(f"corpus {corpus.directory}: no expressed low-precision row with a throughput")
    params = precision_params(Corpus(rows=tuple(rows), directory=corpus.directory), start)
    if not params:
        raise FitError("no low-precision coefficient declares bounds: nothing to fit")
    return solve(rows, params, start, max_evaluations)


def merge(base: FitResult, lp: FitResult, corpus: Corpus) -> FitResult:
    """The dense (+ MoE) result with the low-precision stage on top: one result, as ``fit_all`` returns."""
    cs = lp.coefficients
    fitted = set(base.rows + lp.rows)
    preds = predict_rows([r for r in corpus.expressed if r.id in fitted], cs.for_row)
    return FitResult(params=base.params + lp.params, values=base.values + lp.values, coefficients=cs,
                     rows=base.rows + lp.rows, series=tuple(dict.fromkeys(base.series + lp.series)),
                     scores=tuple(scores(preds)), cost=base.cost + lp.cost, start_cost=base.start_cost + lp.start_cost,
                     message=f"{base.message} low precision: {lp.message}", evaluations=base.evaluations + lp.evaluations)


def fit_all_stages(corpus: Corpus, start: CoefficientSet | None = None) -> FitResult:
    """The one fit of ``attune calibrate --fit``: the dense stage, the MoE stage, then (when the corpus has expressed
    low-precision rows) the low-precision stage with both held."""
    base = fit_all(corpus, start)
    if not any(r.low_precision and r.has_throughput for r in corpus.expressed):
        return base
    return merge(base, fit_precision(corpus, base.coefficients), corpus)


def leave_one_series_out(corpus: Corpus, start: CoefficientSet) -> list[Prediction]:
    """Every low-precision series predicted by the low-precision stage fitted without it (the dense and MoE
    coefficients held at ``start``): the held-out predictions, one per row."""
    rows = [r for r in corpus.expressed if is_low_precision_row(r) and r.has_throughput]
    out: list[Prediction] = []
    for s in dict.fromkeys(r.series for r in rows):
        held = [r for r in rows if r.series == s]
        rest = [r for r in rows if r.series != s]
        cs = fit_precision(corpus, start, rest).coefficients if rest else start
        out += predict_rows(held, cs.for_row)
    return out




# ---------------------------------------------------------------------- bf16 vs low-precision pairs
@dataclass(frozen=True)
class Pair:
    """A low-precision row and a bf16 row of the same release, model, GPUs, layout and workload."""

    low: Prediction
    bf16: Prediction

    @property
    def measured(self) -> float:
        """Measured speed-up, low precision over bf16."""
        return self.low.row.tokens_per_s_per_gpu / self.bf16.row.tokens_per_s_per_gpu

    @property
    def predicted(self) -> float | None:
        if self.low.tokens_per_s_per_gpu is None or self.bf16.tokens_per_s_per_gpu is None:
            return None
        return self.low.tokens_per_s_per_gpu / self.bf16.tokens_per_s_per_gpu


def _release(series: str) -> str:
    """A series with its precision token removed (the DGX-Cloud tables name bf16 and fp8 series apart)."""
    for tok in ("-fp8-", "-bf16-", "-mxfp8-"):
        series = series.replace(tok, "-")
    return series


def pairs(preds: Sequence[Prediction]) -> list[Pair]:
    """Every low-precision prediction with its bf16 twin of the same release (everything but the precision the
    same): the predicted speed-up is the precision model alone."""
    key = lambda p: (_release(p.row.series), p.row.model.name, p.row.cluster.spec,  # noqa: E731
                     dataclasses.replace(p.row.layout, **fields_for("bf16")), p.row.workload)
    bf = {}
    for p in preds:
        if not p.row.low_precision and p.row.has_throughput and p.row.model is not None:
            bf.setdefault(key(p), p)
    return [Pair(p, bf[key(p)]) for p in preds
            if p.row.low_precision and p.row.has_throughput and key(p) in bf]


def pairs_markdown(preds: Sequence[Prediction]) -> str:
    """The report's section on the pairs (empty without any)."""
    ps = [q for q in pairs(preds) if q.predicted is not None]
    if not ps:
        return ""
    errs = [q.predicted / q.measured - 1 for q in ps]
    L = ["", "## bf16 vs low precision, same release and layout", "",
         f"{len(ps)} pairs; predicted speed-up vs measured: mean absolute error "
         f"{100 * sum(abs(e) for e in errs) / len(errs):.1f}%, bias {100 * sum(errs) / len(errs):+.1f}%.", "",
         "| low-precision row | precision | measured speed-up | predicted | error |", "|---|---|---|---|---|"]
    L += [f"| {q.low.row.id} | {recipe_of(q.low.row.layout)} | {q.measured:.3f} | {q.predicted:.3f} | "
          f"{100 * (q.predicted / q.measured - 1):+.1f}% |" for q in ps]
    return "\n".join(L) + "\n"


def groups_markdown(preds: Sequence[Prediction]) -> str:
    """The report's section on where the low-precision error is: per class, model and GPU, the rows, MAPE and bias,
    worst first (by their share of the class's MAPE). Empty without low-precision predictions."""
    ps = [p for p in preds if p.row.low_precision and p.error is not None]
    if not ps:
        return ""
    groups: dict[tuple, list[float]] = {}
    for p in ps:
        groups.setdefault((recipe_of(p.row.layout), p.row.model.name, p.row.cluster.gpu.name), []).append(p.error)
    size = {c: sum(len(v) for k, v in groups.items() if k[0] == c) for c in {k[0] for k in groups}}
    L = ["", "## Low precision by class, model and GPU", "",
         "| precision | model | GPU | rows | MAPE | bias | share of the class's MAPE |", "|---|---|---|---|---|---|---|"]
    for (c, m, g), e in sorted(groups.items(), key=lambda kv: -sum(abs(x) for x in kv[1]) / size[kv[0][0]]):
        L.append(f"| {c} | {m} | {g} | {len(e)} | {100 * sum(abs(x) for x in e) / len(e):.1f}% | "
                 f"{100 * sum(e) / len(e):+.1f}% | {100 * sum(abs(x) for x in e) / size[c]:.1f}% |")
    return "\n".join(L) + "\n"


__all__ = ["is_low_precision_row", "groups_markdown", "precision_params", "fit_precision", "merge",
           "leave_one_series_out", "fit_all_stages", "CORPUS_CLASSES", "Pair", "pairs", "pairs_markdown"]
