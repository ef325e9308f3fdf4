"""Xiaomi MiMo-7B (Base / SFT / RL): the ``mimo`` family, a Qwen2-style decoder with multi-token prediction.

Architecture (the checkpoint's remote code ``modeling_mimo.py``, ``MiMoForCausalLM``, model_type ``mimo``; not in
transformers): Qwen2's decoder (GQA with q/k/v biases, SwiGLU, RMSNorm, rotary, untied output) plus
``num_nextn_predict_layers`` MTP modules (token and hidden RMSNorms, ``input_proj`` Linear(2h, h), one decoder
layer, a final RMSNorm: the ``ModelSpec.mtp_params`` layout). slime trains them: its MODEL_ARGS pass
``--mtp-num-layers 1``, which attune writes from the layout (``Layout.mtp_layers``; the baseline sets it).

slime's MODEL_ARGS: scripts/models/mimo-7B-rl.sh at 624b824a, in its order, less ``--mtp-num-layers``.
"""

from __future__ import annotations

from attune.spec.families._hf import dense_geometry, num
from attune.spec.family_registry import Family, register

NAME = "mimo"


def read(cfg: dict, where: str) -> dict:
    return dict(dense_geometry(cfg, where), mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0))


def model_args(m) -> list[str]:
    a = ["--swiglu", "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden), "--ffn-hidden-size", str(m.ffn),
         "--num-attention-heads", str(m.heads), "--group-query-attention", "--num-query-groups", str(m.kv_heads),
         "--use-rotary-position-embeddings", "--disable-bias-linear"]
    if m.attn_bias:
        a.append("--add-qkv-bias")
    a += ["--normalization", "RMSNorm", "--norm-epsilon", num(m.norm_eps), "--rotary-base", num(m.rope_theta),
          "--vocab-size", str(m.vocab)]
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    return a + ["--max-position-embeddings", str(m.max_positions)]


FAMILY = register(Family(name=NAME, hf_types=("mimo",), read=read, model_args=model_args,
                         source="XiaomiMiMo/MiMo-7B-RL modeling_mimo.py; slime 624b824a scripts/models/mimo-7B-rl.sh"))
