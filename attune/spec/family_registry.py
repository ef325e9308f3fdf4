"""The model-family plug-in registry (issue 19 "model families as plug-ins").

Every model family is one module under ``attune.spec.families`` (imported by ``attune.spec.model``) that registers a
:class:`Family`: the Hugging Face ``model_type`` values it reads, how it reads a config into ``ModelSpec`` fields
(geometry and parameter layout; the counting itself is ``ModelSpec``'s), its layout rules, its slime / Megatron-LM
model arguments (slime's ``scripts/models/*.sh`` MODEL_ARGS, flag by flag, less the layout flags attune's layout
writes) and the traits the parameter count and the torch builder read. The rest of attune asks the family
(``ModelSpec.traits``, or the registry by name or by ``model_type``) and never compares its name
(tests/test_families.py ``test_no_family_name_comparisons_outside_the_family_modules``).

A leaf: it imports nothing of attune but the errors, so ``attune.spec.model`` (which builds the spec) and
``attune.spec.moe`` (which validates MoE family names) can ask it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from attune.errors import ModelError

__all__ = ["Family", "register", "by_name", "by_hf_type", "names", "get", "hf_types", "moe_hf_types",
           "moe_family_names", "for_mlp", "launchable"]


def no_rules(layout: Any, model: Any, engine: Any) -> list[str]:
    """The default layout rules of a family: none beyond attune.spec.rules' own."""
    return []


def no_refusal(engine: Any) -> str | None:
    """The default: the engine takes ``--pipeline-model-parallel-layout`` for this family."""
    return None


@dataclass(frozen=True)
class Family:
    """One model family: what it reads, how it is counted, launched and built, and its layout rules."""

    name: str
    """``ModelSpec.family`` (and ``MoESpec.family`` for its MoE part unless ``moe_families`` names others)."""
    hf_types: tuple[str, ...]
    """Hugging Face ``model_type`` values read by this family."""
    read: Callable[[dict, str], dict]
    """(config, where) -> ``ModelSpec`` keyword arguments other than name, family, model_type and source; the
    config's ``model_type`` is set; a ``ModelError`` names a missing or unsupported field."""
    model_args: Callable[[Any], list[str]] | None
    """ModelSpec -> slime's MODEL_ARGS for it (layout flags excluded: dispatcher, grouped GEMM, permute fusion);
    None: attune writes no slime launch for the family (``launch_refusal`` says why)."""
    source: str
    """Where the geometry and the arguments come from (slime script, transformers module)."""
    moe_hf_types: tuple[str, ...] = ()
    """Of ``hf_types``, those whose configs may carry routed experts (``num_experts`` > 1); a config of another
    type with routed experts is refused before ``read``."""
    moe_families: tuple[str, ...] = ()
    """``MoESpec.family`` values its configs produce besides ``name`` (llama: qwen3_moe, mixtral)."""
    launch_refusal: str = ""
    """Why there is no slime launch (``model_args`` None), one line; the launch adds the families that have one."""
    mlp: str = ""
    """``from_geometry`` builds this family for a bare geometry with this MLP (swiglu, gelu, squared_relu); "" none."""
    geometry: Callable[..., dict] | None = None
    """(common fields, positions, tied_embeddings) -> ``ModelSpec`` keyword arguments for ``from_geometry``."""
    zero_centred_norm: bool = False
    """RMSNorm stores w and scales by (1 + w) (Qwen3.5 / Qwen3-Next; Megatron ``--apply-layernorm-1p``): the torch
    builder's norms and q/k norms."""
    linear_biases: bool = False
    """Every linear has a bias, attention output and MLP included (GPT-2): counted and built."""
    layout_rules: Callable[[Any, Any, Any], list[str]] = no_rules
    """(layout, model, engine) -> the rules the layout breaks for this family, one message each."""
    layout_string_refusal: Callable[[Any], str | None] = no_refusal
    """engine -> why this engine cannot take ``--pipeline-model-parallel-layout`` for the family (None: it can)."""
    crosscheck_refusal: str = ""
    """Why megatron-core's CPU layer specs cannot build the family (``attune.spec.crosscheck``); "": they can."""


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family; a second family with the same name or an HF type already read by another is a bug."""
    if family.name in _REGISTRY:
        raise ModelError(f"model family '{family.name}' is registered twice")
    taken = {t for f in _REGISTRY.values() for t in f.hf_types} & set(family.hf_types)
    if taken:
        raise ModelError(f"model family '{family.name}': model_type {sorted(taken)} already has a family")
    if not set(family.moe_hf_types) <= set(family.hf_types):
        raise ModelError(f"model family '{family.name}': moe_hf_types must be among its hf_types")
    if family.mlp and any(f.mlp == family.mlp for f in _REGISTRY.values()):
        raise ModelError(f"model family '{family.name}': from_geometry already builds another family for mlp "
                         f"'{family.mlp}'")
    _REGISTRY[family.name] = family
    return family


def by_name(name: str) -> Family | None:
    """The registered family of this name, or None."""
    return _REGISTRY.get(name)


def get(name: str) -> Family:
    """The registered family of this name; a one-line ModelError naming the registered ones otherwise."""
    fam = _REGISTRY.get(name)
    if fam is None:
        raise ModelError(f"model family '{name}' is not registered; allowed: {', '.join(_REGISTRY)}")
    return fam


def by_hf_type(model_type: str) -> Family | None:
    """The registered family reading this Hugging Face ``model_type``, or None."""
    return next((f for f in _REGISTRY.values() if model_type in f.hf_types), None)


def for_mlp(mlp: str) -> Family | None:
    """The family ``from_geometry`` builds for a bare geometry with this MLP, or None."""
    return next((f for f in _REGISTRY.values() if f.mlp and f.mlp == mlp), None)


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def hf_types() -> tuple[str, ...]:
    """Every Hugging Face ``model_type`` a registered family reads."""
    return tuple(t for f in _REGISTRY.values() for t in f.hf_types)


def moe_hf_types() -> tuple[str, ...]:
    """Every ``model_type`` read with routed experts."""
    return tuple(t for f in _REGISTRY.values() for t in f.moe_hf_types)


def moe_family_names() -> tuple[str, ...]:
    """Every ``MoESpec.family`` value: the MoE families' names and the MoE variants they declare."""
    out: dict[str, None] = {}
    for f in _REGISTRY.values():
        if f.moe_hf_types:
            out.update(dict.fromkeys(f.moe_families or (f.name,)))
    return tuple(out)


def launchable() -> tuple[str, ...]:
    """The families with a slime launch."""
    return tuple(n for n, f in _REGISTRY.items() if f.model_args is not None)
