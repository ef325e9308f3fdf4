"""Where a study lives: open an Optuna storage from a URL, and survive a database that goes away for a while.

Which storage to use when:

* one machine, one tuner at a time (the default): SQLite, ``sqlite:///out/study.db``. SQLite has one writer at a
  time; a few tuners on the same machine work too (they wait for each other's writes), not tuners on other
  hosts (SQLite over NFS is not safe).
* one machine, no database at all: a journal file, ``--storage study.journal`` (Optuna's append-only log with a
  file lock). It has no heartbeat: a killed tuner's measured trial stays RUNNING there (it never counts).
* many tuners on many hosts (one per node or per slot, restarted ones): PostgreSQL,
  ``postgresql://user:password@host:5432/db`` (the ``postgres`` extra installs the ``psycopg`` driver; a plain
  ``postgresql://`` URL uses it when psycopg2 is not installed), or MySQL, ``mysql+pymysql://...`` (install
  ``pymysql`` yourself). Heartbeats are recorded in the database's own clock, so a tuner killed on any host
  has its trial failed by any other tuner within the grace period.

RDB storages are opened with SQLAlchemy's ``pool_pre_ping`` (a pooled connection the server dropped is replaced
before use), and every call the tuner makes on the storage goes through :class:`RetryingStorage`: an error
that says the connection is gone (server restart, dropped connection, SQLite's "database is locked") is retried
with exponential backoff for up to ``retry_s`` seconds; anything else, or a database still unreachable after
that, raises :class:`StorageUnavailable` with one line naming the URL, password masked.

A retried write whose first attempt reached the database but whose answer was lost can be applied twice: a
trial created twice stays RUNNING without a role and is failed as stale; a second ``tell`` of a finished trial
raises Optuna's ``UpdateFinishedTrialError``, which the tuner already tolerates.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import re
import sqlite3
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy.engine
import sqlalchemy.exc
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages.journal import JournalFileBackend, JournalStorage
from tenacity import RetryError, Retrying, retry_if_exception, stop_after_delay, wait_exponential

from attune.errors import AttuneError, UserInputError

__all__ = ["StorageUnavailable", "BadStorageURL", "StorageHandle", "open_storage", "mask_url", "mask_text", "check_url", "CONNECT_TIMEOUT_S", "is_transient",
           "RetryingStorage", "RetryingHeartbeatStorage", "RETRY_S", "storage_kind"]


log = logging.getLogger(__name__)

# How long a storage call is retried while the database is unreachable, seconds: a PostgreSQL restart takes
# about a second here (pg_ctl restart -m fast, tests/test_postgres.py), a managed database's failover up to a
# minute or two (AWS documents 60-120 s for RDS Multi-AZ); 120 s covers both.
RETRY_S = 120.0
# Backoff between tries, seconds: 0.25 s doubling up to 8 s (tenacity's wait_exponential), so a short restart
# costs well under a second and a long outage about one try every 8 s.
RETRY_FIRST_WAIT_S, RETRY_MAX_WAIT_S = 0.25, 8.0
# Opening retries for at most this long, seconds: long enough for a server that is (re)starting, short enough
# that a wrong host or port is reported quickly.
OPEN_RETRY_S = 20.0
# Default connection timeout, seconds (libpq's / pymysql's connect_timeout; also the most the first connection
# is retried): a reachable database answers within a second; --storage-timeout raises it for a slow one.
CONNECT_TIMEOUT_S = 10.0

# the BaseStorage methods a study calls; each is retried on a transient error
_CALLS = ("create_new_study", "delete_study", "set_study_user_attr", "set_study_system_attr",
          "get_study_id_from_name", "get_study_name_from_id", "get_study_directions", "get_study_user_attrs",
          "get_study_system_attrs", "get_all_studies", "create_new_trial", "set_trial_param",
          "get_trial_id_from_study_id_trial_number", "get_trial_number_from_id", "get_trial_param",
          "set_trial_state_values", "set_trial_intermediate_value", "set_trial_user_attr", "set_trial_system_attr",
          "get_trial", "get_all_trials", "get_n_trials", "get_best_trial", "get_trial_params",
          "get_trial_user_attrs", "get_trial_system_attrs", "check_trial_is_updatable")
_HEARTBEAT_CALLS = ("record_heartbeat", "_get_stale_trial_ids", "get_heartbeat_interval",
                    "get_heartbeat_stale_trial_callback")


class StorageUnavailable(AttuneError):
    """The study's database failed with a permanent error, or stayed unreachable past the retry budget."""

    exit_code = 1


