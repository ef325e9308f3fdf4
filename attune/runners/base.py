"""The runner contract: what a study, ``attune run`` and ``attune verify`` may rely on from any runner.

A runner takes a :class:`TrialSpec` (one layout of one model on one cluster with one workload) and returns a
:class:`TrialResult`. The concrete runners (``sim``, ``torch``, ``slime``, ``ray-torch``) are named only in
:mod:`attune.runners.registry`; callers read a runner's :class:`Capabilities` instead of comparing names.

Step-time statistics (mean, tokens/s/GPU, coefficient of variation) have one definition,
:func:`step_time_stats`, used by every runner and by the slime log parser.
"""

from __future__ import annotations

import abc
import json
import logging
import math
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Sequence

from attune.errors import LayoutError, RunnerError
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec

__all__ = ["OK", "OOM", "FAILED", "TIMEOUT", "STATUSES", "Status", "TrialSpec", "TrialResult", "StepStats",
           "step_time_stats", "Capabilities", "Rerun", "Runner", "RunnerError", "UnsupportedLayout", "RESULT_FILE",
           "LOG_FILE", "LOG_TAIL_CHARS"]

log = logging.getLogger(__name__)

Status = Literal["ok", "oom", "failed", "timeout"]
OK, OOM, FAILED, TIMEOUT = "ok", "oom", "failed", "timeout"
STATUSES: tuple[str, ...] = (OK, OOM, FAILED, TIMEOUT)
# Files every measured runner writes into its trial directory.
RESULT_FILE = "result.json"
LOG_FILE = "log.txt"
# Characters of a trial's log kept in a failed result's log_tail (about the last 50 lines of a traceback).
LOG_TAIL_CHARS = 4000


class UnsupportedLayout(LayoutError):
    """``Runner.run`` was given a spec that ``Runner.check`` refuses (exit code 2: the layout is the input)."""


# ---------------------------------------------------------------------------------------------- records
@dataclass(frozen=True, kw_only=True)
class TrialSpec:
    """Everything that defines one trial; a runner needs nothing else."""

    model: ModelSpec
    """The model architecture to train."""
    cluster: Cluster
    """The GPUs (or CPU workers) the layout is laid out on."""
    layout: Layout
    """The parallel layout under test."""
    workload: Workload
    """Rows, batch, steps, the measurement window and the optimizer hyperparameters."""
    engine: Engine
    """The training engine whose behaviour the trial stands for (slime, megatron, torch)."""
    trial_dir: Path | None = None
    """Folder the runner owns for this trial (log.txt, result.json, runner files); None: a scratch folder, removed when the run returns."""
    timeout_s: float | None = None
    """Wall-clock limit of the trial in seconds, start-up included; past it the whole process tree is
    killed and the result is ``timeout``. None: the runner's default (none for local runs)."""
    label: str = ""
    """Display label of the trial (progress lines, Ray job metadata); never parsed."""
    trial_number: int | None = None
    """The Optuna trial number: makes ``run`` idempotent and names the Ray submission. None outside a study."""
    data_path: str | None = None
    """Packed rows (parquet); None: rows generated from ``workload.seed``."""
    memory_limit_gib: float | None = None
    """Host memory cap per CPU worker in GiB (torch runner on CPU); None: no cap."""

    def __post_init__(self) -> None:
        if self.trial_number is not None and (isinstance(self.trial_number, bool)
                                              or not isinstance(self.trial_number, int) or self.trial_number < 0):
            raise LayoutError(f"trial_number must be an integer >= 0 or None (got {self.trial_number!r})")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise LayoutError(f"timeout_s must be a positive number of seconds (got {self.timeout_s!r})")


