"""Trials as Ray jobs: WHERE a trial runs (a Ray cluster, through the Jobs API) apart from WHAT runs there.

:class:`RayRunner` submits a trial as one Ray job (``attune.runners.ray.jobs``), follows it, stops it past
its timeout, writes ``log.txt`` and ``result.json`` and keeps the runner contract. What the job runs is a
:class:`RayPayload`:

* :class:`attune.runners.slime.runner.SlimePayload`: slime's launch of the layout (registry name ``slime``);
* :class:`TorchJobPayload`: attune's torch trainer (``python -m attune.runners.ray.torch_job``), which runs
  on any Ray cluster, a local CPU one included (registry name ``ray-torch``; what
  ``attune tune --runner slime --trial-kind torch`` means).

Submission ids come from the study name and the Optuna trial number (``TrialSpec.trial_number``):
``attune-<study>-t<NNNN>-<layout slug>-<hash of the trial's definition>``.
gpu_hours = GPUs x (job submission to finish), start-up included (the seed's convention).
"""

from __future__ import annotations

import abc
import hashlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from attune.errors import RunnerError
from attune.runners.base import (
    FAILED,
    LOG_FILE,
    LOG_TAIL_CHARS,
    TIMEOUT,
    Capabilities,
    Rerun,
    Runner,
    TrialResult,
    TrialSpec,
)
from attune.runners.ray import torch_job
from attune.runners.ray.cluster import DEFAULT_SLOT_RESOURCE, ClusterConfig, load_cluster
from attune.runners.ray.jobs import JobOutcome, RayJobs, submission_id
from attune.runners.shell import check_ray_literal, ray_env_vars
from attune.runners.torch_runner import TORCH_CAPABILITIES, torch_check, torch_rerun

__all__ = ["RayRunner", "RayPayload", "RayJob", "TorchJobPayload", "RayTorchRunner", "torch_job_result",
           "RAY_TORCH_CAPABILITIES", "DEFAULT_TIMEOUT_S"]

# Without a cluster file or spec.timeout_s: one hour per trial, s (a 20-step 27B slime trial takes ~25 min on
# 8 H200 including start-up; seed recipe: 3.34 GPU-hours / 8 GPUs).
DEFAULT_TIMEOUT_S = 3600.0
# Seconds to wait for a stopped job to end (as the cluster file's default, timeouts.stop_grace_s).
DEFAULT_STOP_GRACE_S = 60.0
# Seconds between status checks without a cluster file (as the cluster file's default, timeouts.poll_s).
DEFAULT_POLL_S = 10.0


def _tail(log: str) -> str:
    return log[-LOG_TAIL_CHARS:]


@dataclass(frozen=True, kw_only=True)
class RayJob:
    """One job to submit: what the entrypoint runs and in which environment."""

    entrypoint: str
    """The shell command Ray runs as the job's driver."""
    runtime_env: dict
    """Ray runtime environment (env_vars, working dir)."""


class RayPayload(abc.ABC):
    """WHAT a Ray job runs for a trial: its limits, its entrypoint and how to read its log."""

    kind: ClassVar[str]
    """Short name recorded in job metadata and results (``slime``, ``torch``)."""
    runner_name: ClassVar[str]
    """Registry name of a RayRunner with this payload."""
    capabilities: ClassVar[Capabilities]
    """Capabilities of a RayRunner with this payload."""

    @abc.abstractmethod
    def check(self, runner: "RayRunner", spec: TrialSpec) -> list[str]:
        """Reasons this payload cannot run ``spec`` on ``runner``'s cluster; [] when it can."""

    @abc.abstractmethod
    def job(self, runner: "RayRunner", spec: TrialSpec, sid: str, trial_dir: Path) -> RayJob:
        """The job for ``spec`` (may write its launch files into ``trial_dir``)."""

    @abc.abstractmethod
    def parse(self, outcome: JobOutcome, spec: TrialSpec) -> TrialResult:
        """The TrialResult of a finished job, from its log and final status (pure: no I/O)."""

    @abc.abstractmethod
    def rerun(self, spec: TrialSpec) -> Rerun:
        """The recipe's run block for ``spec`` (``Runner.rerun_command``)."""


