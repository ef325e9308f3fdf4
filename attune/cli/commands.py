"""One function per sub-command: call the API, print, return the exit code."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from attune import api
from attune.api import calibrate as calibrate_api
from attune.api import slime as slime_api
from attune.api import study as study_api
from attune.api import tune as tune_api
from attune.api.outdir import check_out_dir
from attune.api.verify import verify as verify_recipe_file
from attune.errors import UserInputError
from attune.recipe import has_errors, lint, load_recipe, render
from attune.runners.ray.cluster import load_cluster
from attune.runners.slime.launch import command_for_recipe
from attune.runners.slime.logparse import format_summary, parse_slime_log
from attune.search.options import RunOptions, TuneOptions, VerifyOptions
from attune.search.storage import mask_url
from attune.spec.hardware import GPUS, detect_local_gpus
from attune.spec.model import bundled_names, load_model

from . import render as out
from .options import options_from_args


def _finite(x):
    """JSON has no NaN or Infinity: a non-finite float is written as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _json(value, indent: int = 2, default=None) -> str:
    """Strict JSON of ``value`` (non-finite floats as null, never ``NaN`` / ``Infinity``)."""
    if default is not None:
        value = json.loads(json.dumps(value, default=default))
    return json.dumps(_finite(value), indent=indent, allow_nan=False)


def _target(args, **overrides) -> api.Target:
    kw = dict(model=args.model, gpus=args.gpus, gpus_per_node=args.gpus_per_node, price=args.price,
              engine=args.engine, seq=args.seq, global_batch=args.global_batch,
              recipe=getattr(args, "recipe", None), flags=getattr(args, "flags", None) or None)
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return api.resolve_target(**kw)


def cmd_estimate(args) -> int:
    target = _target(args)
    est = api.estimate_target(target)
    if args.json:
        d = est.to_dict()
        d["layout_source"] = target.source
        d["ignored_flags"] = list(target.ignored_flags)
        print(_json(d, indent=2))
    else:
        out.print_estimate(est, target.source, target.ignored_flags)
        if getattr(args, "explain", False):
            out.print_explain(est)
    return 0


def cmd_models(args) -> int:
    models = [load_model(n) for n in bundled_names()]
    if args.json:
        print(_json([m.summary() for m in models], indent=2))
    else:
        out.console().print(out.models_table(models))
    return 0


def cmd_gpus(args) -> int:
    local = detect_local_gpus()
    if args.json:
        print(_json({"gpus": [out.gpu_row(k, g) for k, g in GPUS.items()], "local": local}, indent=2))
    else:
        con = out.console()
        con.print(out.gpus_table(GPUS))
        con.print(f"local GPUs (NVML): {', '.join(local) if local else 'none detected'}")
    return 0


def cmd_run(args) -> int:
    o = options_from_args(RunOptions, args)
    if o.out is not None:
        check_out_dir(o.out)  # before any work
    caps = api.runner_capabilities(o.runner)
    target = _target(args, steps=o.steps, base_workload=caps.default_workload,
                     max_tp=caps.max_tp, max_cp=caps.max_cp, engine=caps.engine)
    outcome = api.run_once(target, runner=o.runner, out_dir=o.out, timeout_s=o.timeout_s, cluster_file=o.cluster_file)
    res = outcome.result
    if args.json:
        print(_json(res.to_dict(), indent=2, default=str))
    else:
        print(out.format_run_result(res, target.layout, target.workload, target.source))
        print(f"output: {outcome.out_dir}")
    if res.status != "ok":
        why = " ".join((res.reason or "no reason given").split())
        print(f"attune run: {res.status}: {why}", file=sys.stderr)
        return 1
    return 0


def cmd_tune(args) -> int:
    con = out.console()
    opts = options_from_args(TuneOptions, args)
    cfg = tune_api.tune_config(opts)
    con.print(f"attune tune: {cfg.model.name} on {cfg.cluster.spec}, runner {cfg.runner.name}, "
              f"{cfg.trials} measured trials, study '{cfg.study_name}' in {mask_url(cfg.storage)}", highlight=False)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=con, transient=False) as prog:
        task = prog.add_task("measured trials", total=cfg.trials)

        def progress(msg: str, completed: int | None = None) -> None:
            if completed is not None:
                prog.update(task, completed=min(completed, cfg.trials))
            prog.update(task, description=msg[:100])

        result = tune_api.run_tuning(cfg, verify=opts.verify, save_recipe=opts.save_recipe, progress=progress,
                                     allow_numerics=opts.allow_numerics)
    if result.verdict is not None:
        con.print(f"correctness: {result.recipe.correctness.result}; status {result.recipe.status}",
                  highlight=False)
    for line in result.summary_lines():
        con.print(line, highlight=False, markup=False)
    return 1 if result.lint_errors else 0