@dataclass(kw_only=True)
class TrialResult:
    """What one trial measured (or, for the sim runner, predicted)."""

    status: Status
    """ok | oom | failed | timeout."""
    measured: bool
    """True for real runs, False for the sim runner's predictions."""
    tokens_per_s_per_gpu: float | None = None
    """Window tokens / window time / GPUs (see :func:`step_time_stats`)."""
    step_time_s: float | None = None
    """Mean step time over the window, s."""
    step_time_cv_percent: float | None = None
    """Sample standard deviation / mean of the window's step times, % (None with fewer than 2 steps)."""
    step_times_s: list[float] = field(default_factory=list)
    """Every step's time in s, step 0 first."""
    losses: dict[int, float] = field(default_factory=dict)
    """Step -> training loss."""
    peak_memory_gib: list[float] = field(default_factory=list)
    """Peak memory per pipeline stage (max over its ranks), GiB."""
    window: tuple[int, int] | None = None
    """The measured steps, 0-based and inclusive."""
    window_tokens: int | None = None
    """Tokens trained over the window."""
    gpu_hours: float = 0.0
    """GPUs x wall time of the trial, start-up included, hours."""
    wall_s: float = 0.0
    """Wall time of the trial, s."""
    reason: str = ""
    """Why it failed, ran out of memory or timed out (the overflowing stage, the limit)."""
    oom_stage: int | None = None
    """The pipeline stage that ran out of memory."""
    log_tail: str = ""
    """The end of the trial's log, for failures."""
    trial_number: int | None = None
    """The trial number of the spec that produced this result (``TrialSpec.trial_number``)."""
    extra: dict = field(default_factory=dict)
    """Runner-specific details (per-rank records, Ray submission id, job status)."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"TrialResult.status {self.status!r}; allowed: {', '.join(STATUSES)}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["losses"] = {str(k): v for k, v in self.losses.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrialResult":
        d = dict(d)
        d["losses"] = {int(k): v for k, v in (d.get("losses") or {}).items()}
        if d.get("window") is not None:
            d["window"] = tuple(d["window"])
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2, default=_json_default))


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


# ---------------------------------------------------------------------------------------------- statistics
@dataclass(frozen=True, kw_only=True)
class StepStats:
    """Step-time statistics of a measurement window."""

    steps: int
    """Number of step times the statistics are over."""
    total_s: float
    """Sum of the step times, s."""
    mean_s: float
    """Mean step time, s."""
    cv_percent: float | None
    """Coefficient of variation: SAMPLE standard deviation (n - 1) / mean x 100, %; None with fewer than 2
    steps or a non-positive mean."""
    tokens_per_s_per_gpu: float | None
    """tokens / total_s / gpus; None when tokens or gpus were not given."""


def step_time_stats(step_times_s: Sequence[float], *, tokens: int | None = None,
                    gpus: int | None = None) -> StepStats:
    """The one definition of a window's step-time statistics (every runner and the slime log parser use it).

    step_times_s: the window's step times in s (at least one). tokens: tokens trained over exactly these
    steps. gpus: GPUs (or CPU workers) the tokens were trained on. The CV is the sample standard deviation
    (``statistics.stdev``, n - 1 in the denominator) over the mean, in percent: the step times are a sample
    of the layout's step-time distribution, and slime's logs are read the same way.
    """
    times = [float(t) for t in step_times_s]
    if not times:
        raise ValueError("step_time_stats needs at least one step time (got none)")
    total = math.fsum(times)
    mean = total / len(times)
    cv = 100.0 * statistics.stdev(times) / mean if len(times) >= 2 and mean > 0 else None
    tps = None
    if tokens is not None and gpus:
        tps = tokens / total / gpus if total > 0 else None
    return StepStats(steps=len(times), total_s=total, mean_s=mean, cv_percent=cv, tokens_per_s_per_gpu=tps)


# ---------------------------------------------------------------------------------------------- capabilities
@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a runner can run and how a caller should set it up; callers read this, never the runner's name."""

    measured: bool
    """Whether results are real measurements (recipes ``measured``, verifiable) or predictions."""
    engine: str | None = None
    """Engine every trial of this runner stands for (``attune.spec.engine``); None: the caller's choice."""
    max_tp: int | None = None
    """Largest tensor-parallel size it runs; None: no runner limit."""
    max_cp: int | None = None
    """Largest context-parallel size; None: no runner limit."""
    max_vpp: int | None = None
    """Largest virtual-pipeline size; None: no runner limit."""
    max_ep: int | None = None
    """Largest expert-parallel size; None: no runner limit."""
    default_workload: Workload | None = None
    """The workload its trials use unless told otherwise; None: ``Workload()`` (slime's seed workload)."""
    default_search_space: str | None = None
    """Bundled search space (name under ``search_spaces/``) suited to it; None: the study's default."""
    default_trials: int = 20
    """Measured trials of a study when ``--trials`` is not given (a trial's cost sets it)."""
    default_candidates: int = 32
    """Proposals estimated per measured trial when ``--candidates`` is not given."""
    needs_measurements: bool = False
    """Whether it must be built with ``measurements=`` (a table of measured outcomes: the replay runner)."""
    verifiable: bool = True
    """Whether ``attune verify`` can run its arms on it (a replayed table cannot train anything)."""
    needs_cluster_file: bool = False
    """Whether it must be built with ``cluster_file=`` (``--cluster``, docs/cluster.md)."""
    passes_unknown_flags: bool = False
    """Whether Megatron/slime flags that are not layout or workload flags reach the trainer unchanged."""
    limits_note: str = ""
    """What it does support, appended to a refusal (e.g. "PP, DP and recompute only")."""

    def limit_reasons(self, layout: Layout, runner: str) -> list[str]:
        """The one-line refusal of ``layout`` by these limits ([] when within them)."""
        over = [f"{n} {v}" for n, v, cap in (("TP", layout.tp, self.max_tp), ("CP", layout.cp, self.max_cp),
                                            ("VPP", layout.vpp, self.max_vpp), ("EP", layout.ep, self.max_ep))
                if cap is not None and v > cap]
        if not over:
            return []
        allowed = ", ".join(f"{n} <= {cap}" for n, cap in (("TP", self.max_tp), ("CP", self.max_cp),
                                                            ("VPP", self.max_vpp), ("EP", self.max_ep)) if cap is not None)
        note = f"{self.limits_note}; " if self.limits_note else ""
        return [f"{', '.join(over)} not supported by the {runner} runner ({note}allowed: {allowed})"]

    def baseline_limits(self) -> dict[str, int | None]:
        """Keyword arguments for ``attune.spec.baselines.baseline_layout`` (TP and CP capped to these limits)."""
        return {"max_tp": self.max_tp, "max_cp": self.max_cp}


