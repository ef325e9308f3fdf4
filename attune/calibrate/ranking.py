"""The rank inside a sweep, and how the fit does on series it never saw (issue 18 item 5).

A tuner is judged on the order it puts one model's layouts in on one cluster, not on a correlation across models:
``sweeps`` groups the throughput rows of each series by model, GPU and precision and scores every group whose
layouts differ (``report._series_point``: weak scaling's DP alone is not a different layout) with the Spearman rank
correlation of predicted against measured tokens/s/GPU and whether the predicted fastest layout is the measured
fastest. ``leave_one_series_out`` refits the dense coefficients without each bf16 dense series in turn
(``fit.leave_one_series_out``) and predicts that series: the error on rows the fit never saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from attune.calibrate.fit import CoefficientSet, is_moe_row, leave_one_series_out
from attune.calibrate.report import MIN_RANK_ROWS, Prediction, _series_point, _spearman, score
from attune.calibrate.rows import Corpus


@dataclass(frozen=True, kw_only=True)
class SweepScore:
    """One model's layouts on one GPU type and precision inside one series."""

    series: str
    """The corpus series."""
    model: str
    """The model's name."""
    gpu: str
    """The GPU type (the table's key)."""
    precision: str
    """bf16, fp8, mxfp8, ..."""
    rows: int
    """Throughput rows in the sweep."""
    layouts: int
    """Distinct layouts among them."""
    spearman: float | None
    """Rank correlation of predicted vs measured tokens/s/GPU (None below MIN_RANK_ROWS rows)."""
    best_right: bool
    """The predicted fastest row is the measured fastest one."""
    mape: float
    """Mean absolute relative throughput error (0.05 = 5%)."""


def sweeps(preds: Sequence[Prediction]) -> list[SweepScore]:
    """Every group of at least MIN_RANK_ROWS throughput rows of one series, model, GPU and precision whose layouts
    differ, in first-seen order."""
    groups: dict[tuple[str, str, str, str], list[Prediction]] = {}
    for p in preds:
        if p.error is None:
            continue
        r = p.row
        key = (r.series, r.model.name, r.gpu_name or r.cluster.gpu.name, r.precision or "bf16")
        groups.setdefault(key, []).append(p)
    out = []
    for (series, model, gpu, prec), ps in groups.items():
        layouts = len({_series_point(p.row) for p in ps})
        if len(ps) < MIN_RANK_ROWS or layouts < 2:
            continue
        meas = [p.row.tokens_per_s_per_gpu for p in ps]
        pred = [p.tokens_per_s_per_gpu for p in ps]
        out.append(SweepScore(series=series, model=model, gpu=gpu, precision=prec, rows=len(ps), layouts=layouts,
                              spearman=_spearman(meas, pred), best_right=meas.index(max(meas)) == pred.index(max(pred)),
                              mape=sum(abs(p.error) for p in ps) / len(ps)))
    return out


def sweeps_markdown(table: Sequence[SweepScore]) -> list[str]:
    lines = ["", "## Rank inside each sweep", "",
             "One model's layouts on one GPU type and precision inside a series (at least "
             f"{MIN_RANK_ROWS} rows, layouts beyond DP differing): Spearman of predicted vs measured tokens/s/GPU and "
             "whether the predicted fastest is the measured fastest.", ""]
    if not table:
        return lines + ["No series holds such a sweep."]
    lines += ["| series | model | GPU | precision | rows | layouts | Spearman | fastest right | MAPE |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {s.series} | {s.model} | {s.gpu} | {s.precision} | {s.rows} | {s.layouts} | "
              f"{'' if s.spearman is None else f'{s.spearman:.2f}'} | {'yes' if s.best_right else 'no'} | "
              f"{100 * s.mape:.1f}% |" for s in table]
    return lines


def leave_one_series_out_table(corpus: Corpus, in_sample: Sequence[Prediction],
                               start: CoefficientSet | None = None) -> list[dict]:
    """Per bf16 dense series (the dense fit's rows): its in-sample score (``in_sample``: the rows predicted with the
    coefficients fitted to everything) beside its score when the dense fit leaves it out."""
    dense = [r for r in corpus.expressed if not is_moe_row(r) and not r.low_precision
             and (r.has_throughput or r.memory is not None)]
    by_id = {p.row.id: p for p in in_sample}
    out = []
    for series in dict.fromkeys(r.series for r in dense):
        ins = score(series, [by_id[r.id] for r in dense if r.series == series and r.id in by_id])
        _, held = leave_one_series_out(corpus, series, start)
        left = score(series, held)
        out.append(dict(series=series, rows=ins.rows, throughput_rows=ins.throughput_rows, in_sample=ins,
                        left_out=left))
    return out


def loso_markdown(table: Sequence[dict]) -> list[str]:
    if not table:
        return []
    pct = lambda v: "" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    rho = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    ver = lambda s: f"{s.verdicts_right}/{s.verdicts}" if s.verdicts else ""  # noqa: E731
    lines = ["", "## Dense: leave one series out", "",
             "Each bf16 dense series: the dense coefficients refitted without it, then its rows predicted.", "",
             "| series | rows | throughput rows | in-sample MAPE | left-out MAPE | left-out bias | "
             "in-sample Spearman | left-out Spearman | left-out verdicts | left-out component MAPE |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        i, o = t["in_sample"], t["left_out"]
        lines.append(f"| {t['series']} | {t['rows']} | {t['throughput_rows']} | {pct(i.mape)} | {pct(o.mape)} | "
                     f"{pct(o.bias)} | {rho(i.spearman)} | {rho(o.spearman)} | {ver(o)} | {pct(o.component_mape)} |")
    return lines
