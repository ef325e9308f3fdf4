"""Cross-check attune's parameter counts against megatron-core's own modules, built on the meta device.

Optional extra `megatron` (megatron-core 0.16.1, the newest for Python 3.11). Llama-style and GPT-2 style
models use megatron-core's local (non-Transformer-Engine) layer spec; the Qwen3.5 Gated DeltaNet spec in
megatron-core needs Transformer Engine, which exists only on GPU images, so the hybrid is not cross-checked
here (its counts are checked against the reference's hand count and the torch runner's modules).
"""

from __future__ import annotations

import socket
import warnings

from attune.errors import AttuneError
from attune.spec.model import ModelSpec


class CrossCheckError(AttuneError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def megatron_param_count(model: ModelSpec) -> int:
    """Total parameters of `model` as megatron-core's GPTModel builds it (TP = PP = 1, meta device)."""
    try:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel  # noqa: F401 (the extra's presence, checked up front)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: F401
        from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: F401
    except ImportError as e:
        raise CrossCheckError(f"the cross-check needs the optional extra: pip install 'attune[megatron]' ({e.name})") from None
    if model.traits.crosscheck_refusal:
        raise CrossCheckError(model.traits.crosscheck_refusal)
    if model.moe is not None and (model.mla is not None or model.moe.expert_bias or model.moe.shared_gate
                                  or model.window_layers):
        raise CrossCheckError(f"{model.name}: the MoE cross-check builds GQA models with ungated shared experts "
                              f"only (no latent attention, expert biases, shared gate or sliding windows)")
    # a one-rank gloo group of our own (no environment variables set), torn down again below
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    owns_mp = not parallel_state.model_parallel_is_initialized()
    if owns_mp:
        parallel_state.initialize_model_parallel(1, 1)
    try:
        return _count(model, torch, F)
    finally:
        if owns_mp:
            parallel_state.destroy_model_parallel()
        if owns_group:
            dist.destroy_process_group()


def _count(model: ModelSpec, torch, F) -> int:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if model.moe is not None:
        return _count_moe(model, torch, F)
    llama = model.mlp == "swiglu" and model.norm == "rmsnorm"  # llama-style (llama, glm4, mimo); else GPT-2 style
    cfg = TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden, ffn_hidden_size=model.ffn,
        num_attention_heads=model.heads, num_query_groups=model.kv_heads, kv_channels=model.head_dim,
        gated_linear_unit=llama, activation_func=F.silu if llama else F.gelu,
        normalization="RMSNorm" if llama else "LayerNorm", add_bias_linear=not llama, add_qkv_bias=model.attn_bias,
        qk_layernorm=model.qk_norm, use_cpu_initialization=True, perform_initialization=False,
        params_dtype=torch.bfloat16)
    spec = get_gpt_layer_local_spec(normalization=cfg.normalization, qk_layernorm=model.qk_norm)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="megatron")
        m = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=model.vocab,
                     max_sequence_length=model.max_positions,
                     position_embedding_type="rope" if model.positions == "rope" else "learned_absolute",
                     share_embeddings_and_output_weights=model.tied_embeddings)
    return sum(p.numel() for p in m.parameters())


def _count_moe(model: ModelSpec, torch, F) -> int:
    """An MoE model without its multi-token-prediction modules (``total_params - mtp_params``), as megatron-core's
    local (non-TE) decoder block spec builds it: routed experts as SequentialMLP, the shared expert, the router.

    Two things megatron-core holds outside ``parameters()`` or on the GPU are added by hand: the router's expert
    bias (``TopKRouter.expert_bias``, a buffer megatron-core allocates on ``torch.cuda.current_device()``, so the
    model is built without it and ``experts`` values per MoE layer are added; the checkpoint's
    ``e_score_correction_bias``). megatron-core's QK norm is per head: a model whose norms span the whole
    projection (``qk_norm_full``, MiniMax-M2) differs from this count by (q + kv width - 2 x head_dim) per layer.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = model.moe
    cfg = TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden, ffn_hidden_size=moe.dense_ffn or moe.expert_ffn,
        num_attention_heads=model.heads, num_query_groups=model.kv_heads, kv_channels=model.head_dim,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        add_qkv_bias=model.attn_bias, qk_layernorm=model.qk_norm, num_moe_experts=moe.experts,
        moe_ffn_hidden_size=moe.expert_ffn, moe_router_topk=moe.top_k,
        moe_shared_expert_intermediate_size=moe.shared_ffn or None,
        moe_layer_freq=list(moe.pattern) if moe.pattern else 1, moe_router_score_function=moe.score,
        moe_grouped_gemm=False, use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.bfloat16)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        m = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=model.vocab,
                     max_sequence_length=model.max_positions, position_embedding_type="rope",
                     share_embeddings_and_output_weights=model.tied_embeddings)
    expert_bias = moe.experts * model.count_moe(0, model.num_layers) if moe.router_bias else 0
    return sum(p.numel() for p in m.parameters()) + expert_bias
