"""What a study leaves behind: trials.csv, recipe.yaml (the seed's format), report.md with PNG plots."""

from __future__ import annotations

import csv
import datetime as dt
from pathlib import Path

import optuna

from attune.estimator import estimate
from attune.spec.layout import Layout
from attune.spec.placement import batching
from attune.recipe.codec import to_recipe_block
from .study import TuneConfig, TuneOutcome, study_counts

CSV_FIELDS = ["number", "state", "role", "kind", "runner", "label", "tp", "sp", "pp", "first", "last", "vpp", "cp", "dp",
              "recompute_granularity", "recompute_method", "recompute_num_layers", "optimizer_cpu_offload",
              "max_tokens_per_gpu", "predicted_peak_gib", "predicted_peak_stage", "measured_peak_gib",
              "predicted_tokens_per_s_per_gpu", "measured_tokens_per_s_per_gpu", "memory_error_percent",
              "throughput_error_percent", "reason"]


def trial_rows(study: optuna.Study) -> list[dict]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        lay = a.get("layout") or {}
        meas_peak = a.get("measured_peak_gib")
        meas_peak_max = max(meas_peak) if meas_peak else None
        measured_tps = t.value if (t.state == optuna.trial.TrialState.COMPLETE and a.get("measured")) else None
        pred_peak, pred_tps = a.get("predicted_peak_gib"), a.get("predicted_tokens_per_s_per_gpu")
        rows.append({
            "number": t.number, "state": t.state.name, "role": a.get("role", ""), "kind": a.get("kind", ""),
            "runner": a.get("runner", ""), "label": a.get("label", ""),
            **{k: lay.get(k, "") for k in ("tp", "sp", "pp", "first", "last", "vpp", "cp", "dp", "recompute_granularity",
                                           "recompute_method", "recompute_num_layers", "optimizer_cpu_offload",
                                           "max_tokens_per_gpu")},
            "predicted_peak_gib": pred_peak, "predicted_peak_stage": a.get("predicted_peak_stage", ""),
            "measured_peak_gib": meas_peak_max if a.get("measured") else None,
            "predicted_tokens_per_s_per_gpu": pred_tps, "measured_tokens_per_s_per_gpu": measured_tps,
            "memory_error_percent": (round(100 * (pred_peak - meas_peak_max) / meas_peak_max, 2)
                                     if a.get("measured") and meas_peak_max and pred_peak else None),
            "throughput_error_percent": (round(100 * (pred_tps - measured_tps) / measured_tps, 2)
                                         if measured_tps and pred_tps else None),
            "reason": a.get("reason", ""),
        })
    return rows


def write_csv(study: optuna.Study, path: Path) -> list[dict]:
    rows = trial_rows(study)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
    return rows


def layout_of(t: optuna.trial.FrozenTrial) -> Layout:
    return Layout(**t.user_attrs["layout"])


def _gpu_marketing_gb(name: str) -> int | None:
    import re
    m = re.search(r"(\d+)\s*GB", name)
    return int(m.group(1)) if m else None


