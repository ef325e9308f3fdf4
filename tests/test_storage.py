"""Shared studies without a server: storage URLs and retries, claims between workers, retries of killed workers'
trials, device locks, and `attune study status` on SQLite. The PostgreSQL tests are in test_postgres.py."""

import datetime as dt
import json
import subprocess
import sys
import time

import optuna
import pytest
import sqlalchemy.exc

from attune.api.study import study_status
from attune.api.tune import tune_config
from attune.cli import main
from attune.reporting import write_csv
from attune.runners.locks import DeviceLock, device_names
from attune.search.coordination import CLAIM, contest, new_measured_trial, pending_retries, slots
from attune.search.records import TrialRecord, records
from attune.search.storage import (
    BadStorageURL,
    RetryingStorage,
    StorageUnavailable,
    is_transient,
    mask_url,
    open_storage,
    storage_kind,
)
from attune.search.tuner import Tuner

# plain TPE: the model sampler scores the whole space first (tens of seconds), not what these tests are about
FAST = dict(model="Qwen3.6-27B", gpus="8xH200", candidates=8, sampler="tpe")


def _dropped() -> sqlalchemy.exc.OperationalError:
    return sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("server closed the connection unexpectedly"))


# ------------------------------------------------------------------------------------------ storage
@pytest.mark.parametrize("url,masked", [
    ("postgresql://tuner:s3cret@db:5432/attune", "postgresql://tuner:***@db:5432/attune"),
    ("postgresql+psycopg://tuner:pw@10.0.0.1/a", "postgresql+psycopg://tuner:***@10.0.0.1/a"),
    ("postgresql://tuner@db/attune", "postgresql://tuner@db/attune"),
    ("sqlite:////tmp/study.db", "sqlite:////tmp/study.db"),
])
def test_mask_url(url, masked):
    assert mask_url(url) == masked


def test_storage_kinds_and_bad_urls(tmp_path):
    assert storage_kind("sqlite:///x.db") == "sqlite" and storage_kind("postgresql+psycopg://h/d") == "postgresql"
    assert storage_kind(str(tmp_path / "s.journal")) == "journal"
    with pytest.raises(BadStorageURL, match="allowed sqlite"):
        storage_kind("study.db")
    with pytest.raises(BadStorageURL, match="nosuchdb://u:\\*\\*\\*@h/d"):
        open_storage("nosuchdb://u:pw@h/d")


def test_transient_errors_are_recognised_through_optuna():
    wrapped = optuna.exceptions.StorageInternalError("An exception is raised during the commit.")
    wrapped.__cause__ = _dropped()
    assert is_transient(_dropped()) and is_transient(wrapped)
    assert not is_transient(sqlalchemy.exc.IntegrityError("INSERT", {}, Exception("duplicate key")))
    assert not is_transient(ValueError("no")) and not is_transient(optuna.exceptions.UpdateFinishedTrialError("x"))


def test_transient_error_retried_then_permanent_reported(tmp_path):
    s = RetryingStorage(optuna.storages.InMemoryStorage(), "postgresql://u:pw@db/a", retry_s=5)
    calls = []

    def flaky():
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise _dropped()
        return "ok"

    assert s.call(flaky) == "ok" and s.retries == 2 and len(calls) == 3
    assert calls[1] - calls[0] >= 0.2  # backoff, not a busy loop

    def gone():
        raise _dropped()

    short = RetryingStorage(optuna.storages.InMemoryStorage(), "postgresql://u:pw@db/a", retry_s=0.6)
    with pytest.raises(StorageUnavailable, match=r"postgresql://u:\*\*\*@db/a unreachable for 0.6 s") as e:
        short.call(gone)
    assert "pw" not in str(e.value)

    def wrong():
        raise sqlalchemy.exc.ProgrammingError("SELECT", {}, Exception("relation does not exist"))

    t0 = time.monotonic()
    with pytest.raises(StorageUnavailable, match="relation does not exist"):
        s.call(wrong)
    assert time.monotonic() - t0 < 0.2  # a permanent error is not retried


def test_an_outage_keeps_the_storage_unsettled_for_a_grace_period():
    """Nobody can beat while the database is down: staleness is not judged until a grace period after it is back."""
    s = RetryingStorage(optuna.storages.InMemoryStorage(), "postgresql://u:pw@db/a", retry_s=5)
    assert not s.unsettled(0.3)
    seen = []

    def flaky():
        seen.append(s.unsettled(0.3))  # while the call is failing, the storage is unsettled
        if len(seen) < 2:
            raise _dropped()
        return "ok"

    assert s.call(flaky) == "ok" and seen == [False, True]
    assert s.unsettled(0.3)
    time.sleep(0.35)
    assert not s.unsettled(0.3)
    assert s.call(lambda: 1) == 1 and not s.unsettled(0.3)  # a call that never failed settles nothing


