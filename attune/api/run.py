"""``attune run``: one measured run of a layout on a runner, with its record on disk."""

from __future__ import annotations

import datetime as dt
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from attune.api.target import Target
from attune.errors import LayoutError, UserInputError
from attune.runners.base import TrialResult, TrialSpec
from attune.runners.registry import get_runner
from attune.search.options import RunOptions
from attune.spec.rules import check


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """What ``run_once`` measured and where it left its files."""

    target: Target
    """The layout and workload that ran."""
    runner: str
    """Runner name."""
    result: TrialResult
    """The runner's result (status, throughput, memory, losses)."""
    out_dir: Path
    """Folder with ``run.json`` and the runner's own logs."""


def default_runs_dir() -> Path:
    """``reports/runs/`` under the current working directory."""
    return Path.cwd() / "reports" / "runs"


def run_once(target: Target, *, runner: str = RunOptions.runner, out_dir: str | Path | None = None,
             timeout_s: float | None = None, cluster_file: str | None = None,
             trial_number: int | None = None) -> RunOutcome:
    """Run ``target`` once on ``runner``; never raises for the run's own failure (see the result's status)."""
    opts = {"cluster_file": cluster_file} if cluster_file else {}
    r = get_runner(runner, **opts)
    if target.ignored_flags and not r.capabilities.passes_unknown_flags:
        raise UserInputError(f"flag(s) {' '.join(target.ignored_flags)} are not layout or workload flags the "
                             f"{runner} runner applies")
    errs = check(target.layout, target.model, target.cluster.world_size, target.workload, target.engine)
    if errs:
        raise LayoutError(f"layout {target.layout.label()} is invalid: " + "; ".join(errs))
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
    else:
        root = default_runs_dir()
        root.mkdir(parents=True, exist_ok=True)
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        out = Path(tempfile.mkdtemp(prefix=f"{target.model.name.lower()}-{target.layout.slug()}-{stamp}-", dir=root))
    spec = TrialSpec(model=target.model, cluster=target.cluster, layout=target.layout, workload=target.workload,
                     engine=target.engine, trial_dir=out, timeout_s=timeout_s, label=target.layout.label(),
                     trial_number=trial_number)
    problems = r.check(spec)
    if problems:
        raise UserInputError(f"the {runner} runner cannot run {target.layout.label()}: {'; '.join(problems)}")
    res = r.run(spec)
    wl = target.workload
    (out / "run.json").write_text(json.dumps({
        "layout": target.layout.to_dict(),
        "workload": {k: getattr(wl, k) for k in wl.__dataclass_fields__},
        "source": target.source, "runner": runner, "result": res.to_dict()}, indent=2, default=str))
    return RunOutcome(target=target, runner=runner, result=res, out_dir=out)
