"""GPT-2 / GPT-3 style decoders: the ``gpt2`` family.

Architecture (transformers ``models/gpt2``): LayerNorm, a GeLU MLP of ``n_inner`` (4h by default), MHA, a bias on
every linear (q/k/v, attention output, both MLP projections), learned absolute positions, tied output layer.
``from_geometry`` builds it for a GeLU geometry (Megatron-LM's GPT defaults; BLOOM-style ALiBi or rotary where the
run says so).

slime's MODEL_ARGS: Megatron's GPT flags (learned absolute positions, LayerNorm, biases), with Megatron's GeLU in
OpenAI's tanh form (HF gpt2's ``gelu_new``: ``--openai-gelu``; Megatron's default is the exact GeLU).
"""

from __future__ import annotations

from attune.spec.families._hf import need, num
from attune.spec.family_registry import Family, register

NAME = "gpt2"


def read(cfg: dict, where: str) -> dict:
    h = need(cfg, "n_embd", where)
    heads = need(cfg, "n_head", where)
    return dict(num_layers=need(cfg, "n_layer", where), hidden=h, ffn=cfg.get("n_inner") or 4 * h, heads=heads,
                kv_heads=heads, head_dim=h // heads, vocab=need(cfg, "vocab_size", where),
                tied_embeddings=cfg.get("tie_word_embeddings", True), norm="layernorm", mlp="gelu",
                positions="learned", max_positions=need(cfg, "n_positions", where),
                norm_eps=cfg.get("layer_norm_epsilon", 1e-5), attn_bias=True)


def geometry(common: dict, positions: str | None, tied_embeddings: bool | None) -> dict:
    """Megatron-LM's GPT defaults: LayerNorm, GeLU MLP of ``ffn``, biases, learned absolute positions, tied output."""
    return dict(common, model_type="gpt2", norm="layernorm", mlp="gelu", positions=positions or "learned",
                attn_bias=True, norm_eps=1e-5, tied_embeddings=True if tied_embeddings is None else tied_embeddings)


def model_args(m) -> list[str]:
    return ["--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden), "--ffn-hidden-size", str(m.ffn),
            "--num-attention-heads", str(m.heads), "--kv-channels", str(m.head_dim),
            "--max-position-embeddings", str(m.max_positions), "--position-embedding-type", "learned_absolute",
            "--normalization", "LayerNorm", "--norm-epsilon", num(m.norm_eps),
            "--openai-gelu",  # HF gpt2 activation gelu_new = tanh GeLU (Megatron's default is exact GeLU)
            "--vocab-size", str(m.vocab)]


FAMILY = register(Family(name=NAME, hf_types=("gpt2",), read=read, model_args=model_args,
                         source="transformers models/gpt2; Megatron-LM GPT defaults", mlp="gelu", geometry=geometry,
                         linear_biases=True))
