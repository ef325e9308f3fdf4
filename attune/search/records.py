"""What the study stores per trial, as one typed record.

Every trial of an attune study carries a `TrialRecord` in its Optuna user attributes. `TrialRecord.to_user_attrs`
and `TrialRecord.from_trial` are the ONE place that knows the attribute names: the tuner, resume, the report,
`trials.csv` and the recipe builder all read trials through `from_trial`. The attribute names are the ones
earlier versions wrote, so older studies resume.

A trial is either a *proposal* (a TPE proposal that was only estimated: `kind` says what became of it) or a
*measured* trial (`role` baseline or candidate: it ran on the runner; `outcome` says how it ended).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import optuna

from attune.estimator import Estimate
from attune.runners.base import OK, OOM
from attune.spec.layout import Layout

ROLE_BASELINE, ROLE_CANDIDATE = "baseline", "candidate"
ROLES = (ROLE_BASELINE, ROLE_CANDIDATE)
KIND_INVALID, KIND_OOM, KIND_RULE, KIND_DUP, KIND_SLOW, KIND_EST = (
    "invalid", "oom-predicted", "oom-monotone-rule", "duplicate", "skipped-slow", "estimated")
# a trial created to measure a layout whose worker lost the claim to another worker (attune.search.coordination)
KIND_LOST = "claim-lost"
KINDS = (KIND_INVALID, KIND_OOM, KIND_RULE, KIND_DUP, KIND_SLOW, KIND_EST, KIND_LOST)
# the reason of a trial a killed tuner left RUNNING and resume failed (nothing else records one)
INTERRUPTED = "interrupted: the tuner was killed"
# characters of a reason / log tail kept in the study (SQLite and journal rows stay small)
REASON_CHARS, LOG_TAIL_CHARS = 2000, 2000
# what to_user_attrs never writes: read from the FrozenTrial itself
_FROM_TRIAL = ("number", "state", "value")


@dataclass(kw_only=True)
class TrialRecord:
    """One trial of an attune study: its layout, what the model predicted, and (when it ran) what was measured."""

    number: int | None = None
    """Optuna trial number (read from the trial, not stored as an attribute)."""
    state: str | None = None
    """Optuna trial state name: COMPLETE, PRUNED, FAIL, RUNNING (read from the trial)."""
    value: float | None = None
    """The trial's objective: measured (or, for proposals, predicted) tokens/s/GPU (read from the trial)."""

    role: str | None = None
    """`baseline` or `candidate` for a trial that ran on the runner; None for a proposal."""
    kind: str | None = None
    """What became of a proposal: invalid, oom-predicted, oom-monotone-rule, duplicate, skipped-slow, estimated."""
    runner: str | None = None
    """Name of the runner that measured the trial (measured trials only)."""
    host: str | None = None
    """Host name of the tuner process that asked for the trial (provenance)."""
    pid: int | None = None
    """Process id of the tuner process that asked for the trial (provenance)."""
    claim: str | None = None
    """The layout key a measured trial claimed so no other worker measures it at the same time ('' once
    withdrawn; attune.search.coordination)."""
    retry_of: int | None = None
    """Number of the trial this one re-measures (a measured trial whose worker was killed or interrupted)."""

    layout: dict | None = None
    """The layout, as `Layout.to_dict()`."""
    label: str | None = None
    """The layout's one-line label, e.g. `TP1 PP4 16/14 DP2 Rb12 mt8192`."""
    predicted_tokens_per_s_per_gpu: float | None = None
    """Predicted throughput, tokens per second per GPU."""
    predicted_step_time_s: float | None = None
    """Predicted step time, seconds."""
    predicted_mfu: float | None = None
    """Predicted model FLOPs utilization, a fraction of the dense BF16 peak."""
    predicted_peak_gib: float | None = None
    """Predicted peak memory of the fullest pipeline stage, GiB per GPU."""
    predicted_peak_stage: int | None = None
    """Pipeline stage of the predicted peak."""
    predicted_stage_gib: list[float] | None = None
    """Predicted peak memory per pipeline stage, GiB per GPU, stage 0 first."""
    predicted_shipped_tokens_per_s_per_gpu: float | None = None
    """Predicted throughput with the shipped coefficients (before the study's recalibration), tokens/s/GPU."""
    predicted_model_tokens_per_s_per_gpu: float | None = None
    """The sampler's posterior mean when it proposed the layout (recalibrated model plus the residual GP),
    tokens/s/GPU."""
    predicted_spread_percent: float | None = None
    """The sampler's spread (posterior standard deviation of log throughput) when it proposed it, percent."""

    outcome: str | None = None
    """How the run ended (measured trials): ok, oom, failed, timeout."""
    measured: bool | None = None
    """True when the runner really ran the layout, False for the sim runner's predictions."""
    gpu_hours: float | None = None
    """GPUs x wall time of the run including start-up, GPU-hours."""
    reason: str | None = None
    """Why a proposal was pruned or a run failed (one line, at most REASON_CHARS characters)."""
    log_tail: str | None = None
    """The end of a failed run's log (at most LOG_TAIL_CHARS characters)."""
    measured_peak_gib: list[float] | None = None
    """Measured peak memory per pipeline stage (max over its ranks), GiB per GPU."""
    tokens_per_s_per_gpu: float | None = None
    """Measured throughput over the window, tokens per second per GPU."""
    step_time_s: float | None = None
    """Mean measured step time over the window, seconds."""
    step_time_cv_percent: float | None = None
    """Coefficient of variation of the step time over the window, percent."""
    window: list[int] | None = None
    """First and last step (inclusive) of the measurement window."""
    window_tokens: int | None = None
    """Tokens trained in the window."""
    losses: dict[str, float] | None = None
    """Loss per step (keys are step numbers as strings: Optuna stores JSON)."""
    extra: dict | None = None
    """Runner-specific numbers (e.g. the sim runner's MFU and USD per million tokens)."""
    oom_stage: int | None = None
    """Pipeline stage that ran out of memory for real (outcome oom)."""

    def __post_init__(self) -> None:
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"TrialRecord.role {self.role!r}: allowed {', '.join(ROLES)}")
        if self.kind is not None and self.kind not in KINDS:
            raise ValueError(f"TrialRecord.kind {self.kind!r}: allowed {', '.join(KINDS)}")

    # ------------------------------------------------------------------ Optuna attributes
    def to_user_attrs(self) -> dict[str, Any]:
        """The Optuna user attributes of this record (None fields are left out)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _FROM_TRIAL or v is None:
                continue
            out[f.name] = v
        return out

    def save(self, trial: optuna.Trial) -> None:
        """Write every set field to a live trial's user attributes."""
        for k, v in self.to_user_attrs().items():
            trial.set_user_attr(k, v)

    @classmethod
    def from_trial(cls, trial: optuna.trial.FrozenTrial) -> "TrialRecord":
        """The record of a trial (unknown attributes are ignored, missing ones are None). A trial that failed
        without an outcome was left RUNNING by a killed tuner: its reason says so."""
        a = trial.user_attrs
        kw = {f.name: a.get(f.name) for f in fields(cls) if f.name not in _FROM_TRIAL}
        if kw.get("role") not in ROLES:
            kw["role"] = None
        if kw.get("kind") not in KINDS:
            kw["kind"] = None
        if trial.state == optuna.trial.TrialState.FAIL and not kw.get("outcome") and not kw.get("reason"):
            kw["reason"] = INTERRUPTED
        return cls(number=trial.number, state=trial.state.name, value=trial.value, **kw)

    # ------------------------------------------------------------------ filling in
    def set_estimate(self, est: Estimate) -> None:
        """Record the layout and what the model predicts for it (rounded as the study stores it)."""
        self.layout = est.layout.to_dict()
        self.label = est.layout.label()
        self.predicted_tokens_per_s_per_gpu = round(est.perf.tokens_per_s_per_gpu, 3)
        self.predicted_step_time_s = round(est.perf.step_time_s, 4)
        self.predicted_mfu = round(est.perf.mfu, 5)
        self.predicted_peak_gib = round(est.memory.peak_gib, 3)
        self.predicted_peak_stage = est.memory.peak_stage
        self.predicted_stage_gib = [round(s.total_gib, 3) for s in est.memory.stages]

    # ------------------------------------------------------------------ derived
    @property
    def is_measured(self) -> bool:
        """The trial ran on the runner (baseline or candidate), as opposed to a proposal."""
        return self.role is not None

    @property
    def completed(self) -> bool:
        return self.state == optuna.trial.TrialState.COMPLETE.name

    def to_layout(self) -> Layout:
        """The trial's Layout (a record without a layout raises KeyError)."""
        if self.layout is None:
            raise KeyError(f"trial {self.number} has no layout")
        return Layout(**self.layout)

    @property
    def measured_peak_max_gib(self) -> float | None:
        """Largest measured per-stage peak, GiB (None when the runner did not measure memory)."""
        return max(self.measured_peak_gib) if self.measured and self.measured_peak_gib else None

    @property
    def measured_throughput(self) -> float | None:
        """Measured tokens/s/GPU of a completed real run (None for the sim runner and for unfinished runs)."""
        return self.value if (self.completed and self.measured) else None

    @property
    def memory_error_percent(self) -> float | None:
        """Predicted against measured peak memory, percent of the measured (2 decimals)."""
        m, p = self.measured_peak_max_gib, self.predicted_peak_gib
        return round(100 * (p - m) / m, 2) if (m and p) else None

    @property
    def throughput_error_percent(self) -> float | None:
        """Predicted against measured throughput, percent of the measured (2 decimals)."""
        m, p = self.measured_throughput, self.predicted_tokens_per_s_per_gpu
        return round(100 * (p - m) / m, 2) if (m and p) else None


