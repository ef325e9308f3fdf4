"""The `slime` runner: a trial is a real run submitted to a Ray cluster through the Ray Jobs API.

``SlimeRunner(cluster_file=..., trial_kind="slime")`` (the default) submits the slime launch of the trial's
layout (attune.runners.slime.launch) as a Ray job, follows it, and reads the job log with
``parse_slime_log``. ``trial_kind="torch"`` submits the torch runner's trial instead
(``python -m attune.runners.slime.torch_job``), through the same submission, polling, log and result code:
that path runs on any Ray cluster, a local CPU one included, and is what attune's Ray tests exercise.

Per trial, in ``spec.trial_dir`` (a temp folder when None): ``log.txt`` (the job log, streamed while it
runs), ``result.json`` (the TrialResult) and, for slime trials, ``launch.sh`` (the script the job runs).

Status mapping (slime): a CUDA OOM -> "oom" (``oom_stage`` from the rank the log names, via the layout's
rank order); a crash (traceback, Ray actor error, FAILED job) before the measurement window completed ->
"failed" with the log tail; past the timeout the job is stopped -> "timeout"; otherwise "ok". A job that
fails after every window step was measured is "ok" with the failure in ``reason`` and ``extra``.
gpu_hours = GPUs x (job submission to finish), start-up included (the seed's convention).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
import tempfile
from pathlib import Path
from typing import Callable

from ..base import FAILED, OK, OOM, TIMEOUT, RunnerError, TrialResult, TrialSpec
from .cluster import ClusterConfig, load_cluster
from .jobs import RayJobs, JobOutcome, submission_id
from .launch import LaunchError, slime_command, stage_of_rank
from .logparse import SlimeRun, parse_slime_log
from . import torch_job

__all__ = ["SlimeRunner", "slime_result", "torch_job_result", "TRIAL_KINDS"]

TRIAL_KINDS = ("slime", "torch")
# Characters of the job log kept in a failed result's log_tail.
LOG_TAIL_CHARS = 4000
# Without a cluster file or spec.timeout_s: one hour per trial, s.
DEFAULT_TIMEOUT_S = 3600.0
# Seconds to wait for a stopped job to end.
DEFAULT_STOP_GRACE_S = 60.0
_LABEL_NUMBER_RE = re.compile(r"(\d+)(?!.*\d)")

Parse = Callable[[JobOutcome, TrialSpec], TrialResult]


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
                  step_time_s=statistics.fmean(win_times) if win_times else None, window_tokens=run.window_tokens)
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


def torch_job_result(outcome: JobOutcome, spec: TrialSpec) -> TrialResult:
    """A TrialResult from a torch-trial job: the result line its entrypoint printed."""
    d = torch_job.parse_result_line(outcome.log)
    if outcome.timed_out:
        return TrialResult(status=TIMEOUT, measured=True, reason=f"timeout: stopped after {spec.timeout_s or 0:g} s",
                           log_tail=_tail(outcome.log))
    if d is None:
        return TrialResult(status=FAILED, measured=True, log_tail=_tail(outcome.log),
                           reason=f"torch job {outcome.status.lower()} without a result line: {outcome.message}".strip())
    r = TrialResult.from_dict(d)
    r.extra = dict(r.extra or {})
    r.extra["inner_wall_s"] = r.wall_s
    return r


class SlimeRunner:
    """Runner protocol: ``run(spec) -> TrialResult``, trials as Ray jobs."""

    name = "slime"
    measured = True

    def __init__(self, cluster_file: str | Path | None = None, address: str | None = None, poll_s: float | None = None,
                 python: str | None = None, trial_kind: str = "slime", study: str = "attune", async_: bool = True,
                 stop_grace_s: float | None = None, jobs: RayJobs | None = None):
        """cluster_file: the cluster YAML (attune.runners.slime.cluster); address: the Ray dashboard URL (overrides
        the file's). poll_s: status/log polling interval, s (default: the file's, else 10). python: the
        interpreter the job runs (default: the file's, else python3). trial_kind: slime | torch. study: part of
        every submission id (attune-<study>-t<N>-<layout>)."""
        if trial_kind not in TRIAL_KINDS:
            raise RunnerError(f"unknown trial kind '{trial_kind}'; allowed: {', '.join(TRIAL_KINDS)}")
        self.cluster_cfg: ClusterConfig | None = load_cluster(cluster_file) if cluster_file else None
        self.address = address or (self.cluster_cfg.address if self.cluster_cfg else None)
        if not self.address and jobs is None:
            raise RunnerError("the slime runner needs a Ray cluster: a cluster file with ray.address, "
                              "or address='http://HEAD:8265'")
        cfg = self.cluster_cfg
        self.poll_s = float(poll_s if poll_s is not None else (cfg.poll_s if cfg else 10.0))
        if self.poll_s <= 0:
            raise RunnerError(f"poll_s must be positive seconds (got {poll_s!r})")
        self.python = python or (cfg.python if cfg else "python3")
        self.trial_kind = trial_kind
        self.study = study
        self.async_ = async_
        self.stop_grace_s = float(stop_grace_s if stop_grace_s is not None else (cfg.stop_grace_s if cfg else DEFAULT_STOP_GRACE_S))
        self.slot_resource = cfg.slot_resource if cfg else "attune_trial_slot"
        self._jobs = jobs

    # -------------------------------------------------------------- pieces
    @property
    def jobs(self) -> RayJobs:
        if self._jobs is None:
            self._jobs = RayJobs(self.address)
        return self._jobs

    def submission_id_for(self, spec: TrialSpec) -> str:
        """Deterministic per trial: study, the number in the trial's label (0 if none), layout slug and a hash
        of everything that defines the trial (model, cluster, layout, workload, kind)."""
        m = _LABEL_NUMBER_RE.search(spec.label or "")
        number = int(m.group(1)) if m else 0
        key = json.dumps([self.trial_kind, spec.model.name, spec.cluster.spec, spec.layout.to_dict(),
                          list(spec.workload.__dict__.items()), spec.data_path, spec.label], default=str)
        digest = hashlib.sha256(key.encode()).hexdigest()[:8]
        return submission_id(self.study, number, f"{spec.layout.slug()}-{digest}")

    def _timeout(self, spec: TrialSpec) -> float:
        if spec.timeout_s is not None:
            return float(spec.timeout_s)
        return self.cluster_cfg.trial_timeout_s if self.cluster_cfg else DEFAULT_TIMEOUT_S

    def slime_launch(self, spec: TrialSpec, trial: str | None = None):
        try:
            return slime_command(spec.model, spec.cluster, spec.layout, spec.workload, cluster_cfg=self.cluster_cfg,
                                 async_=self.async_, trial=trial, python=self.python)
        except LaunchError as e:
            raise RunnerError(str(e)) from None

    def _torch_runtime_env(self) -> dict:
        if self.cluster_cfg and self.cluster_cfg.paths.attune:
            root = self.cluster_cfg.paths.attune
        else:
            root = str(Path(__file__).resolve().parents[3])  # this attune checkout (right for a local Ray head)
        env = {"PYTHONPATH": f"{root}:${{PYTHONPATH}}", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        if self.cluster_cfg:
            env.update(self.cluster_cfg.env)
        return {"env_vars": env}

    # -------------------------------------------------------------- run
    def run(self, spec: TrialSpec) -> TrialResult:
        trial_dir = Path(spec.trial_dir) if spec.trial_dir else Path(tempfile.mkdtemp(prefix="attune-slime-"))
        trial_dir.mkdir(parents=True, exist_ok=True)
        sid = self.submission_id_for(spec)
        if self.trial_kind == "slime":
            cmd = self.slime_launch(spec, trial=sid)
            (trial_dir / "launch.sh").write_text(cmd.to_shell())
            return self.run_entrypoint(cmd.ray_entrypoint(), spec, slime_result, runtime_env=cmd.runtime_env(),
                                       sid=sid, trial_dir=trial_dir)
        encoded = torch_job.encode_trial(spec, timeout_s=None)  # the job's own timeout is enforced here, by Ray
        return self.run_entrypoint(torch_job.entrypoint(encoded, self.python), spec, torch_job_result,
                                   runtime_env=self._torch_runtime_env(), sid=sid, trial_dir=trial_dir)

    def run_entrypoint(self, entrypoint: str, spec: TrialSpec, parse: Parse, runtime_env: dict | None = None,
                       sid: str | None = None, trial_dir: Path | None = None) -> TrialResult:
        """Submit (or attach to) a job, stream its log to log.txt, wait, parse, write result.json."""
        trial_dir = Path(trial_dir or spec.trial_dir or tempfile.mkdtemp(prefix="attune-slime-"))
        trial_dir.mkdir(parents=True, exist_ok=True)
        sid = sid or self.submission_id_for(spec)
        used, attached = self.jobs.submit(entrypoint, runtime_env, sid, resources={self.slot_resource: 1},
                                          metadata={"attune_trial": spec.label or sid, "attune_kind": self.trial_kind})
        log_path = trial_dir / "log.txt"
        with open(log_path, "w") as log_file:
            def on_log(chunk: str) -> None:
                log_file.write(chunk)
                log_file.flush()

            outcome = self.jobs.wait(used, timeout_s=self._timeout(spec), poll_s=self.poll_s, on_log=on_log,
                                     stop_grace_s=self.stop_grace_s, attached=attached)
        log_path.write_text(outcome.log)  # the whole log, as Ray holds it at the end
        result = parse(outcome, spec)
        result.measured = True
        result.wall_s = outcome.wall_s
        result.gpu_hours = spec.layout.world_size * outcome.wall_s / 3600.0
        result.extra = dict(result.extra or {})
        result.extra.update(submission_id=used, attached=attached, job_status=outcome.status,
                            job_message=outcome.message, pending_s=outcome.pending_s, ray_address=self.jobs.address,
                            trial_kind=self.trial_kind)
        if result.tokens_per_s_per_gpu is not None and not math.isfinite(result.tokens_per_s_per_gpu):
            result.tokens_per_s_per_gpu = None
        result.save(trial_dir / "result.json")
        return result
