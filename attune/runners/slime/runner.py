"""The `slime` runner: slime's launch of the trial's layout, run as a Ray job (``attune.runners.ray.runner``).

:class:`SlimePayload` is WHAT runs: the slime launch (attune.runners.slime.launch) as the job's entrypoint,
its log read with ``parse_slime_log``. :class:`SlimeRunner` is ``RayRunner(SlimePayload(), ...)``, WHERE it
runs: a Ray cluster through the Jobs API. (A torch trial on Ray is the other payload,
``attune.runners.ray.runner.TorchJobPayload``, registry name ``ray-torch``.)

Per trial, in ``spec.trial_dir`` (a temp folder when None): ``log.txt`` (the job log, streamed while it
runs), ``result.json`` (the TrialResult) and ``launch.sh`` (the script the job runs).

Status mapping: a CUDA OOM -> "oom" (``oom_stage`` from the rank the log names, via the layout's rank order);
a crash (traceback, Ray actor error, FAILED job) before the measurement window completed -> "failed" with
the log tail; past the timeout the job is stopped -> "timeout"; otherwise "ok". A job that fails after
every window step was measured is "ok" with the failure in ``reason`` and ``extra``.
"""

from __future__ import annotations

from pathlib import Path

from attune.errors import UserInputError
from attune.runners.base import (FAILED, LOG_TAIL_CHARS, OK, OOM, TIMEOUT, Capabilities, TrialResult, TrialSpec,
                                 step_time_stats)
from attune.runners.ray.runner import RayJob, RayPayload, RayRunner
from attune.runners.ray.jobs import JobOutcome
from attune.runners.slime.launch import slime_command, stage_of_rank
from attune.runners.slime.logparse import SlimeRun, parse_slime_log

__all__ = ["SlimeRunner", "SlimePayload", "slime_result", "SLIME_CAPABILITIES"]

# A real 20-step slime run per trial: `attune tune` defaults to 12 measured trials and 48 proposals estimated
# per trial; flags attune does not model pass straight to slime's launch.
SLIME_CAPABILITIES = Capabilities(measured=True, default_trials=12, default_candidates=48, needs_cluster_file=True,
                                  passes_unknown_flags=True)


def _tail(log: str) -> str:
    return log[-LOG_TAIL_CHARS:]


def slime_result(outcome: JobOutcome, spec: TrialSpec) -> TrialResult:
    """A TrialResult from a slime job's log and final status (pure: no I/O)."""
    L, w = spec.layout, spec.workload
    run: SlimeRun = parse_slime_log(outcome.log, gpus=L.world_size, window=tuple(w.window))
    ids = sorted(run.train_time_s)
    step_times = [run.train_time_s[i] for i in ids]
    a, b = run.window
    win_times = [run.train_time_s[i] for i in range(a, b + 1) if i in run.train_time_s]
    extra = {"slime": {k: v for k, v in run.to_dict().items() if k not in ("train_perf", "crash")},
             "step_ids": ids}
    common = dict(measured=True, step_times_s=step_times, losses=dict(run.loss), window=(a, b), extra=extra,
                  tokens_per_s_per_gpu=run.tokens_per_s_per_gpu, step_time_cv_percent=run.step_time_cv_percent,
                  step_time_s=step_time_stats(win_times).mean_s if win_times else None, window_tokens=run.window_tokens)
    if outcome.timed_out:
        done = f"{len(ids)} steps logged"
        return TrialResult(status=TIMEOUT, reason=f"timeout: stopped after {spec.timeout_s or 0:g} s ({done})",
                           log_tail=_tail(outcome.log), **common)
    if run.oom is not None:
        o = run.oom
        stage = None
        if o.rank is not None and 0 <= o.rank < L.world_size:
            stage = stage_of_rank(o.rank, L)
        where = f"pipeline stage {stage} (rank {o.rank})" if stage is not None else "an unidentified rank"
        req = f"{o.requested_gib:.2f} GiB" if o.requested_gib is not None else "n/a GiB"
        cap = f" of {o.total_capacity_gib:.2f} GiB" if o.total_capacity_gib is not None else ""
        return TrialResult(status=OOM, oom_stage=stage, log_tail=_tail(outcome.log),
                           reason=f"CUDA out of memory on {where} at rollout {o.rollout_id}: tried to allocate {req}{cap}",
                           **common)
    job_failed = outcome.status in ("FAILED", "STOPPED")
    if run.complete and run.tokens_per_s_per_gpu is not None:
        reason = ""
        if job_failed or run.crash is not None:
            err = (run.crash.error if run.crash and run.crash.error else outcome.message) or outcome.status
            reason = f"job {outcome.status.lower()} after the measurement window completed: {err}"
        return TrialResult(status=OK, reason=reason, **common)
    if run.crash is not None or job_failed:
        err = (run.crash.error if run.crash and run.crash.error else None) or outcome.message or outcome.status
        return TrialResult(status=FAILED, reason=f"slime job {outcome.status.lower()}: {err}",
                           log_tail=(run.crash.tail if run.crash else _tail(outcome.log)), **common)
    missing = ", ".join(map(str, run.window_missing[:10]))
    return TrialResult(status=FAILED, log_tail=_tail(outcome.log),
                       reason=f"job {outcome.status.lower()} without a complete window {a}..{b}: no train time for "
                              f"rollout(s) {missing}", **common)


