"""PyTorch modules for the ModelSpec families (plain PyTorch, no fused kernels); the family's builder traits
(``ModelSpec.traits``: zero-centred norms, biases on every linear) choose the variant, never its name.

* llama: GQA, SwiGLU, RMSNorm, RoPE (partial rotary from `rotary_percent`), optional q/k biases
  (qwen2) and q/k RMSNorm (qwen3).
* gpt2: LayerNorm, tanh-GeLU MLP with biases, MHA with biases, learned positions, tied output.
* qwen3_5: Gated DeltaNet layers and, where `layer_types` says FULL, gated full attention (q_proj also
  emits a per-channel output gate; output * sigmoid(gate)), q/k RMSNorm, zero-centred (1 + w) RMSNorm.

Parameter counts equal `ModelSpec.total_params` (and `stage_params` for a pipeline stage) exactly.
Everything runs in the dtype of the parameters (fp32 on CPU); norms and the delta rule compute in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from attune.spec.model import LINEAR, ModelSpec
from attune.torchmodels.expert_parallel import ExpertParallel
from attune.torchmodels.moe_block import LocalExperts, MoEBlock

# Standard deviation of the normal init of matrices and embeddings: GPT-2 / Megatron `init_method_std` default.
INIT_STD = 0.02
# Seed stride between the per-slot generators (a prime, so slots of nearby seeds do not collide).
SEED_STRIDE = 1_000_003
# GDN decay init: A = uniform(1, 16), A_log = log(A) (transformers Qwen3Next / Mamba2 convention).
A_INIT_RANGE = (1.0, 16.0)
# l2-norm epsilon of the GDN q/k (flash-linear-attention `l2norm` default).
L2_EPS = 1e-6
# Chunk length of the chunked gated delta rule (flash-linear-attention `chunk_gated_delta_rule` default).
GDN_CHUNK = 64


# ---------------------------------------------------------------------- norms
class RMSNorm(nn.Module):
    """RMSNorm over the last dim; `zero_centered` stores w and scales by (1 + w) (Qwen3.5 / Qwen3-Next)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False, device=None):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.empty(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = (1.0 + self.weight.float()) if self.zero_centered else self.weight.float()
        return (y * w).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * w * silu(z) over the last dim (GDN output norm; weight shared by all value heads)."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * F.silu(z.float())).to(x.dtype)


def make_norm(spec: ModelSpec, dim: int, device=None) -> nn.Module:
    if spec.norm == "layernorm":
        return nn.LayerNorm(dim, eps=spec.norm_eps, device=device)
    return RMSNorm(dim, spec.norm_eps, zero_centered=spec.traits.zero_centred_norm, device=device)


# ---------------------------------------------------------------------- rotary positions
def rotary_dim(spec: ModelSpec) -> int:
    d = int(spec.head_dim * spec.rotary_percent)
    return d - d % 2


def rope_tables(spec: ModelSpec, seq_len: int, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq_len, rotary_dim] (the half-split layout: frequencies repeated twice)."""
    rd = rotary_dim(spec)
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, rd, 2, device=device, dtype=torch.float64) / rd))
    ang = torch.arange(seq_len, device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; rotates the first rotary_dim channels, passes the rest through."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return torch.cat([xr * c + rot * s, xp], dim=-1)


# ---------------------------------------------------------------------- attention
def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention; q [B, T, H, D], k/v [B, T, Hkv, D] -> [B, T, H, D]."""
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return o.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, device=None):
        super().__init__()
        h, hd = spec.hidden, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, hd
        self.gated = spec.attn_output_gate
        self.use_rope = spec.positions == "rope"
        qkv_bias = spec.attn_bias
        out_bias = spec.attn_bias and spec.traits.linear_biases
        self.q_proj = nn.Linear(h, spec.q_dim * (2 if self.gated else 1), bias=qkv_bias, device=device)
        self.k_proj = nn.Linear(h, spec.kv_dim, bias=qkv_bias, device=device)
        self.v_proj = nn.Linear(h, spec.kv_dim, bias=qkv_bias, device=device)
        self.o_proj = nn.Linear(spec.q_dim, h, bias=out_bias, device=device)
        if spec.qk_norm:
            zc = spec.traits.zero_centred_norm
            self.q_norm = RMSNorm(hd, spec.norm_eps, zero_centered=zc, device=device)
            self.k_norm = RMSNorm(hd, spec.norm_eps, zero_centered=zc, device=device)
        else:
            self.q_norm = self.k_norm = None
        self.recompute_core = False  # selective recompute: checkpoint the core attention only

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x)
        gate = None
        if self.gated:
            q, gate = q.view(b, t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, t, self.heads * self.head_dim)
        q = q.reshape(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope and rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.recompute_core and torch.is_grad_enabled():
            o = checkpoint(core_attention, q, k, v, use_reentrant=False)
        else:
            o = core_attention(q, k, v)
        o = o.reshape(b, t, self.heads * self.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)


# ---------------------------------------------------------------------- Gated DeltaNet
def gated_delta_rule_recurrent(q, k, v, g, beta, scale: float) -> torch.Tensor:
    """Reference token-by-token gated delta rule.

    q, k [B, T, H, Dk]; v [B, T, H, Dv]; g (log decay, <= 0) and beta [B, T, H]. State S [B, H, Dk, Dv]:
    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t).
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = q * scale
    s = q.new_zeros(b, h, dk, dv)
    out = []
    for i in range(t):
        s = s * g[:, i].exp()[..., None, None]
        kt = k[:, i]
        mem = torch.einsum("bhk,bhkv->bhv", kt, s)
        delta = (v[:, i] - mem) * beta[:, i][..., None]
        s = s + kt[..., :, None] * delta[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, i], s))
    return torch.stack(out, dim=1)


def gated_delta_rule_chunked(q, k, v, g, beta, scale: float, chunk: int = GDN_CHUNK) -> torch.Tensor:
    """The same recurrence in chunks of `chunk` tokens (WY form), same shapes as the recurrent one.

    Within a chunk with cumulative log decay G_i and chunk-initial state S0, the update terms
    u_j = beta_j (v_j - e^{G_j} S0^T k_j - sum_{l<j} e^{G_j - G_l} (k_j . k_l) u_l) solve the unit
    lower-triangular system (I + A) U = beta V - beta e^G K S0, A_jl = beta_j e^{G_j - G_l} k_j . k_l (l < j).
    Outputs o_i = e^{G_i} S0^T q_i + sum_{j<=i} e^{G_i - G_j} (q_i . k_j) u_j; the state carries
    S = e^{G_C} S0 + sum_j e^{G_C - G_j} k_j u_j^T into the next chunk.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.float().transpose(1, 2) for x in (q, k, v, g, beta))  # [B, H, T, ...]
    q = q * scale
    pad = (-t) % chunk
    if pad:  # padded tokens have k = 0, beta = 0, g = 0: they change neither outputs nor state
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    gam = g.cumsum(-1)
    incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    strict = incl.tril(-1)
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~incl, float("-inf")).exp()
    a = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * gam.exp())[..., None] * k], dim=-1)
    sol = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    u0, w = sol.split([dv, dk], dim=-1)
    qk = (q @ k.transpose(-1, -2)) * decay
    s = q.new_zeros(b, h, dk, dv)
    out = []
    for c in range(n):
        u = u0[:, :, c] - w[:, :, c] @ s
        gc = gam[:, :, c]
        out.append((q[:, :, c] * gc.exp()[..., None]) @ s + qk[:, :, c] @ u)
        tail = (gc[..., -1:] - gc).exp()[..., None]
        s = s * gc[..., -1].exp()[..., None, None] + (k[:, :, c] * tail).transpose(-1, -2) @ u
    o = torch.stack(out, dim=2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return o.transpose(1, 2)


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: ModelSpec, device=None):
        super().__init__()
        h = spec.hidden
        self.k_heads, self.v_heads = spec.lin_k_heads, spec.lin_v_heads
        self.k_dim, self.v_dim = spec.lin_k_dim, spec.lin_v_dim
        self.key_dim, self.value_dim = spec.lin_qk_dim, spec.lin_value_dim
        self.conv_dim, self.kernel = spec.lin_conv_dim, spec.conv_kernel
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False, device=device)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False, device=device)
        self.in_proj_b = nn.Linear(h, self.v_heads, bias=False, device=device)
        self.in_proj_a = nn.Linear(h, self.v_heads, bias=False, device=device)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim,
                                padding=self.kernel - 1, bias=False, device=device)
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads, device=device))
        self.A_log = nn.Parameter(torch.empty(self.v_heads, device=device))
        self.norm = GatedRMSNorm(self.v_dim, spec.norm_eps, device=device)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False, device=device)
        self.chunked = True  # False: the token-by-token reference recurrence

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        b, t, _ = x.shape
        mixed = self.conv1d(self.in_proj_qkv(x).transpose(1, 2))[..., :t]  # causal: drop the right padding
        mixed = F.silu(mixed).transpose(1, 2)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, self.k_heads, self.k_dim).float()
        k = k.reshape(b, t, self.k_heads, self.k_dim).float()
        v = v.reshape(b, t, self.v_heads, self.v_dim)
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + L2_EPS)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + L2_EPS)
        if self.v_heads > self.k_heads:
            rep = self.v_heads // self.k_heads
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        rule = gated_delta_rule_chunked if self.chunked else gated_delta_rule_recurrent
        o = rule(q, k, v, g, beta, scale=self.k_dim ** -0.5)
        z = self.in_proj_z(x).reshape(b, t, self.v_heads, self.v_dim)
        o = self.norm(o.to(x.dtype), z).reshape(b, t, self.value_dim)
        return self.out_proj(o)


