"""PyTorch models for attune's torch runner: the three ModelSpec families, built from a ModelSpec.

`CausalLMStage` holds one pipeline stage (a layer range, plus the embedding on the first stage and
the output layer on the last); the whole model is the stage with every layer. Weights are random
from a fixed seed, drawn per layer, so a layer has the same weights whichever stage holds it.

`attune.torchmodels.data` (rows and packing: numpy only) imports without PyTorch; the names below come from
`attune.torchmodels.modules`, which needs PyTorch and is loaded on first access (PEP 562).
"""

import importlib

__all__ = ["CausalLMStage", "build_model", "gated_delta_rule_chunked", "gated_delta_rule_recurrent",
           "init_weights", "token_loss_sum", "quantize", "apply_low_precision", "formats", "CONTROLS", "WRONG_SCALE"]
# issue 22: the emulated low-precision GEMMs (attune.torchmodels.lowp), loaded on first access too
_LOWP = {"quantize", "apply_low_precision", "formats", "CONTROLS", "WRONG_SCALE"}


def __getattr__(name: str):
    if name in _LOWP:
        return getattr(importlib.import_module(f"{__name__}.lowp"), name)
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.modules"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
