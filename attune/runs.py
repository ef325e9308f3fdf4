"""`attune run`: one measured run of a layout on a runner (default: torch).

The layout comes from `--recipe`, from Megatron/slime flags after `--`, or is the model's baseline
(adapted to TP 1 and CP 1 for the torch runner, which supports PP, DP and recompute only). Prints
tokens/s/GPU, step time, step-time CV, peak memory per pipeline stage and the loss curve's ends;
`--json` prints the TrialResult. Exit 0 when the run is ok, 1 on OOM, failure or timeout (one line on
stderr); bad input raises ValueError/RuntimeError, which the CLI turns into exit 2.
"""

from __future__ import annotations

from attune.errors import UserInputError

import datetime as dt
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from attune.errors import LayoutError
from attune.spec.layout import Workload
from attune.spec.rules import check

# The torch runner's default workload: `attune tune --runner torch`'s (attune/search/tune.py build_config):
# 256-token rows, 8 rows per step, lr 3e-3 decaying to 3e-4, so a tiny model's loss falls in 20 steps.
TORCH_WORKLOAD = Workload(seq_length=256, global_batch=8, steps=20, window=(5, 19), lr=3e-3, min_lr=3e-4)
# Where runs land when --out is not given (a fresh folder per run).
RUNS_DIR = Path("reports") / "runs"


class RunError(UserInputError):
    """Bad input to `attune run`."""


def _window(steps: int, base: tuple[int, int]) -> tuple[int, int]:
    a, b = base
    if b < steps:
        return base
    return (min(a, max(0, steps // 4)), steps - 1)  # as `attune tune --steps` shortens the window


def resolve(args):
    """(model, cluster, engine, layout, workload, source) for the run's arguments."""
    from attune.spec.baselines import baseline_layout
    from .cli import _layout_from_args, _target, _workload
    from attune.spec.engine import get_engine

    if args.steps is None or args.steps < 1:
        raise RunError(f"--steps {args.steps}: must be a positive integer")
    if args.recipe and args.flags:
        raise RunError("give a layout by --recipe or by flags after --, not both")
    model, cluster, engine = _target(args)
    if args.runner == "torch":
        engine = get_engine("torch")
    base = TORCH_WORKLOAD if args.runner == "torch" else Workload()
    workload = _workload(args, base)
    if args.runner == "torch" and not args.recipe and not args.flags:
        layout, note = baseline_layout(model, cluster, workload, engine, max_tp=1, max_cp=1)
        source, ignored = note, []
    else:
        layout, workload, source, ignored = _layout_from_args(args, model, cluster, engine, workload)
    if ignored and args.runner != "slime":
        raise RunError(f"flag(s) {' '.join(ignored)} are not layout or workload flags the {args.runner} runner applies")
    workload = replace(workload, steps=args.steps, window=_window(args.steps, workload.window))
    errs = check(layout, model, cluster.world_size, workload, engine)
    if errs:
        raise LayoutError(f"layout {layout.label()} is invalid: " + "; ".join(errs))
    return model, cluster, engine, layout, workload, source


def format_result(res, layout, workload, source: str) -> str:
    lines = [f"layout {layout.label()} ({source}); {workload.global_batch} rows x {workload.seq_length} tokens "
             f"per step, {workload.steps} steps"]
    lines.append(f"status: {res.status}" + (f" ({res.reason})" if res.reason else "")
                 + (" [measured]" if res.measured else " [predicted, nothing ran]"))
    if res.tokens_per_s_per_gpu is not None:
        a, b = res.window or (None, None)
        lines.append(f"throughput: {res.tokens_per_s_per_gpu:,.1f} tokens/s/GPU over steps {a}..{b}")
    if res.step_time_s is not None:
        lines.append(f"step time: {res.step_time_s:.3f} s mean, CV {res.step_time_cv_percent or 0.0:.2f} %")
    if res.peak_memory_gib:
        lines.append("peak memory per stage: " + ", ".join(f"stage {i} {g:.2f} GiB" for i, g in enumerate(res.peak_memory_gib)))
    if res.losses:
        steps = sorted(res.losses)
        lines.append(f"loss: {res.losses[steps[0]]:.4f} (step {steps[0]}) -> {res.losses[steps[-1]]:.4f} (step {steps[-1]})")
    lines.append(f"wall time: {res.wall_s:.1f} s, {res.gpu_hours:.4f} GPU-hours")
    return "\n".join(lines)


def run_once(args) -> int:
    from .runners.base import OK, TrialSpec, get_runner

    model, cluster, engine, layout, workload, source = resolve(args)
    opts = {"cluster_file": args.cluster} if args.runner == "slime" and args.cluster else {}
    runner = get_runner(args.runner, **opts)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
    else:
        RUNS_DIR.mkdir(parents=True, exist_ok=True)
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        out = Path(tempfile.mkdtemp(prefix=f"{model.name.lower()}-{layout.slug()}-{stamp}-", dir=RUNS_DIR))
    spec = TrialSpec(model, cluster, layout, workload, engine, trial_dir=out, timeout_s=args.timeout,
                     label=layout.label())
    res = runner.run(spec)
    d = res.to_dict()
    (out / "run.json").write_text(json.dumps({"layout": layout.to_dict(), "workload": {
        k: getattr(workload, k) for k in workload.__dataclass_fields__}, "source": source, "runner": args.runner,
        "result": d}, indent=2, default=str))
    if args.json:
        print(json.dumps(d, indent=2, default=str))
    else:
        print(format_result(res, layout, workload, source))
        print(f"output: {out}")
    if res.status != OK:
        why = " ".join((res.reason or "no reason given").split())
        print(f"attune run: {res.status}: {why}", file=sys.stderr)
        return 1
    return 0
