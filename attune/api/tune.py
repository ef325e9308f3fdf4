"""`attune tune` as a function: resolve the session's configuration, run the tuner, write the recipe, report,
plots and trials.csv, verify a measured winner, and copy the recipe into `recipes/` only when asked.

Outputs go to `out` or, by default, to `reports/<model>-<gpus>-<UTC date>/` under the CURRENT working directory
(`default_out_dir`); nothing is written into tracked files unless `save_recipe=True`, which copies the recipe to
`<recipes_root>/recipes/<model>/<gpu>/attune-<layout>.yaml` (`recipes_root` defaults to the working directory).
Progress goes to `progress(message, completed=None)` and to the `attune.search.tuner` logger; nothing prints.
"""

from __future__ import annotations

import datetime as dt
import logging
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from attune.api.outdir import OutDirError, check_out_dir, claim_out_dir
from attune.api.target import batch_for_cluster
from attune.correctness.verdict import Verdict, apply_verdict
from attune.correctness.verify import verify_recipe, write_outputs
from attune.errors import NoFeasibleLayout, UserInputError
from attune.recipe import Recipe, lint, write_recipe
from attune.reporting import build_recipe, recipe_path, write_csv, write_report
from attune.reporting.precision_recipe import low_precision_recipe
from attune.runners.base import Capabilities
from attune.runners.registry import get_runner, resolve_runner, runner_capabilities
from attune.search.interrupt import fail_left_running
from attune.search.options import TuneOptions
from attune.search.precision_search import PrecisionComparison, allowed_recipes, compare
from attune.search.records import records, study_counts
from attune.search.space import SearchSpace, load_space
from attune.search.storage import check_url, mask_url
from attune.search.tuner import StudyError, TuneConfig, TuneOutcome, Tuner
from attune.spec.baselines import baseline_layout
from attune.spec.engine import DEFAULT_ENGINE, get_engine
from attune.spec.hardware import Cluster, parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import ModelSpec, load_model
from attune.spec.precision import recipe_of
from attune.torchmodels.data import load_rows

log = logging.getLogger(__name__)

Progress = Callable[..., None]


