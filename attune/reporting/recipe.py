"""The study's winner as a recipe (the seed recipe's format), and where a saved copy goes in `recipes/`."""

from __future__ import annotations

import datetime as dt
import platform
import re
from pathlib import Path

from attune.estimator import estimate
from attune.estimator.metrics import model_flops_utilization, usd_per_million_tokens
from attune.recipe.codec import to_recipe_block
from attune.recipe.models import (
    ActiveParams,
    Author,
    Correctness,
    Gpu,
    LayoutBlock,
    Recipe,
    Result,
    WorkloadBlock,
    validate_block,
)
from attune.runners.base import Rerun, TrialSpec
from attune.search.records import records, study_counts
from attune.search.tuner import TuneConfig, TuneOutcome
from attune.spec.layout import Layout
from attune.spec.placement import batching


def _gpu_marketing_gb(name: str) -> int | None:
    """The GB in a GPU's marketing name ("H200 141GB" -> 141)."""
    m = re.search(r"(\d+)\s*GB", name)
    return int(m.group(1)) if m else None


def rerun_of(cfg: TuneConfig, layout: Layout) -> Rerun:
    """How the recipe reruns ``layout``: the study's runner's launch of it (``Runner.rerun_command``)."""
    spec = TrialSpec(model=cfg.model, cluster=cfg.cluster, layout=layout, workload=cfg.workload, engine=cfg.engine)
    return cfg.runner.rerun_command(spec)


def build_recipe(cfg: TuneConfig, out: TuneOutcome) -> Recipe:
    """The winner in the seed recipe's format."""
    lay = out.best.to_layout()
    model, cluster, wl = cfg.model, cfg.cluster, cfg.workload
    est = estimate(model, cluster, lay, wl, cfg.engine, cfg.coefficients, check_layout=False)
    measured = bool(out.best.measured)
    rerun = rerun_of(cfg, lay)
    return Recipe(
        schema_version=1,
        model=model.name,
        gpu=Gpu(type=cluster.type_key,
                memory_gb=_gpu_marketing_gb(cluster.gpu.name) or round(cluster.gpu.memory_bytes / 1e9),
                count=cluster.world_size, per_node=cluster.gpus_per_node, instance=None),
        author=Author(name="attune", url=None),
        status="measured" if measured else "predicted",
        stack=_stack(cfg, measured, rerun),
        workload=WorkloadBlock(row_tokens=wl.seq_length,
                               rows="packed rows" if cfg.data_path else "synthetic rows (seeded)",
                               global_batch=wl.global_batch, precision=lay.precision),
        layout=validate_block(to_recipe_block(lay, model, batching(lay, wl, cfg.engine)), LayoutBlock, "layout"),
        result=_result(cfg, out, measured),
        correctness=Correctness(result="not_run", summary="not run: predicted by the model" if not measured
                                else "not run yet: attune verify"),
        env=dict(rerun.env),
        patches=[],
        run=rerun.command,
        notes="".join(f"- {n}\n" for n in _notes(cfg, out, est, measured)),
    )


def _result(cfg: TuneConfig, out: TuneOutcome, measured: bool) -> Result:
    """The winner's result block: throughput, cost, MFU, the measurement window and the search's GPU hours."""
    best, model, cluster, wl = out.best, cfg.model, cfg.cluster, cfg.workload
    tps = float(best.value)
    a, b = wl.window
    gpu_hours = sum(float(r.gpu_hours or 0.0) for r in records(out.study))
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()
    return Result(
        tokens_per_s_per_gpu=round(tps, 2), usd_per_million_tokens=round(usd_per_million_tokens(tps, cluster.gpu), 4),
        step_time_cv_percent=round(float(best.step_time_cv_percent or 0.0), 3),
        mfu=round(model_flops_utilization(tps, model, cluster.gpu), 4),
        mfu_note="tokens/s/GPU x 6 x active parameters / dense BF16 peak" + ("" if measured else "; predicted"),
        active_params=ActiveParams(count=model.active_params, source=model.source or f"config of {model.name}",
                                   revision=None),
        measured=today if measured else None,
        steps_per_run=wl.steps, window=[a, b], window_tokens=wl.tokens_per_step * (b - a + 1),
        runs=1, profiler=False, gpu_hours=round(gpu_hours, 4),
        gpu_hours_note=("GPUs x wall time of every measured trial of the search, including start-up" if measured
                        else "nothing ran: the sim runner predicts"),
        **_throughput_basis(cfg, best, measured))


def _notes(cfg: TuneConfig, out: TuneOutcome, est, measured: bool) -> list[str]:
    """How the winner was found, the baseline and the gain over it, and the predicted peak memory."""
    best, base = out.best, out.baseline
    kind = "measured" if measured else "predicted"
    tps = float(best.value)
    base_tps = float(base.value) if (base is not None and base.value is not None) else None
    gain = (tps / base_tps - 1) if base_tps else None
    counts = study_counts(out.study)
    notes = [f"Found by attune tune ({cfg.runner.name} runner, {cfg.engine.name} engine, search space "
             f"'{cfg.space.name}', TPE seed {cfg.seed}): {counts.estimated} candidates estimated, "
             f"{counts.oom_predicted + counts.oom_rule} pruned as out of memory, {counts.invalid} breaking a "
             f"layout rule, {counts.measured} {'measured' if measured else 'run on the model'}."]
    if base is not None:
        notes.append(f"Baseline: {base.label} ({cfg.baseline_note}); "
                     + (f"{base_tps:,.1f} tokens/s/GPU ({kind})." if base_tps else
                        f"it did not complete ({base.outcome}: {base.reason or ''})."))
    if gain is not None:
        notes.append(f"Gain over the baseline: {100 * gain:+.1f}% ({kind}).")
    notes.append(f"Peak memory (predicted): {est.memory.peak_gib:.1f} GiB on stage {est.memory.peak_stage} of "
                 f"{est.memory.capacity_gib:.1f} GiB.")
    return notes


def _throughput_basis(cfg: TuneConfig, best, measured: bool) -> dict:
    """result.throughput_basis (what tokens_per_s_per_gpu divides by) and, for slime trials, the throughput over
    slime's step_time as well (TrialRecord.extra["throughput"], attune.runners.slime.runner)."""
    if not measured:
        return {"throughput_basis": "predicted"}
    tp = (best.extra or {}).get("throughput") if isinstance(best.extra, dict) else None
    if not isinstance(tp, dict):
        return {"throughput_basis": "step"}
    step = tp.get("tokens_per_s_per_gpu_step_time")
    return {"throughput_basis": str(tp.get("basis") or "actor_train_time"),
            "tokens_per_s_per_gpu_step_time": round(float(step), 2) if step is not None else None}


def _stack(cfg: TuneConfig, measured: bool, rerun: Rerun) -> dict:
    return {"framework": f"attune {cfg.runner.name} runner" + ("" if measured else " (calibrated model, nothing ran)"),
            "python": platform.python_version(), **rerun.stack, "source": "the tuning process's environment"}


def recipe_path(root: Path, model: str, gpu: str, layout: Layout) -> Path:
    """Where `--save-recipe` copies a recipe: root/recipes/<model>/<gpu>/attune-<layout slug>.yaml."""
    return Path(root) / "recipes" / model.lower() / gpu.lower() / f"attune-{layout.slug()}.yaml"