def test_heartbeat_retries_wait_at_most_half_an_interval(tmp_path):
    h = open_storage(f"sqlite:///{tmp_path / 's.db'}", heartbeat_interval_s=1, grace_period_s=3)
    assert h.storage.heartbeat_wait_s == 0.5
    calls = []
    inner = h.storage.inner

    class Flaky:  # the storage's own record_heartbeat, failing 5 times: waits 0.25, 0.5, 0.5, 0.5, 0.5 s
        def __getattr__(self, name):
            return getattr(inner, name)

        def record_heartbeat(self, trial_id):
            calls.append(time.monotonic())
            if len(calls) <= 5:
                raise _dropped()

    h.storage._inner = Flaky()
    h.storage.record_heartbeat(0)
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    assert len(calls) == 6 and max(gaps) < 0.8, gaps


def test_unreachable_server_is_one_line_with_the_password_masked():
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailable) as e:
        open_storage("postgresql://tuner:topsecret@127.0.0.1:1/attune", retry_s=1)
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert "topsecret" not in msg and "tuner:***@127.0.0.1:1" in msg and "\n" not in msg


def test_sqlite_and_journal_open_with_and_without_heartbeat(tmp_path):
    h = open_storage(f"sqlite:///{tmp_path / 's.db'}", heartbeat_interval_s=1, grace_period_s=3)
    assert h.rdb is not None and h.storage.get_heartbeat_interval() == 1
    j = open_storage(str(tmp_path / "s.journal"))
    assert j.rdb is None and j.kind == "journal"
    study = optuna.create_study(storage=j.storage, study_name="x")
    study.tell(study.ask(), 1.0)
    assert len(optuna.load_study(study_name="x", storage=open_storage(str(tmp_path / "s.journal")).storage).trials) == 1


# ------------------------------------------------------------------------------------------ claims
def _study(tmp_path, name="c"):
    h = open_storage(f"sqlite:///{tmp_path / 'c.db'}")
    return optuna.create_study(storage=h.storage, study_name=name, load_if_exists=True), h.storage


def test_a_layout_is_claimed_once_and_a_withdrawn_claim_frees_it(tmp_path):
    study, storage = _study(tmp_path)
    a = new_measured_trial(study, storage, None, {}, "K")
    b = new_measured_trial(study, storage, None, {}, "K")
    other = new_measured_trial(study, storage, None, {}, "L")
    assert study.trials[a.number].state == optuna.trial.TrialState.RUNNING
    assert study.trials[a.number].user_attrs[CLAIM] == "K"
    # both wrote their claims before either read: a sees b and withdraws; b then sees no live rival
    assert "claimed by trial" in contest(study, a, "K", target=10, rounds=1)
    assert contest(study, b, "K", target=10) is None
    assert contest(study, other, "L", target=10) is None
    # a later claim on K loses to b while b runs, and wins once b failed (a killed worker's trial is retried)
    c = new_measured_trial(study, storage, None, {}, "K")
    assert contest(study, c, "K", target=10) is not None
    study.tell(b, state=optuna.trial.TrialState.FAIL)
    d = new_measured_trial(study, storage, None, {}, "K")
    assert contest(study, d, "K", target=10) is None


def test_no_slot_beyond_the_trial_target(tmp_path):
    study, storage = _study(tmp_path)
    done = new_measured_trial(study, storage, None, {}, "A")
    done.set_user_attr("role", "candidate")
    study.tell(done, 1.0)
    running = new_measured_trial(study, storage, None, {}, "B")
    assert contest(study, running, "B", target=2) is None
    assert slots(study.get_trials()) == (1, 1)
    late = new_measured_trial(study, storage, None, {}, "C")
    assert "no free measurement slot" in contest(study, late, "C", target=2)
    assert slots(study.get_trials()) == (1, 1)  # the loser withdrew


def test_pending_retries():
    def rec(n, state, **kw):
        return TrialRecord(number=n, state=state, role="candidate", layout={"tp": 1}, **kw)

    rs = [rec(0, "COMPLETE", outcome="ok"), rec(1, "FAIL"), rec(2, "FAIL", outcome="failed"),
          rec(3, "FAIL", reason="interrupted"), rec(4, "RUNNING", retry_of=3), rec(5, "FAIL", retry_of=1),
          rec(6, "FAIL")]
    # 1 was retried by 5 (which failed: no second retry); 3 is being retried by 4; 2 failed on its runner
    assert [r.number for r in pending_retries(rs)] == [6]