class RayRunner(Runner):
    """A trial as one Ray job on the cluster of ``cluster_file`` (or ``address``), running ``payload``."""

    def __init__(self, payload: RayPayload, cluster_file: str | Path | None = None, address: str | None = None,
                 poll_s: float | None = None, python: str | None = None, study: str = "attune",
                 stop_grace_s: float | None = None, jobs: RayJobs | None = None):
        """cluster_file: the cluster YAML (attune.runners.ray.cluster); address: the Ray dashboard URL (overrides
        the file's). poll_s: status polling interval, s (default: the file's, else 10). python: the
        interpreter the job runs (default: the file's, else python3). study: part of every submission id.
        jobs: a RayJobs stand-in (tests)."""
        self.payload = payload
        self.name = payload.runner_name
        self.capabilities = payload.capabilities
        self.cluster_cfg: ClusterConfig | None = load_cluster(cluster_file) if cluster_file else None
        cfg = self.cluster_cfg
        self.address = address or (cfg.address if cfg else None)
        if not self.address and jobs is None:
            raise RunnerError(f"the {self.name} runner needs a Ray cluster: a cluster file with ray.address, "
                              "or address='http://HEAD:8265'")
        self.poll_s = float(poll_s if poll_s is not None else (cfg.poll_s if cfg else DEFAULT_POLL_S))
        if self.poll_s <= 0:
            raise RunnerError(f"poll_s must be positive seconds (got {poll_s!r})")
        self.python = python or (cfg.python if cfg else "python3")
        self.study = study
        self.stop_grace_s = float(stop_grace_s if stop_grace_s is not None
                                  else (cfg.stop_grace_s if cfg else DEFAULT_STOP_GRACE_S))
        self.slot_resource = cfg.slot_resource if cfg else DEFAULT_SLOT_RESOURCE
        self._jobs = jobs

    @property
    def jobs(self) -> RayJobs:
        if self._jobs is None:
            self._jobs = RayJobs(self.address)
        return self._jobs

    def check(self, spec: TrialSpec) -> list[str]:
        return self.payload.check(self, spec)

    def rerun_command(self, spec: TrialSpec) -> Rerun:
        return self.payload.rerun(spec)

    def submission_id_for(self, spec: TrialSpec) -> str:
        """Deterministic per trial: study, ``spec.trial_number``, layout slug and a hash of everything that
        defines the trial (payload, model, cluster, layout, workload, data, label)."""
        key = json.dumps([self.payload.kind, spec.model.name, spec.cluster.spec, spec.layout.to_dict(),
                          list(spec.workload.__dict__.items()), spec.data_path, spec.label], default=str)
        digest = hashlib.sha256(key.encode()).hexdigest()[:8]
        return submission_id(self.study, spec.trial_number, f"{spec.layout.slug()}-{digest}")

    def timeout_for(self, spec: TrialSpec) -> float:
        """The trial's limit, s: the spec's, else the cluster file's, else one hour."""
        if spec.timeout_s is not None:
            return float(spec.timeout_s)
        return self.cluster_cfg.trial_timeout_s if self.cluster_cfg else DEFAULT_TIMEOUT_S

    def _execute(self, spec: TrialSpec, trial_dir: Path) -> TrialResult:
        """Submit (or attach to) the job, stream its log to log.txt, wait, parse."""
        spec = replace(spec, trial_dir=trial_dir)
        sid = self.submission_id_for(spec)
        job = self.payload.job(self, spec, sid, trial_dir)
        used, attached = self.jobs.submit(job.entrypoint, job.runtime_env, sid, resources={self.slot_resource: 1},
                                          metadata={"attune_trial": spec.label or sid, "attune_kind": self.payload.kind})
        log_path = trial_dir / LOG_FILE
        with open(log_path, "w") as log_file:
            def on_log(chunk: str) -> None:
                log_file.write(chunk)
                log_file.flush()

            outcome = self.jobs.wait(used, timeout_s=self.timeout_for(spec), poll_s=self.poll_s, on_log=on_log,
                                     stop_grace_s=self.stop_grace_s, attached=attached)
        log_path.write_text(outcome.log)  # the whole log, as Ray holds it at the end
        result = self.payload.parse(outcome, spec)
        result.measured = True
        result.wall_s = outcome.wall_s
        result.gpu_hours = spec.layout.world_size * outcome.wall_s / 3600.0
        result.extra = dict(result.extra or {})
        result.extra.update(submission_id=used, attached=attached, job_status=outcome.status,
                            job_message=outcome.message, pending_s=outcome.pending_s, ray_address=self.jobs.address,
                            trial_kind=self.payload.kind)
        if result.tokens_per_s_per_gpu is not None and not math.isfinite(result.tokens_per_s_per_gpu):
            result.tokens_per_s_per_gpu = None
        return result

    def attune_root(self) -> str:
        """The attune checkout the job imports: the cluster file's paths.attune, else this one (a local head)."""
        if self.cluster_cfg and self.cluster_cfg.paths.attune:
            return self.cluster_cfg.paths.attune
        return str(Path(__file__).resolve().parents[2])


# ------------------------------------------------------------------------------------------- the torch trainer
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


# attune tune defaults follow the torch trainer's (3 trials, 24 proposals); the job needs the cluster file
RAY_TORCH_CAPABILITIES = replace(TORCH_CAPABILITIES, needs_cluster_file=True)


class TorchJobPayload(RayPayload):
    """attune's torch trainer as the job: ``python -m attune.runners.ray.torch_job`` (torchrun on the node)."""

    kind = "torch"
    runner_name = "ray-torch"
    capabilities = RAY_TORCH_CAPABILITIES

    def check(self, runner: RayRunner, spec: TrialSpec) -> list[str]:
        return torch_check(spec, runner.name, self.capabilities)

    def job(self, runner: RayRunner, spec: TrialSpec, sid: str, trial_dir: Path) -> RayJob:
        encoded = torch_job.encode_trial(spec, timeout_s=None)  # the job's own timeout is enforced by Ray
        literal = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(runner.cluster_cfg.env if runner.cluster_cfg else {})}
        root = check_ray_literal(str(runner.attune_root()), "attune's directory")
        env = ray_env_vars(literal, {"PYTHONPATH": f"{root}:${{PYTHONPATH}}"}, source="cluster file env")
        return RayJob(entrypoint=torch_job.entrypoint(encoded, runner.python), runtime_env={"env_vars": env})

    def parse(self, outcome: JobOutcome, spec: TrialSpec) -> TrialResult:
        return torch_job_result(outcome, spec)

    def rerun(self, spec: TrialSpec) -> Rerun:
        return torch_rerun(spec)


class RayTorchRunner(RayRunner):
    """The torch trainer as a Ray job (registry name ``ray-torch``): ``RayRunner(TorchJobPayload(), ...)``."""

    name = TorchJobPayload.runner_name
    capabilities = RAY_TORCH_CAPABILITIES

    def __init__(self, cluster_file: str | Path | None = None, **options):
        super().__init__(TorchJobPayload(), cluster_file=cluster_file, **options)
