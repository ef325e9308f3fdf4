"""The `slime` runner: slime's launch of the trial's layout, run as a Ray job (``attune.runners.ray.runner``).

:class:`SlimePayload` is WHAT runs: the slime launch (attune.runners.slime.launch) as the job's entrypoint,
its log read with ``parse_slime_log``. :class:`SlimeRunner` is ``RayRunner(SlimePayload(), ...)``, WHERE it
runs: a Ray cluster through the Jobs API. (A torch trial on Ray is the other payload,
``attune.runners.ray.runner.TorchJobPayload``, registry name ``ray-torch``.)

Per trial, in ``spec.trial_dir`` (a temp folder when None): ``log.txt`` (the job log, streamed while it
runs), ``result.json`` (the TrialResult) and ``launch.sh`` (the script the job runs).

Metrics: slime's TensorBoard scalars, which the launch script prints into the job log after training
(``attune.runners.slime.tbscalars``), when the log holds them; else the log's own lines. OOM and crash detection
always read the log lines. ``extra["slime"]["metrics_source"]`` says which; ``extra["throughput"]`` holds both
throughput definitions (over perf/actor_train_time, the result's ``tokens_per_s_per_gpu``, and over
perf/step_time).

Status mapping: a CUDA OOM -> "oom" (``oom_stage`` from the rank the log names, via the layout's rank order);
a crash (an NCCL timeout or error, a dead Ray actor, Ray's host-memory kill, a Python exception, a FAILED job)
before the measurement window completed -> "failed" with its kind, the rank and pipeline stage where the log
names them (``extra["crash"]``) and the log tail; past the timeout the job is stopped -> "timeout"; otherwise
"ok". A job that fails after every window step was measured is "ok" with the failure in ``reason`` and
``extra``.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from attune.errors import UserInputError
from attune.runners.base import (
    FAILED,
    LOG_TAIL_CHARS,
    OK,
    OOM,
    TIMEOUT,
    Capabilities,
    Rerun,
    TrialResult,
    TrialSpec,
    step_time_stats,
)
from attune.runners.ray.jobs import JobOutcome
from attune.runners.ray.runner import RayJob, RayPayload, RayRunner
from attune.runners.slime.launch import LaunchError, launch_versions, slime_command, stage_of_rank
from attune.runners.slime.logparse import CrashInfo, SlimeRun, parse_slime_log
from attune.runners.slime.preflight import PreflightFailed, run_preflight
from attune.runners.slime.tbscalars import scalars_from_log, train_metrics
from attune.spec.flags import to_flags
from attune.spec.hardware import Cluster
from attune.spec.model import ModelSpec

__all__ = ["SlimeRunner", "SlimePayload", "slime_result", "slime_rerun", "slime_run", "crash_stage",
           "SLIME_CAPABILITIES"]

# A real 20-step slime run per trial: `attune tune` defaults to 12 measured trials and 48 proposals estimated
# per trial; flags attune does not model pass straight to slime's launch.
SLIME_CAPABILITIES = Capabilities(measured=True, default_trials=12, default_candidates=48, needs_cluster_file=True,
                                  passes_unknown_flags=True)


def _tail(log: str) -> str:
    return log[-LOG_TAIL_CHARS:]


# What a crash kind reads as in a failed trial's reason.
_CRASH_WORDS = {"host_oom": "host memory exhausted (Ray's memory monitor killed a worker)",
                "nccl_timeout": "NCCL collective timeout", "nccl_error": "NCCL error",
                "actor_died": "Ray actor died", "exception": "exception", "job_failed": "job failed"}


def crash_stage(crash: CrashInfo | None, spec: TrialSpec) -> int | None:
    """The pipeline stage of the rank the crash names (Megatron's rank order), or None."""
    if crash is None or crash.rank is None or not 0 <= crash.rank < spec.layout.world_size:
        return None
    return stage_of_rank(crash.rank, spec.layout)


def slime_run(log: str, spec: TrialSpec) -> SlimeRun:
    """The SlimeRun of a job log: training metrics from the TensorBoard scalars the log carries (else from its
    lines), OOM and crash from its lines."""
    files = scalars_from_log(log)
    metrics = train_metrics(files) if files else None
    return parse_slime_log(log, gpus=spec.layout.world_size, window=tuple(spec.workload.window), metrics=metrics)


def slime_result(outcome: JobOutcome, spec: TrialSpec) -> TrialResult:
    """A TrialResult from a slime job's log and final status (pure: no I/O)."""
    L = spec.layout
    run: SlimeRun = slime_run(outcome.log, spec)
    ids = sorted(run.train_time_s)
    step_times = [run.train_time_s[i] for i in ids]
    a, b = run.window
    win_times = [run.train_time_s[i] for i in range(a, b + 1) if i in run.train_time_s]
    extra = {"slime": {k: v for k, v in run.to_dict().items() if k not in ("train_perf", "crash")},
             "step_ids": ids,
             "throughput": {"basis": run.throughput_basis, "tokens_per_s_per_gpu_actor_train_time": run.tokens_per_s_per_gpu,
                            "tokens_per_s_per_gpu_step_time": run.tokens_per_s_per_gpu_step_time}}
    stage = crash_stage(run.crash, spec)
    if run.crash is not None:
        extra["crash"] = {"kind": run.crash.kind, "rank": run.crash.rank, "stage": stage, "actor": run.crash.actor,
                          "rollout_id": run.crash.rollout_id, "error": run.crash.error}
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
        c = run.crash
        err = (c.error if c and c.error else None) or outcome.message or outcome.status
        where = ""
        if c is not None:
            parts = [f"pipeline stage {stage} (rank {c.rank})" if stage is not None else "",
                     f"in {c.actor}" if c.actor and stage is None else "",
                     f"at rollout {c.rollout_id}" if c.rollout_id is not None else ""]
            where = " ".join(p for p in parts if p)
            where = f"{_CRASH_WORDS.get(c.kind, c.kind)}" + (f" on {where}" if stage is not None else
                                                               (f" {where}" if where else "")) + ": "
        return TrialResult(status=FAILED, reason=f"slime job {outcome.status.lower()}: {where}{err}",
                           log_tail=(c.tail if c else _tail(outcome.log)), **common)
    missing = ", ".join(map(str, run.window_missing[:10]))
    return TrialResult(status=FAILED, log_tail=_tail(outcome.log),
                       reason=f"job {outcome.status.lower()} without a complete window {a}..{b}: no train time for "
                              f"rollout(s) {missing}", **common)


def slime_rerun(spec: TrialSpec) -> Rerun:
    """slime's launch of the layout (attune.runners.slime.launch) with its environment; the stack names the slime and
    Megatron-LM commits the launch and the flag table were written for."""
    v = launch_versions()
    stack = {"slime": f"{v['slime']} (the commit attune's launch and flag table were written for)",
             "megatron_lm": f"{v['megatron_lm']} with slime's Megatron patch "
                            f"(the commit slime pins; launch written for it)"}
    wl = spec.workload
    try:
        cmd = slime_command(spec.model, spec.cluster, spec.layout, wl, steps=wl.steps)
    except LaunchError as e:
        # a model whose slime launch attune cannot write (GPT-OSS): the layout's Megatron flags through attune's
        # own launcher, which names the same reason when it is run, so the recipe still records the winner
        argv = ["attune", "run", "--runner", SlimeRunner.name, "--model", spec.model.name, "--gpus", spec.cluster.spec,
                "--steps", str(wl.steps), "--", *to_flags(spec.layout, wl, spec.engine)]
        return Rerun(command=f"# {e}\n" + shlex.join(argv) + "\n", stack=stack)
    return Rerun(command=str(cmd.to_shell()), env={str(k): str(v) for k, v in cmd.env.items()}, stack=stack)


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

    def rerun(self, spec: TrialSpec) -> Rerun:
        return slime_rerun(spec)


class SlimeRunner(RayRunner):
    """slime on a Ray cluster (registry name ``slime``): ``RayRunner(SlimePayload(async_), ...)``."""

    name = SlimePayload.runner_name
    capabilities = SLIME_CAPABILITIES

    def __init__(self, cluster_file: str | Path | None = None, async_: bool = True, **options):
        """cluster_file and options: as :class:`attune.runners.ray.runner.RayRunner`; async_: as SlimePayload."""
        super().__init__(SlimePayload(async_=async_), cluster_file=cluster_file, **options)

    def preflight(self, model: ModelSpec, cluster: Cluster) -> None:
        """The preflight job (attune.runners.slime.preflight) on the cluster of the cluster file; raises
        PreflightFailed with the first missing things by name. Without a cluster file nothing is checked."""
        if self.cluster_cfg is None:
            return
        report = run_preflight(self.jobs, self.cluster_cfg, model, python=self.python, study=self.study,
                               poll_s=min(self.poll_s, 2.0))
        if not report.ok:
            raise PreflightFailed(report.reason())

    def slime_launch(self, spec: TrialSpec, trial: str | None = None):
        """The LaunchCommand of ``spec`` (as the job runs it, with ``trial`` as its id)."""
        return self.payload.launch(self, spec, trial)
