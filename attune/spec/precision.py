"""Low precision as a numerics knob: the recipes Megatron-LM / Transformer Engine train with, and their rules.

A layout's GEMM precision is three Layout fields that mirror the flags one to one (``attune.spec.layout``):
``fp8_format`` (``--fp8-format``; None: no fp8), ``fp8_recipe`` (``--fp8-recipe``) and ``fp8_param_gather``
(``--fp8-param-gather``), plus ``fp4_format`` (``--fp4-format``: NVFP4). ``recipe_of`` names the class the
estimator and the calibration speak of: ``bf16``, ``fp8-delayed``, ``fp8-tensorwise``, ``fp8-blockwise``,
``mxfp8`` or ``nvfp4``.

Sources (pinned commits):

* [M] Megatron-LM 1dcf0daf megatron/core/transformer/transformer_config.py:434-534 (``fp8``: Literal e4m3,
  hybrid, CLI ``--fp8-format``; ``fp8_recipe``: Literal tensorwise, delayed, mxfp8, blockwise, custom, default
  delayed, "mxfp8 for Blackwell architecture only"; ``fp8_amax_history_len`` default 1; ``fp4``: Literal e2m1,
  CLI ``--fp4-format``; ``fp4_recipe`` nvfp4 | custom; ``fp4_param`` CLI ``--fp4-param-gather``), :1014-1016
  (delayed scaling cannot keep the first / last layers in bf16), :1053 (fp8_param needs fp8), :1060 (fp4 and
  fp8 exclusive), :1267-1272 (delayed scaling refuses ``moe_act`` / ``layernorm`` recompute).
* [A] Megatron-LM 1dcf0daf megatron/training/arguments.py:655-657 (``--fp8-param-gather`` only with the
  distributed optimizer, torch FSDP2, Megatron FSDP or inference), :660 (``--fp4-format`` and
  ``--fp8-format`` exclusive), :1194-1196 (with ``--optimizer-cpu-offload``, ``--fp8-param-gather`` needs
  ``--fp8-recipe delayed``), :1421 (``--fp8-param-gather``: "Keep the compute param in fp8 ... and perform the
  param all-gather in fp8"), :2233 (``--reuse-grad-buf-for-mxfp8-param-ag``).
* [S] slime 624b824a docs/en/advanced/low-precision.md:62-70 (``--fp8-format e4m3 --fp8-recipe blockwise``,
  ``--fp8-param-gather`` "optional; currently incompatible with CPU Adam", ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``
  "slime sets this to 1 by default for Ray actors"), :89 ("Only Linear and GroupLinear layers in
  TransformerEngine use FP8. embedding and lm_head remain in their original precision").
"""

from __future__ import annotations

from .layout import FP4_FORMATS, FP8_FORMATS, FP8_RECIPES, Layout

__all__ = ["RECIPES", "LOW_PRECISION", "PRECISION_RULE_FIELDS", "recipe_of", "is_low_precision", "fields_for", "precision_rules",
           "hardware_refusal", "slime_env", "FP8_FORMATS", "FP8_RECIPES", "FP4_FORMATS", "BLOCK_SCALING_ENV"]

RECIPES = ("bf16", "fp8-delayed", "fp8-tensorwise", "fp8-blockwise", "mxfp8", "nvfp4")
"""The precision classes of a layout's GEMMs (``recipe_of``)."""
LOW_PRECISION = RECIPES[1:]
"""Every class but bf16 (what ``--allow-numerics`` opens)."""

