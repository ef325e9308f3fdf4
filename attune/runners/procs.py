"""Process trees of local trials, through psutil: run a command with a time limit, kill all it started.

torchrun starts each worker in a session of its own, so killing torchrun's process group misses them; the
tree is found from parent links instead (``psutil.Process.children(recursive=True)``), snapshotted before
the first signal so that workers re-parented to init when torchrun dies are still killed.
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from attune.runners.supervise import supervised

__all__ = ["KILL_GRACE_S", "ProcessOutcome", "kill_tree", "kill_descendants", "run_logged"]

log = logging.getLogger(__name__)

# Seconds between SIGTERM and SIGKILL when a trial is killed: torchrun forwards SIGTERM to its workers and
# needs a moment to do so; 3 s is torchrun's own default grace on a signal (torch.distributed.elastic).
KILL_GRACE_S = 3.0


@dataclass(frozen=True, kw_only=True)
class ProcessOutcome:
    """How a locally run command ended."""

    returncode: int | None
    """Exit status (negative: killed by that signal); None if it could not be collected."""
    timed_out: bool
    """Whether it ran past its time limit and was killed with its tree."""
    wall_s: float
    """Seconds from start to end, the kill included."""


def _terminate(procs: list[psutil.Process], grace_s: float) -> None:
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def kill_tree(pid: int, grace_s: float = KILL_GRACE_S, include_root: bool = True) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace_s`` s, to ``pid`` and every descendant; returns the pids signalled."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    if include_root:
        procs = [root] + procs
    _terminate(procs, grace_s)
    return [p.pid for p in procs]


def kill_descendants(grace_s: float = KILL_GRACE_S) -> list[int]:
    """Kill every descendant of this process (not the process itself); returns the pids signalled."""
    return kill_tree(psutil.Process().pid, grace_s, include_root=False)


def run_logged(cmd: list[str], *, log_path: Path, env: dict | None = None, timeout_s: float | None = None,
               grace_s: float = KILL_GRACE_S, hold_fds: tuple[int, ...] = ()) -> ProcessOutcome:
    """Run ``cmd`` with stdout and stderr into ``log_path``; past ``timeout_s`` s kill its whole tree.

    The command starts in a session of its own so a terminal's Ctrl-C reaches only the tuner, which then
    kills the tree here before the interrupt propagates. It runs under :mod:`attune.runners.supervise`, which
    kills the whole tree when this process dies (SIGKILL included) and holds ``hold_fds`` (device locks) until
    the last process of the tree has exited.
    """
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "w") as out:
        proc = subprocess.Popen(supervised(cmd), stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, pass_fds=tuple(hold_fds))
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            log.info("pid %d ran past %s s; killing its process tree", proc.pid, timeout_s)
            kill_tree(proc.pid, grace_s)
            rc = proc.wait()
        except BaseException:
            kill_tree(proc.pid, grace_s)
            proc.wait()
            raise
    return ProcessOutcome(returncode=rc, timed_out=timed_out, wall_s=time.monotonic() - t0)