class BadStorageURL(UserInputError):
    """The storage URL cannot be opened: unknown scheme, missing driver, bad credentials or database."""


# Query-string keys whose values are secrets (libpq's password / sslpassword, and the usual token names).
_SECRET_KEYS_RE = re.compile(r"([?&;](?:password|passwd|pwd|pass|sslpassword|secret|token|api_?key)=)[^&;#\s]*",
                             re.IGNORECASE)
# Passwords of the storages opened in this process: masked wherever they appear in text (mask_text).
_SECRETS: set[str] = set()
# The databases Optuna's RDBStorage supports (SQLAlchemy dialect names).
_KINDS = ("sqlite", "postgresql", "postgres", "mysql")
_URL_IN_TEXT_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S+")


def mask_url(url: str) -> str:
    """The URL with every password replaced by ``***`` (``postgresql://u:secret@h/db`` -> ``postgresql://u:***@h/db``).

    The one masking function for every URL attune prints or writes. It errs on the side of masking: the
    password is everything between the user's ``:`` and the LAST ``@`` (so unencoded ``/``, ``:``, ``?``, ``#``
    or ``@`` in it are masked too), and ``?password=``-like query values are masked.
    """
    url = str(url)
    head, sep, rest = url.partition("://")
    if sep:
        at = rest.rfind("@")
        if at >= 0:
            user, colon, _ = rest[:at].partition(":")
            if colon:
                rest = f"{user}:***{rest[at:]}"
        url = head + sep + rest
    return _SECRET_KEYS_RE.sub(lambda m: m.group(1) + "***", url)


def mask_text(text: str) -> str:
    """``text`` with every URL in it masked (:func:`mask_url`): for error messages and log lines."""
    text = _URL_IN_TEXT_RE.sub(lambda m: mask_url(m.group(0)), str(text))
    for secret in sorted(_SECRETS, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def storage_kind(url: str) -> str:
    """``journal`` for a journal file path, else the URL's database: sqlite, postgresql, mysql, ..."""
    if "://" not in url:
        if url.endswith(".journal"):
            return "journal"
        raise BadStorageURL(f"storage {url!r}: allowed sqlite:///PATH, postgresql://..., mysql+pymysql://... or a "
                            f"PATH ending in .journal")
    return url.split("://", 1)[0].split("+", 1)[0]


# SQLite: write-ahead log with synchronous=NORMAL (https://www.sqlite.org/pragma.html#pragma_synchronous: "WAL mode
# is always consistent with synchronous=NORMAL"; a commit survives the process being killed, and only a power loss
# or OS crash can roll back the last commits). The default rollback journal with synchronous=FULL syncs the disk
# two or three times per commit, and a study commits over a hundred times (each trial's attributes): 1.2 s of the
# main command's 13 s on this machine. Readers do not block the writer, so tuners sharing one file wait less.
SQLITE_PRAGMAS = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=NORMAL")
# seconds a connection waits for another writer's lock before SQLite says "database is locked" (Python's default)
SQLITE_BUSY_TIMEOUT_S = 5.0


def _sqlite_creator(url: str) -> Callable[[], Any]:
    """A DB-API connection factory for a SQLite study file with SQLITE_PRAGMAS (SQLAlchemy's own pysqlite
    arguments for a file database: ``check_same_thread=False``, the heartbeat thread shares the pool)."""
    path = sqlalchemy.engine.make_url(url).database

    def connect():
        conn = sqlite3.connect(path, timeout=SQLITE_BUSY_TIMEOUT_S, check_same_thread=False)
        for pragma in SQLITE_PRAGMAS:
            conn.execute(pragma)
        return conn

    return connect


def _rdb_url(url: str) -> str:
    """A plain ``postgresql://`` URL means psycopg2 to SQLAlchemy; use psycopg (3) when only it is installed."""
    if not url.startswith("postgresql://") and not url.startswith("postgres://"):
        return url
    if importlib.util.find_spec("psycopg2") is not None:
        return url
    return "postgresql+psycopg://" + url.split("://", 1)[1]


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_transient(e: BaseException) -> bool:
    """The error says the connection is gone or the database is busy (worth retrying), not that the request
    is wrong: SQLAlchemy's OperationalError / InterfaceError / DisconnectionError, or a DBAPI error that
    invalidated its connection, anywhere in the cause chain (Optuna re-raises them as StorageInternalError)."""
    for x in _chain(e):
        if isinstance(x, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError,
                          sqlalchemy.exc.DisconnectionError)):
            return True
        if isinstance(x, sqlalchemy.exc.DBAPIError) and x.connection_invalidated:
            return True
    return False


