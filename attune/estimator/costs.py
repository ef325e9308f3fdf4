"""Per-layer costs for one microbatch on one GPU: saved activation bytes, FLOPs, collectives.

Shared by the memory estimator and the performance model so the two never disagree about what a layer
is. All sizes are per token on one GPU unless named otherwise. Sources: reference
megatron-memory-and-performance.md sections 2, 6, 7 and slime-and-qwen.md sections 1.6 and 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from attune.spec.engine import Engine
from attune.spec.model import DENSE, FULL, LINEAR, SLIDING, ModelSpec, mixer_of

BF16 = 2  # bytes per bf16/fp16 element
FP32 = 4  # bytes per fp32 element
GDN_CHUNK = 64  # FLA chunk size of chunk_gated_delta_rule (fla/ops/gated_delta_rule/chunk.py, chunk_size=64)


@dataclass(frozen=True)
class Saved:
    """One tensor a layer keeps for its backward pass, for one microbatch on one GPU."""

    name: str
    """What it is and who saves it (the kernel or autograd node, with its source)."""
    bytes: float
    """Size in bytes."""


@dataclass(frozen=True)
class LayerCost:
    saved: tuple[Saved, ...]  # the tensors kept for backward, per microbatch (no recompute)
    input_bytes: float  # the layer input kept when the layer is recomputed, bytes
    bwd_work_bytes: float  # gradients and recomputed kernel state alive at once during this layer's backward, bytes
    gemm: tuple[tuple[float, float], ...]  # forward GEMMs: (FLOPs, smallest dimension)
    attn_flops: float  # forward softmax-attention core FLOPs
    gdn_flops: float  # forward gated-delta-rule kernel FLOPs
    tp_coll_fwd: int  # TP collectives in forward
    tp_coll_bwd: int  # TP collectives in backward on the critical path (the SP wgrad re-gathers overlap dgrad)
    tp_coll_bytes: float  # bytes per collective (the full-sequence tensor being gathered/reduced)
    tp_allreduce: bool  # without SP the collectives are all-reduces (twice the traffic)
    cp_bytes: float  # CP traffic per GPU per forward, bytes
    params_on_gpu: float  # parameters of this layer held by one GPU
    selective_freed_bytes: float = 0.0  # of ``saved``: what selective (core-attention) recompute does not keep
    mla_up_flops: float = 0.0  # of the forward GEMM FLOPs: MLA's q and kv up projections (``mla_up_proj`` recompute)
    # indices into ``gemm`` of the column-parallel linears whose backward launches the input-gradient TP all-reduce
    # (reduce-scatter under SP) asynchronously and runs the weight-gradient GEMM under it (megatron-core
    # tensor_parallel/layers.py lines 548-566 at 1dcf0daf, "scheduled before the weight gradient computation";
    # TE's Linear / LayerNormLinear overlap dgrad-RS/AR with wgrad the same way): one of the layer's backward
    # collectives each, hidden up to that GEMM's wgrad time
    async_dgrad_gemms: tuple[int, ...] = ()

    @property
    def act_bytes(self) -> float:
        """Bytes saved for backward: the sum of the named tensors (summed once, at construction)."""
        return self._act_bytes

    def __post_init__(self) -> None:
        # the estimator reads act_bytes in its inner loops: sum the named tensors once per (model, engine, shape)
        object.__setattr__(self, "_act_bytes", float(sum(t.bytes for t in self.saved)))


@dataclass(frozen=True)
class Shape:
    """Everything the per-layer cost depends on besides the model."""

    tp: int
    sp: bool
    cp: int
    tokens: int  # tokens per GPU per microbatch (after CP)
    seq: int  # attention context: the packed row length


def _norm_stats(m: ModelSpec) -> int:
    """fp32 statistics a norm saves per token: rsigma (RMSNorm), mu and rsigma (LayerNorm, LayerNorm1p)."""
    return 1 if m.norm == "rmsnorm" else 2


def _te_norm_linear(T: float, m: ModelSpec, hd: int, where: str) -> list[Saved]:
    # Transformer Engine's fused norm + column-parallel linear (_LayerNormLinear.forward,
    # transformer_engine/pytorch/module/layernorm_linear.py) saves the norm input (inputmat), the norm output
    # ln_out (the GEMM input; under SP the local shard, re-gathered in backward) and the norm statistics.
    h = m.hidden
    return [Saved(f"{where} norm input (TE LayerNormLinear inputmat)", T * BF16 * h / hd),
            Saved(f"{where} norm output (TE ln_out, GEMM input)", T * BF16 * h / hd),
            Saved(f"{where} norm statistics (fp32)", T * FP32 * _norm_stats(m) / hd)]


def _fc1(m: ModelSpec, f: int) -> int:
    """Output width of the first MLP projection of an MLP of width ``f``."""
    return (2 if m.mlp_gated else 1) * f


def _te_mlp(T: float, m: ModelSpec, t: int, hd: int, f: int) -> list[Saved]:
    # fc1 output: the activation's input. megatron-core fused bias_swiglu / bias_gelu save their input
    # (megatron/core/fusions/fused_bias_swiglu.py, fused_bias_gelu.py: ctx.save_for_backward(input, bias));
    # squared ReLU (megatron/core/activations.py squared_relu = pow(relu(x), 2)) needs x as well.
    # fc2 input: the activation's output, saved by the row-parallel linear for its wgrad.
    # ``f``: the MLP width of the layer kind (an MoE layer's shared expert, a dense layer's intermediate_size)
    return _te_norm_linear(T, m, hd, "MLP") + [
        Saved(f"fc1 output = {m.mlp} input ({_fc1(m, f) // t} wide)", T * BF16 * _fc1(m, f) / t),
        Saved(f"{m.mlp} output = fc2 input ({f // t} wide)", T * BF16 * f / t),
    ]


def _mlp_bwd_work(T: float, m: ModelSpec, t: int, f: int) -> float:
    """Gradients alive during the MLP backward: d(fc2 input), d(fc1 output)."""
    return T * BF16 * (f + _fc1(m, f)) / t


def attended_keys(m: ModelSpec, kind: str, seq: int) -> float:
    """Keys one query attends to on average in a causal packed row of ``seq`` tokens: seq / 2 over the whole
    context; over a sliding window w < seq, min(i + 1, w) averaged over positions i = w - w(w - 1) / (2 seq)
    (about w: min(window, context), not the full context). FlashAttention skips the blocks outside the window
    (flash_attn window_size; TE's sliding-window mask), so the FLOPs follow the attended keys."""
    base = kind[: -len(DENSE)] if kind.endswith(DENSE) else kind
    if base == SLIDING and m.window and m.window < seq:
        w = m.window
        return w - w * (w - 1) / (2 * seq)
    return seq / 2


def _mla_mixer(m: ModelSpec, T: float, t: int, hd: int) -> tuple[list[Saved], tuple, float, float, int]:
    """Multi-head latent attention (megatron-core MLASelfAttention, attune.spec.mla): the named saved tensors,
    the forward GEMMs, the per-head q/k and v widths fed to attention, and the heads."""
    a, h, H = m.mla, m.hidden, m.heads
    dqk, dv = a.qk_head_dim, a.v_head_dim
    kv_lat = a.kv_lora_rank + a.qk_rope_head_dim  # kv_a_proj_with_mqa output: latent + shared rotary key
    saved = [
        # input_layernorm is a TENorm (the down projections are plain TE Linears, not LayerNormLinear): it saves its
        # input and statistics; its output is the q and kv down projections' shared input (saved once)
        Saved("MLA input norm input (TENorm)", T * BF16 * h / hd),
        Saved("MLA input norm statistics (fp32)", T * FP32 * _norm_stats(m) / hd),
        Saved("MLA q/kv down-projection input (norm output; TP-replicated linears, local sequence shard)",
              T * BF16 * h / hd),
    ]
    if a.q_lora_rank:
        # q latent: gathered over SP, then linear_q_up_proj = TE LayerNormLinear (q_a_layernorm fused) saves its
        # input, its norm output and statistics; full sequence on every TP rank (the latent is not split)
        saved += [Saved("q latent (q_a_layernorm input, TE LayerNormLinear inputmat)", T * BF16 * a.q_lora_rank),
                  Saved("q latent normalised (q up-projection input)", T * BF16 * a.q_lora_rank),
                  Saved("q latent norm statistics (fp32)", T * FP32)]
    saved += [
        # compressed kv latent: linear_kv_up_proj = TE LayerNormLinear (kv_a_layernorm fused) keeps its input and
        # norm output; the rotary key part (qk_rope wide) is kept for the fused rotary's backward
        Saved("compressed kv latent (kv_a_layernorm input)", T * BF16 * a.kv_lora_rank),
        Saved("compressed kv latent normalised (kv up-projection input)", T * BF16 * a.kv_lora_rank),
        Saved("kv latent norm statistics (fp32)", T * FP32),
        Saved("shared rotary key k_pe (qk_rope wide)", T * BF16 * a.qk_rope_head_dim),
        # FlashAttention on the up-projected q, k (qk_nope + qk_rope per head) and v (v_head per head)
        Saved(f"FlashAttention q, k, v after up-projection (q/k head dim {dqk}, v head dim {dv})",
              T * BF16 * H * (2 * dqk + dv) / t),
        Saved("FlashAttention output (also the out-projection input)", T * BF16 * H * dv / t),
        Saved("FlashAttention softmax log-sum-exp (fp32, per head)", T * FP32 * H / t),
    ]
    Tl = T / hd  # the down projections run on the local sequence shard, replicated across TP (not split)
    q_up_in = a.q_lora_rank or h
    gemm = []
    if a.q_lora_rank:
        gemm.append((2 * Tl * h * a.q_lora_rank, min(Tl, h, a.q_lora_rank)))
    gemm += [
        (2 * T * q_up_in * H * dqk / t, min(T, q_up_in, H * dqk / t)),
        (2 * Tl * h * kv_lat, min(Tl, h, kv_lat)),
        (2 * T * a.kv_lora_rank * H * (a.qk_nope_head_dim + dv) / t,
         min(T, a.kv_lora_rank, H * (a.qk_nope_head_dim + dv) / t)),
        (2 * T * H * dv * h / t, min(T, h, H * dv / t)),
    ]
    return saved, tuple(gemm), dqk, dv, H


def _mla_up_flops(m: ModelSpec, T: float, t: int) -> float:
    """Forward FLOPs of MLA's q and kv up projections on one GPU (what ``mla_up_proj`` recompute runs again)."""
    a, H = m.mla, m.heads
    return 2 * T * (a.q_lora_rank or m.hidden) * H * a.qk_head_dim / t + 2 * T * a.kv_lora_rank * H * (
        a.qk_nope_head_dim + a.v_head_dim) / t


def _full(m: ModelSpec, e: Engine, s: Shape, kind: str = FULL) -> LayerCost:
    if m.mla is not None:
        return _mla(m, e, s, kind)
    t, T, h = s.tp, s.tokens, m.hidden
    hd = t if s.sp else 1  # hidden-sized tensors are sequence-sharded only with SP
    q, kv = m.q_dim, m.kv_dim
    f = m.mlp_width(kind)
    gate = m.attn_output_gate
    saved, freed = _full_attention_saved(m, e, s, hd)
    saved += _te_mlp(T, m, t, hd, f)
    q_out = q * (2 if gate else 1)
    mlp_n = _fc1(m, f)
    gemm = (
        (2 * T * h * (q_out + 2 * kv) / t, min(T, h, (q_out + 2 * kv) / t)),
        (2 * T * q * h / t, min(T, h, q / t)),
        (2 * T * h * mlp_n / t, min(T, h, mlp_n / t)),
        (2 * T * f * h / t, min(T, h, f / t)),
    )
    # causal attention: 2 GEMMs (QK^T, PV), 2 FLOPs per multiply-add, over the attended keys (half the context
    # on average; about the window for sliding-window layers): Megatron's 6*q*L counts fwd+bwd
    attn = 4 * T * q * attended_keys(m, kind, s.seq) / t
    work = _full_bwd_work(m, e, s, hd, f)
    p = m.kind_params(kind)
    kv_cp = (s.cp - 1) * 2 * T * kv * BF16 / t if s.cp > 1 else 0.0  # ring KV exchange per GPU
    n_coll = (4 if s.sp else 2) if t > 1 else 0
    # backward under SP: 2 reduce-scatters (column dgrad) + 2 all-gathers (row output grads); the 2 all-gathers
    # re-gathering the column-parallel inputs for wgrad run async under the dgrad GEMM (reference
    # megatron-memory-and-performance.md 7.1, tensor_parallel/layers.py)
    n_bwd = (4 if s.sp else 2) if t > 1 else 0
    return LayerCost(
        saved=tuple(saved), input_bytes=T * BF16 * h / hd, bwd_work_bytes=work, gemm=gemm, attn_flops=attn,
        gdn_flops=0.0, tp_coll_fwd=n_coll, tp_coll_bwd=n_bwd, tp_coll_bytes=BF16 * T * h, tp_allreduce=not s.sp,
        cp_bytes=kv_cp, params_on_gpu=p.matrix / t + p.vectors, selective_freed_bytes=freed,
        async_dgrad_gemms=(0, 2) if t > 1 else (),  # the qkv and fc1 linears
    )


def _full_attention_saved(m: ModelSpec, e: Engine, s: Shape, hd: int) -> tuple[list[Saved], float]:
    """(what a softmax-attention layer saves for backward before its MLP, the bytes selective recompute of core
    attention frees)."""
    t, T, h = s.tp, s.tokens, m.hidden
    q, kv = m.q_dim, m.kv_dim
    gate = m.attn_output_gate
    saved = _te_norm_linear(T, m, hd, "attention")
    if m.qk_norm:
        # per-head RMSNorm on q and k before rotary (TE/megatron-core q_layernorm, k_layernorm): saves its input
        saved.append(Saved("q/k norm inputs and rsigma", T * (BF16 * (q + kv) + FP32 * (m.heads + m.kv_heads)) / t))
    freed = 0.0
    if e.attention_kernel == "unfused":
        # Megatron-LM <= v3.0 CoreAttention (megatron/model/transformer.py): Q, K for the baddbmm, the
        # FusedScaleMaskSoftmax output (bf16), its dropout mask (1 byte) and the dropped-out probabilities
        # (bf16) for the PV bmm, V, the context (out-projection input): Korthikanti et al. 2022 section 4.1,
        # 11*s*b*h + 5*a*s^2*b per layer. Rows of one packed sequence: s = the row length.
        rows = T / s.seq
        scores = rows * m.heads * s.seq * s.seq / t
        core = [Saved("attention softmax probabilities (bf16, a x s x s)", scores * BF16),
                Saved("attention-dropout mask (1 byte per score)", scores * 1),
                Saved("dropped-out attention probabilities (PV bmm input)", scores * BF16)]
        saved += [Saved("q, k (QK^T bmm inputs) and v (PV bmm input)", T * BF16 * (q + 2 * kv) / t), *core,
                  Saved("attention context (out-projection input)", T * BF16 * q / t)]
        freed = sum(x.bytes for x in core)
    else:
        saved += [
            # FlashAttention (flash_attn_interface FlashAttnFunc.forward: save_for_backward(q, k, v, out,
            # softmax_lse, rng_state); TE FusedAttnFunc the same with its aux tensors). Rotary is applied by a fused
            # kernel that saves only the frequencies, so the pre-rotary q/k are freed.
            Saved("FlashAttention q, k, v (post-rotary)", T * BF16 * (q + 2 * kv) / t),
            Saved("FlashAttention output (also the out-projection input)", T * BF16 * q / t),
            Saved("FlashAttention softmax log-sum-exp (fp32, per head)", T * FP32 * m.heads / t),
        ]
    if e.hidden_dropout_masks:
        # bias-dropout-add after the out-projection and after fc2 saves a 1-byte mask of the residual-stream
        # shape (sequence-sharded under SP): Korthikanti et al. 2022 section 4.1
        saved.append(Saved("hidden-dropout masks after attention and MLP (1 byte each)", 2 * T * h / hd))
    if gate:
        # Qwen3.5 gated attention: out * sigmoid(gate); sigmoid saves its output, the product saves both
        # operands (the core output is the FlashAttention output above); the product feeds the out-projection
        saved += [Saved("output-gate sigmoid output", T * BF16 * q / t),
                  Saved("gated attention output (out-projection input)", T * BF16 * q / t)]
    return saved, freed


def _full_bwd_work(m: ModelSpec, e: Engine, s: Shape, hd: int, f: int) -> float:
    """A softmax-attention layer's backward working set, bytes."""
    t, T, h = s.tp, s.tokens, m.hidden
    q, kv = m.q_dim, m.kv_dim
    # backward: FlashAttention's dq, dk, dv, d(out) plus its fp32 dq accumulator; or the MLP's gradients; plus the
    # incoming and outgoing residual-stream gradients and, under SP, the re-gathered full-sequence GEMM input
    attn_work = T * (BF16 * (2 * q + 2 * kv) + FP32 * q) / t
    if e.attention_kernel == "unfused":
        # the unfused backward materialises the gradients of the dropped-out probabilities and of the scores
        attn_work += 2 * BF16 * (T / s.seq) * m.heads * s.seq * s.seq / t
    sp_gather = T * BF16 * h * (hd > 1)
    work = max(attn_work, _mlp_bwd_work(T, m, t, f)) + 2 * T * BF16 * h / hd + sp_gather
    return work


def _mla(m: ModelSpec, e: Engine, s: Shape, kind: str) -> LayerCost:
    """A multi-head-latent-attention layer (DeepSeek-V3, Kimi K2) with its MLP: MLA saved tensors, GEMMs and
    attention FLOPs with q/k head dim qk_nope + qk_rope and v head dim v_head; the down projections are
    replicated across TP (megatron-core MLA ``parallel_mode='duplicated'``)."""
    t, T, h = s.tp, s.tokens, m.hidden
    hd = t if s.sp else 1
    f = m.mlp_width(kind)
    saved, mix_gemm, dqk, dv, H = _mla_mixer(m, T, t, hd)
    if e.hidden_dropout_masks:
        saved.append(Saved("hidden-dropout masks after attention and MLP (1 byte each)", 2 * T * h / hd))
    saved += _te_mlp(T, m, t, hd, f)
    mlp_n = _fc1(m, f)
    gemm = mix_gemm + ((2 * T * h * mlp_n / t, min(T, h, mlp_n / t)), (2 * T * f * h / t, min(T, h, f / t)))
    # QK^T over dqk and PV over dv per head, 2 FLOPs per multiply-add, over the attended keys
    attn = 2 * T * H * (dqk + dv) * attended_keys(m, kind, s.seq) / t
    # backward: dq, dk (dqk wide), dv, d(out) (dv wide) plus the fp32 dq accumulator
    attn_work = T * (BF16 * H * (2 * dqk + 2 * dv) + FP32 * H * dqk) / t
    sp_gather = T * BF16 * h * (hd > 1)
    work = max(attn_work, _mlp_bwd_work(T, m, t, f)) + 2 * T * BF16 * h / hd + sp_gather
    p = m.kind_params(kind)
    # CP: megatron-core MLA runs the ring over the up-projected k and v (dqk and dv wide per head)
    kv_cp = (s.cp - 1) * T * H * (dqk + dv) * BF16 / t if s.cp > 1 else 0.0
    # TP collectives as for attention [approximation: under SP the all-gathers before the up projections move
    # the q and kv latents (q_lora + kv_lora + qk_rope wide, not hidden), counted at the hidden width]
    n_coll = (4 if s.sp else 2) if t > 1 else 0
    rep = p.mixer_replicated
    return LayerCost(
        saved=tuple(saved), input_bytes=T * BF16 * h / hd, bwd_work_bytes=work, gemm=gemm, attn_flops=attn,
        gdn_flops=0.0, tp_coll_fwd=n_coll, tp_coll_bwd=n_coll, tp_coll_bytes=BF16 * T * h, tp_allreduce=not s.sp,
        cp_bytes=kv_cp, params_on_gpu=(p.matrix - rep) / t + rep + p.vectors, mla_up_flops=_mla_up_flops(m, T, t),
    )


def _gdn(m: ModelSpec, e: Engine, s: Shape, kind: str = LINEAR) -> LayerCost:
    t, T, h = s.tp, s.tokens, m.hidden
    f = m.mlp_width(kind)
    hd = t if s.sp else 1
    rep = e.gdn_replicated
    mix_t = 1 if rep else t  # slime: the GDN mixer is not split by TP ...
    Tm = T * s.cp if rep else T  # ... nor by CP: every rank runs the whole CP-group sequence
    vd, conv, vh, dk, dv = m.lin_value_dim, m.lin_conv_dim, m.lin_v_heads, m.lin_k_dim, m.lin_v_dim
    saved = _gdn_input_saved(m, e, T, Tm, hd)
    per_head = _gdn_mixer_saved(m, Tm)
    saved += [Saved(x.name, x.bytes / mix_t) for x in per_head]
    saved += _te_mlp(T, m, t, hd, f)
    in_n = conv + vd + 2 * vh
    mlp_n = _fc1(m, f)
    gemm = (
        (2 * Tm * h * in_n / mix_t, min(Tm, h, in_n / mix_t)),
        (2 * Tm * vd * h / mix_t, min(Tm, h, vd / mix_t)),
        (2 * T * h * mlp_n / t, min(T, h, mlp_n / t)),
        (2 * T * f * h / t, min(T, h, f / t)),
    )
    C = GDN_CHUNK
    per_head_flops = 6 * dk * dv + 2 * C * (3 * dk + 2 * dv) + C * C / 3  # slime-and-qwen.md 4.4
    gdn = Tm * (vh / mix_t) * per_head_flops + 2 * Tm * conv * m.conv_kernel / mix_t
    # backward: the FLA backward recomputes the chunk states h [T/64, H, dk, dv] and builds dh of the same
    # shape, both in q.dtype (fla/ops/common/chunk_delta_h.py: h = k.new_empty, dh = q.new_empty), plus the
    # gradients of the mixer's saved tensors (about their own size); or the MLP's gradients
    states = 2 * Tm * BF16 * vh * dk * dv / C / mix_t
    mixer_saved = sum(x.bytes for x in per_head) / mix_t
    p = m.kind_params(kind)
    # slime's HF GDN linears are plain nn.Linear: no TE gradient-accumulation fusion, so autograd materialises a
    # bf16 .grad of the mixer weights before Megatron's DDP backward hook adds it into main_grad and frees it
    # (megatron/core/distributed/distributed_data_parallel.py _make_backward_post_hook)
    wgrad = BF16 * p.mixer_matrix if rep else 0.0
    work = (max(states + mixer_saved + wgrad, _mlp_bwd_work(T, m, t, f)) + 2 * T * BF16 * h / hd
            + T * BF16 * h * (hd > 1))
    fwd, bwd, cp_bytes = _gdn_collectives(s, rep, T, Tm, h, conv + vd)
    return LayerCost(
        saved=tuple(saved), input_bytes=T * BF16 * h / hd, bwd_work_bytes=work, gemm=gemm, attn_flops=0.0,
        gdn_flops=gdn, tp_coll_fwd=fwd, tp_coll_bwd=bwd, tp_coll_bytes=BF16 * T * h, tp_allreduce=not s.sp,
        cp_bytes=cp_bytes, params_on_gpu=(p.mixer_matrix / mix_t) + p.mlp_matrix / t + p.vectors,
        # fc1; the mixer's input projection too where it is TP-split (slime's replicated HF GDN has no TP dgrad)
        async_dgrad_gemms=(() if t == 1 else (2,) if rep else (0, 2)),
    )


def _gdn_input_saved(m: ModelSpec, e: Engine, T: float, Tm: float, hd: int) -> list[Saved]:
    """The GDN layer's input norm and in_proj input, saved for backward (``Tm``: tokens the mixer runs on)."""
    h = m.hidden
    saved: list[Saved] = []
    if e.gdn_fp32_norm_copies:
        # slime's Qwen3NextRMSNorm in python (HF): x.float() is saved by the square/multiply, the fp32 normalised
        # tensor by the (1 + weight) multiply, plus the fp32 rsqrt; the bf16 output is the in_proj input
        # (slime-and-qwen.md 4.3). It runs after the SP all-gather: full sequence on every TP rank.
        saved += [Saved("GDN input RMSNorm fp32 copy of x (HF python norm)", Tm * FP32 * h),
                  Saved("GDN input RMSNorm fp32 normalised x", Tm * FP32 * h),
                  Saved("GDN input RMSNorm rsqrt (fp32)", Tm * FP32),
                  Saved("GDN in_proj input (norm output, shared by in_proj_qkv / z / b / a)", Tm * BF16 * h)]
    else:
        # megatron-core GDN: in_proj is TE's fused LayerNormLinear (sequence-sharded under SP)
        saved += _te_norm_linear(T, m, hd, "GDN")
    return saved


def _gdn_mixer_saved(m: ModelSpec, Tm: float) -> list[Saved]:
    """The GDN mixer's saved tensors, whole (the caller divides them by the mixer's TP split)."""
    vd, conv, vh, dk = m.lin_value_dim, m.lin_conv_dim, m.lin_v_heads, m.lin_k_dim
    # per-head tensors, divided by TP in megatron-core (head-parallel), whole in slime's replicated plugin.
    # chunk_gated_delta_rule (fla/ops/gated_delta_rule/chunk.py ChunkGatedDeltaRuleFunction.forward) saves
    # q, q_rstd, k, k_rstd, v, g (chunk-local cumsum, fp32), beta, beta_raw (the same tensor unless the
    # sigmoid is in the kernel), A (WY inverse, [T, H, 64] in k.dtype); input_guard makes q/k/v contiguous
    # copies, so the conv output itself is freed. The chunk states h are recomputed in backward, not saved.
    return [
        Saved("causal_conv1d input: pre-conv q, k, v (FLA ShortConvolution saves x)", Tm * BF16 * conv),
        Saved("z output gate (saved by the gated norm)", Tm * BF16 * vd),
        Saved("q, k repeated to the value heads, l2-normalised (saved by chunk_gated_delta_rule)",
              Tm * BF16 * 2 * vh * dk),
        Saved("q, k l2norm rstd (fp32)", Tm * FP32 * 2 * vh),
        Saved("v (saved by chunk_gated_delta_rule)", Tm * BF16 * vd),
        # g = -exp(A_log) * softplus(a.float() + dt_bias): softplus saves its fp32 input, the product its fp32
        # softplus output; the kernel saves the fp32 chunk cumsum of g
        Saved("gate g: softplus input, softplus output, chunk cumsum (fp32)", Tm * FP32 * 3 * vh),
        Saved("beta = sigmoid(b) (one tensor saved as beta and beta_raw)", Tm * BF16 * vh),
        Saved("A: WY-representation inverse per 64-token chunk", Tm * BF16 * vh * GDN_CHUNK),
        # FusedRMSNormGated (fla/modules/fused_norm_gate.py) saves its input o, the gate z (above) and rstd
        Saved("kernel output o (gated-norm input)", Tm * BF16 * vd),
        Saved("gated-norm rstd (fp32)", Tm * FP32 * vh),
        Saved("gated-norm output (out_proj input)", Tm * BF16 * vd),
    ]


def _gdn_collectives(s: Shape, rep: bool, T: float, Tm: float, h: int, mixed: int) -> tuple[int, int, float]:
    """(TP collectives forward, backward, CP bytes) of a GDN layer (``mixed``: conv + value dims)."""
    t = s.tp
    if t > 1:
        # slime under SP: all-gather the input (fwd), all-gather the output grad (bwd) around the replicated
        # mixer; plus the MLP's 2 fwd / 2 exposed bwd collectives (slime_plugins hf_attention.py)
        fwd = (3 if s.sp else 1) if rep else (4 if s.sp else 2)
        bwd = (3 if s.sp else 1) if rep else (4 if s.sp else 2)
    else:
        fwd = bwd = 0
    cp_bytes = ((s.cp - 1) / s.cp * BF16 * Tm * h) if (s.cp > 1 and rep) else (
        2 * (s.cp - 1) / s.cp * BF16 * T * mixed / t if s.cp > 1 else 0.0)  # all-gather / all-to-all
    return fwd, bwd, cp_bytes


@lru_cache(maxsize=4096)
def layer_costs(m: ModelSpec, e: Engine, s: Shape) -> dict[str, LayerCost]:
    """One LayerCost per layer kind of the model (``ModelSpec.kinds``; FULL always, the reference kind)."""
    out = {FULL: _full(m, e, s, FULL)}
    for k in m.kinds:
        if k not in out:
            out[k] = _gdn(m, e, s, k) if mixer_of(k) == LINEAR else _full(m, e, s, k)
    return out


def logits_flops(m: ModelSpec, s: Shape) -> tuple[float, float]:
    """Forward output-layer GEMM FLOPs and its smallest dimension."""
    return 2 * s.tokens * m.hidden * m.vocab / s.tp, min(s.tokens, m.hidden, m.vocab / s.tp)


# ---------------------------------------------------------------------- multi-token prediction
def mtp_saved(m: ModelSpec, s: Shape) -> tuple[Saved, ...]:
    """What one multi-token-prediction layer saves besides its transformer layer, one microbatch on one GPU
    (megatron-core multi_token_prediction.py MultiTokenPredictionLayer: enorm(embedding of the tokens shifted
    by one) and hnorm(previous depth's hidden state), concatenated, eh_proj Linear(2h, h), one transformer layer,
    the final norm, then the shared output layer and the MTP loss)."""
    T, h = s.tokens, m.hidden
    hd = s.tp if s.sp else 1
    st = _norm_stats(m)
    return (
        Saved("MTP enorm and hnorm inputs: the shifted tokens' embedding and the hidden state (TENorm)",
              2 * T * BF16 * h / hd),
        Saved("MTP enorm and hnorm statistics (fp32)", 2 * T * FP32 * st / hd),
        # eh_proj is column-parallel: it keeps its (sequence-local under SP) input for wgrad; its output, gathered
        # over TP (and scattered back to the sequence shard under SP), is the transformer layer's input, which the
        # layer's own first saved tensor already counts
        Saved("MTP eh_proj input: normalised embedding and hidden state concatenated (2h wide)", T * BF16 * 2 * h / hd),
        Saved("MTP final norm input and statistics", T * (BF16 * h + FP32 * st) / hd),
        Saved("MTP output-layer input (final norm output; the shared output layer runs again)", T * BF16 * h / hd),
    )


def mtp_logits_bytes(m: ModelSpec, s: Shape) -> float:
    """The MTP loss's logits on one GPU: megatron-core computes it with vocab_parallel_cross_entropy, which works
    on an fp32 copy of the [tokens, vocab / TP] logits and keeps it for backward."""
    return FP32 * s.tokens * m.vocab / s.tp


def mtp_gemm(m: ModelSpec, s: Shape) -> tuple[tuple[float, float], ...]:
    """Forward GEMMs of one MTP layer besides its transformer layer: eh_proj (2h -> h, column-parallel) and the
    shared output layer run again: (FLOPs, smallest dimension)."""
    T, h = s.tokens, m.hidden
    return ((2 * T * 2 * h * h / s.tp, min(T, 2 * h, h / s.tp)), logits_flops(m, s))
