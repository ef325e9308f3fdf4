"""Model families as plug-ins (``attune.spec.family_registry``): importing this package registers each.

One module per family: ``glm4`` (GLM-4-0414 dense), ``glm4_moe`` (GLM-4.5 / 4.5-Air), ``glm4_moe_lite``
(GLM-4.7-Flash), ``glm_moe_dsa`` (GLM-5, DeepSeek sparse attention), ``minimax_m2``, ``mimo`` (MiMo-7B with MTP).
The families built into ``attune.spec.model`` (llama, qwen3_5, gpt2, nemotron, deepseek_v3, gpt_oss) predate
the registry.
"""

from attune.spec.families import glm4, glm4_moe, glm4_moe_lite, glm_moe_dsa, mimo, minimax_m2  # noqa: F401

__all__ = ["glm4", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "mimo", "minimax_m2"]