def cmd_verify(args) -> int:
    o = options_from_args(VerifyOptions, args)
    outcome = verify_recipe_file(o.recipe, runner=o.runner, steps=o.steps, out_dir=o.out,
                                 negative_control=o.negative_control, reference=o.reference,
                                 cluster_file=o.cluster_file, progress=print, in_place=o.in_place)
    print(f"{outcome.recipe_path}: status {outcome.status}; arms and losses in {outcome.out_dir}")
    if outcome.in_place_refused:
        print(f"attune verify: {outcome.source_path} {outcome.in_place_refused}", file=sys.stderr)
    if not outcome.passed:
        print(f"attune verify: {outcome.verdict.correctness_block()['summary']}", file=sys.stderr)
    return outcome.exit_code


def cmd_recipe_validate(args) -> int:
    findings = lint(load_recipe(args.file))
    for f in findings:
        print(f"{f.severity}: {f.path}: {f.message}")
    n_err = sum(f.severity == "error" for f in findings)
    print(f"{args.file}: {n_err} error(s), {len(findings) - n_err} warning(s)")
    return 1 if has_errors(findings) else 0


def cmd_recipe_show(args) -> int:
    out.console().print(render(load_recipe(args.file)))
    return 0


def cmd_slime_command(args) -> int:
    cfg = load_cluster(args.cluster) if args.cluster else None
    print(command_for_recipe(load_recipe(args.recipe), cfg, save=args.save, save_interval=args.save_interval).to_shell())
    return 0


def cmd_slime_preflight(args) -> int:
    report = slime_api.preflight(args.cluster, model=args.model)
    if args.json:
        print(_json(report.to_dict(), indent=2))
    else:
        out.console().print(out.preflight_table(report))
        if not report.ok:
            out.console(stderr=True).print(report.reason(), highlight=False, soft_wrap=True)
    return 0 if report.ok else 1


def cmd_slime_parse_log(args) -> int:
    p = Path(args.log)
    if not p.is_file():
        raise UserInputError(f"{args.log}: no such log file")
    a, b = args.window
    if a > b:
        raise UserInputError(f"--window {a} {b}: the first step must not be after the last")
    try:
        with open(p, encoding="utf-8", errors="replace") as f:  # streamed: memory does not grow with the log
            run = parse_slime_log(f, gpus=args.gpus, window=(a, b))
    except OSError as e:
        raise UserInputError(f"{args.log}: cannot read the log ({e.strerror})") from None
    print(_json(run.to_dict(), indent=2) if args.json else format_summary(run))
    return 0 if run.complete and not run.crash else 1


def cmd_study_status(args) -> int:
    st = study_api.study_status(args.storage, args.study, args.grace_period, args.storage_timeout)
    if args.json:
        print(_json(dataclasses.asdict(st), indent=2, default=str))
    else:
        for line in st.lines():
            print(line)
    return 0


def cmd_calibrate(args) -> int:
    if args.out is not None:
        check_out_dir(args.out)  # before any work
    outcome = calibrate_api.calibrate(args.corpus, do_fit=args.fit, out_dir=args.out, leave_one_out=args.leave_one_out)
    for line in out.calibration_lines(outcome):
        print(line)
    return 0


def cmd_data_build(args) -> int:
    target = Path(args.out)  # checked before any work: a file in a writable folder
    if target.is_dir():
        raise UserInputError(f"--out {target}: is a folder; name the parquet file to write")
    check_out_dir(target.parent if str(target.parent) else ".", what="--out's folder")
    stats = api.build_data(input_path=args.input, tokenizer=args.tokenizer, row_tokens=args.row_tokens,
                           seed=args.seed, max_rows=args.max_rows, out=args.out)
    print(_json(stats.to_dict(), indent=2))
    return 0
