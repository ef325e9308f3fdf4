"""A thin wrapper around Ray's Jobs API (``ray.job_submission.JobSubmissionClient``) for attune trials.

* One trial = one Ray job. The job asks for one unit of a custom per-node resource (``attune_trial_slot`` by
  default, advertised once per node with ``ray start --resources '{"attune_trial_slot": 1}'``) through
  ``entrypoint_resources``, so Ray admits one trial per node at a time. It asks for no GPUs: slime's own
  placement group reserves the GPUs its actors need, and ``entrypoint_num_gpus`` would take one of them.
  Because it names a resource, Ray would hide the GPUs from the driver; the job's env_vars carry
  ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` so the driver (where Megatron's validate_args queries the
  GPU) sees the node's GPUs (:func:`driver_sees_gpus`).
* Submission ids are deterministic: the study name and the Optuna trial number (:func:`submission_id`), so a
  tuner that restarts attaches to a job that is still running or already succeeded instead of starting it
  twice; a failed or stopped job is resubmitted as ``<id>-retryN``.
* ``wait`` streams the job log through ``JobSubmissionClient.tail_job_logs`` to a callback (the trial's log
  file) while it checks the job's ``JobStatus``; it stops the job when the trial's timeout passes or the
  tuner is interrupted, and returns the final status and the full log (``get_job_logs``).

ray is imported lazily; without it every entry point raises a one-line MissingDependency.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from attune.errors import MissingDependency, RunnerError

__all__ = ["JobOutcome", "RayJobs", "submission_id", "driver_sees_gpus", "NOSET_CUDA_ENV", "import_ray_jobs", "RAY_EXTRA_HINT", "TIMEOUT_STATUS",
           "MAX_RETRIES"]

log = logging.getLogger(__name__)

RAY_EXTRA_HINT = "the slime runner needs the optional extra: pip install 'attune[ray]'"
# attune's own final status for a job it stopped because the trial ran past its timeout (not a JobStatus).
TIMEOUT_STATUS = "TIMEOUT"
# Most resubmissions of one trial id (-retry1 .. -retryN) before giving up.
MAX_RETRIES = 20
# After the job reached a terminal status, how long the log tail may take to deliver its last lines, s.
TAIL_DRAIN_S = 5.0
# Ray job ids: keep to characters that are safe in paths and URLs; Ray accepts ids up to this length here.
_ID_SAFE_RE = re.compile(r"[^A-Za-z0-9_-]+")
_ID_MAX_CHARS = 200


def import_ray_jobs():
    """The ray.job_submission module, or a one-line MissingDependency naming the extra to install."""
    try:
        from ray import job_submission  # noqa: PLC0415 - optional dependency, imported only when used
    except ImportError:
        raise MissingDependency(RAY_EXTRA_HINT) from None
    return job_submission


# Ray's switch that keeps a worker's CUDA_VISIBLE_DEVICES as the node has it (ray/_private/accelerators/
# nvidia_gpu.py NOSET_CUDA_VISIBLE_DEVICES_ENV_VAR; slime's own actors set it too: slime/ray/utils.py
# NOSET_VISIBLE_DEVICES_ENV_VARS_LIST, actor_group.py _allocate_gpus_for_actor).
NOSET_CUDA_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def driver_sees_gpus(runtime_env: dict | None) -> dict:
    """The job's runtime_env with the driver's GPU visibility protected (a copy; the caller's is not changed).

    Ray (2.60.0, dashboard/modules/job/job_manager.py ``_get_supervisor_runtime_env`` lines 400-406 and
    job_supervisor.py ``_get_driver_runtime_env`` lines 139-147) sets ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``
    for a job's supervisor actor only when the submission names no entrypoint resources. attune's jobs name one
    (the per-node trial slot) and no GPUs, so the supervisor actor, and the driver it starts as a child process,
    are treated as any zero-GPU actor: Ray versions before the zero-accelerator change, and 2.60.0 with
    ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1`` (ray/_private/accelerators/accelerator.py lines 5-13,
    ray/_private/utils.py ``set_visible_accelerator_ids`` lines 284-305), set ``CUDA_VISIBLE_DEVICES=""`` for
    them; ``NvidiaGPUAcceleratorManager.set_current_process_visible_accelerator_ids`` (nvidia_gpu.py lines
    110-117) returns early only under the switch. slime's driver runs Megatron's
    validate_args, which calls ``torch.cuda.get_device_capability()`` under ``--moe-grouped-gemm``
    (Megatron-LM 1dcf0daf megatron/training/arguments.py lines 851-853): with no visible GPU every MoE launch
    would fail there. Setting the switch in the job's env_vars makes Ray leave CUDA_VISIBLE_DEVICES alone for the
    supervisor and driver; slime's GPU actors set the same switch themselves and pick their device by local
    rank, so their placement is unchanged. An explicit value in the runtime_env is kept."""
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    env_vars.setdefault(NOSET_CUDA_ENV, "1")
    env["env_vars"] = env_vars
    return env


def submission_id(study: str, trial_number: int | None, layout_slug: str) -> str:
    """Deterministic Ray submission id of a trial: ``attune-<study>-t<NNNN>-<layout>``.

    trial_number: the Optuna trial number (``TrialSpec.trial_number``); None outside a study (``attune run``,
    verify arms) gives ``attune-<study>-run-<layout>``.
    """
    if trial_number is not None and (isinstance(trial_number, bool) or not isinstance(trial_number, int)
                                     or trial_number < 0):
        raise ValueError(f"trial number must be an integer >= 0 or None (got {trial_number!r})")
    parts = [_ID_SAFE_RE.sub("-", p).strip("-") for p in (study, layout_slug)]
    if not parts[0]:
        raise ValueError(f"study name {study!r} has no usable characters; allowed: letters, digits, _ -")
    number = "run" if trial_number is None else f"t{trial_number:04d}"
    sid = f"attune-{parts[0]}-{number}" + (f"-{parts[1]}" if parts[1] else "")
    return sid[:_ID_MAX_CHARS]


@dataclass(kw_only=True)
class JobOutcome:
    """How one Ray job ended, as ``RayJobs.wait`` saw it."""

    submission_id: str
    """The id of the attempt followed (``<id>`` or ``<id>-retryN``)."""
    status: str
    """A ``JobStatus`` value (SUCCEEDED, FAILED, STOPPED) or TIMEOUT (stopped by attune past its limit)."""
    log: str
    """The whole job log at the end."""
    attached: bool
    """True when an existing job was attached to instead of submitting."""
    wall_s: float
    """Submission (Ray's job start_time) to finish, s."""
    pending_s: float = 0.0
    """Submission to first seen past PENDING, s (waiting for a trial slot and the runtime env setup)."""
    message: str = ""
    """Ray's status message (e.g. the entrypoint's exit code)."""
    timed_out: bool = False
    """Whether attune stopped the job past the trial's timeout."""
    interrupted: bool = False
    """Whether the tuner was interrupted while following it."""


class _LogTail:
    """Streams a job's log through ``JobSubmissionClient.tail_job_logs`` (an async iterator) on a daemon thread
    with its own event loop; the chunks wait in a queue for the following thread. Best effort: when the
    stream breaks, the final ``get_job_logs`` still has the whole log."""

    def __init__(self, client, sid: str):
        self._client, self._sid = client, sid
        self._chunks: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._main, name=f"ray-log-tail-{sid}", daemon=True)
        self._thread.start()

    async def _follow(self) -> None:
        self._task = asyncio.current_task()
        try:
            async for chunk in self._client.tail_job_logs(self._sid):
                self._chunks.put(chunk)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - streaming is best effort (see the class docstring)
            log.debug("log tail of %s ended early: %s", self._sid, e)

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._follow())
        finally:
            self._loop.close()

    def drain(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self._chunks.get_nowait())
            except queue.Empty:
                return out

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def stop(self, timeout_s: float = 1.0) -> None:
        loop, task = self._loop, self._task
        if self._thread.is_alive() and loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop closed in between: the thread is ending
                pass
        self._thread.join(timeout_s)