BLOCK_SCALING_ENV = {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
"""[S] low-precision.md:70: blockwise fp8 needs fp32 block scales in TE; slime sets it for its Ray actors."""

# Which GPU generations run each class on their tensor cores: fp8 from Hopper (sm90), the microscaling
# formats (MXFP8 E8M0 block scales, NVFP4) on Blackwell only ([M] transformer_config.py:446 "mxfp8 for
# Blackwell architecture only", :523 "NVFP4BlockScaling recipe for Blackwell+ architecture"). CPU workers
# emulate any of them (the torch runner casts around its GEMMs).
_GENERATIONS = {"fp8-delayed": ("hopper", "blackwell"), "fp8-tensorwise": ("hopper", "blackwell"),
                "fp8-blockwise": ("hopper", "blackwell"), "mxfp8": ("blackwell",), "nvfp4": ("blackwell",)}


def recipe_of(layout: Layout) -> str:
    """The layout's precision class: bf16 (no fp8 / fp4 flag), fp8-<recipe>, mxfp8 or nvfp4."""
    if layout.fp4_format is not None:
        return "nvfp4"
    if layout.fp8_format is None:
        return "bf16"
    return "mxfp8" if layout.fp8_recipe == "mxfp8" else f"fp8-{layout.fp8_recipe}"


def is_low_precision(layout: Layout) -> bool:
    """True when the layout's GEMMs run in fp8 or fp4."""
    return layout.fp8_format is not None or layout.fp4_format is not None


def fields_for(recipe: str, param_gather: bool = False, fp8_format: str = "e4m3") -> dict:
    """The Layout fields of a precision class (``Layout(**fields_for("fp8-blockwise"))``)."""
    if recipe not in RECIPES:
        raise ValueError(f"precision recipe '{recipe}'; allowed: {', '.join(RECIPES)}")
    if recipe == "bf16":
        return dict(fp8_format=None, fp8_recipe="delayed", fp8_param_gather=False, fp4_format=None)
    if recipe == "nvfp4":
        return dict(fp8_format=None, fp8_recipe="delayed", fp8_param_gather=False, fp4_format="e2m1")
    return dict(fp8_format=fp8_format, fp8_recipe="mxfp8" if recipe == "mxfp8" else recipe.removeprefix("fp8-"),
                fp8_param_gather=param_gather, fp4_format=None)


PRECISION_RULE_FIELDS = ("fp8_format", "fp4_format", "fp8_param_gather", "fp8_recipe", "distributed_optimizer",
                         "optimizer_cpu_offload", "recompute_granularity", "recompute_modules", "precision")
"""Every Layout field ``precision_rules`` reads (``effective_recompute_modules`` through the last two recompute
fields): a batch checks it once per distinct value of these (attune.search.precision_search.rules_ok)."""


def precision_rules(L: Layout) -> list[str]:
    """The rules a low-precision layout breaks, one message each (Megatron-LM's own checks, cited above)."""
    e: list[str] = []
    if L.fp8_format is not None and L.fp4_format is not None:
        e.append("--fp8-format and --fp4-format cannot be used together (Megatron-LM arguments.py:660); allowed: one")
    if L.fp8_param_gather:
        if L.fp8_format is None:
            e.append("--fp8-param-gather needs --fp8-format (transformer_config.py:1053)")
        if not L.distributed_optimizer:
            e.append("--fp8-param-gather needs the distributed optimizer (Megatron-LM arguments.py:655)")
        if L.optimizer_cpu_offload:
            # [A] :1194 allows it with delayed scaling only; [S] low-precision.md:67,93: not with slime's CPU Adam
            e.append("--fp8-param-gather is not compatible with CPU Adam (--optimizer-cpu-offload; slime "
                     "low-precision.md; Megatron-LM arguments.py:1194 allows only --fp8-recipe delayed)")
    if L.fp8_format is not None and L.fp8_recipe == "delayed":
        bad = [m for m in L.effective_recompute_modules if m in ("moe_act", "layernorm")]
        if bad:
            e.append(f"delayed fp8 scaling does not support {', '.join(bad)} recompute (transformer_config.py:1267); "
                     f"allowed: --fp8-recipe tensorwise, blockwise or mxfp8")
    if is_low_precision(L) and L.precision != "bf16":
        e.append("fp8 / fp4 GEMMs are modelled on top of bf16 training only (--bf16)")
    return e


def hardware_refusal(layout: Layout, generation: str, is_cpu: bool = False) -> str | None:
    """Why the GPU cannot run the layout's precision class (None: it can). CPU workers emulate every class."""
    recipe = recipe_of(layout)
    if recipe == "bf16" or is_cpu:
        return None
    allowed = _GENERATIONS[recipe]
    if generation not in allowed:
        return (f"{recipe} needs a {' or '.join(g.capitalize() for g in allowed)} GPU (this one is "
                f"{generation.capitalize() or 'unknown'}: no {recipe} tensor cores)")
    return None


def slime_env(layout: Layout) -> dict[str, str]:
    """Environment a slime launch of the layout needs: blockwise fp8 wants fp32 block scales ([S] :70)."""
    return dict(BLOCK_SCALING_ENV) if layout.fp8_format is not None and layout.fp8_recipe == "blockwise" else {}
