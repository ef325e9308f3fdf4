"""The runner registry: the only place that names the concrete runners.

=============  ===========================================================================  ==========
name           what runs, where                                                             measured
=============  ===========================================================================  ==========
``sim``        the calibrated analytic model (``attune.estimator``), in process              no
``torch``      attune's torch trainer under torchrun on this machine                         yes
``slime``      slime's launch as a Ray job on the cluster of ``cluster_file``                yes
``ray-torch``  attune's torch trainer as a Ray job (``--runner slime --trial-kind torch``)   yes
``replay``     answers from a table of measured outcomes (``measurements=``)               yes
=============  ===========================================================================  ==========

Callers pick a runner by name here and from then on read ``runner.capabilities`` (or
:func:`runner_capabilities` before constructing one); they never compare names.
"""

from __future__ import annotations

from attune.errors import UserInputError
from attune.runners.base import Capabilities, Runner
from attune.runners.ray.runner import RayTorchRunner
from attune.runners.replay import ReplayRunner
from attune.runners.sim import SimRunner
from attune.runners.slime.runner import SlimeRunner
from attune.runners.torch_runner import TorchRunner

__all__ = ["get_runner", "runner_names", "runner_capabilities", "runner_class", "resolve_runner", "TRIAL_KINDS",
           "UnknownRunner"]

_RUNNERS: dict[str, type[Runner]] = {
    "sim": SimRunner,
    "torch": TorchRunner,
    "slime": SlimeRunner,
    "ray-torch": RayTorchRunner,
    "replay": ReplayRunner,
}

# what each Ray job runs (`--trial-kind`): a runner's own trials ("slime"), or the torch trainer's ("torch"), which on
# a runner that submits Ray jobs is the runner registered here; a runner that runs where it stands ignores the kind
TRIAL_KINDS = ("slime", "torch")
_BY_TRIAL_KIND: dict[tuple[str, str], str] = {("slime", "torch"): "ray-torch"}


class UnknownRunner(UserInputError):
    """A runner name the registry does not know (exit code 2)."""


def runner_names(*, selectable: bool = False, measured: bool | None = None, verifiable: bool | None = None,
                 needs_measurements: bool | None = None) -> tuple[str, ...]:
    """Registered runner names, the default (``sim``) first. ``selectable``: only those named by ``--runner`` (not
    those reached through another runner's ``--trial-kind``); the other filters match ``Capabilities``."""
    reached = set(_BY_TRIAL_KIND.values()) if selectable else set()
    want = {"measured": measured, "verifiable": verifiable, "needs_measurements": needs_measurements}
    return tuple(n for n, c in _RUNNERS.items() if n not in reached
                 and all(v is None or getattr(c.capabilities, k) == v for k, v in want.items()))


def resolve_runner(name: str, trial_kind: str = "slime") -> str:
    """The registry name of ``--runner name --trial-kind trial_kind`` (``slime`` + ``torch``: ``ray-torch``)."""
    if trial_kind not in TRIAL_KINDS:
        raise UserInputError(f"trial kind '{trial_kind}': allowed {', '.join(TRIAL_KINDS)}")
    _cls(name)
    return _BY_TRIAL_KIND.get((name, trial_kind), name)


def runner_class(name: str) -> type[Runner]:
    """The class registered as ``name`` (its ``capabilities`` are readable without constructing it)."""
    return _cls(name)


def _cls(name: str) -> type[Runner]:
    try:
        return _RUNNERS[name]
    except (KeyError, TypeError):
        raise UnknownRunner(f"unknown runner '{name}'; allowed: {', '.join(_RUNNERS)}") from None


def runner_capabilities(name: str) -> Capabilities:
    """The capabilities of runner ``name`` without constructing it (no cluster file or extra needed)."""
    return _cls(name).capabilities


def get_runner(name: str, **options) -> Runner:
    """A new runner ``name`` built with ``options`` (``cluster_file=`` and ``study=`` for the Ray runners,
    ``device=`` for torch, ``coefficients=`` for sim). Unknown name: UnknownRunner (a UserInputError)."""
    return _cls(name)(**options)
