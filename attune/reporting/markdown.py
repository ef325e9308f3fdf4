"""report.md: the study's winner, baseline, search counts, measured trials (predicted against measured) and
plots, in markdown."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from attune.reporting.plots import plot_study
from attune.search.records import records, study_counts
from attune.search.tuner import TuneConfig, TuneOutcome

# rows of the measured-trials table (best first)
TOP_TRIALS = 10
COUNT_LABELS = (("proposals", "proposals from TPE"), ("estimated", "TPE proposals estimated (memory + speed)"),
                ("refined", "layouts estimated by model-guided refinement (not trials)"),
                ("invalid", "pruned: break a layout rule"), ("oom_predicted", "pruned: predicted out of memory"),
                ("oom_rule", "pruned: monotone rule after a real OOM"), ("duplicate", "already measured"),
                ("skipped_slow", "skipped: predicted < {slack:g} x the best measured"),
                ("estimated_only", "estimated, not chosen"), ("measured", "measured trials (baseline included)"),
                ("measured_ok", "  completed"), ("measured_oom", "  out of memory on the runner"),
                ("measured_failed", "  failed or timed out"))


def _header(cfg: TuneConfig) -> list[str]:
    measured = cfg.runner.capabilities.measured
    return [f"# attune: {cfg.model.name} on {cfg.cluster.spec} ({cfg.engine.name})\n",
            f"Runner `{cfg.runner.name}` ({'measured runs' if measured else 'the calibrated model; every number here is predicted'}), "
            f"search space `{cfg.space.name}` ({cfg.space.path}), TPE seed {cfg.seed}, "
            f"{cfg.workload.seq_length:,}-token rows, global batch {cfg.workload.global_batch} rows. "
            f"Generated {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.\n"]


def _winner(cfg: TuneConfig, out: TuneOutcome, recipe: dict | None, kind: str) -> list[str]:
    best = out.best
    if best is None:
        return []
    L = ["## Winner\n",
         f"**{best.label}**: {best.value:,.1f} tokens/s/GPU ({kind}); predicted peak memory "
         f"{best.predicted_peak_gib:.1f} GiB on stage {best.predicted_peak_stage} "
         f"of {cfg.cluster.gpu.capacity_gib:.1f} GiB."]
    if recipe:
        r = recipe["result"]
        L.append(f" MFU {r['mfu']:.4f}; {r['usd_per_million_tokens']:.3f} USD per million tokens at "
                 f"{cfg.cluster.gpu.usd_per_hour:.2f} USD/GPU-hour.")
    L.append("\n")
    if recipe and recipe.get("correctness"):
        c = recipe["correctness"]
        L.append(f"Correctness: **{c.get('result')}** ({c.get('summary', '')}); recipe status `{recipe.get('status')}`.\n")
    return L


def _baseline(cfg: TuneConfig, out: TuneOutcome, kind: str) -> list[str]:
    base, best = out.baseline, out.best
    if base is None:
        return []
    L = ["## Baseline\n"]
    if base.value is not None:
        L.append(f"{base.label}: {base.value:,.1f} tokens/s/GPU ({kind}). {cfg.baseline_note}.")
        if best is not None:
            L.append(f" **Gain: {100 * (best.value / base.value - 1):+.1f}% ({kind}).**")
    else:
        L.append(f"{base.label}: did not complete ({base.outcome}: {base.reason or ''}).")
    L.append("\n")
    return L


def _search(cfg: TuneConfig, out: TuneOutcome) -> list[str]:
    counts = study_counts(out.study)
    L = ["## Search\n", "| what | count |\n|---|---|"]
    for k, label in COUNT_LABELS:
        L.append(f"| {label.format(slack=cfg.slack)} | {counts[k]} |")
    L.append(f"\nWall time of this session: {out.wall_s:.1f} s. "
             f"{('Stopped early: ' + out.stopped + '.') if out.stopped else ''}\n")
    return L


def _measured_table(out: TuneOutcome, measured: bool) -> list[str]:
    top = sorted([r for r in records(out.study) if r.is_measured and r.value is not None
                  and r.predicted_peak_gib is not None], key=lambda r: -r.value)[:TOP_TRIALS]
    if not top:
        return []
    L = ["## Measured trials (best first), predicted against measured\n",
         "| trial | layout | tokens/s/GPU | predicted tokens/s/GPU | error | peak GiB (max stage) | "
         "predicted peak GiB (stage) | error |\n|---|---|---|---|---|---|---|---|"]
    errs_t, errs_m = [], []
    for t in top:
        pt, pm = t.predicted_tokens_per_s_per_gpu, t.predicted_peak_gib
        mm = max(t.measured_peak_gib or [0]) if t.measured else None
        et = 100 * (pt - t.value) / t.value if pt else None
        em = 100 * (pm - mm) / mm if (mm and pm) else None
        if measured and et is not None:
            errs_t.append(abs(et))
        if em is not None:
            errs_m.append(abs(em))
        L.append(f"| {t.number} | {t.label} | {t.value:,.1f} | {pt:,.1f} | "
                 f"{'' if et is None or not measured else f'{et:+.1f}%'} | {'' if mm is None else f'{mm:.3f}'} | "
                 f"{pm:.3f} ({t.predicted_peak_stage}) | {'' if em is None else f'{em:+.1f}%'} |")
    if errs_t or errs_m:
        L.append("")
        L.append("Model error on measured trials (mean absolute): "
                 + (f"throughput {sum(errs_t) / len(errs_t):.1f}%" if errs_t else "")
                 + ("; " if errs_t and errs_m else "")
                 + (f"peak memory {sum(errs_m) / len(errs_m):.1f}%" if errs_m else "") + ".")
    L.append("")
    return L


def write_report(cfg: TuneConfig, out: TuneOutcome, out_dir: Path, recipe: dict | None) -> Path:
    """Write out_dir/report.md (and its PNG plots); returns its path."""
    plots = plot_study(cfg, out, out_dir)
    measured = bool(out.best and out.best.measured)
    kind = "measured" if measured else "predicted"
    L = _header(cfg) + _winner(cfg, out, recipe, kind) + _baseline(cfg, out, kind) + _search(cfg, out)
    L += _measured_table(out, measured)
    L.append("## Plots\n")
    for title, name in plots:
        L.append(f"### {title}\n\n![{title}]({name})\n")
    L.append("## Files\n\n- `recipe.yaml`: the winner as a recipe\n- `trials.csv`: one row per trial\n"
             f"- the Optuna study: `{cfg.storage}` (open with `optuna-dashboard`)\n")
    p = Path(out_dir) / "report.md"
    p.write_text("\n".join(L))
    return p
