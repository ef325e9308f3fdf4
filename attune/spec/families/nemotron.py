"""Nemotron-4 (15B, 340B): the ``nemotron`` family.

Architecture (transformers ``models/nemotron``: ``NemotronConfig``; NeMo ``Nemotron4Config``): a squared-ReLU MLP
without gating (``hidden_act: relu2``: up_proj, down_proj), LayerNorm1p (LayerNorm with zero-centred gamma: the
same two vectors per norm as LayerNorm), GQA, rotary on part of the head (``partial_rotary_factor``), no biases
(``attention_bias`` / ``mlp_bias`` default False), untied output layer. ``from_geometry`` builds it for a
squared-ReLU geometry.

No slime launch: slime ships no Nemotron model script at 624b824a.
"""

from __future__ import annotations

from attune.errors import ModelError
from attune.spec.families._hf import need
from attune.spec.family_registry import Family, register

NAME = "nemotron"


def read(cfg: dict, where: str) -> dict:
    act = cfg.get("hidden_act", "relu2")
    if act != "relu2":
        raise ModelError(f"{where}: nemotron hidden_act '{act}' is not supported; allowed: relu2 (squared ReLU)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelError(f"{where}: nemotron with attention_bias / mlp_bias is not modelled; allowed: no biases")
    h = need(cfg, "hidden_size", where)
    heads = need(cfg, "num_attention_heads", where)
    return dict(num_layers=need(cfg, "num_hidden_layers", where), hidden=h, ffn=need(cfg, "intermediate_size", where),
                heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or h // heads,
                vocab=need(cfg, "vocab_size", where), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                norm="layernorm1p", mlp="squared_relu", positions="rope",
                max_positions=cfg.get("max_position_embeddings", 4096), rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rotary_percent=float(cfg.get("partial_rotary_factor", 0.5)), norm_eps=float(cfg.get("norm_eps", 1e-5)))


def geometry(common: dict, positions: str | None, tied_embeddings: bool | None) -> dict:
    """NeMo's Nemotron4Config: LayerNorm1p, rotary on half the head, no biases, untied output layer."""
    return dict(common, model_type="nemotron", norm="layernorm1p", mlp="squared_relu", positions=positions or "rope",
                rotary_percent=0.5, norm_eps=1e-5, tied_embeddings=False if tied_embeddings is None else tied_embeddings)


FAMILY = register(Family(name=NAME, hf_types=("nemotron",), read=read, model_args=None,
                         source="transformers models/nemotron; NeMo Nemotron4Config", mlp="squared_relu",
                         geometry=geometry,
                         launch_refusal="family 'nemotron' has no slime launch (slime 624b824a ships no Nemotron "
                                        "model script)"))
