"""Killed tuners (issue 23): SIGTERM and SIGKILL of `attune tune --runner torch` while a trial trains.

Each test starts the real CLI on the torch runner (tiny model, 2 CPU workers), waits until the trial's torch
workers train, kills the tuner, and checks:

* no process of the trial (supervisor, torchrun, workers) is alive 2 s after the kill;
* the rerun, started at once, never runs a worker while a process of the killed trial still lives (the
  trial's device locks are held until its last process exited);
* after the rerun no trial is RUNNING, the completed measured trials are exactly --trials and no layout was
  completed twice (0 lost, 0 duplicated).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest

from attune.search.records import records

pytestmark = pytest.mark.slow

ROOT = str(Path(__file__).resolve().parents[1])
WORKER = "attune.runners.torch_worker"
DEAD_AFTER_S = 2.0


def _tune(out: Path, locks: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), ATTUNE_LOCK_DIR=str(locks))
    cmd = [sys.executable, "-c", "import sys; from attune.cli import main; sys.exit(main())", "tune",
           "--model", "tiny-llama", "--gpus", "2xcpu", "--runner", "torch", "--trials", "2", "--steps", "12",
           "--candidates", "4", "--heartbeat", "1", "--grace-period", "3", "--no-verify", "--out", str(out)]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _workers(root: psutil.Process) -> list[psutil.Process]:
    out = []
    try:
        for p in root.children(recursive=True):
            try:
                if WORKER in " ".join(p.cmdline()):
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                pass
    except psutil.NoSuchProcess:
        pass
    return out


def _all_workers(out_dir: Path) -> list[psutil.Process]:
    """Torch workers of this test's study (other processes on the machine are not ours)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or ())
            if WORKER in cmd and str(out_dir) in cmd and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return out


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_training(tuner: subprocess.Popen, timeout_s: float = 240.0) -> list[psutil.Process]:
    """The trial's processes (everything below the tuner) once both torch workers have run for a second."""
    root = psutil.Process(tuner.pid)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        assert tuner.poll() is None, "the tuner ended before a trial trained"
        w = _workers(root)
        if len(w) >= 2 and min(time.time() - p.create_time() for p in w) > 1.0:
            procs = root.children(recursive=True)
            cmds = " ".join(" ".join(p.cmdline()) for p in procs if _alive(p))
            if "torch.distributed.run" in cmds and len(procs) >= 3:
                return procs
        time.sleep(0.1)
    raise AssertionError("no trial started training")


def _kill_and_watch(tuner: subprocess.Popen, sig: int, rerun_args: tuple) -> tuple[float, subprocess.Popen]:
    """Kill the tuner mid-trial, start the rerun at once; returns (seconds until the trial's last process
    was gone, the rerun)."""
    procs = _wait_training(tuner)  # (supervisor,) torchrun, 2 workers
    t_kill = time.monotonic()
    os.kill(tuner.pid, sig)
    rerun = _tune(*rerun_args)
    old = {p.pid for p in procs}
    t_gone = None
    overlap = []
    while time.monotonic() - t_kill < 30:
        left = [p for p in procs if _alive(p)]
        if not left and t_gone is None:
            t_gone = time.monotonic() - t_kill
        if t_gone is None:
            overlap += [p.pid for p in _all_workers(rerun_args[0]) if p.pid not in old]
        else:
            break
        time.sleep(0.02)
    assert t_gone is not None, "the killed trial's processes are still alive after 30 s"
    assert not overlap, f"the rerun ran workers {sorted(set(overlap))} while the killed trial's processes lived"
    return t_gone, rerun


def _check_study(out: Path) -> None:
    url = f"sqlite:///{out / 'study.db'}"
    study = optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert optuna.trial.TrialState.RUNNING not in states, "a trial was left RUNNING"
    measured = [r for r in records(study) if r.is_measured]
    done = [r for r in measured if r.state == "COMPLETE"]
    assert len(done) == 2, [(r.number, r.state, r.reason) for r in measured]  # 0 lost
    keys = [str(sorted((r.layout or {}).items())) for r in done]
    assert len(set(keys)) == len(keys), "a layout was measured to completion twice"  # 0 duplicated


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killed_tuner_leaves_no_training_and_loses_nothing(sig, tmp_path):
    out, locks = tmp_path / "out", tmp_path / "locks"
    tuner = _tune(out, locks, tmp_path / "first.log")
    try:
        t_gone, rerun = _kill_and_watch(tuner, sig, (out, locks, tmp_path / "rerun.log"))
        rc = tuner.wait(timeout=30)
        first = (tmp_path / "first.log").read_text()
        print(f"{sig.name}: the trial's last process was gone {t_gone:.2f} s after the kill")
        assert t_gone <= DEAD_AFTER_S, f"the trial's processes lived {t_gone:.2f} s after {sig.name}"
        if sig == signal.SIGTERM:
            assert rc == 143 and "terminated" in first and "Traceback" not in first, first[-2000:]
        rerun_rc = rerun.wait(timeout=600)
        log = (tmp_path / "rerun.log").read_text()
        assert rerun_rc == 0, log[-3000:]
        _check_study(out)
    finally:
        for p in (tuner, locals().get("rerun")):
            if p is not None and p.poll() is None:
                p.kill()