@dataclass(frozen=True, kw_only=True)
class Rerun:
    """How a recipe reruns a layout the way this runner measured (or, for a prediction, would run) it."""

    command: str
    """The recipe's ``run`` block: a shell command (or script), ending with a newline."""
    env: dict[str, str] = field(default_factory=dict)
    """The recipe's ``env`` block: environment of the training processes (shell words)."""
    stack: dict[str, str] = field(default_factory=dict)
    """Lines of the recipe's ``stack`` block the command was written for (e.g. slime's and Megatron-LM's commits)."""


# ---------------------------------------------------------------------------------------------- runner
class Runner(abc.ABC):
    """Where and how one trial runs.

    Every runner keeps this contract; callers rely on nothing else.

    ``name``
        The registry name (``attune.runners.registry``); for display and records only: callers never
        branch on it.

    ``capabilities``
        A :class:`Capabilities` record, available on the class (before construction) and on instances.

    ``check(spec) -> list[str]``
        The reasons this runner cannot run ``spec``: one line each, naming what is wrong and what is
        allowed; ``[]`` when it can. It starts nothing, writes nothing and is cheap: a study calls it
        before every trial, ``attune verify`` before each arm.

    ``run(spec) -> TrialResult``
        Runs the trial to its end and returns its result.

        * It never raises for the trial's own failure: running out of memory, a crash of the trainer, a
          hang past ``spec.timeout_s`` each give a result with status ``oom`` / ``failed`` / ``timeout``,
          the reason in one line and the end of the log.
        * It raises :class:`UnsupportedLayout` (exit code 2) when ``check(spec)`` is not empty: call
          ``check`` first. It raises :class:`attune.errors.RunnerError` only when the runner itself cannot
          work (its cluster is unreachable, its own output unreadable) and
          :class:`attune.errors.MissingDependency` when an optional extra is missing. On
          ``KeyboardInterrupt`` everything it started is stopped before the interrupt propagates.
        * It owns ``spec.trial_dir`` (when None, a scratch folder that ``run`` removes when it returns): it creates the folder and writes
          ``log.txt`` and ``result.json`` there, plus its own files; callers only read them.
        * Past ``spec.timeout_s`` it kills the trial's whole process tree (or stops its Ray job, which does
          the same on the node), so a timed-out trial leaves nothing running.
        * It is idempotent per trial number: when ``spec.trial_number`` is set and ``result.json`` in the
          trial folder holds a finished result of that trial number, that result is returned and nothing
          runs again. A spec without a trial number always runs.

    ``rerun_command(spec) -> Rerun``
        The command (with its environment and the stack versions it was written for) that reruns ``spec``'s
        layout the way this runner measured it: a recipe's ``run`` block. It starts nothing.

    Subclasses implement ``capabilities`` (a class attribute), ``check``, ``_execute`` and ``rerun_command``;
    ``run`` is the template that enforces the contract around ``_execute``.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    @property
    def measured(self) -> bool:
        """Whether results are real measurements (``capabilities.measured``)."""
        return self.capabilities.measured

    def preflight(self, model: ModelSpec, cluster: Cluster) -> None:  # noqa: B027 (a default: nothing to check)
        """Check, once before a study's first trial, that the runner's machines hold what its trials need;
        raise a one-line :class:`attune.errors.RunnerError` naming what is missing. Default: nothing to check."""

    @abc.abstractmethod
    def check(self, spec: TrialSpec) -> list[str]:
        """Reasons this runner cannot run ``spec`` (one line each), [] when it can; starts nothing."""

    @abc.abstractmethod
    def rerun_command(self, spec: TrialSpec) -> Rerun:
        """The recipe's run block for ``spec``'s layout (see the class docstring); starts nothing."""

    @abc.abstractmethod
    def _execute(self, spec: TrialSpec, trial_dir: Path) -> TrialResult:
        """Run the trial in ``trial_dir`` (created) and return its result; ``run`` saves it."""

    def run(self, spec: TrialSpec) -> TrialResult:
        """Run one trial under the contract in the class docstring."""
        reasons = self.check(spec)
        if reasons:
            raise UnsupportedLayout(f"layout {spec.layout.label()}: {reasons[0]}")
        if spec.trial_dir is None:  # nobody keeps this trial's files: a scratch folder, removed after the run
            with tempfile.TemporaryDirectory(prefix=f"attune-{self.name}-") as scratch:
                return self._run_in(spec, Path(scratch))
        return self._run_in(spec, Path(spec.trial_dir))

    def _run_in(self, spec: TrialSpec, trial_dir: Path) -> TrialResult:
        """``run`` in ``trial_dir``: a finished result there is reused, else the trial runs and its result is saved."""
        trial_dir.mkdir(parents=True, exist_ok=True)
        done = self.finished_result(spec, trial_dir)
        if done is not None:
            log.info("trial %s: finished result in %s reused", spec.trial_number, trial_dir)
            return done
        result = self._execute(spec, trial_dir)
        result.trial_number = spec.trial_number
        result.save(trial_dir / RESULT_FILE)
        return result

    @staticmethod
    def finished_result(spec: TrialSpec, trial_dir: Path) -> TrialResult | None:
        """The finished result of ``spec.trial_number`` already in ``trial_dir``, or None."""
        if spec.trial_number is None:
            return None
        p = trial_dir / RESULT_FILE
        try:
            prior = TrialResult.from_dict(json.loads(p.read_text()))
        except (OSError, ValueError, TypeError):
            return None
        return prior if prior.trial_number == spec.trial_number else None
