"""`attune study status`: what a shared study looks like right now, for the people running its workers.

Read-only: workers seen (host and pid of the tuners that measured trials, their last heartbeat in the
database's clock, the trial each is running), trials per state (measured trials and proposals apart), the
best measured trial, stale trials (RUNNING measured trials whose heartbeat is older than the grace period:
their worker is gone, the next `fail_stale_trials` of any worker fails them) and retries (attempt -> retry).
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass, field

import optuna
import sqlalchemy

from attune.errors import UserInputError
from attune.search.coordination import pending_retries
from attune.search.options import GRACE_PERIOD_S
from attune.search.records import TrialRecord, records
from attune.search.storage import CONNECT_TIMEOUT_S, StorageHandle, open_storage

__all__ = ["WorkerSeen", "StaleTrial", "StudyStatus", "study_status"]

# Optuna's heartbeat table (optuna/storages/_rdb/models.py, TrialHeartbeatModel), read as it is: one row per
# trial, the time of its last heartbeat in the database's clock
_HEARTBEATS = sqlalchemy.text("SELECT t.number, h.heartbeat FROM trial_heartbeats h "
                              "JOIN trials t ON t.trial_id = h.trial_id WHERE t.study_id = :sid")


@dataclass(kw_only=True)
class WorkerSeen:
    """A tuner process that measured trials in the study."""

    host: str
    """Host name of the worker."""
    pid: int
    """Process id of the worker on its host."""
    measured: int
    """Measured trials it started (all states)."""
    last_heartbeat_age_s: float | None
    """Seconds since its latest trial heartbeat, database clock (None: no heartbeat recorded, e.g. a journal)."""
    running: int | None
    """Number of the trial it is running now (None: none)."""


@dataclass(kw_only=True)
class StaleTrial:
    """A RUNNING measured trial whose worker stopped beating."""

    number: int
    """Trial number."""
    label: str
    """The layout's label."""
    host: str
    """Host of the worker that ran it."""
    pid: int
    """Process id of that worker."""
    heartbeat_age_s: float
    """Seconds since its last heartbeat (database clock)."""


@dataclass(kw_only=True)
class StudyStatus:
    """The state of one study in one storage."""

    storage: str
    """The storage URL, password masked."""
    study: str
    """The study's name."""
    target: dict = field(default_factory=dict)
    """What the study was made for (model, gpus, runner, ...: its user attributes)."""
    measured_states: dict = field(default_factory=dict)
    """Measured trials per Optuna state (COMPLETE, RUNNING, FAIL, PRUNED = out of memory for real)."""
    proposals: int = 0
    """Trials that were only estimated (proposals and lost claims)."""
    best: TrialRecord | None = None
    """The best completed measured trial (None when none completed)."""
    workers: list[WorkerSeen] = field(default_factory=list)
    """Every worker seen, most recent heartbeat first."""
    stale: list[StaleTrial] = field(default_factory=list)
    """RUNNING measured trials without a heartbeat for longer than the grace period."""
    retries: list[tuple[int, int]] = field(default_factory=list)
    """(failed attempt, its retry) trial numbers."""
    pending_retries: list[int] = field(default_factory=list)
    """Failed attempts of killed or interrupted workers not retried yet."""
    grace_period_s: float = GRACE_PERIOD_S
    """Heartbeat silence after which a RUNNING trial counts as stale, seconds."""

    def lines(self) -> list[str]:
        """The text `attune study status` prints."""
        t = self.target
        out = [f"study '{self.study}' in {self.storage}"]
        if t.get("model"):
            out.append(f"  target: {t.get('model')} on {t.get('gpus')}, runner {t.get('runner')}, "
                       f"engine {t.get('engine')}, space {t.get('space')}")
        states = ", ".join(f"{k} {v}" for k, v in sorted(self.measured_states.items())) or "none"
        out.append(f"  measured trials: {states}; proposals estimated: {self.proposals}")
        if self.best is not None:
            out.append(f"  best so far: trial {self.best.number}: {self.best.label}: {self.best.value:,.1f} "
                       f"tokens/s/GPU ({'measured' if self.best.measured else 'predicted'})")
        else:
            out.append("  best so far: none completed")
        out.append(f"  workers seen: {len(self.workers)}")
        for w in self.workers:
            age = "no heartbeat" if w.last_heartbeat_age_s is None else f"last heartbeat {w.last_heartbeat_age_s:.0f} s ago"
            run = f"running trial {w.running}" if w.running is not None else "idle or gone"
            out.append(f"    {w.host} pid {w.pid}: {w.measured} measured, {age}, {run}")
        out.append(f"  stale trials (no heartbeat for > {self.grace_period_s:g} s): {len(self.stale)}")
        for s in self.stale:
            out.append(f"    trial {s.number} {s.label} on {s.host} pid {s.pid}: silent for {s.heartbeat_age_s:.0f} s")
        if self.retries or self.pending_retries:
            pairs = ", ".join(f"{a} -> {b}" for a, b in self.retries) or "none"
            out.append(f"  retries (attempt -> retry): {pairs}; waiting for a retry: "
                       f"{', '.join(map(str, self.pending_retries)) or 'none'}")
        return out


