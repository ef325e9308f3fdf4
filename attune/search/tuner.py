"""The Optuna study: only measured runs (and the baseline) are trials; the model decides what gets measured.

With the default `model` sampler (attune.search.sampler.ModelGuidedSampler) the whole space is scored once;
per measurement slot the sampler, recalibrated to the study's measurements, proposes the unmeasured layout with
the best expected improvement, which is estimated (the prediction stays on its trial: `predicted_*` fields)
and run on the runner: COMPLETE with the measured tokens/s/GPU, PRUNED+infeasible if it ran out of memory for
real, FAIL if it crashed or hung. The first measured trial is the baseline layout. The session stops at
`trials` completed measured trials, when `budget_gpu_hours` is spent, or by the stop rule (no unmeasured
layout likely to beat the best measured by more than `min_gain`); the outcome says which and the estimated
remaining regret. With `sampler="tpe"` (plain multivariate TPE, for comparison) each TPE proposal that breaks
a rule, is predicted out of memory or was measured already stays a PRUNED trial TPE learns from, and its first
new feasible proposal per slot is measured.
`trials` counts completed measured trials in the study, so rerunning resumes up to it.

Trials a killed tuner left RUNNING are failed when a tuner next opens the study:

* RDB storages (SQLite, PostgreSQL, MySQL URLs) are opened with Optuna's heartbeat
  (`RDBStorage(heartbeat_interval=..., grace_period=...)`). The tuner records a heartbeat for a measured
  trial every `heartbeat_interval_s` while the runner runs it, and `optuna.storages.fail_stale_trials` fails
  measured trials whose heartbeat is older than `grace_period_s`.
* A proposal lives milliseconds between ask and tell and gets no heartbeat; a RUNNING trial without a
  recorded role (a proposal, or a measured trial killed before its first heartbeat, which is recorded before
  its role) older than `grace_period_s` is failed with `study.tell`.
* Journal storages (`*.journal`) have no heartbeat in Optuna 5: only the second rule applies, so a measured
  trial a killed tuner left RUNNING stays RUNNING there (it never counts as measured).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import optuna

from attune.errors import LayoutError, UserInputError
from attune.estimator import Estimate, estimate
from attune.estimator.coefficients import Coefficients, coefficients_for
from attune.runners.base import FAILED, OK, OOM, Runner, TrialResult, TrialSpec
from attune.search.coordination import claim_key, contest, new_measured_trial, pending_retries, slots
from attune.search.options import SAMPLERS, TuneOptions
from attune.search.records import (
    INTERRUPTED,
    KIND_DUP,
    KIND_EST,
    KIND_INVALID,
    KIND_LOST,
    KIND_OOM,
    KIND_RULE,
    KIND_SLOW,
    LOG_TAIL_CHARS,
    REASON_CHARS,
    ROLE_BASELINE,
    ROLE_CANDIDATE,
    StudyCounts,
    TrialRecord,
    records,
)
from attune.search.sampler import ModelGuidedSampler
from attune.search.scoring import score_space
from attune.search.space import SearchSpace, layout_key
from attune.search.storage import BadStorageURL, StorageHandle, StorageUnavailable, mask_url, open_storage
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec

log = logging.getLogger(__name__)

# constraint value of a layout that breaks a rule: worse than any memory overflow (GiB)
INVALID_PENALTY = 1000.0
# TPE proposals before the multivariate sampler starts modelling (Optuna's n_startup_trials)
TPE_STARTUP_TRIALS = 16
# TPE: proposals in a row without a candidate worth measuring before the study stops, counted in proposals (not
# rounds) so a small --candidates does not end a study early in a large space where most proposals do not fit;
# at least 3 rounds
DRY_PROPOSALS = 256
DRY_ROUNDS = 3
# the number of measured attempts (failures included) is capped at this many per requested trial, plus 2
ATTEMPTS_PER_TRIAL = 2


class StudyError(UserInputError):
    """The study cannot be opened: bad storage URL, or the name belongs to a study of another target."""


@dataclass(kw_only=True)
class TuneConfig:
    """Everything one tuning session needs. Built by `attune.api.tune`; the CLI never builds it."""

    model: ModelSpec
    """The model to train."""
    cluster: Cluster
    """The GPUs (or CPU workers) it trains on."""
    engine: Engine
    """The training engine the estimator models (slime, megatron, or the torch runner's)."""
    workload: Workload
    """Rows, batch, steps and measurement window of every measured trial."""
    space: SearchSpace
    """The knobs TPE searches and their domains."""
    runner: Runner
    """Where measured trials run (sim, torch, slime)."""
    baseline: Layout
    """The layout measured first (the model's baseline adapted to the cluster and runner)."""
    baseline_note: str
    """Where the baseline comes from and what was adapted (one sentence for the report)."""
    workload_note: str = ""
    """What was adapted in the default workload for this cluster (one sentence for the report; "" if nothing)."""
    trials: int = 20
    """Target number of completed measured trials in the study (resuming counts earlier sessions)."""
    sampler: str = TuneOptions.sampler
    """Who proposes the next layout: `model` (ModelGuidedSampler: expected improvement under the study's
    recalibrated model) or `tpe` (plain multivariate TPE with the predicted memory as a constraint)."""
    recalibrate: bool = TuneOptions.recalibrate
    """Refit the model to the study's measurements after each measured trial (model sampler)."""
    min_gain: float = TuneOptions.min_gain
    """Stop rule: a candidate must beat the best measured by more than this fraction to be worth a trial."""
    p_stop: float = TuneOptions.p_stop
    """Stop rule: stop when no candidate has more than this probability of such a gain."""
    budget_gpu_hours: float | None = None
    """Stop once the study's measured trials have used this many GPU-hours (None: no budget)."""
    candidates: int = 48
    """TPE proposals estimated (and recorded as trials) per measurement slot."""
    slack: float = TuneOptions.slack
    """Skip candidates predicted slower than this fraction of the best measured layout's prediction."""
    seed: int = TuneOptions.seed
    """Seed of the TPE sampler and of the uniform draws."""
    storage: str = ""
    """Optuna storage: an RDB URL (sqlite:///..., postgresql://...) or a path ending in .journal."""
    study_name: str = "attune"
    """Name of the study in the storage."""
    out_dir: Path = Path(".")
    """Folder of the session's outputs; trial folders go to out_dir/trials/."""
    timeout_s: float | None = None
    """Seconds a measured trial may run before the runner kills it (None: the runner's default)."""
    coefficients: Coefficients | None = None
    """Calibrated coefficients of the estimator; None: the fitted set of the cluster's GPU generation."""
    memory_limit_gib: float | None = None
    """Host memory cap per CPU worker for the torch runner on CPU, GiB (None: no cap)."""
    data_path: str | None = None
    """Packed rows (parquet) for measured trials; None: seeded synthetic rows."""
    headroom: float = TuneOptions.memory_headroom
    """Fraction of GPU memory kept free: predictions this close to capacity are not trusted."""
    heartbeat_interval_s: int = TuneOptions.heartbeat_interval_s
    """Seconds between heartbeats of a measured trial (RDB storages)."""
    grace_period_s: int = TuneOptions.grace_period_s
    """Seconds without a heartbeat (or, for a trial without a role, since it started) after which a RUNNING
    trial is taken as left by a killed tuner and failed."""
    storage_timeout_s: float = TuneOptions.storage_timeout_s
    """Database connection timeout, seconds (also how long the first connection is retried)."""

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise UserInputError(f"trials {self.trials}: must be at least 1 measured trial")
        if self.candidates < 1:
            raise UserInputError(f"candidates {self.candidates}: must be at least 1 proposal per trial")
        if not 0.0 < self.slack <= 1.0:
            raise UserInputError(f"slack {self.slack:g}: must be in (0, 1] (a fraction of the best prediction)")
        if not 0.0 <= self.headroom < 1.0:
            raise UserInputError(f"memory headroom {self.headroom:g}: must be in [0, 1) (a fraction of GPU memory)")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise UserInputError(f"timeout {self.timeout_s:g} s: must be positive")
        if self.heartbeat_interval_s < 1 or self.grace_period_s <= self.heartbeat_interval_s:
            raise UserInputError(f"heartbeat {self.heartbeat_interval_s} s / grace period {self.grace_period_s} s: "
                                 f"need 1 s <= heartbeat < grace period")
        if self.sampler not in SAMPLERS:
            raise UserInputError(f"sampler '{self.sampler}': allowed {', '.join(SAMPLERS)}")
        if not 0.0 <= self.min_gain < 1.0:
            raise UserInputError(f"min gain {self.min_gain:g}: must be a fraction in [0, 1)")
        if not 0.0 < self.p_stop < 1.0:
            raise UserInputError(f"stop probability {self.p_stop:g}: must be in (0, 1)")
        if self.budget_gpu_hours is not None and not self.budget_gpu_hours > 0:
            raise UserInputError(f"GPU-hour budget {self.budget_gpu_hours:g}: must be positive")
        if not self.storage:
            self.storage = f"sqlite:///{(Path(self.out_dir) / 'study.db').resolve()}"


@dataclass(kw_only=True)
class TuneOutcome:
    """What a tuning session leaves: the study and its best and baseline trials as records."""

    study: optuna.Study
    """The Optuna study (all sessions)."""
    baseline: TrialRecord | None
    """The baseline's measured trial (None if it never ran)."""
    best: TrialRecord | None
    """The best completed feasible measured trial (None when nothing fitted)."""
    counts: StudyCounts = field(default_factory=StudyCounts)
    """This session's counts: estimated, invalid, oom_predicted, oom_rule, duplicate, skipped_slow, lost, measured."""
    scored: int = 0
    """Layouts of the space the model sampler scored (not trials; 0 with TPE)."""
    wall_s: float = 0.0
    """Wall time of this session, seconds."""
    stopped: str = ""
    """Why the session stopped, one sentence."""
    stop_kind: str = ""
    """What stopped it: trials, budget, rule (the stop rule), exhausted (nothing left to propose), attempts."""
    remaining_regret: float | None = None
    """Estimated remaining regret when it stopped: the largest expected improvement of an unmeasured layout
    over the best measured, a fraction (model sampler; None with TPE)."""
    p_improve: float | None = None
    """Largest probability of an unmeasured layout beating the best measured by more than min_gain."""
    top_predicted: list = field(default_factory=list)
    """The 10 best layouts by the recalibrated model: label, tokens/s/GPU, spread %, peak GiB, margin GiB."""


# ---------------------------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _quiet_optuna():
    """Optuna warns that heartbeats are meant for `Study.optimize` (we run ask-and-tell and beat ourselves)
    and that the heartbeat API is experimental: silence both inside this block only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        yield


class _Heartbeat:
    """Records a trial's heartbeat every `interval_s` seconds in a daemon thread while the `with` block runs
    (through the public `record_heartbeat` of the RDBStorage the tuner opened; a no-op without one)."""

    def __init__(self, storage: optuna.storages.RDBStorage | None, study_name: str, number: int, interval_s: int,
                 on_beat: Callable[[], None] | None = None, trial_id: int | None = None):
        self._stop = threading.Event()
        self._on_beat = on_beat  # after each beat: fail other workers' stale trials (attune.search.coordination)
        self._thread = None
        self.trial_id = trial_id
        """The trial's storage id (looked up once; pass it to a later heartbeat of the same trial)."""
        if storage is not None:
            if trial_id is None:
                trial_id = self.trial_id = storage.get_trial_id_from_study_id_trial_number(
                    storage.get_study_id_from_name(study_name), number)
            self._first = lambda: storage.record_heartbeat(trial_id)
            self._thread = threading.Thread(target=self._beat, args=(storage, trial_id, interval_s), daemon=True,
                                            name=f"attune-heartbeat-{number}")

    def _beat(self, storage, trial_id: int, interval_s: int) -> None:
        while not self._stop.wait(interval_s):
            try:
                storage.record_heartbeat(trial_id)
                if self._on_beat is not None:
                    self._on_beat()
            except Exception as e:  # a busy database must not kill the measurement; the next beat retries
                log.warning("heartbeat of trial id %d not recorded: %s", trial_id, e)

    def __enter__(self) -> "_Heartbeat":
        if self._thread is not None:
            self._first()  # before the caller records anything: a trial with a role always has a heartbeat
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# ---------------------------------------------------------------------------------------------- the tuner
class Tuner:
    """One tuning session over a (possibly resumed) study: `Tuner(cfg).run()`.

    Steps, each a method: `open_study` (create or resume, check the target matches, fail stale trials),
    `measure_baseline`, then per measurement slot `stop_reason`, `pick_model` (or `propose` + `pick_tpe`)
    and `measure`, then `record_calibration`.
    Progress goes to `progress(message, completed)` when given, and to this module's logger.
    """

    def __init__(self, cfg: TuneConfig, progress: Callable[..., None] | None = None):
        self.cfg = cfg
        self.progress = progress
        self.study: optuna.Study | None = None
        self._rdb: optuna.storages.RDBStorage | None = None
        self.counts = StudyCounts()  # this session's
        self.measured_layouts: set[tuple] = set()
        # monotone rule: a stage that ran out of memory for real at a predicted P GiB rules out >= P GiB there
        self.oom_floor: dict[int, float] = {}
        self._dists = cfg.space.distributions()
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._capacity = cfg.cluster.gpu.capacity_gib
        self._usable = self._capacity * (1.0 - cfg.headroom)
        self.shipped = cfg.coefficients if cfg.coefficients is not None else coefficients_for(cfg.cluster.gpu)
        self.model_sampler: ModelGuidedSampler | None = None
        self.scored = 0  # layouts the model sampler scored
        self._proposal_fields: dict = {}
        self.asked: list[int] = []
        self._edge_step: dict | None = None

    # ------------------------------------------------------------------ study
    def _open_storage(self):
        """The study storage (attune.search.storage: pool_pre_ping, transient errors retried with backoff)."""
        self._handle: StorageHandle = open_storage(self.cfg.storage, heartbeat_interval_s=self.cfg.heartbeat_interval_s,
                                                   grace_period_s=self.cfg.grace_period_s,
                                                   connect_timeout_s=self.cfg.storage_timeout_s)
        self._rdb = self._handle.rdb
        return self._handle.storage

    def open_study(self) -> optuna.Study:
        """Create or resume the study, check it was made for this target, fail trials a killed tuner left."""
        cfg = self.cfg
        sampler = self._make_sampler()
        try:
            storage = self._open_storage()
            study = optuna.create_study(storage=storage, study_name=cfg.study_name, direction="maximize",
                                        sampler=sampler, load_if_exists=True)
        except (BadStorageURL, StorageUnavailable):
            raise
        except Exception as e:  # bad URL, unreachable database, missing driver
            raise StudyError(f"cannot open the Optuna storage {mask_url(cfg.storage)}: {str(e).splitlines()[0]}") from None
        meta = {"model": cfg.model.name, "gpus": cfg.cluster.spec, "engine": cfg.engine.name,
                "runner": cfg.runner.name, "space": cfg.space.name, "seq_length": cfg.workload.seq_length,
                "global_batch": cfg.workload.global_batch}
        have = study.user_attrs
        # compare what is there: a worker that created the study a moment ago may still be writing the rest
        diff = [k for k, v in meta.items() if k in have and have[k] != v]
        if diff:
            k = diff[0]
            raise StudyError(f"study '{cfg.study_name}' was created for {k}={have.get(k)!r}, not {meta[k]!r}; "
                             f"use another --study-name or --out")
        extra = {"baseline_note": cfg.baseline_note, "grace_period_s": cfg.grace_period_s}  # read by `attune study status`
        for k, v in {**meta, **extra}.items():
            if k not in have:
                study.set_user_attr(k, v)
        self.study = study
        self.fail_stale_trials()
        return study

    def _make_sampler(self) -> optuna.samplers.BaseSampler:
        """TPE, or the model-guided sampler over the space scored once (attune.search.scoring)."""
        cfg = self.cfg
        if cfg.sampler == "tpe":
            return optuna.samplers.TPESampler(seed=cfg.seed, multivariate=True, n_startup_trials=TPE_STARTUP_TRIALS)
        table = score_space(cfg.space, cfg.model, cfg.cluster, cfg.workload, cfg.engine, self.shipped)
        self.scored = len(table)

        def refused(layout: Layout) -> list[str]:
            return cfg.runner.check(self._spec(layout))

        self.model_sampler = ModelGuidedSampler(
            table=table, shipped=self.shipped, capacity_gib=self._capacity, headroom=cfg.headroom,
            exact=not cfg.runner.capabilities.measured, recalibrate=cfg.recalibrate, min_gain=cfg.min_gain,
            seed=cfg.seed, runner_check=refused)
        return self.model_sampler

    def fail_stale_trials(self) -> int:
        """Fail the trials a killed tuner left RUNNING (see the module docstring); returns how many."""
        study = self.study
        before = {t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))}
        if not before or self._handle.storage.unsettled(self.cfg.grace_period_s):
            return 0  # after a database outage nobody could beat: silence proves nothing for a grace period
        with _quiet_optuna():
            optuna.storages.fail_stale_trials(study)
        now = dt.datetime.now()
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            if TrialRecord.from_trial(t).role is None and t.datetime_start is not None \
                    and (now - t.datetime_start).total_seconds() > self.cfg.grace_period_s:
                try:
                    study.tell(t.number, state=optuna.trial.TrialState.FAIL)
                except (ValueError, RuntimeError):  # another tuner finished it meanwhile
                    pass
        after = {t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))}
        n = len(before - after)
        if n:
            log.info("failed %d trial(s) a killed tuner left running (%s)", n, INTERRUPTED)
        return n

    def _fail_stale_after_beat(self) -> None:
        """After each heartbeat: fail other workers' stale measured trials (not right after a database outage)."""
        if not self._handle.storage.unsettled(self.cfg.grace_period_s):
            with _quiet_optuna():
                optuna.storages.fail_stale_trials(self.study)

    def _ask(self, dists: dict | None = None) -> optuna.Trial:
        with _quiet_optuna():
            t = self.study.ask(dists)
        self.asked.append(t.number)  # failed if the tuner is interrupted before telling it (search.interrupt)
        return t

    # ------------------------------------------------------------------ state read back from the study
    def measured(self, complete_only: bool = False) -> list[TrialRecord]:
        states = (optuna.trial.TrialState.COMPLETE,) if complete_only else None
        return [r for r in records(self.study, states) if r.is_measured]

    def _resume_state(self) -> None:
        for r in self.measured():
            if r.layout is not None:
                self.measured_layouts.add(layout_key(r.layout, self.cfg.model.num_layers))
            if r.outcome == OOM and r.oom_stage is not None:
                p = r.predicted_stage_gib or []
                if r.oom_stage < len(p):
                    self.oom_floor[r.oom_stage] = min(self.oom_floor.get(r.oom_stage, 1e18), p[r.oom_stage])

    def n_complete(self) -> int:
        return len(self.measured(complete_only=True))

    def best_measured(self) -> TrialRecord | None:
        done = {r.number: r for r in self.measured(complete_only=True)}
        feasible = [t for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                    if t.number in done and all(v <= 0 for v in t.constraints.values())]
        return done[max(feasible, key=lambda t: t.value).number] if feasible else None

    # ------------------------------------------------------------------ the model
    def fits(self, e: Estimate) -> bool:
        return e.memory.host_fits and e.memory.peak_gib <= self._usable

    def _over_floor(self, e: Estimate) -> list:
        return [s for s in e.memory.stages if s.stage in self.oom_floor and s.total_gib >= self.oom_floor[s.stage]]

    def to_layout(self, params: dict) -> Layout:
        """The layout of a parameter set; LayoutError when it breaks a rule or the runner cannot run it."""
        c = self.cfg
        layout = c.space.to_layout(params, c.model, c.cluster.world_size, c.workload, c.engine)
        refused = c.runner.check(self._spec(layout))
        if refused:
            raise LayoutError(f"the {c.runner.name} runner cannot run {layout.label()}: {'; '.join(refused)}")
        return layout

    def estimate(self, layout: Layout, check_layout: bool = False) -> Estimate:
        c = self.cfg
        return estimate(c.model, c.cluster, layout, c.workload, c.engine, c.coefficients, check_layout=check_layout)

    def _spec(self, layout: Layout, number: int | None = None) -> TrialSpec:
        c = self.cfg
        tdir = c.out_dir / "trials" / f"{number:05d}-{layout.slug()}" if number is not None else None
        return TrialSpec(model=c.model, cluster=c.cluster, layout=layout, workload=c.workload, engine=c.engine,
                         trial_dir=tdir, timeout_s=c.timeout_s, label=layout.label(), data_path=c.data_path,
                         memory_limit_gib=c.memory_limit_gib, trial_number=number)

    # ------------------------------------------------------------------ measuring
    def measure(self, params: dict | None, layout: Layout, est: Estimate, role: str,
                retry_of: int | None = None) -> TrialRecord | None:
        """Run one layout on the runner as a trial (created with `params` so TPE learns from it). Returns None
        when another worker holds the layout or every measurement slot (attune.search.coordination): the trial
        is then a PRUNED `claim-lost` trial carrying the prediction, and the caller takes its next candidate."""
        cfg, study = self.cfg, self.study
        L = cfg.model.num_layers
        claim = claim_key(layout_key(layout, L))
        trial = new_measured_trial(study, self._handle.storage, params, self._dists, claim, retry_of)
        # without heartbeats (a journal) a killed worker's RUNNING claim never ends: no slot rule there
        lost = contest(study, trial, claim, cfg.trials if self._rdb is not None else 1 << 30,
                       rekey=lambda d: claim_key(layout_key(d, L)))
        if lost:
            rec = TrialRecord(kind=KIND_LOST, reason=lost, host=self._host, pid=self._pid)
            rec.set_estimate(est)
            rec.save(trial)
            trial.report(est.perf.tokens_per_s_per_gpu, 0)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            self.counts.lost += 1
            return None
        beat: _Heartbeat | None = None
        rec = TrialRecord(role=role, host=self._host, pid=self._pid, runner=cfg.runner.name)
        rec.set_estimate(est)
        for k, v in self._proposal_fields.items():
            setattr(rec, k, v)
        try:
            with _Heartbeat(self._handle.storage if self._rdb is not None else None, cfg.study_name, trial.number,
                            cfg.heartbeat_interval_s, on_beat=self._fail_stale_after_beat) as beat:
                rec.save(trial)
                self.measured_layouts.add(layout_key(layout, cfg.model.num_layers))
                self._say(f"running trial {trial.number}: {layout.label()}")
                res: TrialResult = cfg.runner.run(self._spec(layout, trial.number))
        except KeyboardInterrupt:
            trial.set_user_attr("reason", "interrupted")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        except Exception as e:  # a runner bug must not lose the study
            res = TrialResult(status=FAILED, measured=cfg.runner.capabilities.measured,
                              reason=f"runner error: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        out = TrialRecord(outcome=res.status, measured=res.measured, gpu_hours=res.gpu_hours,
                          reason=res.reason[:REASON_CHARS] if res.reason else None,
                          log_tail=res.log_tail[-LOG_TAIL_CHARS:] if res.log_tail else None,
                          measured_peak_gib=[round(x, 3) for x in res.peak_memory_gib] if res.peak_memory_gib else None)
        try:
            # the trial is this worker's until it is told: keep beating while the result is filed (a database outage
            # here makes the filing retry; without beats another worker would fail the trial as stale meanwhile)
            with _Heartbeat(self._handle.storage if self._rdb is not None else None, cfg.study_name, trial.number,
                            cfg.heartbeat_interval_s, trial_id=beat.trial_id if beat is not None else None):
                self._file_result(trial, out, res, est)
        except optuna.exceptions.UpdateFinishedTrialError:
            # another worker failed this trial as stale (its heartbeats could not reach the database for longer
            # than the grace period): keep the measurement as a new trial linked to the failed one
            again = new_measured_trial(study, self._handle.storage, params, self._dists, claim, trial.number)
            log.warning("trial %d was failed as stale by another worker while this one measured it; its result is "
                        "kept as trial %d", trial.number, again.number)
            rec.save(again)  # what the measurement started with: role, worker, estimate, proposal
            self._file_result(again, out, res, est)
            trial = again
        self.counts.measured += 1
        return TrialRecord.from_trial(study.trials[trial.number])

    def _file_result(self, trial: optuna.Trial, out: TrialRecord, res: TrialResult, est) -> None:
        """Record a measurement on its trial and tell the study (COMPLETE, PRUNED for an OOM, or FAIL)."""
        study = self.study
        if res.status == OK:
            out.tokens_per_s_per_gpu = res.tokens_per_s_per_gpu
            out.step_time_s = res.step_time_s
            out.step_time_cv_percent = res.step_time_cv_percent
            out.window = list(res.window) if res.window else None
            out.window_tokens = res.window_tokens
            out.losses = {str(k): v for k, v in res.losses.items()} if res.losses else None
            out.extra = res.extra
            out.save(trial)
            # a real run proves its layout fits; a prediction (the sim runner) must fit within the headroom
            margin = est.memory.peak_gib - (self._capacity if res.measured else self._usable)
            trial.set_constraint("memory_gib", min(margin, -1e-6) if res.measured else margin)
            study.tell(trial, res.tokens_per_s_per_gpu)
        elif res.status == OOM:
            stage = res.oom_stage if res.oom_stage is not None else est.memory.peak_stage
            out.oom_stage = stage
            out.save(trial)
            p = [s.total_gib for s in est.memory.stages]
            if stage < len(p):
                self.oom_floor[stage] = min(self.oom_floor.get(stage, 1e18), p[stage])
            trial.set_constraint("memory_gib", max(est.memory.peak_gib - self._capacity, 0.5))
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            out.save(trial)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)

    def coordinate(self) -> int | None:
        """What other workers left, before a new candidate (attune.search.coordination): fail stale trials;
        while every measurement slot is taken by a RUNNING trial, wait a heartbeat interval; re-measure a
        killed or interrupted worker's trial once. Returns the measured attempts it made (0 after a wait), or
        None when the caller should pick a new candidate."""
        cfg = self.cfg
        self.fail_stale_trials()
        done, running = slots(self.study.get_trials(deepcopy=False))
        if self._rdb is not None and done < cfg.trials and done + running >= cfg.trials:
            time.sleep(cfg.heartbeat_interval_s)
            return 0
        for r in pending_retries(records(self.study)):
            layout = r.to_layout()
            self._say(f"retrying trial {r.number} ({r.label}) of a worker that was killed or interrupted")
            params = cfg.space.params_for(layout, cfg.model, cfg.workload)
            if self.measure(params, layout, self.estimate(layout), r.role, retry_of=r.number) is not None:
                return 1
        return None

    def measure_baseline(self) -> TrialRecord | None:
        """Measure the baseline layout first, unless an earlier session did."""
        if [r for r in self.measured() if r.role == ROLE_BASELINE and r.state != "RUNNING"]:
            return None
        cfg = self.cfg
        est = estimate(cfg.model, cfg.cluster, cfg.baseline, cfg.workload, cfg.engine, cfg.coefficients)
        self.counts.estimated += 1
        return self.measure(cfg.space.params_for(cfg.baseline, cfg.model, cfg.workload), cfg.baseline, est,
                            ROLE_BASELINE)

    # ------------------------------------------------------------------ proposing
    def propose(self, best_pred: float | None) -> list[tuple[float, dict]]:
        """Ask TPE for `candidates` proposals; estimate and record each as a PRUNED trial. Returns the pool of
        (predicted tokens/s/GPU, params) worth refining."""
        cfg, study = self.cfg, self.study
        pool: list[tuple[float, dict]] = []
        for _ in range(cfg.candidates):
            t = self._ask()
            t.set_user_attr("host", self._host)
            t.set_user_attr("pid", self._pid)
            params = cfg.space.suggest(t)
            t.set_user_attr("kind", KIND_EST)
            try:
                layout = self.to_layout(params)
            except LayoutError as e:
                self.counts.invalid += 1
                TrialRecord(kind=KIND_INVALID, reason=str(e)[:500]).save(t)
                t.set_constraint("valid", INVALID_PENALTY)
                study.tell(t, state=optuna.trial.TrialState.PRUNED)
                continue
            est = self.estimate(layout)
            self.counts.estimated += 1
            rec = TrialRecord()
            rec.set_estimate(est)
            rec.save(t)
            pred = est.perf.tokens_per_s_per_gpu
            t.report(pred, 0)
            over = self._over_floor(est)
            if not self.fits(est):
                self.counts.oom_predicted += 1
                reason = est.memory.verdict() if not est.fits else (
                    f"predicted peak {est.memory.peak_gib:.1f} GiB on stage {est.memory.peak_stage} is within the "
                    f"{100 * cfg.headroom:g}% headroom of {self._capacity:.1f} GiB")
                TrialRecord(kind=KIND_OOM, reason=reason).save(t)
                t.set_constraint("memory_gib", max(est.memory.peak_gib - self._usable, 1e-3))
                study.tell(t, state=optuna.trial.TrialState.PRUNED)
                continue
            t.set_constraint("memory_gib", est.memory.peak_gib - self._usable)
            if over:
                self.counts.oom_rule += 1
                TrialRecord(kind=KIND_RULE, reason=(
                    f"stage {over[0].stage} needs {over[0].total_gib:.1f} GiB, at least as much as a layout that ran "
                    f"out of memory there ({self.oom_floor[over[0].stage]:.1f} GiB predicted)")).save(t)
            elif layout_key(layout, cfg.model.num_layers) in self.measured_layouts:
                self.counts.duplicate += 1
                TrialRecord(kind=KIND_DUP).save(t)
            elif best_pred and pred < cfg.slack * best_pred:
                self.counts.skipped_slow += 1
                TrialRecord(kind=KIND_SLOW, reason=(
                    f"predicted {pred:.1f} tokens/s/GPU < {cfg.slack:g} x {best_pred:.1f} predicted for the best "
                    f"measured layout")).save(t)
            else:
                pool.append((pred, params))
            study.tell(t, state=optuna.trial.TrialState.PRUNED)
            if pool:  # plain TPE: its first feasible, new proposal is measured
                break
        return pool

    # ------------------------------------------------------------------ refining
    def pick_tpe(self, pool: list[tuple[float, dict]]) -> tuple[dict, Layout, Estimate] | None:
        """Plain TPE: its first proposal that is valid, predicted to fit and not measured yet."""
        if not pool:
            return None
        params = pool[0][1]
        lay = self.to_layout(params)
        return params, lay, self.estimate(lay)

    # ------------------------------------------------------------------ the loop
    def should_stop(self, attempts: int) -> bool:
        return self.n_complete() >= self.cfg.trials or attempts >= ATTEMPTS_PER_TRIAL * self.cfg.trials + 2

    def run(self) -> TuneOutcome:
        """Open (or resume) the study, measure the baseline, then one candidate per slot until a stop."""
        t0 = time.time()
        self.open_study()
        self._resume_state()
        if not self.measured():  # before the study's first trial: refuse to start on a cluster missing something
            self.cfg.runner.preflight(self.cfg.model, self.cfg.cluster)
        self.measure_baseline()
        attempts = len([r for r in self.measured() if r.state != "RUNNING"])
        dry, stopped, stop_kind = 0, "", ""
        self.record_calibration()
        while True:
            stop = self._budget_stop(attempts)
            if stop:
                stop_kind, stopped = stop
                break
            done = self.coordinate()
            if done is not None:
                attempts += done
                continue
            stop, chosen, dry = self._choose(dry)
            if stop:
                stop_kind, stopped = stop
                break
            if chosen is None:  # TPE proposed nothing new this round
                continue
            try:
                rec = self.measure(*chosen, ROLE_CANDIDATE)
            finally:
                self._proposal_fields = {}
            if rec is None:  # another worker holds that layout or every slot: next candidate
                continue
            attempts += 1
            self.record_edge_step(rec)
            self.record_calibration()
            b = self.best_measured()
            self._say(f"best {b.value:,.1f} tokens/s/GPU ({b.label})" if b else "no measured result yet",
                      completed=self.n_complete())
        self.fail_stale_trials()  # orphans too young to judge at the start
        return self._outcome(t0, stopped, stop_kind)

    def _budget_stop(self, attempts: int) -> tuple[str, str] | None:
        """(kind, reason) when the trial budget or the attempts allowed for it are used up."""
        cfg = self.cfg
        if self.n_complete() >= cfg.trials:
            return "trials", f"--trials {cfg.trials} completed measured trials reached"
        if attempts >= ATTEMPTS_PER_TRIAL * cfg.trials + 2:
            return "attempts", f"{attempts} measured attempts (failures included) made"
        return None

    def _choose(self, dry: int) -> tuple[tuple[str, str] | None, tuple | None, int]:
        """The next candidate: (stop, chosen, dry rounds). The model sampler's best unless its stop rule fires or
        nothing is left; otherwise TPE's proposal, stopping after enough dry rounds of nothing new."""
        if self.model_sampler is not None:
            stop = self.stop_reason(self.model_sampler.assess(self.study))
            if stop:
                return stop, None, dry
            chosen = self.pick_model()
            if chosen is None:
                return ("exhausted", "no unmeasured layout is predicted to fit"), None, dry
            return None, chosen, 0
        stop = self.stop_reason(None)
        if stop:
            return stop, None, dry
        best = self.best_measured()
        chosen = self.pick_tpe(self.propose(best.predicted_tokens_per_s_per_gpu if best else None))
        if chosen is not None:
            return None, chosen, 0
        dry += 1
        if dry >= max(DRY_ROUNDS, math.ceil(DRY_PROPOSALS / self.cfg.candidates)):
            return ("exhausted", f"TPE proposed no new layout predicted to fit in {dry} rounds "
                                 f"({dry * self.cfg.candidates} proposals)"), None, dry
        return None, None, dry

    def _outcome(self, t0: float, stopped: str, stop_kind: str) -> TuneOutcome:
        """The study's result: baseline, best measured, and the model sampler's last claim and top predictions."""
        baseline = next((r for r in self.measured() if r.role == ROLE_BASELINE), None)
        regret = p_imp = None
        top = []
        if self.model_sampler is not None:
            a = self.model_sampler.assess(self.study)
            regret = a.remaining_regret if a.best_tokens is not None else None
            p_imp = a.p_improve if a.best_tokens is not None else None
            top = self.model_sampler.top_predicted(self.study)
        return TuneOutcome(study=self.study, baseline=baseline, best=self.best_measured(),
                           counts=self.counts, scored=self.scored,
                           wall_s=time.time() - t0, stopped=stopped, stop_kind=stop_kind,
                           remaining_regret=regret, p_improve=p_imp, top_predicted=top)

    # ------------------------------------------------------------------ the model sampler
    def gpu_hours(self) -> float:
        """GPU-hours the study's measured trials used."""
        return sum(r.gpu_hours or 0.0 for r in self.measured())

    def stop_reason(self, a) -> tuple[str, str] | None:
        """(kind, sentence) when the GPU-hour budget is spent or the stop rule holds, else None."""
        cfg = self.cfg
        if cfg.budget_gpu_hours is not None and self.gpu_hours() >= cfg.budget_gpu_hours:
            return "budget", f"--budget-gpu-hours {cfg.budget_gpu_hours:g} spent ({self.gpu_hours():.2f} GPU-hours)"
        if a is not None and a.should_stop(cfg.p_stop, cfg.min_gain):
            return "rule", (f"stop rule: no unmeasured layout has more than {100 * cfg.p_stop:g}% probability of "
                            f"beating the best measured by more than {100 * cfg.min_gain:g}% "
                            f"(largest: {100 * a.p_improve:.1f}%; claimed remaining regret "
                            f"{100 * a.remaining_regret:.2f}%)")
        return None

    def pick_model(self) -> tuple[dict, Layout, Estimate] | None:
        """The sampler's proposal, estimated with the study's recalibrated coefficients (kept on the trial)."""
        ms = self.model_sampler
        row = ms.propose(self.study)
        if row is None:
            return None
        a = ms.assess(self.study)
        layout = ms.table.layouts[row]
        est = estimate(self.cfg.model, self.cfg.cluster, layout, self.cfg.workload, self.cfg.engine,
                       a.calibration.coefficients, check_layout=False)
        self._edge_step = dict(a.edge_step) if a.edge_step and a.edge_step["row"] == row else None
        self._proposal_fields = dict(
            predicted_shipped_tokens_per_s_per_gpu=round(float(ms.table.tokens[row]), 3),
            predicted_model_tokens_per_s_per_gpu=round(float(math.exp(a.mean_log[row])), 3),
            predicted_spread_percent=round(100 * float(a.spread[row]), 3))
        return dict(ms.table.params[row]), layout, est

    def record_edge_step(self, rec: TrialRecord) -> None:
        """A measured edge step (attune.search.edge) appended to the study attribute `edge_steps` (read by the
        report): the trial whose OOM or fit led to it, what changed, and how the step came out."""
        step, self._edge_step = self._edge_step, None
        if step is None or self.study is None:
            return
        done = list(self.study.user_attrs.get("edge_steps", []))
        done.append({"after_trial": step["after_trial"], "from": step["from"], "why": step["why"],
                     "kind": step["kind"], "trial": rec.number, "to": rec.label, "p_fit": step["p_fit"],
                     "outcome": rec.outcome, "tokens_per_s_per_gpu": rec.value})
        self.study.set_user_attr("edge_steps", done)

    def record_calibration(self) -> None:
        """The study's current calibration as a study attribute (read by the report)."""
        ms = self.model_sampler
        if ms is None or not ms.calibrations:
            return
        number, cal = max(ms.calibrations.items())
        self.study.set_user_attr("calibration", {
            "after_trial": number,
            "coefficients": {n: getattr(cal.coefficients, n) for n in cal.log_shift},
            "shipped": {n: getattr(self.shipped, n) for n in cal.log_shift},
            "memory_offset_gib": dict(cal.memory_offset_gib), "residual_rms": cal.residual_rms})

    def _say(self, message: str, completed: int | None = None) -> None:
        log.info(message)
        if self.progress is not None:
            self.progress(message, completed)