# tries of opening a fresh database while other workers create its tables (see open_storage)
CREATE_RACE_TRIES = 5


def _lost_create_race(e: BaseException) -> bool:
    text = " ".join(str(x) for x in _chain(e)).lower()
    return "already exists" in text or "duplicate key value" in text


def _first_line(e: BaseException) -> str:
    for x in _chain(e):
        if isinstance(x, sqlalchemy.exc.DBAPIError) and x.orig is not None:
            e = x.orig
            break
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class _RetryingBase(BaseStorage):
    """A storage whose every call is retried on a transient database error (see the module docstring).

    Wraps the storage a study would use (for an RDB URL, Optuna's cached RDB storage from
    ``optuna.storages.get_storage``). ``retry_s``: the retry budget, seconds.
    """

    def __init__(self, inner: BaseStorage, url: str, retry_s: float = RETRY_S):
        self._inner = inner
        self._url = mask_url(url)
        self._retry_s = retry_s
        self.retries = 0
        """Transient errors retried so far (all calls together)."""
        self.call_wait_s = RETRY_MAX_WAIT_S
        """Longest wait between tries of any other call, seconds (``open_storage`` sets the heartbeat interval
        when heartbeats are on, so a worker finishing a trial during an outage files it soon after)."""
        self.heartbeat_wait_s = RETRY_MAX_WAIT_S
        """Longest wait between tries of a heartbeat call, seconds (``open_storage`` sets half the heartbeat
        interval, so a worker beats again within about one interval of the database coming back)."""
        self._failing = 0  # calls now between a transient error and their next success (any thread)
        self._recovered_at: float | None = None  # time.monotonic() of the last success after a transient error

    def unsettled(self, window_s: float) -> bool:
        """True while a call is failing with a transient error, and for ``window_s`` seconds after the database
        answered again. Nobody could record a heartbeat during the outage, so the tuner does not fail other
        workers' trials as stale until they have had a grace period to beat again."""
        if self._failing:
            return True
        return self._recovered_at is not None and time.monotonic() - self._recovered_at < window_s

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)`` retried on transient errors; StorageUnavailable past the budget."""
        return self._call(fn, self.call_wait_s, *args, **kwargs)

    def _call(self, fn: Callable[..., Any], max_wait_s: float, *args, **kwargs) -> Any:
        failed = False

        def _log(state) -> None:
            nonlocal failed
            if not failed:
                failed = True
                self._failing += 1
            self.retries += 1
            log.warning("study storage %s: %s; retrying in %.1f s", self._url,
                        _first_line(state.outcome.exception()), state.next_action.sleep)

        backoff = wait_exponential(multiplier=RETRY_FIRST_WAIT_S, max=max_wait_s)

        def wait(state) -> float:  # never sleep past the budget: a 10 s budget ends at ~10 s, not at 16
            return max(0.0, min(backoff(state), self._retry_s - (state.seconds_since_start or 0.0) + 0.05))

        try:
            for attempt in Retrying(retry=retry_if_exception(is_transient), reraise=False,
                                    stop=stop_after_delay(self._retry_s), before_sleep=_log, wait=wait):
                with attempt:
                    out = fn(*args, **kwargs)
                    if failed:
                        self._recovered_at = time.monotonic()
                    return out
        except RetryError as e:
            last = e.last_attempt.exception()
            raise StorageUnavailable(f"study storage {self._url} unreachable for {self._retry_s:g} s: "
                                     f"{_first_line(last)}") from None
        except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as e:
            raise StorageUnavailable(f"study storage {self._url}: {_first_line(e)}") from None
        finally:
            if failed:
                self._failing -= 1

    def __getstate__(self):  # Optuna deep-copies studies in places; a storage is shared, not copied
        return self.__dict__

    @property
    def inner(self) -> BaseStorage:
        """The wrapped storage."""
        return self._inner


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return self.call(getattr(self._inner, name), *args, **kwargs)
    method.__name__ = name
    method.__doc__ = f"``{name}`` of the wrapped storage, retried on transient errors."
    return method


def _delegate_heartbeat(name: str):
    def method(self, *args, **kwargs):
        return self._call(getattr(self._inner, name), self.heartbeat_wait_s, *args, **kwargs)
    method.__name__ = name
    method.__doc__ = (f"``{name}`` of the wrapped storage, retried on transient errors at most "
                      f"``heartbeat_wait_s`` apart.")
    return method


def _remove_session(self) -> None:
    self._inner.remove_session()


# the ABC's abstract methods are filled in when the class is built, so the two classes are made with type()
_NS = {n: _delegate(n) for n in _CALLS}
_NS["remove_session"] = _remove_session
RetryingStorage = type("RetryingStorage", (_RetryingBase,), dict(_NS, __doc__=_RetryingBase.__doc__,
                                                                  __module__=__name__))
RetryingHeartbeatStorage = type("RetryingHeartbeatStorage", (RetryingStorage, BaseHeartbeat),
                                dict({n: _delegate_heartbeat(n) for n in _HEARTBEAT_CALLS}, __module__=__name__,
                                     __doc__=_RetryingBase.__doc__ + "\n\nWith Optuna's heartbeat."))


@dataclass(frozen=True, kw_only=True)
class StorageHandle:
    """An opened study storage."""

    storage: RetryingStorage
    """What `optuna.create_study(storage=...)` takes: every call retried on transient errors."""
    rdb: optuna.storages.RDBStorage | None
    """The underlying RDB storage (heartbeats, its SQLAlchemy engine); None for a journal file."""
    url: str
    """The URL as given (use `masked` in messages)."""
    kind: str
    """sqlite, postgresql, mysql, journal, ..."""

    @property
    def masked(self) -> str:
        """The URL with its password masked."""
        return mask_url(self.url)


def _register_secret(url: str) -> None:
    head, sep, rest = url.partition("://")
    at = rest.rfind("@")
    if sep and at >= 0 and ":" in rest[:at]:
        pw = rest[:at].partition(":")[2]
        if len(pw) >= 3:
            _SECRETS.add(pw)
    for m in re.finditer(r"[?&;](?:password|passwd|pwd|pass|sslpassword)=([^&;#\s]{3,})", url, re.IGNORECASE):
        _SECRETS.add(m.group(1))


def check_url(url: str, must_exist: bool = False) -> str:
    """Parse and check a storage URL before connecting; returns its kind. A malformed URL, an unknown scheme, a
    missing folder (sqlite, journal) or, with ``must_exist``, a missing database file raise BadStorageURL
    (exit 2) at once, naming the URL with its password masked."""
    if not isinstance(url, str) or not url.strip() or any(c in url for c in "\n\r\x00"):
        raise BadStorageURL(f"storage {mask_url(str(url))[:200]!r}: must be one line (sqlite:///PATH, "
                            f"postgresql://USER:PASSWORD@HOST:PORT/DB or a PATH ending in .journal)")
    _register_secret(url)
    kind = storage_kind(url)
    masked = mask_url(url)
    if kind == "journal":
        path = Path(url)
    else:
        try:
            u = sqlalchemy.engine.make_url(url)
        except (sqlalchemy.exc.ArgumentError, ValueError) as e:
            raise BadStorageURL(f"storage {masked}: not a database URL ({_first_line(e)})") from None
        if kind not in _KINDS:
            raise BadStorageURL(f"storage {masked}: unknown database {kind!r}; allowed: {', '.join(_KINDS)} "
                                f"or a PATH ending in .journal")
        if kind != "sqlite":
            if not u.host and "host" not in u.query:
                raise BadStorageURL(f"storage {masked}: no host (postgresql://USER:PASSWORD@HOST:PORT/DB)")
            return kind
        if not u.database or u.database == ":memory:" or u.database.startswith("file:"):
            if must_exist:
                raise BadStorageURL(f"storage {masked}: an in-memory SQLite database holds no study")
            return kind
        path = Path(u.database)
    if not path.parent.is_dir():
        raise BadStorageURL(f"storage {masked}: the folder {path.parent} does not exist")
    if path.exists() and not path.is_file():
        raise BadStorageURL(f"storage {masked}: {path} is not a file")
    if must_exist and not path.is_file():
        raise BadStorageURL(f"storage {masked}: no such study database {path}")
    return kind


def open_storage(url: str, *, heartbeat_interval_s: int | None = None, grace_period_s: int | None = None,
                 retry_s: float = RETRY_S, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 must_exist: bool = False) -> StorageHandle:
    """Open the storage at ``url`` (an RDB URL or a ``.journal`` path). The first connection is retried like
    any call while the error is transient (a server still starting); a bad URL, missing driver or refused
    login raises BadStorageURL naming the URL (password masked); a server unreachable past ``retry_s`` s
    raises StorageUnavailable."""
    kind = check_url(url, must_exist=must_exist)
    masked = mask_url(url)
    if kind == "journal":
        return StorageHandle(storage=RetryingStorage(JournalStorage(JournalFileBackend(url)), url, retry_s),
                             rdb=None, url=url, kind=kind)
    engine_kwargs: dict = {"pool_pre_ping": True}
    if kind == "sqlite" and sqlalchemy.engine.make_url(url).database not in (None, "", ":memory:"):
        engine_kwargs["creator"] = _sqlite_creator(url)
    if kind in ("postgresql", "postgres", "mysql") and "connect_timeout" not in url:
        # libpq and pymysql take whole seconds
        engine_kwargs["connect_args"] = {"connect_timeout": max(1, math.ceil(connect_timeout_s))}
    hb = dict(heartbeat_interval=heartbeat_interval_s, grace_period=grace_period_s) if heartbeat_interval_s else {}

    def _open() -> optuna.storages.RDBStorage:
        for attempt in range(CREATE_RACE_TRIES):
            try:
                with warnings.catch_warnings():  # Optuna marks the heartbeat arguments experimental
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    return optuna.storages.RDBStorage(_rdb_url(url), engine_kwargs=engine_kwargs, **hb)
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError) as e:
                # workers starting together on a fresh database all create Optuna's tables; PostgreSQL reports
                # the losers' CREATE TABLE as a duplicate (pg_type unique index) or "already exists". The
                # winner's tables are there on the next try.
                if attempt == CREATE_RACE_TRIES - 1 or not _lost_create_race(e):
                    raise
                time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    probe = RetryingStorage(optuna.storages.InMemoryStorage(), url, min(retry_s, OPEN_RETRY_S, connect_timeout_s))
    try:
        rdb = probe.call(_open)
    except StorageUnavailable as e:
        if "unreachable" in str(e):
            raise
        raise BadStorageURL(f"cannot open the study storage {masked}: {str(e).split(': ', 1)[-1]}") from None
    except (ImportError, ValueError, TypeError, sqlalchemy.exc.ArgumentError) as e:
        raise BadStorageURL(f"cannot open the study storage {masked}: {_first_line(e)}") from None
    cls = RetryingHeartbeatStorage if hb else RetryingStorage
    storage = cls(optuna.storages.get_storage(rdb), url, retry_s)
    if heartbeat_interval_s:
        storage.heartbeat_wait_s = max(RETRY_FIRST_WAIT_S, heartbeat_interval_s / 2)
        storage.call_wait_s = max(RETRY_FIRST_WAIT_S, min(RETRY_MAX_WAIT_S, float(heartbeat_interval_s)))
    return StorageHandle(storage=storage, rdb=rdb, url=url, kind=kind)
