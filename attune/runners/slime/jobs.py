"""A thin wrapper around Ray's Jobs API (``ray.job_submission.JobSubmissionClient``) for attune trials.

* One trial = one Ray job. The job asks for one unit of a custom per-node resource (``attune_trial_slot`` by
  default, advertised once per node with ``ray start --resources '{"attune_trial_slot": 1}'``) through
  ``entrypoint_resources``, so Ray admits one trial per node at a time. It asks for no GPUs: slime's own
  placement group reserves the GPUs its actors need, and ``entrypoint_num_gpus`` would take one of them.
* Submission ids are deterministic (study, trial number, layout), so a tuner that restarts attaches to a job
  that is still running or already succeeded instead of starting it twice; a failed or stopped job is
  resubmitted as ``<id>-retryN``.
* ``wait`` polls the job status, streams the new part of the job log to a callback (the trial's log file),
  stops the job when the trial's timeout passes or the tuner is interrupted, and returns the final status and
  the full log.

ray is imported lazily; without it every entry point raises a one-line RunnerError.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable

from ..base import RunnerError

__all__ = ["JobOutcome", "RayJobs", "submission_id", "import_ray_jobs", "RAY_EXTRA_HINT",
           "ACTIVE", "TERMINAL", "TIMEOUT_STATUS"]

RAY_EXTRA_HINT = "the slime runner needs the optional extra: pip install 'attune[ray]'"
# Ray JobStatus values (ray.job_submission.JobStatus).
PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED = "PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED"
ACTIVE = (PENDING, RUNNING)
TERMINAL = (STOPPED, SUCCEEDED, FAILED)
ATTACHABLE = (PENDING, RUNNING, SUCCEEDED)
# attune's own final status for a job it stopped because the trial ran past its timeout.
TIMEOUT_STATUS = "TIMEOUT"
# Most resubmissions of one trial id (-retry1 .. -retryN) before giving up.
MAX_RETRIES = 20
# Ray job ids: keep to characters that are safe in paths and URLs.
_ID_SAFE_RE = re.compile(r"[^A-Za-z0-9_-]+")
_RETRY_RE = re.compile(r"^(?P<base>.*)-retry(?P<n>\d+)$")


def import_ray_jobs():
    """The ray.job_submission module, or a one-line RunnerError naming the extra to install."""
    try:
        from ray import job_submission  # noqa: PLC0415 - optional dependency, imported only when used
    except ImportError:
        raise RunnerError(RAY_EXTRA_HINT) from None
    return job_submission


def submission_id(study: str, trial_number: int, layout_slug: str) -> str:
    """Deterministic Ray submission id of a trial: attune-<study>-t<NNNN>-<layout>."""
    if isinstance(trial_number, bool) or not isinstance(trial_number, int) or trial_number < 0:
        raise ValueError(f"trial number must be an integer >= 0 (got {trial_number!r})")
    parts = [_ID_SAFE_RE.sub("-", p).strip("-") for p in (study, layout_slug)]
    if not parts[0]:
        raise ValueError(f"study name {study!r} has no usable characters; allowed: letters, digits, _ -")
    sid = f"attune-{parts[0]}-t{trial_number:04d}" + (f"-{parts[1]}" if parts[1] else "")
    return sid[:200]


def _status_name(status) -> str:
    return str(getattr(status, "value", status)).upper()


@dataclass
class JobOutcome:
    submission_id: str
    status: str  # SUCCEEDED | FAILED | STOPPED | TIMEOUT
    log: str
    attached: bool  # True when an existing job was attached to instead of submitting
    wall_s: float  # submission (Ray's job start_time) to finish, s
    pending_s: float = 0.0  # submission to first seen past PENDING, s (a free trial slot + runtime env setup)
    message: str = ""  # Ray's status message (e.g. the entrypoint's exit code)
    timed_out: bool = False
    interrupted: bool = False


class RayJobs:
    """Submit, attach to, follow and stop attune trial jobs on one Ray cluster."""

    def __init__(self, address: str, client=None):
        """address: the Ray dashboard, http://HEAD:8265. client: an existing JobSubmissionClient (tests)."""
        if client is None:
            js = import_ray_jobs()
            try:
                client = js.JobSubmissionClient(address)
            except Exception as e:  # connection refused, bad URL: Ray raises ConnectionError / ValueError
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise RunnerError(f"cannot reach the Ray dashboard at {address}: {first}") from None
        self.address = address
        self.client = client

    # -------------------------------------------------------------- status
    def status(self, sid: str) -> str | None:
        """The job's status name, or None when no job has this id."""
        try:
            return _status_name(self.client.get_job_status(sid))
        except RuntimeError as e:  # Ray: "Request failed with status code 404: Job ... does not exist."
            if "404" in str(e) or "does not exist" in str(e):
                return None
            raise

    def _info_times(self, sid: str) -> tuple[float | None, float | None, str]:
        try:
            info = self.client.get_job_info(sid)
        except Exception:  # noqa: BLE001 - timing is best effort
            return None, None, ""
        st, en = getattr(info, "start_time", None), getattr(info, "end_time", None)
        return (st / 1000.0 if st else None), (en / 1000.0 if en else None), getattr(info, "message", "") or ""

    def latest_attempt(self, sid: str) -> tuple[str, str | None, int]:
        """(id, status, retry number) of the newest existing attempt of `sid` (status None: none exists)."""
        status = self.status(sid)
        if status is None:
            return sid, None, 0
        last, last_status, n = sid, status, 0
        for k in range(1, MAX_RETRIES + 1):
            s = self.status(f"{sid}-retry{k}")
            if s is None:
                break
            last, last_status, n = f"{sid}-retry{k}", s, k
        return last, last_status, n

    # -------------------------------------------------------------- submit
    def submit(self, entrypoint: str, runtime_env: dict | None, sid: str,
               resources: dict[str, float] | None = None, metadata: dict[str, str] | None = None) -> tuple[str, bool]:
        """Submit the job as `sid`, or attach to it: returns (id used, attached).

        An existing job with this id that is PENDING/RUNNING/SUCCEEDED is attached to; one that FAILED or was
        STOPPED is resubmitted as `<sid>-retryN`. resources: custom Ray resources the entrypoint needs (the
        per-node trial slot), passed as entrypoint_resources.
        """
        last, status, n = self.latest_attempt(sid)
        if status in ATTACHABLE:
            return last, True
        if status is not None:
            if n >= MAX_RETRIES:
                raise RunnerError(f"job {sid} failed {n + 1} times; not resubmitting (limit {MAX_RETRIES} retries)")
            sid = f"{sid}-retry{n + 1}"
        kw: dict = {"entrypoint": entrypoint, "submission_id": sid, "runtime_env": runtime_env or {}}
        if resources:
            kw["entrypoint_resources"] = dict(resources)
        if metadata:
            kw["metadata"] = {str(k): str(v) for k, v in metadata.items()}
        try:
            got = self.client.submit_job(**kw)
        except RuntimeError as e:
            # a concurrent submitter won the race for this id: attach to its job
            if "already exists" in str(e) and self.status(sid) in ATTACHABLE:
                return sid, True
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RunnerError(f"Ray job submission {sid} failed: {first}") from None
        return got, False

    # -------------------------------------------------------------- stop
    def stop(self, sid: str, grace_s: float = 60.0, poll_s: float = 1.0) -> str | None:
        """Ask Ray to stop the job and wait up to grace_s for it to end; returns its last status."""
        try:
            self.client.stop_job(sid)
        except Exception:  # noqa: BLE001 - already finished or gone: nothing to stop
            pass
        deadline = time.monotonic() + grace_s
        status = self.status(sid)
        while status in ACTIVE and time.monotonic() < deadline:
            time.sleep(poll_s)
            status = self.status(sid)
        return status

    # -------------------------------------------------------------- wait
    def logs(self, sid: str) -> str:
        try:
            return self.client.get_job_logs(sid) or ""
        except Exception:  # noqa: BLE001 - logs not available yet (job still pending)
            return ""

    def wait(self, sid: str, timeout_s: float | None = None, poll_s: float = 10.0,
             on_log: Callable[[str], None] | None = None, stop_grace_s: float = 60.0,
             attached: bool = False) -> JobOutcome:
        """Follow the job to its end: poll its status every poll_s, hand each new piece of its log to on_log.

        Past timeout_s (counted from the job's submission, as Ray recorded it) the job is stopped and the
        outcome is TIMEOUT. On KeyboardInterrupt the job is stopped before the interrupt propagates, so an
        interrupted tuner leaves nothing running.
        """
        t_local0 = time.time()
        start, _, _ = self._info_times(sid)
        start = start or t_local0
        sent = 0
        log = ""
        admitted: float | None = None  # when a job seen PENDING was first seen past it
        seen_pending = False

        def pump() -> None:
            nonlocal sent, log
            text = self.logs(sid)
            if len(text) >= sent:
                log = text
                if on_log is not None and len(text) > sent:
                    on_log(text[sent:])
                sent = len(text)

        timed_out = False
        try:
            while True:
                status = self.status(sid)
                seen_pending = seen_pending or status == PENDING
                if admitted is None and seen_pending and status != PENDING:
                    admitted = time.time()
                pump()
                if status in TERMINAL or status is None:
                    break
                if timeout_s is not None and time.time() - start > timeout_s:
                    timed_out = True
                    status = self.stop(sid, grace_s=stop_grace_s, poll_s=min(poll_s, 1.0))
                    pump()
                    break
                time.sleep(poll_s)
        except KeyboardInterrupt:
            self.stop(sid, grace_s=stop_grace_s, poll_s=1.0)
            raise
        st, en, msg = self._info_times(sid)
        end = en or time.time()
        submitted = st or start
        # PENDING covers waiting for a trial slot and the runtime env setup; Ray does not tell them apart
        pending = (admitted - submitted) if admitted is not None else 0.0
        final = TIMEOUT_STATUS if timed_out else (status or "UNKNOWN")
        return JobOutcome(submission_id=sid, status=final, log=log, attached=attached,
                          wall_s=max(0.0, end - submitted), pending_s=max(0.0, pending), message=msg,
                          timed_out=timed_out)
