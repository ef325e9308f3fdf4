"""The Optuna study: ask-and-tell with the memory verdict as a constraint, the model deciding what gets measured.

Every proposal is estimated (microseconds) and recorded as a trial: a layout that breaks a rule (or that the
runner cannot run), or that the memory estimator predicts to run out of memory, is an infeasible PRUNED trial
carrying its reason and overflowing stage; a feasible proposal is a PRUNED trial carrying its predicted
tokens/s/GPU as an intermediate value (so TPE ranks it). Per measurement slot the best feasible, not yet
measured proposal, unless predicted slower than `slack` x the prediction of the best measured layout, is
re-asked as an enqueued trial and run on the runner: COMPLETE with the measured tokens/s/GPU, PRUNED+infeasible
if it ran out of memory for real, FAIL if it crashed or hung. The first measured trial is the baseline layout.
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
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import optuna

from attune.errors import LayoutError, UserInputError
from attune.estimator import Estimate, estimate
from attune.estimator.coefficients import DEFAULT, Coefficients
from attune.runners.base import FAILED, OK, OOM, Runner, TrialResult, TrialSpec
from attune.search.records import (
    INTERRUPTED, KIND_DUP, KIND_EST, KIND_INVALID, KIND_OOM, KIND_RULE, KIND_SLOW, LOG_TAIL_CHARS, REASON_CHARS,
    ROLE_BASELINE, ROLE_CANDIDATE, TrialRecord, records)
from attune.search.refine import refine
from attune.search.space import SearchSpace
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec

log = logging.getLogger(__name__)

# constraint value of a layout that breaks a rule: worse than any memory overflow (GiB)
INVALID_PENALTY = 1000.0
# TPE proposals before the multivariate sampler starts modelling (Optuna's n_startup_trials)
TPE_STARTUP_TRIALS = 16
# starting points for refinement: the best TPE proposals, and the best of the model-scored uniform draws
REFINE_FROM_PROPOSALS, REFINE_FROM_DRAWS = 3, 5
# measurement slots in a row without a candidate worth measuring before the study stops
DRY_ROUNDS = 3
# the number of measured attempts (failures included) is capped at this many per requested trial, plus 2
ATTEMPTS_PER_TRIAL = 2
# heartbeat of a measured trial (seconds; Optuna takes integers) and the silence after which it is stale:
# SQLite stores heartbeat times to the second, so the grace period spans several beats
HEARTBEAT_INTERVAL_S, GRACE_PERIOD_S = 5, 20


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
    trials: int = 20
    """Target number of completed measured trials in the study (resuming counts earlier sessions)."""
    candidates: int = 48
    """TPE proposals estimated (and recorded as trials) per measurement slot."""
    random_starts: int = 400
    """Uniform draws scored by the model per slot; the best REFINE_FROM_DRAWS start hill-climbs."""
    slack: float = 0.8
    """Skip candidates predicted slower than this fraction of the best measured layout's prediction."""
    seed: int = 0
    """Seed of the TPE sampler and of the uniform draws."""
    storage: str = ""
    """Optuna storage: an RDB URL (sqlite:///..., postgresql://...) or a path ending in .journal."""
    study_name: str = "attune"
    """Name of the study in the storage."""
    out_dir: Path = Path(".")
    """Folder of the session's outputs; trial folders go to out_dir/trials/."""
    timeout_s: float | None = None
    """Seconds a measured trial may run before the runner kills it (None: the runner's default)."""
    coefficients: Coefficients = DEFAULT
    """Calibrated coefficients of the estimator."""
    memory_limit_gib: float | None = None
    """Host memory cap per CPU worker for the torch runner on CPU, GiB (None: no cap)."""
    data_path: str | None = None
    """Packed rows (parquet) for measured trials; None: seeded synthetic rows."""
    headroom: float = 0.02
    """Fraction of GPU memory kept free: predictions this close to capacity are not trusted."""
    heartbeat_interval_s: int = HEARTBEAT_INTERVAL_S
    """Seconds between heartbeats of a measured trial (RDB storages)."""
    grace_period_s: int = GRACE_PERIOD_S
    """Seconds without a heartbeat (or, for a trial without a role, since it started) after which a RUNNING
    trial is taken as left by a killed tuner and failed."""

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise UserInputError(f"trials {self.trials}: must be at least 1 measured trial")
        if self.candidates < 1:
            raise UserInputError(f"candidates {self.candidates}: must be at least 1 proposal per trial")
        if self.random_starts < 0:
            raise UserInputError(f"random_starts {self.random_starts}: must be 0 or more draws")
        if not 0.0 < self.slack <= 1.0:
            raise UserInputError(f"slack {self.slack:g}: must be in (0, 1] (a fraction of the best prediction)")
        if not 0.0 <= self.headroom < 1.0:
            raise UserInputError(f"memory headroom {self.headroom:g}: must be in [0, 1) (a fraction of GPU memory)")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise UserInputError(f"timeout {self.timeout_s:g} s: must be positive")
        if self.heartbeat_interval_s < 1 or self.grace_period_s <= self.heartbeat_interval_s:
            raise UserInputError(f"heartbeat {self.heartbeat_interval_s} s / grace period {self.grace_period_s} s: "
                                 f"need 1 s <= heartbeat < grace period")
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
    counts: dict = field(default_factory=dict)
    """This session's counts: estimated, invalid, oom_predicted, oom_rule, duplicate, skipped_slow, measured."""
    wall_s: float = 0.0
    """Wall time of this session, seconds."""
    stopped: str = ""
    """Why the session stopped before reaching its trial target ('' when it did not stop early)."""


