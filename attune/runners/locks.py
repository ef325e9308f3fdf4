"""Device locks: on one machine, trials of several tuners never share GPUs or CPU workers.

A torch-runner trial of world size W uses the first W devices of its kind: GPUs ``cuda:0..W-1`` (indices as
``CUDA_VISIBLE_DEVICES`` lists them, when it is set) or CPU worker slots ``cpu0..cpuW-1``. Before it starts, the
trial takes an exclusive ``flock`` on one file per device, ``<lock dir>/<device>.lock``, in sorted order (so two
trials wanting overlapping sets cannot deadlock), and holds them until its process tree is gone. The kernel
drops a ``flock`` when its holder dies, SIGKILL included, so a killed tuner never leaves a device locked.

The lock folder is ``$ATTUNE_LOCK_DIR`` or ``<temp dir>/attune-locks``; tuners that share devices must share
it (they do on one machine by default). On Ray, the per-node trial slot resource (``attune_trial_slot``,
:mod:`attune.runners.ray.jobs`) does the same job across nodes: Ray admits one trial per node at a time.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from pathlib import Path

__all__ = ["DeviceLock", "device_names", "lock_dir", "POLL_S"]

log = logging.getLogger(__name__)

# seconds between tries while another trial holds a device
POLL_S = 0.2


def lock_dir() -> Path:
    """``$ATTUNE_LOCK_DIR`` or ``<temp dir>/attune-locks``."""
    return Path(os.environ.get("ATTUNE_LOCK_DIR") or Path(tempfile.gettempdir()) / "attune-locks")


def device_names(device: str, count: int, visible: str | None = None) -> list[str]:
    """The devices a trial of ``count`` ranks on ``device`` ("cpu" or "cuda") uses: ``cpu0..``, or ``cuda<i>``
    for the first ``count`` physical GPU ids of ``visible`` (``CUDA_VISIBLE_DEVICES``; None: 0..count-1)."""
    if count < 1:
        raise ValueError(f"device count {count}: must be at least 1")
    if device == "cpu":
        return [f"cpu{i}" for i in range(count)]
    if device != "cuda":
        raise ValueError(f"device {device!r}: allowed cpu, cuda")
    ids = [x.strip() for x in visible.split(",") if x.strip()] if visible else [str(i) for i in range(count)]
    return [f"cuda{i}" for i in ids[:count]]


class DeviceLock:
    """Exclusive locks on a set of devices for the duration of a ``with`` block (see the module docstring).

    ``names``: device names from :func:`device_names`; ``folder``: the lock folder (default :func:`lock_dir`);
    ``timeout_s``: give up with TimeoutError after this many seconds of waiting (None: wait as long as it takes).
    """

    def __init__(self, names: list[str], folder: Path | None = None, timeout_s: float | None = None):
        self.names = sorted(set(names))
        self.folder = Path(folder) if folder else lock_dir()
        self.timeout_s = timeout_s
        self.waited_s = 0.0
        """Seconds spent waiting for another trial to release the devices."""
        self._fds: list[int] = []

    def _try(self, name: str) -> bool:
        fd = os.open(self.folder / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fds.append(fd)
        return True

    def holder(self, name: str) -> int | None:
        """Process id recorded by the last holder of a device's lock (None if never taken)."""
        try:
            text = (self.folder / f"{name}.lock").read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def acquire(self) -> "DeviceLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        said = False
        for name in self.names:
            while not self._try(name):
                if not said:
                    log.info("waiting for %s (held by pid %s)", name, self.holder(name))
                    said = True
                if self.timeout_s is not None and time.monotonic() - t0 > self.timeout_s:
                    self.release()
                    raise TimeoutError(f"device {name} still locked by pid {self.holder(name)} after "
                                       f"{self.timeout_s:g} s ({self.folder})")
                time.sleep(POLL_S)
        self.waited_s = time.monotonic() - t0
        return self

    @property
    def fds(self) -> tuple[int, ...]:
        """The held locks' file descriptors: a trial's supervisor inherits them, so the devices stay locked
        until the trial's last process has exited (attune.runners.supervise)."""
        return tuple(self._fds)

    def release(self) -> None:
        for fd in reversed(self._fds):
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        self._fds = []

    def __enter__(self) -> "DeviceLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