def build_recipe(cfg: TuneConfig, out: TuneOutcome) -> dict:
    """The winner in the seed recipe's format."""
    from ..runners.slime.launch import slime_command

    best, base = out.best, out.baseline
    lay = layout_of(best)
    model, cluster, wl, eng = cfg.model, cfg.cluster, cfg.workload, cfg.engine
    est = estimate(model, cluster, lay, wl, eng, cfg.coefficients, check_layout=False)
    measured = bool(best.user_attrs.get("measured"))
    tps = float(best.value)
    usd = cluster.gpu.usd_per_hour / 3600.0 / tps * 1e6
    mfu = tps * 6 * model.active_params / (cluster.gpu.bf16_tflops * 1e12)
    a, b = wl.window
    gpu_hours = sum(float(t.user_attrs.get("gpu_hours") or 0.0) for t in out.study.get_trials(deepcopy=False))
    kind = "measured" if measured else "predicted"
    base_tps = float(base.value) if (base is not None and base.value is not None) else None
    gain = (tps / base_tps - 1) if base_tps else None
    cmd = slime_command(model, cluster, lay, wl, steps=wl.steps)
    counts = study_counts(out.study)
    notes = [f"Found by attune tune ({cfg.runner.name} runner, {cfg.engine.name} engine, search space "
             f"'{cfg.space.name}', TPE seed {cfg.seed}): {counts['estimated']} candidates estimated, "
             f"{counts['oom_predicted'] + counts['oom_rule']} pruned as out of memory, {counts['invalid']} breaking a "
             f"layout rule, {counts['measured']} {'measured' if measured else 'run on the model'}."]
    if base is not None:
        notes.append(f"Baseline: {base.user_attrs.get('label')} ({cfg.baseline_note}); "
                     + (f"{base_tps:,.1f} tokens/s/GPU ({kind})." if base_tps else
                        f"it did not complete ({base.user_attrs.get('outcome')}: {base.user_attrs.get('reason', '')})."))
    if gain is not None:
        notes.append(f"Gain over the baseline: {100 * gain:+.1f}% ({kind}).")
    notes.append(f"Peak memory (predicted): {est.memory.peak_gib:.1f} GiB on stage {est.memory.peak_stage} of "
                 f"{est.memory.capacity_gib:.1f} GiB.")
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()
    recipe = {
        "schema_version": 1,
        "model": model.name,
        "gpu": {"type": cluster.type_key,
                "memory_gb": _gpu_marketing_gb(cluster.gpu.name) or round(cluster.gpu.memory_bytes / 1e9),
                "count": cluster.world_size,
                "per_node": cluster.gpus_per_node, "instance": None},
        "author": {"name": "attune", "url": None},
        "status": "measured" if measured else "predicted",
        "stack": _stack(cfg, measured),
        "workload": {"row_tokens": wl.seq_length, "rows": "packed rows" if cfg.data_path else "synthetic rows (seeded)",
                     "global_batch": wl.global_batch, "precision": lay.precision},
        "layout": to_recipe_block(lay, model, batching(lay, wl, eng)),
        "result": {
            "tokens_per_s_per_gpu": round(tps, 2), "usd_per_million_tokens": round(usd, 4),
            "step_time_cv_percent": round(float(best.user_attrs.get("step_time_cv_percent") or 0.0), 3),
            "mfu": round(mfu, 4),
            "mfu_note": "tokens/s/GPU x 6 x active parameters / dense BF16 peak" + ("" if measured else "; predicted"),
            "active_params": {"count": model.active_params, "source": model.source or f"config of {model.name}", "revision": None},
            "measured": today if measured else None,
            "steps_per_run": wl.steps, "window": [a, b], "window_tokens": wl.tokens_per_step * (b - a + 1),
            "runs": 1, "profiler": False, "gpu_hours": round(gpu_hours, 4),
            "gpu_hours_note": ("GPUs x wall time of every measured trial of the search, including start-up" if measured
                               else "nothing ran: the sim runner predicts"),
        },
        "correctness": {"result": "not_run",
                        "summary": "not run: predicted by the model" if not measured else "not run yet: attune verify"},
        "env": {str(k): str(v) for k, v in cmd.env.items()},
        "patches": [],
        "run": str(cmd.to_shell()),
        "notes": "".join(f"- {n}\n" for n in notes),
    }
    return recipe


def _stack(cfg: TuneConfig, measured: bool) -> dict:
    import platform
    s = {"framework": f"attune {cfg.runner.name} runner" + ("" if measured else " (calibrated model, nothing ran)"),
         "python": platform.python_version()}
    if cfg.runner.name == "torch":
        try:
            import torch
            s["pytorch"] = str(torch.__version__)
        except ImportError:
            pass
    s["source"] = "the tuning process's environment"
    return s


def recipe_path(root: Path, model: str, gpu: str, layout: Layout) -> Path:
    return root / "recipes" / model.lower() / gpu.lower() / f"attune-{layout.slug()}.yaml"


