"""Model families as plug-ins (``attune.spec.family_registry``): importing this package registers each.

One module per family, found here by name (every module not starting with ``_``, imported in name order, so the
registration order is fixed): ``llama`` (Llama, Mistral, Qwen2/2.5, Qwen3; MoE ``qwen3_moe``, ``mixtral``),
``qwen3_5`` (the Gated DeltaNet hybrids Qwen3.5/3.6, Qwen3-Next; MoE ``qwen3_next``, ``qwen3_5_moe``), ``gpt2``,
``nemotron``, ``deepseek_v3`` (DeepSeek-V3, Kimi K2, Moonlight), ``gpt_oss``, ``glm4`` (GLM-4-0414 dense),
``glm4_moe`` (GLM-4.5 / 4.5-Air), ``glm4_moe_lite`` (GLM-4.7-Flash), ``glm_moe_dsa`` (GLM-5, DeepSeek sparse
attention), ``minimax_m2``, ``mimo`` (MiMo-7B with MTP). Adding a family is one module here (it calls
``register``), its config files (``attune/spec/model_configs``, ``attune/spec/baselines.yaml``) and its tests.
``_hf`` holds the helpers the modules share.
"""

import importlib
import pkgutil

__all__ = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))

for _name in __all__:
    importlib.import_module(f"{__name__}.{_name}")