@pytest.mark.slow  # waits out a grace period, then tunes (about 10 s)
def test_killed_workers_trial_is_retried_once_with_the_link(tmp_path):
    cfg = tune_config(**FAST, trials=2, out=tmp_path, heartbeat_interval_s=1, grace_period_s=2)
    t = Tuner(cfg)
    study = t.open_study()
    lay = cfg.baseline
    dead = new_measured_trial(study, t._handle.storage, cfg.space.params_for(lay, cfg.model, cfg.workload),
                              t._dists, "dead-claim")
    rec = TrialRecord(role="baseline", host="elsewhere", pid=1)
    rec.set_estimate(t.estimate(lay))
    rec.save(dead)
    t._rdb.record_heartbeat(t._rdb.get_trial_id_from_study_id_trial_number(
        t._rdb.get_study_id_from_name(cfg.study_name), dead.number))
    time.sleep(3.2)  # past the grace period: the worker is gone
    Tuner(cfg).run()
    rs = records(optuna.load_study(study_name=cfg.study_name, storage=cfg.storage))
    failed = [r for r in rs if r.number == dead.number][0]
    assert failed.state == "FAIL" and failed.outcome is None
    retries = [r for r in rs if r.retry_of == dead.number]
    assert len(retries) == 1 and retries[0].state == "COMPLETE" and retries[0].role == "baseline"
    assert retries[0].label == failed.label
    assert not [r for r in rs if r.state == "RUNNING"]
    st = study_status(cfg.storage)
    assert st.retries == [(dead.number, retries[0].number)] and st.pending_retries == []
    assert st.measured_states["COMPLETE"] == 2 and st.best is not None
    assert {(w.host, w.pid) for w in st.workers} >= {("elsewhere", 1)}
    csv = (tmp_path / "t.csv")
    write_csv(optuna.load_study(study_name=cfg.study_name, storage=cfg.storage), csv)
    assert f",{dead.number}," in [ln for ln in csv.read_text().splitlines() if ln.startswith(f"{retries[0].number},")][0]


# ------------------------------------------------------------------------------------------ study status
def test_study_status_cli(tmp_path, capsys):
    out = tmp_path / "s"
    Tuner(tune_config(**FAST, trials=2, out=out, study_name="shared")).run()  # the study `attune tune` makes
    url = f"sqlite:///{out / 'study.db'}"
    assert main(["study", "status", "--storage", url]) == 0
    text = capsys.readouterr().out
    assert "study 'shared'" in text and "COMPLETE 2" in text and "workers seen: 1" in text and "best so far: trial" in text
    assert "stale trials (no heartbeat for > 20 s): 0" in text
    assert main(["study", "status", "--storage", url, "--study", "shared", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["measured_states"] == {"COMPLETE": 2} and len(d["workers"]) == 1
    assert main(["study", "status", "--storage", url, "--study", "nope"]) == 2
    assert "no study 'nope'" in capsys.readouterr().err


def test_stale_trial_shown_by_status(tmp_path):
    h = open_storage(f"sqlite:///{tmp_path / 'st.db'}", heartbeat_interval_s=1, grace_period_s=2)
    study = optuna.create_study(storage=h.storage, study_name="st")
    t = new_measured_trial(study, h.storage, None, {}, "K")
    TrialRecord(role="candidate", host="node7", pid=4242, label="TP1 PP2").save(t)
    h.rdb.record_heartbeat(h.rdb.get_trial_id_from_study_id_trial_number(h.rdb.get_study_id_from_name("st"), t.number))
    assert study_status(f"sqlite:///{tmp_path / 'st.db'}", grace_period_s=2).stale == []
    time.sleep(3.2)  # SQLite keeps heartbeat times to the second
    st = study_status(f"sqlite:///{tmp_path / 'st.db'}", grace_period_s=2)
    assert [(s.number, s.host, s.pid) for s in st.stale] == [(t.number, "node7", 4242)]
    assert st.workers[0].running == t.number and st.workers[0].last_heartbeat_age_s >= 2


# ------------------------------------------------------------------------------------------ device locks
def test_device_names():
    assert device_names("cpu", 2) == ["cpu0", "cpu1"]
    assert device_names("cuda", 2, "3,5,7") == ["cuda3", "cuda5"]
    assert device_names("cuda", 2) == ["cuda0", "cuda1"]
    with pytest.raises(ValueError):
        device_names("tpu", 1)


_HOLD = ("import sys, time; from attune.runners.locks import DeviceLock; "
         "l = DeviceLock(['cpu0', 'cpu1'], sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)")


def test_device_lock_excludes_and_dies_with_its_holder(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(TimeoutError, match="cpu1 still locked by pid"):  # overlapping set: cpu1
            DeviceLock(["cpu1", "cpu2"], tmp_path, timeout_s=0.5).acquire()
        with DeviceLock(["cpu2", "cpu3"], tmp_path, timeout_s=0.5):  # a disjoint set is free
            pass
    finally:
        p.kill()  # SIGKILL: the kernel drops its locks
        p.wait()
    t0 = dt.datetime.now()
    with DeviceLock(["cpu0", "cpu1"], tmp_path, timeout_s=5) as lock:
        assert lock.waited_s < 1.0 and (dt.datetime.now() - t0).total_seconds() < 2