# ---------------------------------------------------------------------------------------------- helpers
def layout_key(d: dict) -> tuple:
    """Identity of a layout for "already measured": uniform recompute in groups of N recomputes every layer
    whatever N, so N does not make a different layout worth another measurement."""
    d = dict(d)
    if d.get("recompute_method") == "uniform":
        d["recompute_num_layers"] = 0
    return tuple(sorted(d.items()))


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

    def __init__(self, storage: optuna.storages.RDBStorage | None, study_name: str, number: int, interval_s: int):
        self._stop = threading.Event()
        self._thread = None
        if storage is not None:
            trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study_name), number)
            self._first = lambda: storage.record_heartbeat(trial_id)
            self._thread = threading.Thread(target=self._beat, args=(storage, trial_id, interval_s), daemon=True,
                                            name=f"attune-heartbeat-{number}")

    def _beat(self, storage, trial_id: int, interval_s: int) -> None:
        while not self._stop.wait(interval_s):
            try:
                storage.record_heartbeat(trial_id)
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
    `measure_baseline`, then per measurement slot `propose` (TPE proposals, estimated and recorded),
    `pick` (model-guided refinement chooses the candidate) and `measure`, until `should_stop`.
    Progress goes to `progress(message, completed)` when given, and to this module's logger.
    """

    def __init__(self, cfg: TuneConfig, progress: Callable[..., None] | None = None):
        self.cfg = cfg
        self.progress = progress
        self.study: optuna.Study | None = None
        self._rdb: optuna.storages.RDBStorage | None = None
        self.counts = dict(estimated=0, invalid=0, oom_predicted=0, oom_rule=0, duplicate=0, skipped_slow=0,
                           measured=0, refined=0)
        self.measured_layouts: set[tuple] = set()
        # monotone rule: a stage that ran out of memory for real at a predicted P GiB rules out >= P GiB there
        self.oom_floor: dict[int, float] = {}
        self._dists = cfg.space.distributions()
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._capacity = cfg.cluster.gpu.capacity_gib
        self._usable = self._capacity * (1.0 - cfg.headroom)

    # ------------------------------------------------------------------ study
    def _open_storage(self):
        url = self.cfg.storage
        if url.endswith(".journal") and "://" not in url:
            from optuna.storages.journal import JournalFileBackend, JournalStorage
            return JournalStorage(JournalFileBackend(url))
        with _quiet_optuna():
            self._rdb = optuna.storages.RDBStorage(url, heartbeat_interval=self.cfg.heartbeat_interval_s,
                                                   grace_period=self.cfg.grace_period_s)
        return self._rdb

    def open_study(self) -> optuna.Study:
        """Create or resume the study, check it was made for this target, fail trials a killed tuner left."""
        cfg = self.cfg
        try:
            storage = self._open_storage()
            study = optuna.create_study(storage=storage, study_name=cfg.study_name, direction="maximize",
                                        sampler=optuna.samplers.TPESampler(seed=cfg.seed, multivariate=True,
                                                                           n_startup_trials=TPE_STARTUP_TRIALS),
                                        load_if_exists=True)
        except Exception as e:  # bad URL, unreachable database, missing driver
            raise StudyError(f"cannot open the Optuna storage {cfg.storage!r}: {str(e).splitlines()[0]}") from None
        meta = {"model": cfg.model.name, "gpus": cfg.cluster.spec, "engine": cfg.engine.name,
                "runner": cfg.runner.name, "space": cfg.space.name, "seq_length": cfg.workload.seq_length,
                "global_batch": cfg.workload.global_batch}
        have = study.user_attrs
        if have.get("model"):
            diff = [k for k, v in meta.items() if have.get(k) != v]
            if diff:
                k = diff[0]
                raise StudyError(f"study '{cfg.study_name}' was created for {k}={have.get(k)!r}, not {meta[k]!r}; "
                                 f"use another --study-name or --out")
        else:
            for k, v in meta.items():
                study.set_user_attr(k, v)
            study.set_user_attr("baseline_note", cfg.baseline_note)
        self.study = study
        self.fail_stale_trials()
        return study

    def fail_stale_trials(self) -> int:
        """Fail the trials a killed tuner left RUNNING (see the module docstring); returns how many."""
        study = self.study
        before = {t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))}
        if not before:
            return 0
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

    def _ask(self, dists: dict | None = None) -> optuna.Trial:
        with _quiet_optuna():
            return self.study.ask(dists)

    # ------------------------------------------------------------------ state read back from the study
    def measured(self, complete_only: bool = False) -> list[TrialRecord]:
        states = (optuna.trial.TrialState.COMPLETE,) if complete_only else None
        return [r for r in records(self.study, states) if r.is_measured]

    def _resume_state(self) -> None:
        for r in self.measured():
            if r.layout is not None:
                self.measured_layouts.add(layout_key(r.layout))
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
    def measure(self, params: dict | None, layout: Layout, est: Estimate, role: str) -> TrialRecord:
        """Run one layout on the runner as a trial (re-asked from `params` so TPE learns from it)."""
        cfg, study = self.cfg, self.study
        if params is not None:
            study.enqueue_trial(params, skip_if_exists=False)
        trial = self._ask(self._dists if params is not None else None)
        try:
            with _Heartbeat(self._rdb, cfg.study_name, trial.number, cfg.heartbeat_interval_s):
                rec = TrialRecord(role=role, host=self._host, pid=self._pid, runner=cfg.runner.name)
                rec.set_estimate(est)
                rec.save(trial)
                self.measured_layouts.add(layout_key(layout.to_dict()))
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
        if res.status == OK:
            out.tokens_per_s_per_gpu = res.tokens_per_s_per_gpu
            out.step_time_s = res.step_time_s
            out.step_time_cv_percent = res.step_time_cv_percent
            out.window = list(res.window) if res.window else None
            out.window_tokens = res.window_tokens
            out.losses = {str(k): v for k, v in res.losses.items()} if res.losses else None
            out.extra = res.extra
            out.save(trial)
            trial.set_constraint("memory_gib", min(est.memory.peak_gib - self._capacity, -1e-6))
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
        self.counts["measured"] += 1
        return TrialRecord.from_trial(study.trials[trial.number])

    def measure_baseline(self) -> TrialRecord | None:
        """Measure the baseline layout first, unless an earlier session did."""
        if [r for r in self.measured() if r.role == ROLE_BASELINE and r.state != "RUNNING"]:
            return None
        cfg = self.cfg
        est = estimate(cfg.model, cfg.cluster, cfg.baseline, cfg.workload, cfg.engine, cfg.coefficients)
        self.counts["estimated"] += 1
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
                self.counts["invalid"] += 1
                TrialRecord(kind=KIND_INVALID, reason=str(e)[:500]).save(t)
                t.set_constraint("valid", INVALID_PENALTY)
                study.tell(t, state=optuna.trial.TrialState.PRUNED)
                continue
            est = self.estimate(layout)
            self.counts["estimated"] += 1
            rec = TrialRecord()
            rec.set_estimate(est)
            rec.save(t)
            pred = est.perf.tokens_per_s_per_gpu
            t.report(pred, 0)
            over = self._over_floor(est)
            if not self.fits(est):
                self.counts["oom_predicted"] += 1
                reason = est.memory.verdict() if not est.fits else (
                    f"predicted peak {est.memory.peak_gib:.1f} GiB on stage {est.memory.peak_stage} is within the "
                    f"{100 * cfg.headroom:g}% headroom of {self._capacity:.1f} GiB")
                TrialRecord(kind=KIND_OOM, reason=reason).save(t)
                t.set_constraint("memory_gib", max(est.memory.peak_gib - self._usable, 1e-3))
                study.tell(t, state=optuna.trial.TrialState.PRUNED)
                continue
            t.set_constraint("memory_gib", est.memory.peak_gib - self._usable)
            if over:
                self.counts["oom_rule"] += 1
                TrialRecord(kind=KIND_RULE, reason=(
                    f"stage {over[0].stage} needs {over[0].total_gib:.1f} GiB, at least as much as a layout that ran "
                    f"out of memory there ({self.oom_floor[over[0].stage]:.1f} GiB predicted)")).save(t)
            elif layout_key(layout.to_dict()) in self.measured_layouts:
                self.counts["duplicate"] += 1
                TrialRecord(kind=KIND_DUP).save(t)
            elif best_pred and pred < cfg.slack * best_pred:
                self.counts["skipped_slow"] += 1
                TrialRecord(kind=KIND_SLOW, reason=(
                    f"predicted {pred:.1f} tokens/s/GPU < {cfg.slack:g} x {best_pred:.1f} predicted for the best "
                    f"measured layout")).save(t)
            else:
                pool.append((pred, params))
            study.tell(t, state=optuna.trial.TrialState.PRUNED)
        return pool

    # ------------------------------------------------------------------ refining
    def pick(self, pool: list[tuple[float, dict]], best_pred: float | None) -> tuple[dict, Layout, Estimate] | None:
        """The model decides what deserves a measurement: hill-climb from the best proposals and from the best
        uniform draws; the best feasible, unmeasured result not predicted slower than slack x best."""
        cfg = self.cfg
        cache: dict[tuple, float] = {}

        def score(p: dict) -> float:
            key = tuple(sorted(p.items()))
            if key not in cache:
                try:
                    lay = self.to_layout(p)
                except LayoutError:
                    cache[key] = float("-inf")
                    return cache[key]
                e = self.estimate(lay)
                bad = not self.fits(e) or layout_key(lay.to_dict()) in self.measured_layouts or self._over_floor(e)
                cache[key] = float("-inf") if bad else e.perf.tokens_per_s_per_gpu
            return cache[key]

        rng = np.random.default_rng([cfg.seed, len(self.study.trials)])
        draws = [cfg.space.random_params(rng) for _ in range(cfg.random_starts)]
        refined = len(draws)
        scored = sorted(((score(p), p) for p in draws), key=lambda x: -x[0])
        starts = [p for _, p in sorted(pool, key=lambda x: -x[0])[:REFINE_FROM_PROPOSALS]] + \
                 [p for sc, p in scored[:REFINE_FROM_DRAWS] if sc > float("-inf")]
        pick = None
        for params in starts:
            p2, sc, n = refine(params, score, cfg.space)
            refined += n
            if sc > float("-inf") and (best_pred is None or sc >= cfg.slack * best_pred) and (pick is None or sc > pick[0]):
                pick = (sc, p2)
        self.study.set_user_attr("refined_estimates", int(self.study.user_attrs.get("refined_estimates", 0)) + refined)
        if pick is None:
            return None
        lay = self.to_layout(pick[1])
        return pick[1], lay, self.estimate(lay)

    # ------------------------------------------------------------------ the loop
    def should_stop(self, attempts: int) -> bool:
        return self.n_complete() >= self.cfg.trials or attempts >= ATTEMPTS_PER_TRIAL * self.cfg.trials + 2

    def run(self) -> TuneOutcome:
        """Open (or resume) the study, measure the baseline, then one candidate per slot until the target."""
        t0 = time.time()
        self.open_study()
        self._resume_state()
        self.measure_baseline()
        attempts = len([r for r in self.measured() if r.state != "RUNNING"])
        dry, stopped = 0, ""
        while not self.should_stop(attempts):
            best = self.best_measured()
            best_pred = best.predicted_tokens_per_s_per_gpu if best else None
            pool = self.propose(best_pred)
            chosen = self.pick(pool, best_pred)
            if chosen is None:
                dry += 1
                if dry >= DRY_ROUNDS:
                    stopped = f"no new feasible candidate worth measuring in {DRY_ROUNDS} rounds of proposals"
                    break
                continue
            dry = 0
            self.measure(*chosen, ROLE_CANDIDATE)
            attempts += 1
            b = self.best_measured()
            self._say(f"best {b.value:,.1f} tokens/s/GPU ({b.label})" if b else "no measured result yet",
                      completed=self.n_complete())
        self.fail_stale_trials()  # orphans too young to judge at the start
        baseline = next((r for r in self.measured() if r.role == ROLE_BASELINE), None)
        return TuneOutcome(study=self.study, baseline=baseline, best=self.best_measured(),
                           counts={k: v for k, v in self.counts.items() if k != "refined"},
                           wall_s=time.time() - t0, stopped=stopped)

    def _say(self, message: str, completed: int | None = None) -> None:
        log.info(message)
        if self.progress is not None:
            self.progress(message, completed)


def run_study(cfg: TuneConfig, progress: Callable[..., None] | None = None) -> TuneOutcome:
    """`Tuner(cfg, progress).run()`."""
    return Tuner(cfg, progress).run()
