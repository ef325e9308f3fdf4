"""GLM-4-0414 dense (GLM-4-9B, GLM-4-32B): the ``glm4`` family.

Architecture (transformers ``models/glm4``: ``Glm4Config``, ``Glm4DecoderLayer``): GQA with q/k/v biases where
``attention_bias`` (9B: yes; 32B: no), rotary on half of each head, interleaved (``partial_rotary_factor`` 0.5),
a fused gate/up SwiGLU MLP, RMSNorm before attention and MLP and again after each ("sandwich":
``post_self_attn_layernorm``, ``post_mlp_layernorm``), untied output layer.

slime's MODEL_ARGS: scripts/models/glm4-9B.sh at 624b824a, in its order (glm4-32B.sh has the same flags in
another order, plus ``--seq-length`` (the workload's) and ``--max-position-embeddings``, which does nothing with
rotary positions). slime's Megatron plugin spec ``slime_plugins.models.glm4`` builds the sandwich norms.

Not priced: the two extra RMSNorms per layer are memory-bound elementwise work the estimator's layer costs do not
list (a fraction of a percent of a layer's time); their parameters and optimizer state are counted.
"""

from __future__ import annotations

from attune.spec.families._hf import dense_geometry, num
from attune.spec.family_registry import Family, register

NAME = "glm4"


def read(cfg: dict, where: str) -> dict:
    return dict(dense_geometry(cfg, where), rotary_percent=float(cfg.get("partial_rotary_factor", 0.5)),
                sandwich_norm=True)


def model_args(m) -> list[str]:
    a = ["--spec", "slime_plugins.models.glm4", "get_glm_spec", "--swiglu", "--num-layers", str(m.num_layers),
         "--hidden-size", str(m.hidden), "--ffn-hidden-size", str(m.ffn), "--num-attention-heads", str(m.heads),
         "--group-query-attention", "--num-query-groups", str(m.kv_heads)]
    if m.head_dim != m.hidden // m.heads:
        a += ["--kv-channels", str(m.head_dim)]
    a += ["--use-rotary-position-embeddings", "--disable-bias-linear"]
    if m.attn_bias:
        a.append("--add-qkv-bias")
    a += ["--normalization", "RMSNorm", "--norm-epsilon", num(m.norm_eps), "--rotary-base", num(m.rope_theta),
          "--vocab-size", str(m.vocab), "--post-self-attn-layernorm", "--post-mlp-layernorm", "--rotary-interleaved",
          "--rotary-percent", num(m.rotary_percent), "--no-rope-fusion"]
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    return a


FAMILY = register(Family(name=NAME, hf_types=("glm4",), read=read, model_args=model_args,
                         source="transformers models/glm4; slime 624b824a scripts/models/glm4-9B.sh, glm4-32B.sh"))