def default_out_dir(model: str, gpus: str, now: dt.datetime | None = None) -> Path:
    """`reports/<model>-<gpus>-<UTC date>/` under the current working directory."""
    date = (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y-%m-%d")
    return Path.cwd() / "reports" / f"{model}-{gpus}-{date}"


def _check_data(path: str | Path, seq_length: int, vocab: int) -> None:
    """--data readable as packed rows for the torch runner, else one line (exit 2)."""
    p = Path(path)
    if not p.is_file():
        raise UserInputError(f"--data {p}: no such file (packed rows: a parquet file from `attune data build`)")
    try:
        load_rows(str(p), 1, seq_length, vocab, 0)
    except (ValueError, OSError, KeyError, TypeError, IndexError) as e:
        raise UserInputError(f"--data {p}: not packed training rows ({' '.join(str(e).split())[:200]}); "
                             f"build them with `attune data build`") from None


def tune_config(options: TuneOptions | None = None, /, **overrides) -> TuneConfig:
    """The session's configuration from ``options`` (``TuneOptions(**overrides)`` when not given; with both, the
    overrides replace fields of ``options``). The runner's declared capabilities decide the engine, workload, search
    space, trial counts and baseline limits it needs."""
    o = replace(options, **overrides) if options is not None else TuneOptions(**overrides)
    name = resolve_runner(o.runner, o.trial_kind)
    caps = runner_capabilities(name)
    if o.storage is not None:
        check_url(o.storage)  # a malformed URL or a missing folder is exit 2 before any work
    m = load_model(o.model)
    cluster = parse_cluster(o.gpus, o.gpus_per_node, o.price)
    eng = get_engine(caps.engine or o.engine or DEFAULT_ENGINE)
    wl, workload_note = _workload(o, caps, cluster.world_size)
    space = load_space(o.search_space or _default_space(caps, m))
    opts = _runner_options(o, caps, m, cluster, space)
    if o.data is not None and caps.engine == "torch" and not caps.needs_cluster_file:  # the trainer reads it here
        _check_data(o.data, wl.seq_length, m.vocab)  # before the first trial, not after four failed ones
    run = get_runner(name, **opts)
    base, note = baseline_layout(m, cluster, wl, eng, **caps.baseline_limits())
    name_of_study = o.study_name or f"{m.name}-{cluster.spec}-{o.runner}-{eng.name}-{space.name}"
    identity = {"model": m.name, "gpus": cluster.spec, "runner": run.name, "engine": eng.name,
                "study_name": name_of_study, "storage": mask_url(o.storage) if o.storage else "study.db"}
    out_dir = _claimed_out_dir(o.out, m.name, cluster.spec, identity)
    return TuneConfig(model=m, cluster=cluster, engine=eng, workload=wl, space=space, runner=run, baseline=base,
                      baseline_note=note, workload_note=workload_note, trials=o.trials or caps.default_trials,
                      candidates=o.candidates or caps.default_candidates, slack=o.slack, seed=o.seed,
                      storage=o.storage or f"sqlite:///{(out_dir / 'study.db').resolve()}",
                      study_name=name_of_study,
                      out_dir=out_dir, timeout_s=o.timeout_s, headroom=o.memory_headroom, data_path=o.data,
                      sampler=o.sampler, recalibrate=o.recalibrate, min_gain=o.min_gain, p_stop=o.p_stop,
                      budget_gpu_hours=o.budget_gpu_hours, heartbeat_interval_s=o.heartbeat_interval_s,
                      grace_period_s=o.grace_period_s, storage_timeout_s=o.storage_timeout_s)


def _workload(o: TuneOptions, caps: Capabilities, world_size: int) -> tuple[Workload, str]:
    """The runner's workload with the options' sequence, global batch and steps; without a global batch, one the
    cluster's data-parallel sizes divide (and the note that says so)."""
    wl = caps.default_workload or Workload()
    if o.seq or o.global_batch:
        wl = replace(wl, **{k: v for k, v in (("seq_length", o.seq), ("global_batch", o.global_batch)) if v})
    workload_note = ""
    if not o.global_batch:
        wl, workload_note = batch_for_cluster(wl, world_size)
    if o.steps:
        wl = wl.with_steps(o.steps)
    return wl, workload_note


def _default_space(caps: Capabilities, m: ModelSpec) -> str | None:
    """The runner's default search space, its MoE variant for a MoE model."""
    if m.moe is not None and caps.default_search_space in (None, "dense"):
        return "moe"  # MoE models: EP, ETP and the dispatcher on top of the dense knobs (issue 14)
    if m.moe is not None and caps.default_search_space == "small":
        return "small-moe"  # the small space plus EP (the torch runner's EP, issue 14)
    return caps.default_search_space


def _runner_options(o: TuneOptions, caps: Capabilities, m: ModelSpec, cluster: Cluster, space: SearchSpace) -> dict:
    """What the runner is built with: the cluster file and study name, or the measurements table."""
    opts: dict = {}
    if caps.needs_cluster_file:
        if not o.cluster_file:
            raise StudyError(f"the {o.runner} runner needs --cluster cluster.yaml (format: docs/cluster.md)")
        # the study name goes into every Ray submission id, so a resubmission finds this study's job only
        opts.update(cluster_file=o.cluster_file,
                    study=o.study_name or f"{m.name}-{cluster.spec}-{space.name}-seed{o.seed}")
    if caps.needs_measurements:
        if not o.measurements:
            raise StudyError(f"the {o.runner} runner needs --measurements FILE (a CSV or YAML table; see the README)")
        opts.update(measurements=o.measurements, model=m, world_size=cluster.world_size)
    return opts


def _claimed_out_dir(out: str | None, model_name: str, cluster_spec: str, identity: dict) -> Path:
    """The output folder, claimed for this study: ``out`` (refused with one line when it holds another study), or
    the default folder, or the next free ``<default>-2``, ``-3``, ... when today's holds another study."""
    out_dir = Path(out) if out else default_out_dir(model_name, cluster_spec)
    check_out_dir(out_dir)
    for n in range(2, 100):
        try:
            claim_out_dir(out_dir, identity)
            break
        except OutDirError:
            if out:  # a folder the user named: refused with one line
                raise
            default = default_out_dir(model_name, cluster_spec)
            out_dir = check_out_dir(default.with_name(f"{default.name}-{n}"))
    return out_dir


@dataclass(kw_only=True)
class TuneResult:
    """What `tune` produced."""

    config: TuneConfig
    """The resolved configuration of the session."""
    outcome: TuneOutcome
    """The study, its best and baseline trials, this session's counts and wall time."""
    recipe: Recipe
    """The winner as a recipe (after verification when it ran)."""
    recipe_path: Path
    """out_dir/recipe.yaml."""
    report_path: Path
    """out_dir/report.md."""
    csv_path: Path
    """out_dir/trials.csv."""
    saved_recipe: Path | None = None
    """The copy in recipes/ (save_recipe=True only)."""
    verdict: Verdict | None = None
    """The correctness verdict of a measured winner (None when not verified)."""
    lint_errors: list = field(default_factory=list)
    """Recipe lint findings of severity error (the CLI exits 1 when there are any)."""
    low_precision: PrecisionComparison | None = None
    """With ``allow_numerics``: the best bf16 and the best low-precision layout, predicted (issue 22)."""
    low_precision_recipe_path: Path | None = None
    """out_dir/recipe-<recipe>.yaml: the low-precision best as a recipe (status predicted)."""

    @property
    def measured(self) -> bool:
        return bool(self.outcome.best and self.outcome.best.measured)

    def summary_lines(self) -> list[str]:
        """The lines `attune tune` prints at the end: winner, baseline and gain, where the files are."""
        best, base = self.outcome.best, self.outcome.baseline
        kind = "measured" if self.measured else "predicted"
        lines = [f"winner: {best.label}: {best.value:,.1f} tokens/s/GPU ({kind})"]
        if base is not None and base.value:
            lines.append(f"baseline: {base.label}: {base.value:,.1f} tokens/s/GPU; "
                         f"gain {100 * (best.value / base.value - 1):+.1f}% ({kind})")
        o = self.outcome
        if o.stopped:
            regret = "" if o.remaining_regret is None else \
                f"; estimated remaining regret {100 * o.remaining_regret:.2f}%"
            lines.append(f"stopped by {o.stop_kind}: {o.stopped}{regret}")
        copy = f" (copied to {self.saved_recipe})" if self.saved_recipe else ""
        lines.append(f"recipe: {self.recipe_path}{copy}; report: {self.report_path}; "
                     f"wall time {self.outcome.wall_s:.1f} s")
        lines += [f"recipe lint error: {f.path}: {f.message}" for f in self.lint_errors]
        if self.low_precision is not None:
            lines += self.low_precision.summary_lines()
        if self.low_precision_recipe_path is not None:
            lines.append(f"low-precision recipe: {self.low_precision_recipe_path} (predicted; attune verify it "
                         f"against bf16)")
        return lines


def _no_feasible(cfg: TuneConfig, outcome: TuneOutcome) -> NoFeasibleLayout:
    c = study_counts(outcome.study)
    cap = cfg.cluster.gpu.capacity_gib
    recs = records(outcome.study)
    short = [r.predicted_peak_gib - cap for r in recs if r.predicted_peak_gib is not None]
    failed = [r for r in recs if r.measured and r.outcome not in (None, "ok", "oom") and r.reason]
    if failed and not any(r.measured and r.outcome == "oom" for r in recs):
        # measured runs failed for a reason of their own (not in a replay table, a crash): say that, not memory
        top, n = Counter(" ".join(r.reason.split())[:200] for r in failed).most_common(1)[0]
        return NoFeasibleLayout(f"no measured trial of {cfg.model.name} on {cfg.cluster.spec} succeeded: "
                                f"{len(failed)} failed, e.g. {top}" + (f" ({n} like it)" if n > 1 else ""))
    msg = f"no layout fits {cfg.cluster.spec} for {cfg.model.name}"
    if short and min(short) > 0:
        msg += f" (smallest shortfall {min(short):.1f} GiB over {cap:.1f} GiB per GPU)"
    elif short:
        msg += f" within the memory headroom {100 * cfg.headroom:g}% of {cap:.1f} GiB per GPU"
    return NoFeasibleLayout(msg + f"; {c.estimated} candidates estimated")


def verify_winner(cfg: TuneConfig, recipe: Recipe, progress: Progress | None = None) -> tuple[Recipe, Verdict]:
    """Verify a measured winner against the study's baseline layout (convergence + component tests); returns
    the recipe with the verdict applied and the verdict (also written to out_dir/verify/)."""
    say = (lambda m: progress(m)) if progress else None
    verdict = verify_recipe(recipe, cfg.runner, workdir=cfg.out_dir / "verify", reference_layout=cfg.baseline,
                            reference_source=f"the study's baseline layout ({cfg.baseline.label()})",
                            steps=cfg.workload.steps, progress=say)
    write_outputs(verdict, cfg.out_dir / "verify")
    return apply_verdict(recipe, verdict), verdict


def run_tuning(cfg: TuneConfig, *, verify: bool = True, save_recipe: bool = False,
               recipes_root: str | Path | None = None, progress: Progress | None = None,
               allow_numerics: tuple[str, ...] | list[str] = ()) -> TuneResult:
    """Tune with a resolved configuration and write every output (see the module docstring). ``allow_numerics``
    (``fp8`` or recipes): also price the space in low precision and report it beside the bf16 best."""
    recipes = allowed_recipes(allow_numerics)
    tuner = Tuner(cfg, progress)
    try:
        outcome = tuner.run()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: leave no trial of this tuner RUNNING
        fail_left_running(getattr(tuner, "study", None), tuner.asked)
        raise
    csv_path = cfg.out_dir / "trials.csv"
    if outcome.best is None:
        write_csv(outcome.study, csv_path)
        raise _no_feasible(cfg, outcome)
    recipe = build_recipe(cfg, outcome)
    rp = cfg.out_dir / "recipe.yaml"
    write_recipe(recipe, rp)
    verdict = None
    if cfg.runner.capabilities.measured and cfg.runner.capabilities.verifiable and verify:
        if progress:
            progress("verifying the winner against the baseline layout (convergence + component tests)")
        recipe, verdict = verify_winner(cfg, recipe, progress)
        write_recipe(recipe, rp)
    errors = [f for f in lint(recipe) if f.severity == "error"]
    write_csv(outcome.study, csv_path)
    low = low_path = None
    if recipes:
        if progress:
            progress(f"pricing the space in {', '.join(recipes)} (--allow-numerics)")
        low = compare(cfg.space, cfg.model, cfg.cluster, cfg.workload, cfg.engine, outcome.best.to_layout(), recipes,
                      cfg.headroom)
        low_recipe = low_precision_recipe(cfg, recipe, low)
        if low_recipe is not None:
            low_path = cfg.out_dir / f"recipe-{recipe_of(low.low.layout)}.yaml"
            write_recipe(low_recipe, low_path)
    report = write_report(cfg, outcome, cfg.out_dir, recipe, extra=low.markdown() if low else ())
    saved = None
    if save_recipe:
        saved = recipe_path(Path(recipes_root) if recipes_root else Path.cwd(), cfg.model.name, cfg.cluster.type_key,
                            outcome.best.to_layout())
        saved.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(rp, saved)
    return TuneResult(config=cfg, outcome=outcome, recipe=recipe, recipe_path=rp, report_path=report,
                      csv_path=csv_path, saved_recipe=saved, verdict=verdict, lint_errors=errors, low_precision=low,
                      low_precision_recipe_path=low_path)


def tune(options: TuneOptions | None = None, /, *, recipes_root: str | Path | None = None,
         progress: Progress | None = None, **overrides) -> TuneResult:
    """`attune tune`: `tune_config(options, **overrides)` then `run_tuning` with the options' ``verify``,
    ``save_recipe`` and ``allow_numerics``. Raises NoFeasibleLayout (exit 1) when no layout fits, UserInputError
    subclasses (exit 2) for bad input."""
    o = replace(options, **overrides) if options is not None else TuneOptions(**overrides)
    return run_tuning(tune_config(o), verify=o.verify, save_recipe=o.save_recipe, recipes_root=recipes_root,
                      progress=progress, allow_numerics=o.allow_numerics)


__all__ = ["tune", "tune_config", "run_tuning", "TuneOptions", "TuneResult", "default_out_dir", "verify_winner"]