class RayJobs:
    """Submit, attach to, follow and stop attune trial jobs on one Ray cluster."""

    def __init__(self, address: str, client=None):
        """address: the Ray dashboard, http://HEAD:8265. client: an existing JobSubmissionClient (tests)."""
        js = import_ray_jobs()
        self.JobStatus = js.JobStatus
        if client is None:
            try:
                client = js.JobSubmissionClient(address)
            except Exception as e:  # noqa: BLE001 - connection refused, bad URL: Ray raises ConnectionError / ValueError
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise RunnerError(f"cannot reach the Ray dashboard at {address}: {first}") from None
        self.address = address
        self.client = client

    # -------------------------------------------------------------- status
    def status(self, sid: str):
        """The job's ``JobStatus``, or None when no job has this id."""
        try:
            got = self.client.get_job_status(sid)
        except RuntimeError as e:  # Ray: "Request failed with status code 404: Job ... does not exist."
            if "404" in str(e) or "does not exist" in str(e):
                return None
            raise
        return self.JobStatus(str(getattr(got, "value", got)).upper())

    def _active(self, status) -> bool:
        return status is not None and not status.is_terminal()

    def _info_times(self, sid: str) -> tuple[float | None, float | None, str]:
        try:
            info = self.client.get_job_info(sid)
        except Exception:  # noqa: BLE001 - timing is best effort
            return None, None, ""
        st, en = getattr(info, "start_time", None), getattr(info, "end_time", None)
        return (st / 1000.0 if st else None), (en / 1000.0 if en else None), getattr(info, "message", "") or ""

    def latest_attempt(self, sid: str):
        """(id, JobStatus, retry number) of the newest existing attempt of `sid` (status None: none exists)."""
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

    def _attachable(self, status) -> bool:
        """A live or succeeded job is attached to; a failed or stopped one is resubmitted."""
        return status is not None and status in (self.JobStatus.PENDING, self.JobStatus.RUNNING,
                                                 self.JobStatus.SUCCEEDED)

    # -------------------------------------------------------------- submit
    def submit(self, entrypoint: str, runtime_env: dict | None, sid: str,
               resources: dict[str, float] | None = None, metadata: dict[str, str] | None = None) -> tuple[str, bool]:
        """Submit the job as `sid`, or attach to it: returns (id used, attached).

        An existing job with this id that is PENDING/RUNNING/SUCCEEDED is attached to; one that FAILED or was
        STOPPED is resubmitted as `<sid>-retryN`. resources: custom Ray resources the entrypoint needs (the
        per-node trial slot), passed as entrypoint_resources.
        """
        last, status, n = self.latest_attempt(sid)
        if self._attachable(status):
            return last, True
        if status is not None:
            if n >= MAX_RETRIES:
                raise RunnerError(f"job {sid} failed {n + 1} times; not resubmitting (limit {MAX_RETRIES} retries)")
            sid = f"{sid}-retry{n + 1}"
        kw: dict = {"entrypoint": entrypoint, "submission_id": sid, "runtime_env": runtime_env or {}}
        if resources:
            kw["entrypoint_resources"] = dict(resources)
            kw["runtime_env"] = driver_sees_gpus(kw["runtime_env"])
        if metadata:
            kw["metadata"] = {str(k): str(v) for k, v in metadata.items()}
        try:
            got = self.client.submit_job(**kw)
        except RuntimeError as e:
            # a concurrent submitter won the race for this id: attach to its job
            if "already exists" in str(e) and self._attachable(self.status(sid)):
                return sid, True
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RunnerError(f"Ray job submission {sid} failed: {first}") from None
        return got, False

    # -------------------------------------------------------------- stop
    def stop(self, sid: str, grace_s: float = 60.0, poll_s: float = 1.0):
        """Ask Ray to stop the job and wait up to grace_s s for it to end; returns its last JobStatus."""
        try:
            self.client.stop_job(sid)
        except Exception:  # noqa: BLE001 - already finished or gone: nothing to stop
            pass
        retry = Retrying(stop=stop_after_delay(grace_s), wait=wait_fixed(poll_s), retry=retry_if_result(self._active),
                         retry_error_callback=lambda state: state.outcome.result(), reraise=True)
        return retry(self.status, sid)

    # -------------------------------------------------------------- follow
    def logs(self, sid: str) -> str:
        """The whole job log so far ('' while none is available)."""
        try:
            return self.client.get_job_logs(sid) or ""
        except Exception:  # noqa: BLE001 - logs not available yet (job still pending)
            return ""

    def wait(self, sid: str, timeout_s: float | None = None, poll_s: float = 10.0,
             on_log: Callable[[str], None] | None = None, stop_grace_s: float = 60.0,
             attached: bool = False) -> JobOutcome:
        """Follow the job to its end, handing each new piece of its log to on_log.

        Past timeout_s s (counted from the job's submission, as Ray recorded it) the job is stopped and the
        outcome is TIMEOUT. On KeyboardInterrupt the job is stopped before the interrupt propagates, so an
        interrupted tuner leaves nothing running. The log streams in a helper thread (:class:`_LogTail`); this
        thread checks the status every poll_s s and hands the new chunks on.
        """
        t_local0 = time.time()
        start, _, _ = self._info_times(sid)
        start = start or t_local0
        streamed: list[str] = []
        tail = _LogTail(self.client, sid)

        def pump() -> None:
            for chunk in tail.drain():
                streamed.append(chunk)
                if on_log is not None:
                    on_log(chunk)

        try:
            status, admitted, timed_out = self._follow(sid, tail, pump, start, timeout_s, poll_s)
            tail.stop()
            pump()
            if timed_out:
                status = self.stop(sid, grace_s=stop_grace_s, poll_s=min(poll_s, 1.0))
            text = self._whole_log(sid, "".join(streamed), on_log)
        except KeyboardInterrupt:
            tail.stop()
            self.stop(sid, grace_s=stop_grace_s, poll_s=1.0)
            raise
        st, en, msg = self._info_times(sid)
        end = en or time.time()
        submitted = st or start
        # PENDING covers waiting for a trial slot and the runtime env setup; Ray does not tell them apart
        pending = (admitted - submitted) if admitted is not None else 0.0
        final = TIMEOUT_STATUS if timed_out else (status.value if status is not None else "UNKNOWN")
        return JobOutcome(submission_id=sid, status=final, log=text, attached=attached,
                          wall_s=max(0.0, end - submitted), pending_s=max(0.0, pending), message=msg,
                          timed_out=timed_out)

    def _follow(self, sid: str, tail: _LogTail, pump: Callable[[], None], start: float, timeout_s: float | None,
                poll_s: float) -> tuple[object, float | None, bool]:
        """Check the status every ``poll_s`` s, pumping the log, until the job ends or is past ``timeout_s`` s since
        ``start``: (the last ``JobStatus`` or None, when a job seen PENDING was first seen past it or None, whether it
        timed out)."""
        pending_seen, admitted = False, None
        while True:
            status = self.status(sid)
            pending_seen = pending_seen or status == self.JobStatus.PENDING
            if admitted is None and pending_seen and status != self.JobStatus.PENDING:
                admitted = time.time()
            pump()
            if not self._active(status):
                tail.join(TAIL_DRAIN_S)
                pump()
                return status, admitted, False
            if timeout_s is not None and time.time() - start > timeout_s:
                return status, admitted, True
            tail.join(poll_s) if tail.alive() else time.sleep(poll_s)

    def _whole_log(self, sid: str, sent: str, on_log: Callable[[str], None] | None) -> str:
        """The job's whole log: Ray's, or what was streamed when that is longer; hands on_log what the tail missed."""
        text = self.logs(sid)
        if len(text) < len(sent):
            return sent
        if on_log is not None and len(text) > len(sent) and text.startswith(sent):
            on_log(text[len(sent):])  # what the tail did not deliver
        return text
