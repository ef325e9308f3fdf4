"""Per-layer costs for one microbatch on one GPU: saved activation bytes, FLOPs, collectives.

Shared by the memory estimator and the performance model so the two never disagree about what a layer
is. All sizes are per token on one GPU unless named otherwise. Sources: reference
megatron-memory-and-performance.md sections 2, 6, 7 and slime-and-qwen.md sections 1.6 and 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from attune.spec.engine import Engine
from attune.spec.model import FULL, LINEAR, ModelSpec

BF16 = 2  # bytes
FP32 = 4
GDN_CHUNK = 64  # FLA chunk size of chunk_gated_delta_rule (fla/ops/gated_delta_rule/chunk.py)


@dataclass(frozen=True)
class LayerCost:
    act_bytes: float  # saved for backward, per microbatch, bytes (no recompute)
    input_bytes: float  # the layer input kept when the layer is recomputed, bytes
    gemm: tuple[tuple[float, float], ...]  # forward GEMMs: (FLOPs, smallest dimension)
    attn_flops: float  # forward softmax-attention core FLOPs
    gdn_flops: float  # forward gated-delta-rule kernel FLOPs
    tp_coll_fwd: int  # TP collectives in forward (exposed)
    tp_coll_bwd: int  # TP collectives in backward (exposed; wgrad all-gathers overlap with dgrad)
    tp_coll_bytes: float  # bytes per collective (the full-sequence tensor being gathered/reduced)
    tp_allreduce: bool  # without SP the collectives are all-reduces (twice the traffic)
    cp_bytes: float  # CP traffic per GPU per forward, bytes
    params_on_gpu: float  # parameters of this layer held by one GPU


@dataclass(frozen=True)
class Shape:
    """Everything the per-layer cost depends on besides the model."""

    tp: int
    sp: bool
    cp: int
    tokens: int  # tokens per GPU per microbatch (after CP)
    seq: int  # attention context: the packed row length


def _full(m: ModelSpec, e: Engine, s: Shape) -> LayerCost:
    t, T, h = s.tp, s.tokens, m.hidden
    hd = t if s.sp else 1  # hidden-sized tensors are sequence-sharded only with SP
    gate = m.attn_output_gate
    # saved tensors (bf16): norm input+output for both norms (TE fused norm-linear) 8h; q, k, v; core output;
    # with the output gate also the gate and the gated output (reference section 2.4)
    heads_bytes = BF16 * (2 * m.q_dim + 2 * m.kv_dim + (2 * m.q_dim if gate else 0)) / t
    mlp_bytes = BF16 * ((3 * m.ffn) if m.mlp == "swiglu" else (2 * m.ffn)) / t
    act = T * (4 * BF16 * h / hd + heads_bytes + mlp_bytes + FP32 * m.heads / t)  # + softmax LSE
    q_out = m.q_dim * (2 if gate else 1)
    mlp_n = (2 if m.mlp == "swiglu" else 1) * m.ffn
    gemm = (
        (2 * T * h * (q_out + 2 * m.kv_dim) / t, min(T, h, (q_out + 2 * m.kv_dim) / t)),
        (2 * T * m.q_dim * h / t, min(T, h, m.q_dim / t)),
        (2 * T * h * mlp_n / t, min(T, h, mlp_n / t)),
        (2 * T * m.ffn * h / t, min(T, h, m.ffn / t)),
    )
    # causal attention: 2 GEMMs (QK^T, PV) over half the context on average (Megatron's 6*q*L counts fwd+bwd)
    attn = 2 * T * m.q_dim * s.seq / t
    p = m.full_layer()
    kv_cp = (s.cp - 1) * 2 * T * m.kv_dim * BF16 / t if s.cp > 1 else 0.0  # ring KV exchange per GPU
    return LayerCost(
        act_bytes=act, input_bytes=T * BF16 * h / hd, gemm=gemm, attn_flops=attn, gdn_flops=0.0,
        tp_coll_fwd=(4 if s.sp else 2) if t > 1 else 0, tp_coll_bwd=(4 if s.sp else 2) if t > 1 else 0,
        tp_coll_bytes=BF16 * T * h, tp_allreduce=not s.sp, cp_bytes=kv_cp,
        params_on_gpu=p.matrix / t + p.vectors,
    )


def _gdn(m: ModelSpec, e: Engine, s: Shape) -> LayerCost:
    t, T, h = s.tp, s.tokens, m.hidden
    hd = t if s.sp else 1
    rep = e.gdn_replicated
    mix_t = 1 if rep else t  # slime: the GDN mixer is not split by TP ...
    Tm = T * s.cp if rep else T  # ... nor by CP: every rank runs the whole CP-group sequence
    vd, conv, vh = m.lin_value_dim, m.lin_conv_dim, m.lin_v_heads
    qk_rep = 2 * vh * m.lin_k_dim  # q and k repeated to the value heads
    mixer_saved = BF16 * (h + conv + vd + qk_rep + vd + vh * GDN_CHUNK + 2 * vd) + 3 * FP32 * vh  # slime-and-qwen 4.3
    norm_saved = (FP32 * 2 * h + BF16 * h) if e.gdn_fp32_norm_copies else (BF16 * 2 * h / (1 if rep else hd))
    mlp_bytes = BF16 * ((3 * m.ffn) if m.mlp == "swiglu" else 2 * m.ffn) / t
    act = Tm * (mixer_saved / mix_t + norm_saved) + T * (2 * BF16 * h / hd + mlp_bytes)
    in_n = conv + vd + 2 * vh
    mlp_n = 2 * m.ffn
    gemm = (
        (2 * Tm * h * in_n / mix_t, min(Tm, h, in_n / mix_t)),
        (2 * Tm * vd * h / mix_t, min(Tm, h, vd / mix_t)),
        (2 * T * h * mlp_n / t, min(T, h, mlp_n / t)),
        (2 * T * m.ffn * h / t, min(T, h, m.ffn / t)),
    )
    C, dk, dv = GDN_CHUNK, m.lin_k_dim, m.lin_v_dim
    per_head = 6 * dk * dv + 2 * C * (3 * dk + 2 * dv) + C * C / 3  # slime-and-qwen.md 4.4
    gdn = Tm * (vh / mix_t) * per_head + 2 * Tm * conv * m.conv_kernel / mix_t
    p = m.gdn_layer()
    if t > 1:
        # slime under SP: all-gather the input (fwd), all-gather the output grad (bwd) around the replicated
        # mixer; plus the MLP's 2 fwd / 2 exposed bwd collectives (slime_plugins hf_attention.py)
        fwd = (3 if s.sp else 1) if rep else (4 if s.sp else 2)
        bwd = (3 if s.sp else 1) if rep else (4 if s.sp else 2)
    else:
        fwd = bwd = 0
    cp_bytes = ((s.cp - 1) / s.cp * BF16 * Tm * h) if (s.cp > 1 and rep) else (
        2 * (s.cp - 1) / s.cp * BF16 * T * (conv + vd) / t if s.cp > 1 else 0.0)  # all-gather / all-to-all
    return LayerCost(
        act_bytes=act, input_bytes=T * BF16 * h / hd, gemm=gemm, attn_flops=0.0, gdn_flops=gdn,
        tp_coll_fwd=fwd, tp_coll_bwd=bwd, tp_coll_bytes=BF16 * T * h, tp_allreduce=not s.sp, cp_bytes=cp_bytes,
        params_on_gpu=(p.mixer_matrix / mix_t) + p.mlp_matrix / t + p.vectors,
    )


@lru_cache(maxsize=4096)
def layer_costs(m: ModelSpec, e: Engine, s: Shape) -> dict[str, LayerCost]:
    out = {FULL: _full(m, e, s)}
    if m.family == "qwen3_5":
        out[LINEAR] = _gdn(m, e, s)
    return out


def logits_flops(m: ModelSpec, s: Shape) -> tuple[float, float]:
    """Forward output-layer GEMM FLOPs and its smallest dimension."""
    return 2 * s.tokens * m.hidden * m.vocab / s.tp, min(s.tokens, m.hidden, m.vocab / s.tp)
