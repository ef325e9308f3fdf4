"""report.md: the study's winner, baseline, search counts, measured trials (predicted against measured) and
plots, in markdown."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from pathlib import Path

from attune.estimator import estimate
from attune.estimator.coefficients import coefficients_for
from attune.recipe.models import Recipe
from attune.reporting.edge import edge_section
from attune.reporting.plots import plot_study
from attune.search.ablation import ablation
from attune.search.records import records, study_counts
from attune.search.storage import mask_url
from attune.search.tuner import TuneConfig, TuneOutcome

# rows of the measured-trials table (best first)
TOP_TRIALS = 10
COUNT_LABELS = (("proposals", "proposals from TPE"), ("estimated", "TPE proposals estimated (memory + speed)"),
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
            f"{cfg.workload.seq_length:,}-token rows, global batch {cfg.workload.global_batch} rows"
            f"{f' ({cfg.workload_note})' if cfg.workload_note else ''}. "
            f"Generated {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.\n"]


def _winner(cfg: TuneConfig, out: TuneOutcome, recipe: Recipe | None, kind: str) -> list[str]:
    best = out.best
    if best is None:
        return []
    L = ["## Winner\n",
         f"**{best.label}**: {best.value:,.1f} tokens/s/GPU ({kind}); predicted peak memory "
         f"{best.predicted_peak_gib:.1f} GiB on stage {best.predicted_peak_stage} "
         f"of {cfg.cluster.gpu.capacity_gib:.1f} GiB."]
    if recipe:
        r = recipe.result
        L.append(f" MFU {r.mfu:.4f}; {r.usd_per_million_tokens:.3f} USD per million tokens at "
                 f"{cfg.cluster.gpu.usd_per_hour:.2f} USD/GPU-hour.")
    L.append("\n")
    if recipe and recipe.correctness:
        c = recipe.correctness
        L.append(f"Correctness: **{c.result}** ({c.summary or ''}); recipe status `{recipe.status}`.\n")
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
        n = getattr(counts, k)
        if n or k == "measured":  # the model sampler makes no proposal trials: its rows stay empty
            L.append(f"| {label.format(slack=cfg.slack)} | {n} |")
    scored = out.scored
    L.append(f"\nSampler `{cfg.sampler}`; layouts of the space scored by the model (not trials): {scored:,}. "
             f"Wall time of this session: {out.wall_s:.1f} s.")
    if out.stopped:
        regret = "" if out.remaining_regret is None else \
            f" Estimated remaining regret: {100 * out.remaining_regret:.2f}% (the largest expected improvement of " \
            f"an unmeasured layout over the best measured)."
        L.append(f"\n**Stopped by {out.stop_kind}**: {out.stopped}.{regret}")
    L.append("")
    return L


def _calibration(cfg: TuneConfig, out: TuneOutcome) -> list[str]:
    """Coefficients before and after the study's recalibration, and each trial's prediction error."""
    cal = out.study.user_attrs.get("calibration")
    meas = [r for r in records(out.study) if r.is_measured and r.layout]
    if not meas:
        return []
    L = ["## Recalibration\n"]
    after = None
    if cal and cal.get("coefficients"):
        L += [f"Refitted to the study's measurements after trial {cal['after_trial']} (bounded least squares on log "
              f"tokens/s/GPU with the shipped calibration as a prior; residual RMS {100 * cal['residual_rms']:.2f}%).\n",
              "| coefficient | shipped | recalibrated | change |\n|---|---|---|---|"]
        for n, v in cal["coefficients"].items():
            v0 = cal["shipped"][n]
            L.append(f"| {n} | {v0:.4g} | {v:.4g} | {100 * (v / v0 - 1):+.1f}% |")
        offs = cal.get("memory_offset_gib", {})
        L.append("\nMemory offsets added to the predicted peak per stage position (GiB): "
                 + ", ".join(f"{k} {v:+.2f}" for k, v in offs.items()) + ".\n")
        after = cal["coefficients"]
    else:
        L.append("No recalibration: the shipped coefficients " +
                 ("are the measurement (sim runner)." if not cfg.runner.capabilities.measured
                  else "were kept (no completed measurement, or recalibration off).") + "\n")
    rows = [r for r in meas if r.value is not None and r.completed]
    if rows and cfg.runner.capabilities.measured:
        from_shipped = [r.predicted_shipped_tokens_per_s_per_gpu or r.predicted_tokens_per_s_per_gpu for r in rows]
        final = []
        for r in rows:
            if after:
                c = replace_coefficients(cfg, after)
                final.append(estimate(cfg.model, cfg.cluster, r.to_layout(), cfg.workload, cfg.engine, c,
                                      check_layout=False).perf.tokens_per_s_per_gpu)
            else:
                final.append(None)
        L += ["| trial | layout | measured tokens/s/GPU | error before (shipped) | error at proposal | "
              "error after (final calibration) |\n|---|---|---|---|---|---|"]
        for r, p0, p1 in zip(rows, from_shipped, final):
            e = lambda p, ref=r.value: "" if not p else f"{100 * (p - ref) / ref:+.1f}%"  # noqa: E731
            L.append(f"| {r.number} | {r.label} | {r.value:,.1f} | {e(p0)} | "
                     f"{e(r.predicted_model_tokens_per_s_per_gpu or r.predicted_tokens_per_s_per_gpu)} | {e(p1)} |")
        L.append("")
    return L


def replace_coefficients(cfg: TuneConfig, values: dict):
    """The shipped coefficients of the study with `values` replaced."""
    base = cfg.coefficients if cfg.coefficients is not None else coefficients_for(cfg.cluster.gpu)
    return replace(base, **values)


def _top_predicted(cfg: TuneConfig, out: TuneOutcome) -> list[str]:
    if not out.top_predicted:
        return []
    L = ["## Top 10 predicted layouts\n",
         f"By the study's final model (recalibrated coefficients plus measured residuals); margin = "
         f"{cfg.cluster.gpu.capacity_gib:.1f} GiB capacity - predicted peak.\n",
         "| layout | predicted tokens/s/GPU | spread | predicted peak GiB | memory margin GiB |\n|---|---|---|---|---|"]
    for t in out.top_predicted:
        L.append(f"| {t['label']} | {t['tokens_per_s_per_gpu']:,.1f} | {t['spread_percent']:.1f}% | "
                 f"{t['peak_gib']:.2f} | {t['margin_gib']:.2f} |")
    L.append("")
    return L


def _ablation(cfg: TuneConfig) -> list[str]:
    """The knobs beyond the seed (issue 15): the best predicted layout without each (attune.search.ablation)."""
    shipped = cfg.coefficients if cfg.coefficients is not None else coefficients_for(cfg.cluster.gpu)
    a = ablation(cfg.space, cfg.model, cfg.cluster, cfg.workload, cfg.engine, shipped, cfg.headroom)
    if a.best_label is None:
        return []
    L = ["## What each knob beyond the seed buys (ablation, predicted)\n",
         f"Best fitting layout of the space with every knob: {a.best_label}, {a.best_tokens:,.1f} tokens/s/GPU "
         f"(shipped coefficients, {a.usable_gib:.1f} GiB usable per GPU). Each row pins one knob off and takes the "
         f"best fitting layout left; the last column says what the knob buys or which limit it hits. "
         f"With none of them: {a.seed_label or 'none fits'}"
         f"{'' if a.seed_tokens is None else f', {a.seed_tokens:,.1f} tokens/s/GPU'}.\n",
         "| knob | flags | best without it | tokens/s/GPU | loss | best using it | tokens/s/GPU | what it buys / limit |",
         "|---|---|---|---|---|---|---|---|"]
    for r in a.rows:
        def num(x):
            return "" if x is None else f"{x:,.1f}"
        L.append(f"| {r.knob}{'' if r.searched else ' (not searched)'} | `{r.flags}` | {r.without_label or 'none fits'} | "
                 f"{num(r.without_tokens)} | {'' if r.loss_percent is None else f'{r.loss_percent:.1f}%'} | "
                 f"{r.using_label or ''} | {num(r.using_tokens)} | {r.limit.replace('|', '/')} |")
    L.append("")
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


def write_report(cfg: TuneConfig, out: TuneOutcome, out_dir: Path, recipe: Recipe | None, extra=()) -> Path:
    """Write out_dir/report.md (and its PNG plots); returns its path. ``extra``: markdown lines of a section after
    the baseline (the low-precision comparison of ``--allow-numerics``)."""
    plots = plot_study(cfg, out, out_dir)
    measured = bool(out.best and out.best.measured)
    kind = "measured" if measured else "predicted"
    L = _header(cfg) + _winner(cfg, out, recipe, kind) + _baseline(cfg, out, kind) + list(extra) + _search(cfg, out)
    L += _top_predicted(cfg, out) + _ablation(cfg) + _calibration(cfg, out) + edge_section(cfg, out)
    L += _measured_table(out, measured)
    L.append("## Plots\n")
    for title, name in plots:
        L.append(f"### {title}\n\n![{title}]({name})\n")
    L.append("## Files\n\n- `recipe.yaml`: the winner as a recipe\n- `trials.csv`: one row per trial\n"
             f"- the Optuna study: `{mask_url(cfg.storage)}` (open with `optuna-dashboard`)\n")
    p = Path(out_dir) / "report.md"
    p.write_text("\n".join(L))
    return p