def _when(v) -> dt.datetime | None:
    if v is None:
        return None
    if isinstance(v, str):
        v = dt.datetime.fromisoformat(v)
    return v.replace(tzinfo=None)


def _heartbeat_ages(h: StorageHandle, study_id: int) -> dict[int, float]:
    """Seconds since each trial's last heartbeat, by trial number (database clock); {} for a journal."""
    if h.rdb is None:
        return {}
    with h.rdb.engine.connect() as con:
        now = _when(con.execute(sqlalchemy.select(sqlalchemy.func.now())).scalar())  # as Optuna's stale check
        rows = con.execute(_HEARTBEATS, {"sid": study_id}).all()
    return {int(n): (now - _when(hb)).total_seconds() for n, hb in rows}


def study_status(storage: str, study: str | None = None, grace_period_s: float | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> StudyStatus:
    """The status of ``study`` in ``storage`` (an RDB URL or a .journal path). ``study`` may be omitted when
    the storage holds one study. ``grace_period_s``: default the one the study's tuners recorded."""
    h = open_storage(storage, must_exist=True, connect_timeout_s=connect_timeout_s)  # never creates a database
    names = [s.study_name for s in optuna.get_all_study_summaries(h.storage, include_best_trial=False)]
    if study is None:
        if len(names) != 1:
            raise UserInputError(f"storage {h.masked} holds {len(names)} studies; name one with --study: "
                                 f"{', '.join(names) or '(none)'}")
        study = names[0]
    elif study not in names:
        raise UserInputError(f"no study '{study}' in {h.masked}; studies there: {', '.join(names) or '(none)'}")
    s = optuna.load_study(study_name=study, storage=h.storage)
    grace = float(grace_period_s or s.user_attrs.get("grace_period_s") or GRACE_PERIOD_S)
    recs = records(s)
    ages = _heartbeat_ages(h, h.storage.get_study_id_from_name(study))
    measured = [r for r in recs if r.is_measured]
    workers: dict[tuple, dict] = {}
    for r in measured:
        if r.host is None or r.pid is None:
            continue
        w = workers.setdefault((r.host, r.pid), dict(measured=0, age=None, running=None))
        w["measured"] += 1
        if r.number in ages and (w["age"] is None or ages[r.number] < w["age"]):
            w["age"] = ages[r.number]
        if r.state == "RUNNING":
            w["running"] = r.number
    seen = sorted((WorkerSeen(host=k[0], pid=int(k[1]), measured=v["measured"], last_heartbeat_age_s=v["age"],
                               running=v["running"]) for k, v in workers.items()),
                  key=lambda w: (w.last_heartbeat_age_s is None, w.last_heartbeat_age_s or 0.0))
    stale = [StaleTrial(number=r.number, label=r.label or "", host=r.host or "?", pid=int(r.pid or 0),
                        heartbeat_age_s=ages[r.number])
             for r in measured if r.state == "RUNNING" and r.number in ages and ages[r.number] > grace]
    done = [r for r in measured if r.completed and r.value is not None]
    best = max(done, key=lambda r: r.value) if done else None
    return StudyStatus(
        storage=h.masked, study=study,
        target={k: v for k, v in s.user_attrs.items() if isinstance(v, (str, int, float))},
        measured_states=dict(Counter(r.state for r in measured)), proposals=len(recs) - len(measured), best=best,
        workers=seen, stale=stale, retries=[(r.retry_of, r.number) for r in measured if r.retry_of is not None],
        pending_retries=[r.number for r in pending_retries(recs)], grace_period_s=grace)
