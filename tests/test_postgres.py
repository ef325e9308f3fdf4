"""Many tuners on one study in a REAL PostgreSQL server: real worker processes, real signals.

The server is Debian's postgresql-15 (``initdb``/``pg_ctl`` under /usr/lib/postgresql/15/bin, not on PATH; .ci/run
installs the package where it is missing), started by the fixture in a fresh folder as the unprivileged user
``nobody`` (PostgreSQL refuses root), listening on 127.0.0.1 at a free port. The folder is made with mkdtemp in
the temp dir rather than under tmp_path, because pytest's tmp_path is under a root-only folder that nobody cannot
enter; the fixture removes it.

Workers are ``python3 -c`` processes calling ``attune.api.tune.tune`` on the sim runner with a 1 s heartbeat and a
3 s grace period; a trial is made slow by wrapping the sim runner's ``_execute`` in the worker script (a sleep, or
a child process tree started with ``attune.runners.procs.run_logged`` as the torch runner starts torchrun).
Each test prints one FAULT line (workers, trials completed, failed, retried, time to detect a killed worker).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import psutil
import pytest

pytestmark = pytest.mark.slow

PG_BIN = Path("/usr/lib/postgresql/15/bin")
HEARTBEAT_S, GRACE_S = 1, 3
ROOT = str(Path(__file__).resolve().parents[1])


def _skip_reason() -> str | None:
    if not (PG_BIN / "initdb").exists():
        return f"PostgreSQL 15 server binaries not found in {PG_BIN} (apt-get install postgresql-15)"
    if shutil.which("runuser") is None:
        return "runuser not found (needed to run PostgreSQL as an unprivileged user)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "the psycopg driver is not installed (pip install -e '.[postgres]')"
    return None


def _as_nobody(*cmd) -> list[str]:
    return ["runuser", "-u", "nobody", "--", *map(str, cmd)] if os.geteuid() == 0 else list(map(str, cmd))


class Server:
    """A throwaway PostgreSQL server."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="attune-pg-"))
        os.chmod(self.dir, 0o755)
        if os.geteuid() == 0:
            shutil.chown(self.dir, "nobody")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.data = self.dir / "data"
        subprocess.run(_as_nobody(PG_BIN / "initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync"),
                       check=True, capture_output=True)
        self.opts = f"-h 127.0.0.1 -p {self.port} -k {self.dir} -c max_connections=200 -c fsync=off"
        self.pg_ctl("start")
        self.url = f"postgresql://postgres:unused-password@127.0.0.1:{self.port}/postgres"

    def pg_ctl(self, action: str) -> float:
        t0 = time.monotonic()
        subprocess.run(_as_nobody(PG_BIN / "pg_ctl", "-D", self.data, "-o", self.opts, "-l", self.dir / "log",
                                  "-w", "-m", "fast", action), check=True, capture_output=True)
        return time.monotonic() - t0

    def close(self):
        try:
            self.pg_ctl("stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def pg():
    why = _skip_reason()
    if why:
        pytest.skip(why)
    s = Server()
    yield s
    s.close()


# The worker: attune's tune on the sim runner against the shared study. DELAY_S slows each trial down; TREE=1
# makes each trial a child process tree (what the torch runner has) that lives DELAY_S seconds.
_WORKER = """
import os, sys, time
from attune.runners.sim import SimRunner
from attune.runners.procs import run_logged
_orig = SimRunner._execute
def _slow(self, spec, trial_dir):
    d = float(os.environ.get("DELAY_S", "0"))
    if os.environ.get("TREE") == "1" and trial_dir is not None:
        run_logged([sys.executable, "-c", "import subprocess, sys, time; "
                    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(%g)" % d],
                   log_path=trial_dir / "log.txt")
    else:
        time.sleep(d)
    return _orig(self, spec, trial_dir)
SimRunner._execute = _slow
from attune.api.tune import tune
tune(model="Qwen3.6-27B", gpus="8xH200", runner="sim", sampler="tpe", candidates=4, trials=int(sys.argv[3]),
     storage=sys.argv[1], study_name=sys.argv[2], out=sys.argv[4], heartbeat_interval_s=HB, grace_period_s=GRACE)
""".replace("HB", str(HEARTBEAT_S)).replace("GRACE", str(GRACE_S))


def _worker(pg, study, trials, out, delay=0.0, tree=False) -> subprocess.Popen:
    env = dict(os.environ, DELAY_S=str(delay), TREE="1" if tree else "0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", _WORKER, pg.url, study, str(trials), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _trials(pg, study):
    try:
        s = optuna.load_study(study_name=study, storage=pg.url.replace("postgresql://", "postgresql+psycopg://"))
    except KeyError:
        return []
    return s.get_trials(deepcopy=False)


def _measured(trials):
    return [t for t in trials if t.user_attrs.get("role")]


def _summary(trials) -> dict:
    m = _measured(trials)
    return dict(completed=sum(t.state.name == "COMPLETE" for t in m), failed=sum(t.state.name == "FAIL" for t in m),
                running=sum(t.state.name == "RUNNING" for t in m),
                retried=sum(1 for t in m if t.user_attrs.get("retry_of") is not None))


def _finish(procs, timeout_s=240):
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append((p.returncode, out))
    return outs


def _no_layout_measured_twice(trials):
    keys = [json.dumps(t.user_attrs["layout"], sort_keys=True) for t in _measured(trials)
            if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(keys) == len(set(keys)), "a layout was measured twice"


def _wait_for(fn, timeout_s, poll_s=0.1):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = fn()
        if v:
            return v
        time.sleep(poll_s)
    return None


def _running_of(pg, study, pid):
    run = [t for t in _measured(_trials(pg, study)) if t.state.name == "RUNNING" and t.user_attrs.get("pid") == pid
           and t.user_attrs.get("role") and t.user_attrs.get("layout")]
    return run[0] if run else None


# ------------------------------------------------------------------------------------------ the faults
def test_three_workers_reach_the_target_together(pg, tmp_path, capsys):
    procs = [_worker(pg, "three", 12, tmp_path / f"w{i}", delay=0.3) for i in range(3)]
    outs = _finish(procs)
    assert all(rc == 0 for rc, _ in outs), outs
    trials = _trials(pg, "three")
    s = _summary(trials)
    assert s["completed"] == 12 and s["running"] == 0
    _no_layout_measured_twice(trials)
    workers = {t.user_attrs["pid"] for t in _measured(trials)}
    assert len(workers) >= 2  # the work was shared
    with capsys.disabled():
        print(f"\nFAULT none: workers 3 (measured by {len(workers)}), completed {s['completed']}, failed {s['failed']}, "
              f"retried {s['retried']}")


def test_sigkilled_worker_trial_fails_within_grace_and_is_retried(pg, tmp_path, capsys):
    procs = [_worker(pg, "killed", 8, tmp_path / f"w{i}", delay=2.0) for i in range(3)]
    victim = procs[0]
    running = _wait_for(lambda: _running_of(pg, "killed", victim.pid), 120)
    assert running is not None, _finish(procs, 5)
    victim.send_signal(signal.SIGKILL)
    t_kill = time.monotonic()
    victim.wait()
    failed = _wait_for(lambda: [t for t in _trials(pg, "killed") if t.number == running.number
                                and t.state.name == "FAIL"], 60, poll_s=0.05)
    detect_s = time.monotonic() - t_kill
    assert failed, "the killed worker's trial never failed"
    assert detect_s <= GRACE_S + 2 * HEARTBEAT_S + 1.0  # grace period + a beat of the survivors + polling
    outs = _finish(procs[1:])
    assert all(rc == 0 for rc, _ in outs), outs
    trials = _trials(pg, "killed")
    s = _summary(trials)
    assert s["completed"] == 8 and s["running"] == 0
    retries = [t for t in _measured(trials) if t.user_attrs.get("retry_of") == running.number]
    assert len(retries) == 1 and retries[0].user_attrs["pid"] != victim.pid
    assert retries[0].user_attrs["layout"] == running.user_attrs["layout"]
    _no_layout_measured_twice(trials)
    with capsys.disabled():
        print(f"\nFAULT sigkill: workers 3 (1 killed), completed {s['completed']}, failed {s['failed']}, "
              f"retried {s['retried']}, killed worker's trial failed {detect_s:.1f} s after the kill "
              f"(grace {GRACE_S} s, heartbeat {HEARTBEAT_S} s)")


def test_server_down_longer_than_the_grace_period_while_two_workers_run(pg, tmp_path, capsys):
    # nobody can beat while the server is down: no worker may fail another's trial as stale when it comes back
    procs = [_worker(pg, "restart", 10, tmp_path / f"w{i}", delay=0.5) for i in range(2)]
    assert _wait_for(lambda: _summary(_trials(pg, "restart"))["completed"] >= 3, 120)
    before = {t.number for t in _measured(_trials(pg, "restart")) if t.state.name == "COMPLETE"}
    t0 = time.monotonic()
    pg.pg_ctl("stop")
    time.sleep(GRACE_S + 1)
    pg.pg_ctl("start")
    down_s = time.monotonic() - t0
    outs = _finish(procs)
    assert all(rc == 0 for rc, _ in outs), [(rc, out[-6000:]) for rc, out in outs if rc != 0]
    trials = _trials(pg, "restart")
    s = _summary(trials)
    after = {t.number for t in _measured(trials) if t.state.name == "COMPLETE"}
    assert before <= after and s["completed"] == 10 and s["running"] == 0 and s["failed"] == 0
    retried_calls = sum(out.count("retrying in") for _, out in outs)
    _no_layout_measured_twice(trials)
    with capsys.disabled():
        print(f"\nFAULT server restart ({down_s:.1f} s): workers 2, completed {s['completed']}, failed {s['failed']}, "
              f"retried {s['retried']}, storage calls retried {retried_calls}, finished trials lost "
              f"{len(before - after)}")


def test_sigint_fails_the_trial_kills_the_tree_and_a_restart_resumes(pg, tmp_path, capsys):
    w = _worker(pg, "sigint", 3, tmp_path / "w0", delay=30.0, tree=True)
    running = _wait_for(lambda: _running_of(pg, "sigint", w.pid), 120)
    assert running is not None, _finish([w], 5)
    # the trial's whole tree: its leaf, the sleeping grandchild, is running (the worker's own source, and so any
    # fork of it, also holds the text "time.sleep(120)": only the leaf's last argument is exactly the sleep)
    tree = _wait_for(lambda: [c for c in psutil.Process(w.pid).children(recursive=True)
                              if c.cmdline()[-1:] == ["import time; time.sleep(120)"]] and
                     psutil.Process(w.pid).children(recursive=True), 30)
    assert tree, "the trial's process tree never started"
    w.send_signal(signal.SIGINT)
    (rc, out), = _finish([w], 60)
    assert rc != 0
    assert _wait_for(lambda: not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 10), \
        "the runner's process tree survived SIGINT"
    t = [t for t in _trials(pg, "sigint") if t.number == running.number][0]
    assert t.state.name == "FAIL" and t.user_attrs["reason"] == "interrupted"
    (rc2, out2), = _finish([_worker(pg, "sigint", 3, tmp_path / "w1", delay=0.2)])
    assert rc2 == 0, out2
    trials = _trials(pg, "sigint")
    s = _summary(trials)
    assert s["completed"] == 3 and s["running"] == 0, (s, out2[-3000:])
    assert [x for x in _measured(trials) if x.user_attrs.get("retry_of") == running.number]
    with capsys.disabled():
        print(f"\nFAULT sigint: workers 1 then 1 restarted, completed {s['completed']}, failed {s['failed']}, "
              f"retried {s['retried']}, process tree of {len(tree)} processes gone")
