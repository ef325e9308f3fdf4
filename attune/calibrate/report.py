"""Measured vs predicted for every expressed corpus row: errors, per-series MAPE and rank correlation,
memory verdicts, a CSV and markdown table and a parity plot (matplotlib's object API, no pyplot)."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from attune.calibrate.rows import MEMORY, Corpus, CorpusRow
from attune.errors import AttuneError
from attune.estimator import BatchEstimate, Estimate, estimate, estimate_batch
from attune.estimator.coefficients import Coefficients, coefficients_for
from attune.spec.columns import LayoutColumns
from attune.spec.layout import Layout

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CoefficientsFor = Callable[[CorpusRow], Coefficients]
"""Which coefficients predict a row: by default the fitted set of the row's GPU generation."""

MIN_RANK_ROWS = 3
"""Spearman's rank correlation is reported for series with at least this many throughput rows."""


def default_coefficients(row: CorpusRow) -> Coefficients:
    return coefficients_for(row.cluster.gpu)


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """One expressed row, predicted."""

    row: CorpusRow
    """The corpus row."""
    tokens_per_s_per_gpu: float | None = None
    """Predicted tokens/s/GPU (None for memory-only rows or a failed estimate)."""
    peak_gib: float | None = None
    """Predicted peak of the stage the row observed (the worst stage when it names none), GiB."""
    capacity_gib: float | None = None
    """The GPU's memory, GiB."""
    fits: bool | None = None
    """Predicted verdict for the observed stage (or the whole layout)."""
    components_gib: dict[str, float] = field(default_factory=dict)
    """Predicted component memory of the observed stage (``states``, ``activations``), GiB."""
    allocated_gib: float | None = None
    """Predicted allocated peak of that stage (``max_memory_allocated``), GiB."""
    reserved_gib: float | None = None
    """Predicted reserved peak of that stage (``max_memory_reserved``), GiB."""
    failure: str | None = None
    """Why the estimator could not predict the row."""

    @property
    def error(self) -> float | None:
        """Relative throughput error: predicted / measured - 1."""
        m = self.row.tokens_per_s_per_gpu
        return None if (m is None or self.tokens_per_s_per_gpu is None) else self.tokens_per_s_per_gpu / m - 1

    @property
    def verdict_right(self) -> bool | None:
        obs = self.row.memory.fits if self.row.memory else None
        return None if (obs is None or self.fits is None) else obs == self.fits

    @property
    def component_errors(self) -> dict[str, float]:
        meas = self.row.memory.components_gib if self.row.memory else {}
        return {k: self.components_gib[k] / v - 1 for k, v in meas.items() if k in self.components_gib}

    @property
    def peak_errors(self) -> dict[str, float]:
        """Relative errors of the predicted reserved and allocated peaks against the measured ones."""
        mem, out = self.row.memory, {}
        if mem and mem.peak_reserved_gib and self.reserved_gib:
            out["reserved"] = self.reserved_gib / mem.peak_reserved_gib - 1
        if mem and mem.peak_allocated_gib and self.allocated_gib:
            out["allocated"] = self.allocated_gib / mem.peak_allocated_gib - 1
        return out


def _from_estimate(row: CorpusRow, est: Estimate) -> Prediction:
    mem = est.memory
    stage = row.memory.stage if (row.memory and row.memory.stage is not None) else None
    st = mem.stages[stage] if stage is not None and stage < len(mem.stages) else max(mem.stages, key=lambda s: s.total_gib)
    fits = (st.total_gib <= mem.capacity_gib) if (stage is not None and row.memory.fits is False) else mem.fits
    comps = {"states": st.weights_gib + st.grads_gib + st.optimizer_gib, "activations": st.activations_gib}
    return Prediction(row=row, tokens_per_s_per_gpu=est.perf.tokens_per_s_per_gpu if row.has_throughput else None,
                      peak_gib=st.total_gib, capacity_gib=mem.capacity_gib, fits=fits, components_gib=comps,
                      allocated_gib=st.allocated_gib, reserved_gib=st.reserved_gib)


def predict_row(row: CorpusRow, coef: Coefficients | None = None) -> Prediction:
    """The estimator's prediction of one expressed row (a failed estimate is kept with its reason)."""
    if not row.expressed:
        raise ValueError(f"row {row.id} is not expressed: {row.reason}")
    c = coef if coef is not None else default_coefficients(row)
    try:
        est = estimate(row.model, row.cluster, row.layout, row.workload, row.engine, c, check_layout=False)
    except AttuneError as e:
        return Prediction(row=row, failure=str(e))
    except ArithmeticError as e:  # an estimator bug on an unusual row: kept in the table, not fatal to the report
        return Prediction(row=row, failure=f"estimator error: {type(e).__name__}: {e}")
    return _from_estimate(row, est)