class SlimePayload(RayPayload):
    """slime's launch of the layout as the job (``launch.sh``, written into the trial folder)."""

    kind = "slime"
    runner_name = "slime"
    capabilities = SLIME_CAPABILITIES

    def __init__(self, async_: bool = True):
        """async_: slime's asynchronous training loop (train_async.py), as the seed ran it."""
        self.async_ = async_

    def launch(self, runner: RayRunner, spec: TrialSpec, trial: str | None = None):
        """The LaunchCommand of ``spec`` on the runner's cluster (raises LaunchError, a UserInputError)."""
        return slime_command(spec.model, spec.cluster, spec.layout, spec.workload, cluster_cfg=runner.cluster_cfg,
                             async_=self.async_, trial=trial, python=runner.python)

    def check(self, runner: RayRunner, spec: TrialSpec) -> list[str]:
        reasons = self.capabilities.limit_reasons(spec.layout, runner.name)
        if reasons:
            return reasons
        try:
            self.launch(runner, spec)
        except UserInputError as e:
            return [str(e).splitlines()[0] if str(e) else type(e).__name__]
        return []

    def job(self, runner: RayRunner, spec: TrialSpec, sid: str, trial_dir: Path) -> RayJob:
        cmd = self.launch(runner, spec, trial=sid)
        (trial_dir / "launch.sh").write_text(cmd.to_shell())
        return RayJob(entrypoint=cmd.ray_entrypoint(), runtime_env=cmd.runtime_env())

    def parse(self, outcome: JobOutcome, spec: TrialSpec) -> TrialResult:
        return slime_result(outcome, spec)


class SlimeRunner(RayRunner):
    """slime on a Ray cluster (registry name ``slime``): ``RayRunner(SlimePayload(async_), ...)``."""

    name = SlimePayload.runner_name
    capabilities = SLIME_CAPABILITIES

    def __init__(self, cluster_file: str | Path | None = None, async_: bool = True, **options):
        """cluster_file and options: as :class:`attune.runners.ray.runner.RayRunner`; async_: as SlimePayload."""
        super().__init__(SlimePayload(async_=async_), cluster_file=cluster_file, **options)

    def slime_launch(self, spec: TrialSpec, trial: str | None = None):
        """The LaunchCommand of ``spec`` (as the job runs it, with ``trial`` as its id)."""
        return self.payload.launch(self, spec, trial)