def write_report(cfg: TuneConfig, out: TuneOutcome, out_dir: Path, recipe: dict | None) -> Path:
    from ..report import plot_study

    counts = study_counts(out.study)
    plots = plot_study(cfg, out, out_dir)
    best, base = out.best, out.baseline
    measured = bool(best and best.user_attrs.get("measured"))
    kind = "measured" if measured else "predicted"
    L = []
    L.append(f"# attune: {cfg.model.name} on {cfg.cluster.spec} ({cfg.engine.name})\n")
    L.append(f"Runner `{cfg.runner.name}` ({'measured runs' if cfg.runner.measured else 'the calibrated model; every number here is predicted'}), "
             f"search space `{cfg.space.name}` ({cfg.space.path}), TPE seed {cfg.seed}, "
             f"{cfg.workload.seq_length:,}-token rows, global batch {cfg.workload.global_batch} rows. "
             f"Generated {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.\n")
    if best is not None:
        lab = best.user_attrs.get("label")
        L.append("## Winner\n")
        L.append(f"**{lab}**: {best.value:,.1f} tokens/s/GPU ({kind}); predicted peak memory "
                 f"{best.user_attrs.get('predicted_peak_gib'):.1f} GiB on stage {best.user_attrs.get('predicted_peak_stage')} "
                 f"of {cfg.cluster.gpu.capacity_gib:.1f} GiB.")
        if recipe:
            r = recipe["result"]
            L.append(f" MFU {r['mfu']:.4f}; {r['usd_per_million_tokens']:.3f} USD per million tokens at "
                     f"{cfg.cluster.gpu.usd_per_hour:.2f} USD/GPU-hour.")
        L.append("\n")
        if recipe and recipe.get("correctness"):
            c = recipe["correctness"]
            L.append(f"Correctness: **{c.get('result')}** ({c.get('summary', '')}); recipe status `{recipe.get('status')}`.\n")
    if base is not None:
        L.append("## Baseline\n")
        if base.value is not None:
            L.append(f"{base.user_attrs.get('label')}: {base.value:,.1f} tokens/s/GPU ({kind}). {cfg.baseline_note}.")
            if best is not None:
                L.append(f" **Gain: {100 * (best.value / base.value - 1):+.1f}% ({kind}).**")
        else:
            L.append(f"{base.user_attrs.get('label')}: did not complete ({base.user_attrs.get('outcome')}: "
                     f"{base.user_attrs.get('reason', '')}).")
        L.append("\n")
    L.append("## Search\n")
    L.append("| what | count |\n|---|---|")
    for k, label in (("proposals", "proposals from TPE"), ("estimated", "TPE proposals estimated (memory + speed)"),
                     ("refined", "layouts estimated by model-guided refinement (not trials)"),
                     ("invalid", "pruned: break a layout rule"), ("oom_predicted", "pruned: predicted out of memory"),
                     ("oom_rule", "pruned: monotone rule after a real OOM"), ("duplicate", "already measured"),
                     ("skipped_slow", f"skipped: predicted < {cfg.slack:g} x the best measured"),
                     ("estimated_only", "estimated, not chosen"), ("measured", "measured trials (baseline included)"),
                     ("measured_ok", "  completed"), ("measured_oom", "  out of memory on the runner"),
                     ("measured_failed", "  failed or timed out")):
        L.append(f"| {label} | {counts[k]} |")
    L.append(f"\nWall time of this session: {out.wall_s:.1f} s. {('Stopped early: ' + out.stopped + '.') if out.stopped else ''}\n")
    top = sorted([t for t in out.study.get_trials(deepcopy=False) if t.user_attrs.get("role") and t.value is not None
                  and "predicted_peak_gib" in t.user_attrs],
                 key=lambda t: -t.value)[:10]
    if top:
        L.append("## Measured trials (best first), predicted against measured\n")
        L.append("| trial | layout | tokens/s/GPU | predicted tokens/s/GPU | error | peak GiB (max stage) | "
                 "predicted peak GiB (stage) | error |\n|---|---|---|---|---|---|---|---|")
        errs_t, errs_m = [], []
        for t in top:
            pt = t.user_attrs.get("predicted_tokens_per_s_per_gpu")
            pm = t.user_attrs.get("predicted_peak_gib")
            mm = max(t.user_attrs.get("measured_peak_gib") or [0]) if t.user_attrs.get("measured") else None
            et = 100 * (pt - t.value) / t.value if pt else None
            em = 100 * (pm - mm) / mm if (mm and pm) else None
            if measured and et is not None:
                errs_t.append(abs(et))
            if em is not None:
                errs_m.append(abs(em))
            L.append(f"| {t.number} | {t.user_attrs.get('label')} | {t.value:,.1f} | {pt:,.1f} | "
                     f"{'' if et is None or not measured else f'{et:+.1f}%'} | {'' if mm is None else f'{mm:.3f}'} | "
                     f"{pm:.3f} ({t.user_attrs.get('predicted_peak_stage')}) | {'' if em is None else f'{em:+.1f}%'} |")
        if errs_t or errs_m:
            L.append("")
            L.append("Model error on measured trials (mean absolute): "
                     + (f"throughput {sum(errs_t) / len(errs_t):.1f}%" if errs_t else "")
                     + ("; " if errs_t and errs_m else "")
                     + (f"peak memory {sum(errs_m) / len(errs_m):.1f}%" if errs_m else "") + ".")
        L.append("")
    L.append("## Plots\n")
    for title, name in plots:
        L.append(f"### {title}\n\n![{title}]({name})\n")
    L.append("## Files\n\n- `recipe.yaml`: the winner as a recipe\n- `trials.csv`: one row per trial\n"
             f"- the Optuna study: `{cfg.storage}` (open with `optuna-dashboard`)\n")
    p = out_dir / "report.md"
    p.write_text("\n".join(L))
    return p