def predict_rows(rows: Sequence[CorpusRow], coefficients: CoefficientsFor = default_coefficients) -> list[Prediction]:
    """``predict_row`` of every row, in order: the rows of one target (model, cluster, engine, workload) and
    coefficients estimated as one batch (``estimate_batch``, its records read as ``estimate`` reads them); a batch
    that fails goes row by row."""
    groups: list[tuple[CorpusRow, Coefficients, list[int]]] = []
    by_name: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        if not r.expressed:
            raise ValueError(f"row {r.id} is not expressed: {r.reason}")
        c = coefficients(r)
        key = (r.model.name, r.cluster.spec, r.engine.name, r.workload, id(c))
        for g in by_name.setdefault(key, []):
            first, gc, members = groups[g]
            if gc is c and (first.model, first.cluster, first.engine) == (r.model, r.cluster, r.engine):
                members.append(i)
                break
        else:
            by_name[key].append(len(groups))
            groups.append((r, c, [i]))
    out: list[Prediction | None] = [None] * len(rows)
    for first, c, members in groups:
        try:
            cols = _columns(tuple(rows[i].layout for i in members))
            b = estimate_batch(first.model, first.cluster, cols, first.workload, first.engine, c)
        except (AttuneError, ArithmeticError):  # one row's failure: each row on its own, failures kept with reasons
            b = None
        if b is None:
            for i in members:
                out[i] = predict_row(rows[i], c)
            continue
        terms = {k: b.stage_values(k) for k in _STAGE_TERMS}
        for j, i in enumerate(members):
            out[i] = _from_batch(rows[i], b, j, terms)
    return out


_STAGE_TERMS = ("total_gib", "weights_gib", "grads_gib", "optimizer_gib", "activations_gib", "allocated_gib",
                "reserved_gib")
"""The per-stage terms a prediction reads (``_from_estimate``'s)."""


def _from_batch(row: CorpusRow, b: BatchEstimate, j: int, terms: dict) -> Prediction:
    """``_from_estimate`` of row j of a batch, read from its records (the same numbers ``estimate`` gives)."""
    stage = row.memory.stage if (row.memory and row.memory.stage is not None) else None
    pp = int(b.stage[j].sum())
    k = stage if stage is not None and stage < pp else int(b.peak_stage[j])
    total = float(terms["total_gib"][j, k])
    fits = (total <= b.capacity_gib) if (stage is not None and row.memory.fits is False) else bool(b.fits[j])
    at = {n: float(v[j, k]) for n, v in terms.items()}
    comps = {"states": at["weights_gib"] + at["grads_gib"] + at["optimizer_gib"], "activations": at["activations_gib"]}
    return Prediction(row=row, tokens_per_s_per_gpu=float(b.tokens_per_s_per_gpu[j]) if row.has_throughput else None,
                      peak_gib=total, capacity_gib=b.capacity_gib, fits=fits, components_gib=comps,
                      allocated_gib=at["allocated_gib"], reserved_gib=at["reserved_gib"])


def _columns(layouts: tuple[Layout, ...]) -> LayoutColumns:
    """The batch of a group's layouts, kept: a fit asks for the same groups at every evaluation."""
    cols = _COLUMNS.get(layouts)
    if cols is None:
        if len(_COLUMNS) >= 4096:
            _COLUMNS.clear()
        cols = _COLUMNS[layouts] = LayoutColumns.from_layouts(layouts)
    return cols


_COLUMNS: dict[tuple, LayoutColumns] = {}


def predict(corpus: Corpus, coefficients: CoefficientsFor = default_coefficients) -> list[Prediction]:
    return predict_rows(corpus.expressed, coefficients)


