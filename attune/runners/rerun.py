"""The run block of a runner that measures nothing of its own engine (the sim and replay runners): the engine's
launch, as the engine's own runner writes it (attune's torch trainer, else slime's launch)."""

from __future__ import annotations

from attune.runners.base import Rerun, TrialSpec
from attune.runners.slime.runner import slime_rerun
from attune.runners.torch_runner import torch_rerun

__all__ = ["engine_rerun"]


def engine_rerun(spec: TrialSpec) -> Rerun:
    """``attune run --runner torch`` for the torch trainer's engine, else slime's launch (`Runner.rerun_command`)."""
    return torch_rerun(spec) if spec.engine.attune_trainer else slime_rerun(spec)