# ---------------------------------------------------------------------- MLP and layer
class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, device=None):
        super().__init__()
        h, f = spec.hidden, spec.ffn
        self.swiglu = spec.mlp == "swiglu"
        bias = spec.traits.linear_biases
        if self.swiglu:
            self.gate_proj = nn.Linear(h, f, bias=False, device=device)
        self.up_proj = nn.Linear(h, f, bias=bias, device=device)
        self.down_proj = nn.Linear(f, h, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, device=None, ep: ExpertParallel | None = None):
        super().__init__()
        self.index = index  # global layer number (seeds its init)
        self.kind = spec.layer_type(index)
        self.input_norm = make_norm(spec, spec.hidden, device)
        self.mixer = GatedDeltaNet(spec, device) if self.kind == LINEAR else Attention(spec, device)
        self.post_norm = make_norm(spec, spec.hidden, device)
        self.mlp = MoEBlock(spec, device, ep) if spec.moe is not None else MLP(spec, device)  # MoE: issue 14

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self.mixer(self.input_norm(x), rope)
        return x + self.mlp(self.post_norm(x))


# ---------------------------------------------------------------------- stage / model
class CausalLMStage(nn.Module):
    """Layers [start, stop) of a ModelSpec; the first stage embeds token ids, the last returns logits.

    With tied embeddings and a last stage that is not also the first, the last stage holds its own copy
    of the embedding matrix as `lm_head` (Megatron's convention); the runner keeps the copies in sync
    by summing their gradients. With ``ep`` (MoE models, EP > 1) each MoE block holds this rank's share of the
    routed experts and exchanges tokens with its EP group.
    """

    def __init__(self, spec: ModelSpec, start: int = 0, stop: int | None = None, first: bool = True,
                 last: bool = True, device=None, ep: ExpertParallel | None = None):
        super().__init__()
        stop = spec.num_layers if stop is None else stop
        self.spec, self.start, self.stop, self.first, self.last = spec, start, stop, first, last
        self.embed = nn.Embedding(spec.vocab, spec.hidden, device=device) if first else None
        self.pos = (nn.Embedding(spec.max_positions, spec.hidden, device=device)
                    if first and spec.positions == "learned" else None)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, device, ep) for i in range(start, stop))
        self.final_norm = make_norm(spec, spec.hidden, device) if last else None
        self.lm_head = None
        if last and not (first and spec.tied_embeddings):
            self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False, device=device)
        self.recompute = ("none", None, None)

    def set_recompute(self, granularity: str = "none", method: str | None = None, num_layers: int | None = None) -> None:
        """Megatron's recompute: full/block checkpoints the first N layers one by one, full/uniform checkpoints
        groups of N layers, selective checkpoints the core (softmax) attention of every full-attention layer."""
        self.recompute = (granularity, method, num_layers)
        for layer in self.layers:
            if isinstance(layer.mixer, Attention):
                layer.mixer.recompute_core = granularity == "selective"

    def output_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.lm_head is not None else self.embed.weight

    def _run_layers(self, x: torch.Tensor, rope, lo: int, hi: int) -> torch.Tensor:
        for layer in self.layers[lo:hi]:
            x = layer(x, rope)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            t = x.shape[1]
            ids = x
            x = self.embed(ids)
            if self.pos is not None:
                x = x + self.pos(torch.arange(t, device=ids.device))[None]
        t = x.shape[1]
        rope = rope_tables(self.spec, t, x.device) if self.spec.positions == "rope" else None
        gran, method, n = self.recompute
        nl = len(self.layers)
        ckpt = gran == "full" and torch.is_grad_enabled() and n
        if ckpt and method == "block":
            for j in range(nl):
                if j < n:
                    x = checkpoint(self._run_layers, x, rope, j, j + 1, use_reentrant=False)
                else:
                    x = self.layers[j](x, rope)
        elif ckpt and method == "uniform":
            for j in range(0, nl, n):
                x = checkpoint(self._run_layers, x, rope, j, min(j + n, nl), use_reentrant=False)
        else:
            x = self._run_layers(x, rope, 0, nl)
        if self.last:
            x = self.final_norm(x)
            x = F.linear(x, self.output_weight()).float()  # fp32 logits
        return x


