"""The subset of a Hugging Face ``config.json`` that attune reads, as a typed, ranged pydantic model.

:func:`check_hf_config` runs before :func:`attune.spec.model.from_hf_config` reads a field: a count that is a
string, a float, a bool or not positive (``"hidden_size": "128"``, ``"num_hidden_layers": true``), a NaN or
infinite float, or heads that do not divide the hidden size without a ``head_dim`` is one line naming the field
and what is allowed (``ModelError``, exit 2), never a traceback or a silently wrong model. Fields attune does not
read are left alone (``extra="allow"``); a ``text_config`` (multimodal wrappers) is checked the same way.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from attune.errors import ModelError
from attune.spec.validation import one_line

__all__ = ["HFConfig", "check_hf_config"]

Count = Optional[Annotated[StrictInt, Field(ge=1)]]
Zero = Optional[Annotated[StrictInt, Field(ge=0)]]
Positive = Optional[Annotated[float, Field(gt=0, allow_inf_nan=False, strict=False)]]
Fraction = Optional[Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]]


class HFConfig(BaseModel):
    """config.json fields attune reads; every count a positive JSON integer, every float finite."""

    model_config = ConfigDict(extra="allow")

    model_type: Optional[StrictStr] = None
    hidden_act: Optional[StrictStr] = None
    scoring_func: Optional[StrictStr] = None
    topk_method: Optional[StrictStr] = None
    # geometry counts
    hidden_size: Count = None
    num_hidden_layers: Count = None
    num_attention_heads: Count = None
    num_key_value_heads: Count = None
    intermediate_size: Zero = None  # 0: no dense MLP (MoE configs)
    vocab_size: Count = None
    head_dim: Count = None
    max_position_embeddings: Count = None
    n_embd: Count = None
    n_head: Count = None
    n_layer: Count = None
    n_inner: Count = None
    n_positions: Count = None
    # hybrid / linear attention
    linear_conv_kernel_dim: Count = None
    linear_key_head_dim: Count = None
    linear_num_key_heads: Count = None
    linear_num_value_heads: Count = None
    linear_value_head_dim: Count = None
    full_attention_interval: Count = None
    layer_types: Optional[list[StrictStr]] = None
    # mixture of experts
    num_experts: Zero = None
    num_local_experts: Zero = None
    n_routed_experts: Zero = None
    n_shared_experts: Zero = None
    num_experts_per_tok: Count = None
    moe_intermediate_size: Count = None
    shared_expert_intermediate_size: Zero = None
    decoder_sparse_step: Count = None
    first_k_dense_replace: Zero = None
    moe_layer_freq: Optional[StrictInt | list[StrictInt]] = None
    mlp_only_layers: Optional[list[Annotated[StrictInt, Field(ge=0)]]] = None
    n_group: Count = None
    topk_group: Count = None
    routed_scaling_factor: Positive = None
    # multi-head latent attention, MTP, windows
    kv_lora_rank: Count = None
    q_lora_rank: Count = None
    qk_nope_head_dim: Count = None
    qk_rope_head_dim: Count = None
    v_head_dim: Count = None
    num_nextn_predict_layers: Zero = None
    sliding_window: Count = None
    # floats
    rope_theta: Positive = None
    rms_norm_eps: Positive = None
    layer_norm_epsilon: Positive = None
    norm_eps: Positive = None
    partial_rotary_factor: Fraction = None
    # switches
    tie_word_embeddings: Optional[StrictBool] = None
    attention_bias: Optional[StrictBool] = None
    mlp_bias: Optional[StrictBool] = None
    attn_output_gate: Optional[StrictBool] = None
    text_config: Optional["HFConfig"] = None

    @model_validator(mode="after")
    def _geometry(self) -> "HFConfig":
        h, heads, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        if heads and kv and heads % kv:
            raise ValueError(f"num_key_value_heads {kv} must divide num_attention_heads {heads}")
        if h and heads and self.head_dim is None and self.kv_lora_rank is None and h % heads:
            raise ValueError(f"num_attention_heads {heads} must divide hidden_size {h} (or give head_dim)")
        if self.n_embd and self.n_head and self.n_embd % self.n_head:
            raise ValueError(f"n_head {self.n_head} must divide n_embd {self.n_embd}")
        if self.rope_theta is None and isinstance(self.model_extra, dict):
            rp = self.model_extra.get("rope_parameters")
            if rp is not None and not isinstance(rp, dict):
                raise ValueError("rope_parameters must be an object")
            if isinstance(rp, dict) and rp.get("rope_theta") is not None:
                t = rp["rope_theta"]
                if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < float("inf")):
                    raise ValueError(f"rope_parameters.rope_theta must be a positive finite number (got {t!r})")
        return self


def check_hf_config(cfg: Any, where: str) -> dict:
    """``cfg`` without its null fields (HF writes ``"head_dim": null`` for "the default"), or ModelError (one
    line) when it is not a config.json attune can read safely."""
    if not isinstance(cfg, dict):
        raise ModelError(f"{where}: config.json must be a JSON object")
    try:
        HFConfig.model_validate(cfg)
    except ValidationError as e:
        raise ModelError(f"{where}: config.json field {one_line(e, HFConfig)}") from None
    except RecursionError:
        raise ModelError(f"{where}: config.json is nested too deeply") from None
    out = {k: v for k, v in cfg.items() if v is not None}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = {k: v for k, v in out["text_config"].items() if v is not None}
    return out