# ---------------------------------------------------------------------- scores
def _series_point(r: CorpusRow) -> tuple:
    """What makes two rows of a series different layouts (weak scaling's DP alone does not): model,
    TP, PP, VPP, CP, SP, micro batch, recompute and microbatches per DP rank."""
    lay, wl = r.layout, r.workload
    return (r.model.name, lay.tp, lay.pp, lay.vpp, lay.cp, lay.sp, lay.micro_batch_size, lay.recompute_granularity,
            wl.global_batch // (lay.dp * lay.micro_batch_size))


@dataclass(frozen=True, kw_only=True)
class SeriesScore:
    """Throughput and memory scores of one series (or of all rows: series ``overall``)."""

    series: str
    """The series name."""
    rows: int
    """Expressed rows."""
    throughput_rows: int
    """Rows with a measured and a predicted throughput."""
    mape: float | None
    """Mean absolute relative throughput error (0.05 = 5%)."""
    bias: float | None
    """Mean signed relative throughput error (negative: predicted too slow)."""
    spearman: float | None
    """Spearman rank correlation of predicted vs measured throughput (None below MIN_RANK_ROWS rows or when
    either side is constant)."""
    varies_layout: bool
    """Whether the series' rows differ in layout beyond DP (the rank correlation is a done-criterion there)."""
    verdicts: int
    """Rows with an observed fit / OOM verdict."""
    verdicts_right: int
    """Of those, predicted right."""
    component_mape: float | None
    """Mean absolute relative error of the memory components (states, activations) and measured peaks."""


def _spearman(meas: Sequence[float], pred: Sequence[float]) -> float | None:
    if len(meas) < MIN_RANK_ROWS or len(set(meas)) < 2 or len(set(pred)) < 2:
        return None
    from scipy.stats import spearmanr  # scipy.stats and matplotlib load when used (0.7-1 s each to import)

    rho = spearmanr(meas, pred).statistic
    return None if math.isnan(rho) else float(rho)


def score(series: str, preds: Sequence[Prediction]) -> SeriesScore:
    tp = [p for p in preds if p.error is not None]
    errs = [p.error for p in tp]
    comp = [abs(e) for p in preds for e in (*p.component_errors.values(), *p.peak_errors.values())]
    verdicts = [p.verdict_right for p in preds if p.verdict_right is not None]
    keys = {_series_point(p.row) for p in tp}
    return SeriesScore(
        series=series, rows=len(preds), throughput_rows=len(tp),
        mape=sum(abs(e) for e in errs) / len(errs) if errs else None,
        bias=sum(errs) / len(errs) if errs else None,
        spearman=_spearman([p.row.tokens_per_s_per_gpu for p in tp], [p.tokens_per_s_per_gpu for p in tp]),
        varies_layout=len(keys) > 1, verdicts=len(verdicts), verdicts_right=sum(verdicts),
        component_mape=sum(comp) / len(comp) if comp else None,
    )


def scores(preds: Sequence[Prediction]) -> list[SeriesScore]:
    """One score per series (in first-seen order); when MoE rows are present, one per MoE model (``MoE <model>``)
    and the dense and MoE rows apart (``dense``, ``MoE``); then ``overall``."""
    by: dict[str, list[Prediction]] = {}
    for p in preds:
        by.setdefault(p.row.series, []).append(p)
    out = [score(s, ps) for s, ps in by.items()]
    low = [p for p in preds if p.row.low_precision]  # issue 22: scored per precision class, apart from bf16
    out += precision_class_scores(low)
    moe = [p for p in preds if p.row.model is not None and p.row.model.moe is not None and not p.row.low_precision]
    if moe:
        per_model: dict[str, list[Prediction]] = {}
        for p in moe:
            per_model.setdefault(p.row.model.name, []).append(p)
        out += [score(f"MoE {name}", ps) for name, ps in per_model.items()]
        moe_ids = {id(p) for p in moe}
        out += [score("dense", [p for p in preds if id(p) not in moe_ids and not p.row.low_precision]),
                score("MoE", moe)]
    return out + [score("overall", list(preds))]


def precision_class_scores(preds: Sequence[Prediction]) -> list[SeriesScore]:
    """Per low-precision class of the rows (``fp8``, ``mxfp8``), and per class x dense / MoE where both occur."""
    out = []
    for pc in dict.fromkeys(p.row.precision for p in preds):
        ps = [p for p in preds if p.row.precision == pc]
        out.append(score(pc, ps))
        moe = [p for p in ps if p.row.model.moe is not None]
        if moe and len(moe) < len(ps):
            out += [score(f"{pc} dense", [p for p in ps if p.row.model.moe is None]), score(f"{pc} MoE", moe)]
    return out


# ---------------------------------------------------------------------- tables and the parity plot
COLUMNS = ("id", "series", "gpu", "layout", "measured_tokens_per_s_per_gpu", "predicted_tokens_per_s_per_gpu",
           "error_pct", "observed_fits", "predicted_fits", "verdict", "peak_gib", "capacity_gib",
           "measured_components_gib", "predicted_components_gib", "measured_peak_gib", "predicted_peak_gib", "failure")


def _fmt(v, nd: int = 1) -> str:
    return "" if v is None else f"{v:.{nd}f}"


def _peaks(mem) -> tuple[tuple[str, float | None], ...]:
    """(kind, measured GiB) of the reserved and allocated peaks (None where not measured)."""
    return (("reserved", mem.peak_reserved_gib if mem else None), ("allocated", mem.peak_allocated_gib if mem else None))


def table_rows(preds: Sequence[Prediction]) -> list[dict[str, str]]:
    out = []
    for p in preds:
        r, mem = p.row, p.row.memory
        out.append({
            "id": r.id, "series": r.series, "gpu": r.cluster.type_key, "layout": r.layout.label(),
            "measured_tokens_per_s_per_gpu": _fmt(r.tokens_per_s_per_gpu),
            "predicted_tokens_per_s_per_gpu": _fmt(p.tokens_per_s_per_gpu),
            "error_pct": _fmt(None if p.error is None else 100 * p.error),
            "observed_fits": "" if not mem or mem.fits is None else str(mem.fits).lower(),
            "predicted_fits": "" if p.fits is None or MEMORY not in r.kinds else str(p.fits).lower(),
            "verdict": "" if p.verdict_right is None else ("right" if p.verdict_right else "WRONG"),
            "peak_gib": _fmt(p.peak_gib) if MEMORY in r.kinds else "",
            "capacity_gib": _fmt(p.capacity_gib) if MEMORY in r.kinds else "",
            "measured_components_gib": " ".join(f"{k}={v:.1f}" for k, v in (mem.components_gib if mem else {}).items()),
            "predicted_components_gib": " ".join(
                f"{k}={p.components_gib[k]:.1f}" for k in (mem.components_gib if mem else {}) if k in p.components_gib),
            "measured_peak_gib": " ".join(f"{k}={v:.1f}" for k, v in _peaks(mem) if v),
            "predicted_peak_gib": " ".join(f"{k}={v:.1f}" for (k, m), v in zip(
                _peaks(mem), (p.reserved_gib, p.allocated_gib)) if m and v is not None),
            "failure": p.failure or "",
        })
    return out


def write_csv(preds: Sequence[Prediction], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(table_rows(preds))
    return path


def _md_score(s: SeriesScore) -> str:
    pct = lambda v: "" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    rho = "" if s.spearman is None else f"{s.spearman:.2f}"
    ver = f"{s.verdicts_right}/{s.verdicts}" if s.verdicts else ""
    return (f"| {s.series} | {s.rows} | {s.throughput_rows} | {pct(s.mape)} | {pct(s.bias)} | {rho} | "
            f"{'yes' if s.varies_layout else 'no'} | {ver} | {pct(s.component_mape)} |")


def transfer_markdown(table: Sequence[dict]) -> list[str]:
    """The MoE transfer table (``attune.calibrate.fit.moe_transfer_table``) as markdown lines."""
    if not table:
        return []
    pct = lambda v: "" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    lines = ["", "## MoE: in-sample and leave one model out", "",
             "The MoE coefficients are shared by every MoE model. Leave one model out: the MoE stage refitted without "
             "the model's rows (the dense coefficients held), then the model's rows predicted.", "",
             "| model | throughput rows | in-sample MAPE | in-sample bias | left-out MAPE | left-out bias |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {t['model']} | {t['rows']} | {pct(t['in_sample_mape'])} | {pct(t['in_sample_bias'])} | "
              f"{pct(t['lomo_mape'])} | {pct(t['lomo_bias'])} |" for t in table]
    return lines


def markdown(preds: Sequence[Prediction], unexpressed: Sequence[CorpusRow], title: str = "Calibration",
             moe_transfer: Sequence[dict] = ()) -> str:
    lines = [f"# {title}", "", "## Per series", "",
             "| series | rows | throughput rows | MAPE | bias | Spearman | varies layout | verdicts right | component MAPE |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [_md_score(s) for s in scores(preds)]
    lines += transfer_markdown(moe_transfer)
    lines += ["", "## Rows", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(v.replace("|", "/") for v in row.values()) + " |" for row in table_rows(preds)]
    if unexpressed:
        lines += ["", "## Rows not expressed", "", "| id | series | reason |", "|---|---|---|"]
        lines += [f"| {r.id} | {r.series} | {r.reason} |" for r in unexpressed]
    return "\n".join(lines) + "\n"


def parity_figure(preds: Sequence[Prediction]) -> Figure:
    """Predicted vs measured tokens/s/GPU on log axes, one colour per series, with the +-10% band."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 7))
    ax = fig.subplots()
    pts = [p for p in preds if p.error is not None]
    by: dict[str, list[Prediction]] = {}
    for p in pts:
        by.setdefault(p.row.series, []).append(p)
    for s, ps in by.items():
        ax.scatter([p.row.tokens_per_s_per_gpu for p in ps], [p.tokens_per_s_per_gpu for p in ps], s=16, label=s)
    if pts:
        vals = [p.row.tokens_per_s_per_gpu for p in pts] + [p.tokens_per_s_per_gpu for p in pts]
        lo, hi = min(vals) / 1.5, max(vals) * 1.5
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="predicted = measured")
        ax.fill_between([lo, hi], [0.9 * lo, 0.9 * hi], [1.1 * lo, 1.1 * hi], color="grey", alpha=0.2, label="+-10%")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured tokens/s/GPU")
    ax.set_ylabel("predicted tokens/s/GPU")
    ax.set_title("attune estimator vs published runs")
    ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    return fig


def write_parity_png(preds: Sequence[Prediction], path: Path, dpi: int = 110) -> Path:
    parity_figure(preds).savefig(path, dpi=dpi)
    return path