def build_model(spec: ModelSpec, start: int = 0, stop: int | None = None, first: bool = True, last: bool = True,
                seed: int | None = 0, device=None, ep: ExpertParallel | None = None) -> CausalLMStage:
    """A stage (or, by default, the whole model), initialised from `seed` unless on the meta device or seed is None.
    ``ep``: this rank's expert-parallel place (MoE models); its experts get exactly the weights they have at EP 1."""
    m = CausalLMStage(spec, start, stop, first, last, device=device, ep=ep)
    if seed is not None and torch.device(device or "cpu").type != "meta":
        init_weights(m, seed)
    return m


def _generator(seed: int, slot: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * SEED_STRIDE + slot)


def _init_module(module: nn.Module, gen: torch.Generator) -> None:
    """Fill every parameter of `module` in registration order from `gen` (values drawn on CPU, then copied).
    Routed experts draw the full expert set in order and keep this rank's share, so every EP size initialises an
    expert identically."""

    def normal(p: torch.Tensor, std: float = INIT_STD) -> None:
        p.copy_(torch.randn(p.shape, generator=gen) * std)

    skip: set[int] = set()
    for m in module.modules():
        if id(m) in skip:
            continue
        if isinstance(m, LocalExperts):
            skip.update(id(s) for s in m.modules())
            linears = [mod for mod in m[0].modules() if isinstance(mod, nn.Linear)]  # one expert's, in order
            for e in range(m.total):
                for j, lin in enumerate(linears):
                    w = torch.randn(lin.weight.shape, generator=gen) * INIT_STD
                    if m.first <= e < m.first + len(m):
                        target = [mod for mod in m[e - m.first].modules() if isinstance(mod, nn.Linear)][j]
                        target.weight.copy_(w)
            continue
        if isinstance(m, nn.Linear):
            normal(m.weight)
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            normal(m.weight)
        elif isinstance(m, nn.Conv1d):  # PyTorch's default bound for a depthwise conv: 1/sqrt(fan_in = kernel)
            bound = 1.0 / math.sqrt(m.kernel_size[0])
            m.weight.copy_(torch.rand(m.weight.shape, generator=gen) * 2 * bound - bound)
        elif isinstance(m, nn.LayerNorm):
            m.weight.fill_(1.0)
            m.bias.zero_()
        elif isinstance(m, RMSNorm):
            m.weight.fill_(0.0 if m.zero_centered else 1.0)
        elif isinstance(m, GatedRMSNorm):
            m.weight.fill_(1.0)
        elif isinstance(m, GatedDeltaNet):
            lo, hi = A_INIT_RANGE
            m.A_log.copy_(torch.log(torch.rand(m.A_log.shape, generator=gen) * (hi - lo) + lo))
            m.dt_bias.fill_(1.0)


@torch.no_grad()
def init_weights(stage: CausalLMStage, seed: int) -> None:
    """Deterministic init: slot 0 embedding (and a tied lm_head copy), 1 positions, 2 + i layer i, last the head."""
    spec = stage.spec
    if stage.embed is not None:
        _init_module(stage.embed, _generator(seed, 0))
    if stage.pos is not None:
        _init_module(stage.pos, _generator(seed, 1))
    for layer in stage.layers:
        _init_module(layer, _generator(seed, 2 + layer.index))
    if stage.last:
        _init_module(stage.final_norm, _generator(seed, 2 + spec.num_layers))
        if stage.lm_head is not None:
            # tied: the last stage's copy draws exactly what the embedding drew
            slot = 0 if spec.tied_embeddings else 3 + spec.num_layers
            normal = torch.randn(stage.lm_head.weight.shape, generator=_generator(seed, slot)) * INIT_STD
            stage.lm_head.weight.copy_(normal)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy over supervised tokens (mask 1); logits [B, T, V] fp32."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none")
    return (ce * mask.reshape(-1).to(ce.dtype)).sum()
