"""Interrupts and kills without torch (fast lane): SIGTERM as Ctrl-C, the trial supervisor, proposals left RUNNING.
The real torch kill tests are tests/test_kill.py (slow lane)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import psutil
import pytest

from attune.cli.signals import Terminated, terminate_as_interrupt
from attune.runners.locks import DeviceLock
from attune.search.interrupt import fail_left_running

ROOT = str(Path(__file__).resolve().parents[1])


def test_sigterm_raises_terminated_inside_the_block_only():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        with terminate_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) is before
    assert issubclass(Terminated, KeyboardInterrupt)  # every Ctrl-C path (tree kill, trial FAIL) runs


def test_interrupted_tuner_fails_its_untold_trials():
    study = optuna.create_study(direction="maximize")
    mine = [study.ask() for _ in range(3)]
    study.tell(mine[0], 1.0)
    other = study.ask()  # another worker's trial: not this tuner's to fail
    assert fail_left_running(study, [t.number for t in mine]) == 2
    states = {t.number: t.state for t in study.trials}
    assert states[mine[1].number] == states[mine[2].number] == optuna.trial.TrialState.FAIL
    assert states[other.number] == optuna.trial.TrialState.RUNNING


# A stand-in tuner: takes a device lock, runs a command under the supervisor through run_logged (the command
# starts a grandchild in a session of its own, as torchrun's workers are), prints the pids, then waits.
_TUNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from attune.runners.locks import DeviceLock
    from attune.runners.procs import run_logged
    lock = DeviceLock(["cpu0"], folder=Path(sys.argv[1])).acquire()
    cmd = [sys.executable, "-c", "import subprocess, sys, time; "
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
           "time.sleep(60)"]
    run_logged(cmd, log_path=Path(sys.argv[2]), hold_fds=lock.fds)
""")


def _lives(p: psutil.Process) -> bool:
    """Whether a process of the trial tree still runs: gone, reaped or a zombie (exited, its files closed) is not."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigkilled_tuner_takes_its_trial_tree_down_and_keeps_the_lock_until_then(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tuner = subprocess.Popen([sys.executable, "-c", _TUNER, str(tmp_path), str(tmp_path / "log.txt")], env=env)
    root = psutil.Process(tuner.pid)
    t0 = time.monotonic()
    tree: list[psutil.Process] = []
    while time.monotonic() - t0 < 30:  # the command and its grandchild running (under the supervisor)
        time.sleep(0.05)
        tree = root.children(recursive=True)
        try:
            if sum("time.sleep(60)" in " ".join(p.cmdline()) for p in tree) >= 2:
                break
        except psutil.NoSuchProcess:
            pass
    else:
        raise AssertionError(f"the trial did not start: {tree}")
    tuner.kill()
    tuner.wait()
    fd = os.open(tmp_path / "cpu0.lock", os.O_RDWR)
    try:
        t_kill = time.monotonic()
        while time.monotonic() - t_kill < 5:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                got = True
            except BlockingIOError:
                got = False
            if got:  # the tree is looked at after the lock is taken: a process dying in between is not a leak
                alive = [p for p in tree if _lives(p)]
                assert not alive, f"the device lock was free while {alive} lived"
                break
            time.sleep(0.02)
        took = time.monotonic() - t_kill
    finally:
        os.close(fd)
    assert took < 2.0, f"the trial tree lived {took:.2f} s after the tuner's SIGKILL"
    assert not [p for p in tree if _lives(p)]


def test_device_lock_exposes_its_fds(tmp_path):
    with DeviceLock(["cpu0", "cpu1"], folder=tmp_path) as lk:
        assert len(lk.fds) == 2 and all(isinstance(fd, int) for fd in lk.fds)
    assert lk.fds == ()
