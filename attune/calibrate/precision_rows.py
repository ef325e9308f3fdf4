"""The low-precision recipe of a corpus row (issue 22): Layout fields for its fp8 / mxfp8 class, with the
assumptions made where the source names the class but not the recipe. Read by ``attune.calibrate.corpus``."""

from __future__ import annotations

from attune.spec.precision import fields_for

# NeMo 2.0's fp8 precision plugin of the DGX-Cloud benchmark releases (24.11-25.05):
# nemo/collections/llm/recipes/precision/mixed_precision.py bf16_with_fp8_mixed(): fp8 "hybrid", delayed scaling,
# amax history 1024 ("max"), fp8_param_gather True; scripts/performance/llm: --fp8_recipe default "ds" (delayed)
# [recalled from NeMo 2.0, not pinned here]
NEMO_FP8 = ("fp8-delayed", True, "hybrid")


# Megatron-Bridge's mixed-precision recipes (src/megatron/bridge/training/mixed_precision.py, v0.2.0 through v0.5.1):
# bf16_with_mxfp8_mixed and bf16_with_fp8_current_scaling_mixed set fp8_param_gather = True (v0.5.0 lines 255-265,
# 285-302; the MXFP8 one also reuse_grad_buf_for_mxfp8_param_ag); bf16_with_fp8_subchannel_scaling_mixed (blockwise)
# sets it False up to v0.3.x and True from v0.5.0 (v0.5.0 line 346). The performance scripts take them as they are
# (scripts/performance/utils/precision.py get_precision_config: fp8_cs only turns first_last_layers_bf16 off).
MBRIDGE_PARAM_GATHER = {"mxfp8": True, "fp8-tensorwise": True, "fp8-blockwise": False}


class NotModelled(ValueError):
    """The row's precision is not expressible (the message is the reason)."""


def row_precision(row: dict, generation: str, engine_name: str, assumptions: list[str]) -> dict:
    """Layout fields for the row's precision ({} for bf16 / fp16); ``NotModelled`` for nvfp4 and unknown classes.

    fp8 rows name the class, not the recipe: NeMo's DGX-Cloud releases ran delayed scaling with fp8 parameters
    (``NEMO_FP8``); Megatron-Bridge's performance summaries label the recipe from 25.11 (FP8-CS: current =
    tensor-wise scaling, FP8-MX: MXFP8) and their 25.09 footnote gives the alternate granularity (Blackwell MXFP8
    32x32, H100 128x128 blockwise), so a plain "FP8" there is read as current scaling. Megatron-Bridge rows carry the --fp8-param-gather their
    mixed-precision recipe sets (``MBRIDGE_PARAM_GATHER``)."""
    out = _row_precision(row, generation, engine_name, assumptions)
    recipe = recipe_of_fields(out)
    if "bridge" in engine_name.lower() and MBRIDGE_PARAM_GATHER.get(recipe):
        out = {**out, "fp8_param_gather": True}
        assumptions.append(f"--fp8-param-gather (Megatron-Bridge's {recipe} mixed-precision recipe sets "
                           "fp8_param_gather = True) [the release's recipe]")
    return out


def recipe_of_fields(fields: dict) -> str:
    """The precision class of Layout fields from ``fields_for`` ('bf16' for {})."""
    if not fields:
        return "bf16"
    if fields.get("fp4_format"):
        return "nvfp4"
    r = fields.get("fp8_recipe")
    return "mxfp8" if r == "mxfp8" else f"fp8-{r}"


def _row_precision(row: dict, generation: str, engine_name: str, assumptions: list[str]) -> dict:
    pc = str(row.get("precision_class") or "")
    text = str(row.get("precision") or "").lower()
    if pc in ("bf16", "fp16", ""):
        return {}
    if pc == "nvfp4":
        raise NotModelled("not modelled: nvfp4 (no expressible corpus row: the NVFP4 runs are Nemotron 3 hybrids)")
    if pc == "mxfp8":
        assumptions.append("precision: MXFP8 (--fp8-format e4m3 --fp8-recipe mxfp8) [the source's class]")
        return fields_for("mxfp8")
    if pc != "fp8":
        raise NotModelled(f"not modelled: precision class {pc}")
    low = engine_name.lower()
    if "alternate granularity" in text:
        recipe = "mxfp8" if generation == "blackwell" else "fp8-blockwise"
        assumptions.append(f"precision: {recipe} (the source's alternate granularity: Blackwell MXFP8 32x32, H100 "
                           "128x128 blockwise)")
        return fields_for(recipe)
    named = _named_recipe(text)
    if named is not None:  # the row names its recipe (FP8-CS, FP8-MX, FP8-SC / blockwise, delayed, ...)
        if named == "mxfp8" and generation != "blackwell":
            raise NotModelled(f"not modelled: precision '{text}' (MXFP8) on a {generation or 'non-Blackwell'} GPU")
        assumptions.append(f"precision: {named} (the row's '{text}')")
        return fields_for(named)
    if "bridge" not in low and "nemo" in low:
        recipe, pg, fmt = NEMO_FP8
        assumptions.append("precision: fp8 hybrid, delayed scaling, --fp8-param-gather (NeMo 2.0 bf16_with_fp8_mixed, "
                           "the DGX-Cloud recipes' default) [assumed]")
        return fields_for(recipe, param_gather=pg, fp8_format=fmt)
    if "bridge" not in low and "megatron" in low:
        assumptions.append("precision: fp8 delayed scaling (Megatron-LM's --fp8-recipe default, transformer_config.py:441) "
                           "[assumed]")
        return fields_for("fp8-delayed")
    assumptions.append("precision: fp8 current (tensor-wise) scaling (Megatron-Bridge's FP8-CS; the row says FP8 only) "
                       "[assumed]")
    return fields_for("fp8-tensorwise")


# Recipe names a row's precision text may carry -> the recipe (Megatron-Bridge's performance configs: fp8_cs current
# scaling, fp8_mx MXFP8, fp8_sc sub-channel = blockwise; NeMo's --fp8_recipe ds / cs / mxfp8 / ss), first match wins
_NAMES = (("mxfp8", "mxfp8"), ("fp8-mx", "mxfp8"), ("fp8_mx", "mxfp8"), ("blockwise", "fp8-blockwise"),
          ("fp8-sc", "fp8-blockwise"), ("fp8_sc", "fp8-blockwise"), ("subchannel", "fp8-blockwise"),
          ("sub-channel", "fp8-blockwise"), ("128x128", "fp8-blockwise"), ("fp8-cs", "fp8-tensorwise"),
          ("fp8_cs", "fp8-tensorwise"), ("current", "fp8-tensorwise"), ("tensorwise", "fp8-tensorwise"),
          ("delayed", "fp8-delayed"), ("fp8-ds", "fp8-delayed"), ("fp8_ds", "fp8-delayed"))


def _named_recipe(text: str) -> str | None:
    return next((recipe for token, recipe in _NAMES if token in text), None)


__all__ = ["NotModelled", "row_precision", "NEMO_FP8", "MBRIDGE_PARAM_GATHER", "recipe_of_fields"]
