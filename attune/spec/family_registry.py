"""The model-family plug-in registry (issue 19 "model families as plug-ins"; issue 21's new families).

A family is one module under ``attune.spec.families`` (imported by ``attune.spec.model``) that registers a :class:`Family`: the Hugging Face
``model_type`` values it reads, how it reads a config into ``ModelSpec`` fields (geometry and parameter
layout; the counting itself is ``ModelSpec``'s), and its slime / Megatron-LM model arguments (slime's
``scripts/models/*.sh`` MODEL_ARGS, flag by flag, less the layout flags attune's layout writes). The rest of
attune asks the registry by name or by ``model_type`` and never compares the name.

A leaf: it imports nothing of attune but the errors, so ``attune.spec.model`` (which builds the spec) and
``attune.spec.moe`` (which validates MoE family names) can ask it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from attune.errors import ModelError

__all__ = ["Family", "register", "by_name", "by_hf_type", "names"]


@dataclass(frozen=True)
class Family:
    """One model family."""

    name: str
    """``ModelSpec.family`` (and ``MoESpec.family`` for its MoE part)."""
    hf_types: tuple[str, ...]
    """Hugging Face ``model_type`` values read by this family."""
    read: Callable[[dict, str], dict]
    """(config, where) -> ``ModelSpec`` keyword arguments other than name, family, model_type and source;
    a ``ModelError`` names a missing or unsupported field."""
    model_args: Callable[[Any], list[str]]
    """ModelSpec -> slime's MODEL_ARGS for it (layout flags excluded: dispatcher, grouped GEMM, permute fusion)."""
    source: str
    """Where the geometry and the arguments come from (slime script, transformers module)."""


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family; a second family with the same name or an HF type already read by another is a bug."""
    if family.name in _REGISTRY:
        raise ModelError(f"model family '{family.name}' is registered twice")
    taken = {t for f in _REGISTRY.values() for t in f.hf_types} & set(family.hf_types)
    if taken:
        raise ModelError(f"model family '{family.name}': model_type {sorted(taken)} already has a family")
    _REGISTRY[family.name] = family
    return family


def by_name(name: str) -> Family | None:
    """The registered family of this name, or None (a family built into attune.spec.model)."""
    return _REGISTRY.get(name)


def by_hf_type(model_type: str) -> Family | None:
    """The registered family reading this Hugging Face ``model_type``, or None."""
    return next((f for f in _REGISTRY.values() if model_type in f.hf_types), None)


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)
