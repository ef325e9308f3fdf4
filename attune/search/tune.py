"""`attune tune`: build the study's configuration from the command line, run it with live progress, write
the recipe, report, plots and trials.csv."""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

from attune.errors import NoFeasibleLayout
from attune.spec.baselines import baseline_layout
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import load_model
from ..runners.base import get_runner
from .space import load_space
from .study import StudyError, TuneConfig, run_study

# defaults per runner: measured trials, proposals estimated per trial, steps per trial, workload
RUNNER_DEFAULTS = {
    "sim": dict(trials=20, candidates=32),
    "torch": dict(trials=3, candidates=24),
    "slime": dict(trials=12, candidates=48),
}


def repo_root() -> Path:
    return Path.cwd()


def build_config(args) -> TuneConfig:
    model = load_model(args.model)
    cluster = parse_cluster(args.gpus, args.gpus_per_node, args.price)
    torch_trials = args.runner == "torch" or (args.runner == "slime" and getattr(args, "trial_kind", "slime") == "torch")
    engine = get_engine("torch" if torch_trials else args.engine)
    d = RUNNER_DEFAULTS["torch" if torch_trials else args.runner]
    wl = Workload()
    if torch_trials:
        wl = Workload(seq_length=256, global_batch=8, steps=20, window=(5, 19), lr=3e-3, min_lr=3e-4)
    kw = {}
    if args.seq:
        kw["seq_length"] = args.seq
    if args.global_batch:
        kw["global_batch"] = args.global_batch
    if args.steps:
        kw["steps"] = args.steps
        a, b = wl.window
        if b >= args.steps:
            kw["window"] = (min(a, max(0, args.steps // 4)), args.steps - 1)
    from dataclasses import replace
    wl = replace(wl, **kw)
    space_path = args.search_space
    if space_path is None and torch_trials:
        space_path = str(Path(__file__).resolve().parents[2] / "search_spaces" / "small.yaml")
    space = load_space(space_path)
    runner_opts = {}
    if args.runner == "slime":
        if not args.cluster:
            raise StudyError("the slime runner needs --cluster cluster.yaml (format: docs/cluster.md)")
        # the study name goes into every Ray submission id, so a resubmission finds this study's job only
        study_id = args.study_name or f"{model.name}-{cluster.spec}-{space.name}-seed{args.seed}"
        runner_opts.update(cluster_file=args.cluster, trial_kind=getattr(args, "trial_kind", "slime"), study=study_id)
    runner = get_runner(args.runner, **runner_opts)
    max_tp = 1 if torch_trials else None
    base, note = baseline_layout(model, cluster, wl, engine, max_tp=max_tp, max_cp=max_tp)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    out = Path(args.out) if args.out else repo_root() / "reports" / f"{model.name}-{cluster.spec}-{date}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise StudyError(f"output folder {out} is not writable ({e.strerror})") from None
    storage = args.storage or f"sqlite:///{(out / 'study.db').resolve()}"
    name = args.study_name or f"{model.name}-{cluster.spec}-{args.runner}-{engine.name}-{space.name}"
    return TuneConfig(model=model, cluster=cluster, engine=engine, workload=wl, space=space, runner=runner,
                      baseline=base, baseline_note=note, trials=args.trials or d["trials"],
                      candidates=args.candidates or d["candidates"], slack=args.slack, seed=args.seed,
                      storage=storage, study_name=name, out_dir=out, timeout_s=args.timeout,
                      headroom=args.memory_headroom, data_path=getattr(args, "data", None))


def run_tune(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..recipe import lint, write_recipe
    from .outputs import build_recipe, recipe_path, write_csv, write_report, layout_of

    con = Console()
    cfg = build_config(args)
    con.print(f"attune tune: {cfg.model.name} on {cfg.cluster.spec}, runner {cfg.runner.name}, "
              f"{cfg.trials} measured trials, study '{cfg.study_name}' in {cfg.storage}", highlight=False)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=con, transient=False) as prog:
        task = prog.add_task("measured trials", total=cfg.trials)

        def progress(msg: str, advance: int | None = None) -> None:
            if advance is not None:
                prog.update(task, completed=min(advance, cfg.trials))
            prog.update(task, description=msg[:100])

        out = run_study(cfg, progress)
    if out.best is None:
        from .study import study_counts
        c = study_counts(out.study)
        short = [t.user_attrs.get("predicted_peak_gib", 0) - cfg.cluster.gpu.capacity_gib
                 for t in out.study.get_trials(deepcopy=False) if "predicted_peak_gib" in t.user_attrs]
        smallest = min(short) if short else None
        write_csv(out.study, cfg.out_dir / "trials.csv")
        msg = f"no layout fits {cfg.cluster.spec} for {cfg.model.name}"
        if smallest is not None:
            msg += f" (smallest shortfall {smallest:.1f} GiB over {cfg.cluster.gpu.capacity_gib:.1f} GiB per GPU)"
        raise NoFeasibleLayout(msg + f"; {c['estimated']} candidates estimated")
    recipe = build_recipe(cfg, out)
    rp = cfg.out_dir / "recipe.yaml"
    write_recipe(recipe, rp)
    if cfg.runner.measured and not args.no_verify:
        from ..verify import apply_result, verify_recipe
        con.print("verifying the winner against the baseline layout (convergence + component tests)", highlight=False)
        res = verify_recipe(recipe, cfg.runner, reference_layout=cfg.baseline, steps=cfg.workload.steps,
                            workdir=cfg.out_dir / "verify", log=lambda m: con.print(m, highlight=False, markup=False),
                            reference_source=f"the study's baseline layout ({cfg.baseline.label()})")
        recipe = apply_result(recipe, res)
        write_recipe(recipe, rp)
        con.print(f"correctness: {recipe['correctness']['result']}; status {recipe['status']}", highlight=False)
    errors = [f for f in lint(recipe) if f.severity == "error"]
    write_csv(out.study, cfg.out_dir / "trials.csv")
    report = write_report(cfg, out, cfg.out_dir, recipe)
    copy = None
    if not args.no_copy:
        copy = recipe_path(repo_root(), cfg.model.name, cfg.cluster.type_key, layout_of(out.best))
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(rp, copy)
    base = out.baseline
    kind = "measured" if out.best.user_attrs.get("measured") else "predicted"
    con.print(f"winner: {out.best.user_attrs.get('label')}: {out.best.value:,.1f} tokens/s/GPU ({kind})", highlight=False)
    if base is not None and base.value:
        con.print(f"baseline: {base.user_attrs.get('label')}: {base.value:,.1f} tokens/s/GPU; "
                  f"gain {100 * (out.best.value / base.value - 1):+.1f}% ({kind})", highlight=False)
    con.print(f"recipe: {rp}{f' (copied to {copy})' if copy else ''}; report: {report}; "
              f"wall time {out.wall_s:.1f} s", highlight=False)
    if errors:
        for f in errors:
            con.print(f"recipe lint error: {f.path}: {f.message}", highlight=False)
        return 1
    return 0
