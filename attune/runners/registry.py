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

__all__ = ["get_runner", "runner_names", "runner_capabilities", "runner_class", "UnknownRunner"]

_RUNNERS: dict[str, type[Runner]] = {
    "sim": SimRunner,
    "torch": TorchRunner,
    "slime": SlimeRunner,
    "ray-torch": RayTorchRunner,
    "replay": ReplayRunner,
}


class UnknownRunner(UserInputError):
    """A runner name the registry does not know (exit code 2)."""


def runner_names() -> tuple[str, ...]:
    """Every registered runner name, the default (``sim``) first."""
    return tuple(_RUNNERS)


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