def records(study: optuna.Study, states: tuple | None = None) -> list[TrialRecord]:
    """Every trial of the study as a record, in trial order."""
    return [TrialRecord.from_trial(t) for t in study.get_trials(deepcopy=False, states=states)]


@dataclass(kw_only=True)
class StudyCounts:
    """What a study (all its sessions together) estimated, pruned and measured."""

    proposals: int = 0
    """TPE proposals (trials that were not measured)."""
    estimated: int = 0
    """Proposals that were estimated (all but those breaking a layout rule)."""
    invalid: int = 0
    """Proposals breaking a layout rule."""
    oom_predicted: int = 0
    """Proposals predicted to run out of memory."""
    oom_rule: int = 0
    """Proposals ruled out by a real out-of-memory run (monotone rule)."""
    duplicate: int = 0
    """Proposals of an already measured layout."""
    skipped_slow: int = 0
    """Proposals predicted slower than slack x the best measured."""
    lost: int = 0
    """Trials created to measure a layout whose claim another worker won (attune.search.coordination)."""
    estimated_only: int = 0
    """Proposals estimated and not chosen."""
    measured: int = 0
    """Trials run on the runner (baseline included)."""
    measured_ok: int = 0
    """Measured trials that completed."""
    measured_oom: int = 0
    """Measured trials that ran out of memory on the runner."""
    measured_failed: int = 0
    """Measured trials that failed, timed out or were interrupted."""


_KIND_FIELD = {KIND_INVALID: "invalid", KIND_OOM: "oom_predicted", KIND_RULE: "oom_rule", KIND_DUP: "duplicate",
               KIND_SLOW: "skipped_slow", KIND_EST: "estimated_only", KIND_LOST: "lost"}


def study_counts(study: optuna.Study) -> StudyCounts:
    """Counts over the whole study (all sessions): what was estimated, pruned and measured."""
    c = StudyCounts()
    for r in records(study):
        if r.is_measured:
            c.measured += 1
            if r.outcome == OK:
                c.measured_ok += 1
            elif r.outcome == OOM:
                c.measured_oom += 1
            else:
                c.measured_failed += 1
            continue
        c.proposals += 1
        if r.kind in _KIND_FIELD:
            setattr(c, _KIND_FIELD[r.kind], getattr(c, _KIND_FIELD[r.kind]) + 1)
        if r.kind != KIND_INVALID:
            c.estimated += 1
    return c
