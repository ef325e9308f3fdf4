"""Model families as plug-ins (``attune.spec.family_registry``): importing this package registers each.

One module per family: ``llama`` (Llama, Mistral, Qwen2/2.5, Qwen3; MoE ``qwen3_moe``, ``mixtral``), ``qwen3_5``
(the Gated DeltaNet hybrids Qwen3.5/3.6, Qwen3-Next; MoE ``qwen3_next``, ``qwen3_5_moe``), ``gpt2``, ``nemotron``,
``deepseek_v3`` (DeepSeek-V3, Kimi K2, Moonlight), ``gpt_oss``, ``glm4`` (GLM-4-0414 dense), ``glm4_moe`` (GLM-4.5 /
4.5-Air), ``glm4_moe_lite`` (GLM-4.7-Flash), ``glm_moe_dsa`` (GLM-5, DeepSeek sparse attention), ``minimax_m2``,
``mimo`` (MiMo-7B with MTP). Adding a family is one module here, its config files and its tests.
"""

from attune.spec.families import (deepseek_v3, glm4, glm4_moe, glm4_moe_lite, glm_moe_dsa, gpt2, gpt_oss,  # noqa: F401
                                  llama, mimo, minimax_m2, nemotron, qwen3_5)

__all__ = ["llama", "qwen3_5", "gpt2", "nemotron", "deepseek_v3", "gpt_oss", "glm4", "glm4_moe", "glm4_moe_lite",
           "glm_moe_dsa", "mimo", "minimax_m2"]
