"""A trial's supervisor: the process between the tuner and the trial's command (torchrun and its workers).  # entry point

``python -m attune.runners.supervise --parent PID -- CMD...`` (built by :func:`supervised`, started by
:func:`attune.runners.procs.run_logged`):

* it asks the kernel for SIGTERM when its parent (the tuner) dies, SIGKILL included (``prctl(PR_SET_PDEATHSIG)``,
  Linux ``man 2 prctl``), and exits at once if the tuner is already gone;
* it becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): torchrun's workers run in sessions of their own and
  are re-parented to it, not to init, when torchrun dies, so it always sees the whole tree;
* on SIGTERM or SIGINT (the tuner's death, a kill of the tree, a Ctrl-C) it sends SIGTERM to every descendant,
  SIGKILL after ``--grace`` s, and exits only when every one of them is gone;
* it holds the trial's device-lock file descriptors (inherited through ``pass_fds``): the kernel drops a
  ``flock`` when the last descriptor of it closes, so the devices stay locked until the trial's last process has
  exited, even when the tuner was killed with SIGKILL (:mod:`attune.runners.locks`).

Otherwise it waits for the command and exits with its status (128 + N for a command killed by signal N).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

import psutil

__all__ = ["supervised", "main", "GRACE_S"]

# Seconds between SIGTERM and SIGKILL for the trial's processes when the tuner dies: the kill tests ask for no
# training process alive 2 s after the tuner's death; a worker that ignores SIGTERM gets SIGKILL after this.
GRACE_S = 1.0
# prctl options (linux/prctl.h)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


class _Stop(Exception):
    pass


def supervised(cmd: list[str], grace_s: float = GRACE_S) -> list[str]:
    """``cmd`` run under the supervisor, for this process as the parent."""
    return [sys.executable, "-m", "attune.runners.supervise", "--parent", str(os.getpid()), "--grace",
            f"{grace_s:g}", "--", *cmd]


def _prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: the tuner's own kill of the tree is all there is
        return False


def _kill_all(grace_s: float) -> None:
    """SIGTERM every descendant, SIGKILL what is left after grace_s, until none is left (orphans re-parented
    to this subreaper included)."""
    me = psutil.Process()
    deadline = time.monotonic() + grace_s
    sig = signal.SIGTERM
    while True:
        procs = me.children(recursive=True)
        if not procs:
            break
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=0.1)
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
    _reap()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attune.runners.supervise")
    ap.add_argument("--parent", type=int, required=True, help="the tuner's pid: its death stops the trial")
    ap.add_argument("--grace", type=float, default=GRACE_S, help="seconds between SIGTERM and SIGKILL")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command after --")

    def stop(signum, frame):
        raise _Stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, stop)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != args.parent:  # the tuner died before the death signal was armed
        return 128 + signal.SIGTERM
    proc = None
    try:
        proc = subprocess.Popen(cmd)
        rc = proc.wait()
        _kill_all(args.grace)  # anything the command left behind (re-parented orphans)
        return rc if rc >= 0 else 128 - rc
    except _Stop:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _kill_all(args.grace)
        return 128 + signal.SIGTERM
    except OSError as e:
        print(f"attune supervise: cannot start {cmd[0]}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
