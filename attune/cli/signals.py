"""SIGTERM handled like Ctrl-C (``kill``, ``timeout``, Slurm and ``docker stop`` send SIGTERM).

Inside :func:`terminate_as_interrupt` a SIGTERM raises :class:`Terminated`, a ``KeyboardInterrupt``: every path
that handles Ctrl-C runs (the running trial's process tree is killed, the trial is marked FAIL with reason
``interrupted``) and the CLI exits with 143 (128 + SIGTERM) after one line.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

__all__ = ["Terminated", "terminate_as_interrupt", "TERMINATED_EXIT"]

TERMINATED_EXIT = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived."""


def _raise(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one interrupt: the clean-up must not be interrupted again
    raise Terminated()


@contextmanager
def terminate_as_interrupt():
    """Within the block, SIGTERM raises Terminated (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
