"""PyTorch models for attune's torch runner: the three ModelSpec families, built from a ModelSpec.

`CausalLMStage` holds one pipeline stage (a layer range, plus the embedding on the first stage and
the output layer on the last); the whole model is the stage with every layer. Weights are random
from a fixed seed, drawn per layer, so a layer has the same weights whichever stage holds it.
"""

from .modules import (CausalLMStage, build_model, gated_delta_rule_chunked, gated_delta_rule_recurrent,
                      init_weights, token_loss_sum)

__all__ = ["CausalLMStage", "build_model", "gated_delta_rule_chunked", "gated_delta_rule_recurrent",
           "init_weights", "token_loss_sum"]
