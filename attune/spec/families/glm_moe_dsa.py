"""GLM-5 (744B-A40B): the ``glm_moe_dsa`` family, GLM-4.7-Flash's layout (MLA + DeepSeek-style MoE) at scale with
DeepSeek sparse attention (DSA).

Architecture (transformers ``models/glm_moe_dsa``: ``GlmMoeDsaConfig``, ``GlmMoeDsaAttention``,
``GlmMoeDsaIndexer``): multi-head latent attention (q LoRA 2048, kv LoRA 512, qk 192 + rope 64, v 256) whose
queries attend to the ``index_topk`` keys an indexer picks (``index_n_heads`` x ``index_head_dim``);
``first_k_dense_replace`` dense layers, then MoE layers as GLM-4.5 (sigmoid router with expert bias, one shared
expert, ``routed_scaling_factor``); ``num_nextn_predict_layers`` MTP modules (counted).

What is exact and what is approximated: the geometry, the parameter count (the indexer's weights included:
``attune.spec.mla.MLASpec.indexer``), memory of weights, gradients and optimizer state, and the launch arguments
are exact. The attention cost is not: attune prices MLA over the whole causal context, while DSA attends to
``index_topk`` (2,048) keys per query, and the indexer's own scoring over every key is not priced. Above a few
thousand tokens the core-attention time is overestimated (by about seq / (2 x 2048) at the attention kernel) and
the indexer's is missing; GEMMs, MoE and communication are priced as for any MLA model.

slime's MODEL_ARGS: scripts/models/glm5-744B-A40B.sh at 624b824a, in its order (the layout writes
``--moe-grouped-gemm`` and ``--moe-permute-fusion``). ``--allgather-cp`` is slime's CP layout for DSA models
(slime/backends/megatron_utils/arguments.py ``_validate_allgather_cp_supported``).

GLM-5.2 (glm5.2-744B-A40B.sh, the same MODEL_ARGS but ``--rotary-base 8000000``) shares the indexer's top-k across
layers: the config's ``index_topk_freq`` / ``index_skip_topk_offset`` (both required when the frequency is above
1: transformers defaults the offset to 2, slime's provider to 0) give the computing layers
(``attune.spec.mla.MLASpec.computes_index``); the others are layer kind ``SHARED_INDEX`` and carry no indexer
weights, so the parameters and what the estimator derives from each stage's layer kinds (weight, gradient and
optimizer memory) count the indexer on computing layers only. The indexer's own scoring is priced on no layer (see above), so computing and sharing
layers cost the same time and activation memory. slime's provider (slime_plugins/models/glm5/glm5.py lines
1023-1047) refuses a (virtual) pipeline stage that starts on a sharing layer: ``attune.spec.rules.check``.
"""

from __future__ import annotations

from dataclasses import replace

from attune.errors import ModelError
from attune.spec.families import glm4_moe_lite
from attune.spec.families._hf import glm_moe_router_args, need, num
from attune.spec.family_registry import Family, register

NAME = "glm_moe_dsa"


def read(cfg: dict, where: str) -> dict:
    if cfg.get("indexer_types") is not None or cfg.get("index_topk_pattern") is not None:
        raise ModelError(f"{where}: an explicit indexer_types / index_topk_pattern is not read; allowed: the "
                         f"index_topk_freq / index_skip_topk_offset schedule (GLM-5.2) or none (GLM-5)")
    freq = int(cfg.get("index_topk_freq") or 1)
    offset = int(need(cfg, "index_skip_topk_offset", where)) if freq > 1 else 0
    fields = glm4_moe_lite.read(cfg, where)
    fields["moe"] = replace(fields["moe"], family=NAME)
    fields["mla"] = replace(fields["mla"], index_heads=int(need(cfg, "index_n_heads", where)),
                            index_head_dim=int(need(cfg, "index_head_dim", where)), index_topk_freq=freq,
                            index_skip_topk_offset=offset)
    return fields


def model_args(m) -> list[str]:
    moe, mla = m.moe, m.mla
    a = ["--spec", "slime_plugins.models.glm5.glm5", "get_glm5_spec", *glm_moe_router_args(m)]
    a += ["--make-vocab-size-divisible-by", "16",
          "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden), "--ffn-hidden-size", str(moe.dense_ffn),
          "--num-attention-heads", str(m.heads), "--disable-bias-linear", "--swiglu"]
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    a += ["--position-embedding-type", "rope", "--no-position-embedding", "--normalization", "RMSNorm",
          "--qk-layernorm", "--multi-latent-attention", "--q-lora-rank", str(mla.q_lora_rank),
          "--kv-lora-rank", str(mla.kv_lora_rank), "--qk-head-dim", str(mla.qk_nope_head_dim),
          "--v-head-dim", str(mla.v_head_dim), "--kv-channels", str(mla.qk_nope_head_dim),
          "--qk-pos-emb-head-dim", str(mla.qk_rope_head_dim), "--vocab-size", str(m.vocab),
          "--rotary-base", num(m.rope_theta), "--enable-experimental", "--allgather-cp"]
    return a


FAMILY = register(Family(name=NAME, hf_types=("glm_moe_dsa",), moe_hf_types=("glm_moe_dsa",), read=read, model_args=model_args,
                         source="transformers models/glm_moe_dsa; slime 624b824a scripts/models/glm5-744B-A40B.sh, "
                                "glm5.2-744B-A40B.sh"))
