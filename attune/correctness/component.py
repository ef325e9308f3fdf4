"""Optimizer component test: candidate optimizer storage schemes against a float64 AdamW.

A layout change that moves or re-encodes optimizer state (the precision-aware optimizer's bf16 +
16-bit-remainder masters, CPU offload of master/m/v) must leave each optimizer step the same as the
default distributed optimizer's up to float32 rounding. The optimizer step is elementwise, so
real layer shapes on any device exercise it fully.

Configurations (see shared/reference/megatron-memory-and-performance.md sections 4.1, 4.3, 4.4):

- `default`: bf16 model params, fp32 master weights, fp32 m and v (Megatron's default distributed
  optimizer with bf16: "fp32 master 4 + Adam m 4 + v 4").
- `precision_aware`: bf16 model params; the fp32 master is stored as the bf16 param (its rounded
  high half) plus an int16 remainder (TE FusedAdam `store_param_remainders`); m/v in a
  configurable dtype (fp32 default, as `--exp-avg-dtype`/`--exp-avg-sq-dtype`).
- `cpu_offload`: the first `offload_fraction` of the parameters (by element count, in order, as
  Megatron's HybridDeviceOptimizer) get fp32 CPU copies stepped by `torch.optim.AdamW`, and the
  result is copied back into the bf16 params; the rest run the precision-aware path.
- `broken_no_bias_correction`, `broken_double_weight_decay`: deliberately wrong optimizers, the
  negative controls; they must fail.

Every configuration starts from the same bf16 parameters and receives the same seeded fp32
gradients. After N steps the update of each tensor (full-precision master after N steps minus the
initial value; the bf16 model param cannot resolve updates below its ulp) is compared with the
float64 reference's update as a relative L2 error. Pass rule (the seed recipes'): the worst
tensor's error <= 2 x the `default` configuration's worst error on the same inputs + 1e-3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from attune.errors import UserInputError, require

# Pass rule of the seed recipes' component tests: "bound 2 x the default GPU optimizer's error
# + 1e-3" (seeds/attune-tp1-pp4-split16-rb12.yaml, correctness.component_tests[0].detail).
BOUND_FACTOR = 2.0
BOUND_SLACK = 1.0e-3

# Parameter init and gradient scales of the synthetic inputs. 0.02 is the usual transformer init
# std (Megatron `--init-method-std` default); the gradient scale only matters relative to eps.
DEFAULT_INIT_STD = 0.02
DEFAULT_GRAD_STD = 1.0e-3

CONFIGS = ("default", "precision_aware", "cpu_offload",
           "broken_no_bias_correction", "broken_double_weight_decay")
NEGATIVE_CONTROLS = ("broken_no_bias_correction", "broken_double_weight_decay")

_DTYPE_NAMES = ("fp32", "bf16", "fp16")


def _torch():
    """PyTorch, imported on first use (``MissingDependency`` naming the ``torch`` extra when absent)."""
    return require("torch", "torch")


def _dtype(name: str):
    torch = _torch()
    table = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name not in table:
        raise UserInputError(f"unknown dtype {name!r}; expected one of {_DTYPE_NAMES}")
    return table[name]


# --------------------------------------------------------------------------------------------
# Shapes


def decoder_layer_shapes(hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int, *,
                         qk_norm: bool = True, attention_output_gate: bool = False,
                         bias: bool = False) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of one dense GQA decoder layer with a SwiGLU MLP (HF/Qwen3 naming).

    `attention_output_gate` doubles the query projection (Qwen3.5 full-attention layers);
    `qk_norm` adds the per-head q/k RMSNorm weights (Qwen3 and Qwen3.5 `--qk-layernorm`).
    """
    if min(hidden, ffn, heads, kv_heads, head_dim) <= 0:
        raise UserInputError(f"all dimensions must be positive (hidden {hidden}, ffn {ffn}, heads {heads}, "
                             f"kv_heads {kv_heads}, head_dim {head_dim})")
    if heads % kv_heads:
        raise UserInputError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
    q_out = heads * head_dim * (2 if attention_output_gate else 1)
    kv_out = kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_out, hidden),
        "self_attn.k_proj.weight": (kv_out, hidden),
        "self_attn.v_proj.weight": (kv_out, hidden),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
    }
    if bias:
        shapes["self_attn.q_proj.bias"] = (q_out,)
        shapes["self_attn.k_proj.bias"] = (kv_out,)
        shapes["self_attn.v_proj.bias"] = (kv_out,)
    if qk_norm:
        shapes["self_attn.q_norm.weight"] = (head_dim,)
        shapes["self_attn.k_norm.weight"] = (head_dim,)
    shapes.update({
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    })
    return shapes


def describe_shapes(shapes: Mapping[str, Sequence[int]]) -> str:
    numel = sum(math.prod(s) for s in shapes.values())
    largest = max(shapes, key=lambda k: math.prod(shapes[k]))
    return (f"{len(shapes)} tensors, {numel:,} parameters "
            f"(largest {largest} {tuple(shapes[largest])})")


# --------------------------------------------------------------------------------------------
# fp32 master <-> bf16 high half + int16 remainder


def split_fp32(master):
    """Split fp32 values into a bf16 high half and an int16 remainder, exactly invertible.

    The high half is rounded to nearest (a low half >= 0x8000 carries into it, ties away from
    zero in magnitude), so the bf16 tensor is a usable model parameter; the remainder is the
    signed difference low - 0x10000 in that case, so (high << 16) + remainder == the fp32 bits.
    """
    torch = _torch()
    if master.dtype != torch.float32:
        raise TypeError(f"split_fp32 needs float32, got {master.dtype}")
    bits = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # unsigned 32-bit
    low = bits & 0xFFFF
    carry = (low >= 0x8000).to(torch.int64)
    high = ((bits >> 16) + carry) & 0xFFFF  # may wrap 0xFFFF -> 0x0000 (NaN payloads only)
    remainder = low - (carry << 16)  # in [-0x8000, 0x7FFF]
    high_i16 = torch.where(high >= 0x8000, high - 0x10000, high).to(torch.int16)
    return high_i16.view(torch.bfloat16), remainder.to(torch.int16)


def merge_fp32(high, remainder):
    """Inverse of `split_fp32`: rebuild the exact fp32 master from the bf16 half and remainder."""
    torch = _torch()
    if high.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError("merge_fp32 needs a bfloat16 high half and an int16 remainder")
    hi = high.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((hi << 16) + remainder.to(torch.int64)) & 0xFFFFFFFF
    signed = torch.where(bits >= 0x80000000, bits - 0x100000000, bits).to(torch.int32)
    return signed.view(torch.float32)


# --------------------------------------------------------------------------------------------
# Optimizer steps


@dataclass(frozen=True)
class AdamHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def _adamw_fp64_step(p, m, v, g, step: int, h: AdamHyper):
    """Float64 reference: bias-corrected Adam with decoupled weight decay (Loshchilov & Hutter)."""
    m.mul_(h.beta1).add_(g, alpha=1.0 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1.0 - h.beta2)
    m_hat = m / (1.0 - h.beta1 ** step)
    v_hat = v / (1.0 - h.beta2 ** step)
    update = m_hat / (v_hat.sqrt() + h.eps) + h.weight_decay * p
    p.sub_(h.lr * update)


def _adamw_fp32_step(master, m_store, v_store, g, step: int, h: AdamHyper, *,
                     bias_correction: bool = True, weight_decay_times: int = 1):
    """One AdamW step in fp32 arithmetic, as a fused GPU Adam does it; m/v stored in any dtype.

    `master` (fp32) is updated in place; m/v are read and written back in their storage dtype.
    The flags exist only for the negative controls.
    """
    m = m_store.float()
    v = v_store.float()
    m.mul_(h.beta1).add_(g, alpha=1.0 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1.0 - h.beta2)
    if bias_correction:
        bc1 = 1.0 - h.beta1 ** step
        bc2 = 1.0 - h.beta2 ** step
    else:
        bc1 = bc2 = 1.0
    denom = (v / bc2).sqrt_().add_(h.eps)
    update = (m / bc1).div_(denom)
    if h.weight_decay:
        update.add_(master, alpha=h.weight_decay * weight_decay_times)
    master.add_(update, alpha=-h.lr)
    m_store.copy_(m)
    v_store.copy_(v)


@dataclass
class _State:
    """One configuration's optimizer state; `master_fp32()` is its full-precision parameter."""

    params_bf16: dict
    masters: dict = field(default_factory=dict)  # explicit fp32 masters (default, broken, cpu)
    remainders: dict = field(default_factory=dict)  # int16 remainders (precision-aware)
    m: dict = field(default_factory=dict)
    v: dict = field(default_factory=dict)
    cpu_optimizers: dict = field(default_factory=dict)  # name -> torch.optim.AdamW (offload)

    def master_fp32(self, name: str):
        if name in self.masters:
            return self.masters[name]
        return merge_fp32(self.params_bf16[name], self.remainders[name])


def _offloaded_names(shapes: Mapping[str, Sequence[int]], fraction: float) -> set[str]:
    """Leading tensors holding `fraction` of the elements, whole tensors only, in order."""
    if not 0.0 <= fraction <= 1.0:
        raise UserInputError(f"offload_fraction must be in [0, 1], got {fraction}")
    total = sum(math.prod(s) for s in shapes.values())
    target = fraction * total
    chosen, running = set(), 0
    for name, shape in shapes.items():
        if running >= target:
            break
        chosen.add(name)
        running += math.prod(shape)
    return chosen


def _init_state(config: str, init_bf16: Mapping[str, Any], h: AdamHyper, *, device,
                exp_avg_dtype: str, exp_avg_sq_dtype: str, offload: set[str]) -> _State:
    torch = _torch()
    st = _State(params_bf16={k: t.clone().to(device) for k, t in init_bf16.items()})
    for name, p in st.params_bf16.items():
        if config == "cpu_offload" and name in offload:
            cpu_param = p.detach().to("cpu", torch.float32).clone().requires_grad_(True)
            st.masters[name] = cpu_param
            st.cpu_optimizers[name] = torch.optim.AdamW(
                [cpu_param], lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps,
                weight_decay=h.weight_decay, foreach=False)
        elif config in ("precision_aware", "cpu_offload"):
            # The master starts as the bf16 param exactly: remainder zero.
            st.remainders[name] = torch.zeros(p.shape, dtype=torch.int16, device=device)
            st.m[name] = torch.zeros(p.shape, dtype=_dtype(exp_avg_dtype), device=device)
            st.v[name] = torch.zeros(p.shape, dtype=_dtype(exp_avg_sq_dtype), device=device)
        else:  # default and the negative controls: explicit fp32 master, fp32 m/v
            st.masters[name] = p.float()
            st.m[name] = torch.zeros(p.shape, dtype=torch.float32, device=device)
            st.v[name] = torch.zeros(p.shape, dtype=torch.float32, device=device)
    return st


def _step_state(config: str, st: _State, grads: Mapping[str, Any], step: int, h: AdamHyper):
    torch = _torch()
    for name, p in st.params_bf16.items():
        g = grads[name].to(p.device)
        if name in st.cpu_optimizers:
            cpu_param = st.masters[name]
            cpu_param.grad = g.to("cpu", torch.float32)  # D2H of the fp32 grad
            st.cpu_optimizers[name].step()
            p.copy_(cpu_param.detach())  # H2D into the bf16 param (round to nearest even)
        elif name in st.remainders:
            master = merge_fp32(p, st.remainders[name])
            _adamw_fp32_step(master, st.m[name], st.v[name], g, step, h)
            high, rem = split_fp32(master)
            p.copy_(high)
            st.remainders[name] = rem
        else:
            master = st.masters[name]
            _adamw_fp32_step(
                master, st.m[name], st.v[name], g, step, h,
                bias_correction=config != "broken_no_bias_correction",
                weight_decay_times=2 if config == "broken_double_weight_decay" else 1)
            p.copy_(master)  # fp32 -> bf16 model param


# --------------------------------------------------------------------------------------------
# The test


@dataclass(frozen=True)
class ComponentResult:
    config: str
    steps: int
    passed: bool
    worst_tensor: str
    worst_error: float
    default_worst_error: float
    bound: float
    errors: dict  # tensor name -> relative L2 error of its update
    hyper: AdamHyper
    shape: str
    device: str
    checks: dict = field(default_factory=dict)  # extra named booleans/numbers (see below)

    def to_record(self, test: str | None = None) -> dict:
        """One item of a recipe's `correctness.component_tests`."""
        extras = "; ".join(f"{k} {v}" for k, v in self.checks.items())
        detail = (f"{self.config}: worst tensor (update) relative L2 error {self.worst_error:.3g} "
                  f"({self.worst_tensor}) against a bound of {self.bound:.3g} after "
                  f"{self.steps} step(s) (bound {BOUND_FACTOR:g} x the default optimizer's "
                  f"error {self.default_worst_error:.3g} + {BOUND_SLACK:g}); lr {self.hyper.lr:g}, "
                  f"betas ({self.hyper.beta1:g}, {self.hyper.beta2:g}), eps {self.hyper.eps:g}, "
                  f"weight decay {self.hyper.weight_decay:g}; device {self.device}"
                  + (f"; {extras}" if extras else ""))
        return {
            "test": test or f"{self.config} Adam against an FP64 reference, {self.steps} step(s)",
            "shape": self.shape,
            "result": "pass" if self.passed else "fail",
            "detail": detail,
        }


def _seeded_tensors(shapes, seed: int, salt: int, std: float):
    """Deterministic fp32 normal tensors on CPU, one generator per (seed, salt, tensor index)."""
    torch = _torch()
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + salt * 10_007 + i)
        out[name] = torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * std
    return out


def _rel_l2(delta, ref_delta) -> float:
    torch = _torch()
    diff = torch.linalg.vector_norm((delta - ref_delta).flatten()).item()
    norm = torch.linalg.vector_norm(ref_delta.flatten()).item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def _run_config(config: str, shapes, init_bf16, grads_per_step, h: AdamHyper, ref_delta, *,
                device, exp_avg_dtype, exp_avg_sq_dtype, offload_fraction):
    torch = _torch()
    offload = _offloaded_names(shapes, offload_fraction) if config == "cpu_offload" else set()
    st = _init_state(config, init_bf16, h, device=device, exp_avg_dtype=exp_avg_dtype,
                     exp_avg_sq_dtype=exp_avg_sq_dtype, offload=offload)
    with torch.no_grad():
        for step, grads in enumerate(grads_per_step, start=1):
            _step_state(config, st, grads, step, h)
    errors, masters = {}, {}
    for name in shapes:
        master = st.master_fp32(name).detach().to("cpu", torch.float64)
        masters[name] = master
        delta = master - init_bf16[name].to(torch.float64)
        errors[name] = _rel_l2(delta, ref_delta[name])
    # Consistency of the bf16 model param with its master: round-to-nearest of the master for the
    # explicit/CPU masters; the split's high half for the remainder path (equal except at ties).
    bf16_ok = all(
        torch.equal(st.params_bf16[n].to("cpu"), st.master_fp32(n).detach().to("cpu").to(
            torch.bfloat16)) for n in shapes if n not in st.remainders)
    return errors, masters, bf16_ok, len(offload)


def run_component_test(config: str, shapes: Mapping[str, Sequence[int]], steps: int = 1,
                       lr: float = 1e-5, betas: tuple[float, float] = (0.9, 0.98),
                       eps: float = 1e-8, weight_decay: float = 0.1, seed: int = 1234, *,
                       exp_avg_dtype: str = "fp32", exp_avg_sq_dtype: str = "fp32",
                       offload_fraction: float = 1.0, init_std: float = DEFAULT_INIT_STD,
                       grad_std: float = DEFAULT_GRAD_STD, device: str = "cpu",
                       shape_label: str | None = None) -> ComponentResult:
    """Run `config` and the `default` configuration against a float64 AdamW for `steps` steps.

    Defaults of lr/betas/weight_decay are the seed recipe's (`--lr 1e-5 --adam-beta1 0.9
    --adam-beta2 0.98 --weight-decay 0.1`); eps 1e-8 is Megatron's `--adam-eps` default.
    """
    torch = _torch()
    if config not in CONFIGS:
        raise UserInputError(f"unknown config {config!r}; expected one of {CONFIGS}")
    if steps < 1:
        raise UserInputError(f"steps must be >= 1 (got {steps})")
    if not shapes:
        raise UserInputError("shapes is empty")
    h = AdamHyper(lr, betas[0], betas[1], eps, weight_decay)

    init_fp32 = _seeded_tensors(shapes, seed, 0, init_std)
    init_bf16 = {k: t.to(torch.bfloat16) for k, t in init_fp32.items()}
    grads_per_step = [_seeded_tensors(shapes, seed, s, grad_std) for s in range(1, steps + 1)]

    ref_delta = {}
    with torch.no_grad():
        for name in shapes:
            p0 = init_bf16[name].to(torch.float64)
            p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
            for step, grads in enumerate(grads_per_step, start=1):
                _adamw_fp64_step(p, m, v, grads[name].to(torch.float64), step, h)
            ref_delta[name] = p - p0

    common = dict(device=device, exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype,
                  offload_fraction=offload_fraction)
    default_errors, default_masters, default_bf16_ok, _ = _run_config(
        "default", shapes, init_bf16, grads_per_step, h, ref_delta, **common)
    default_worst = max(default_errors.values())
    if config == "default":
        errors, masters, bf16_ok, n_off = default_errors, default_masters, default_bf16_ok, 0
    else:
        errors, masters, bf16_ok, n_off = _run_config(
            config, shapes, init_bf16, grads_per_step, h, ref_delta, **common)

    worst_tensor = max(errors, key=errors.get)
    worst = errors[worst_tensor]
    bound = BOUND_FACTOR * default_worst + BOUND_SLACK
    checks: dict[str, Any] = {}
    if config == "precision_aware":
        checks["masters bitwise equal to the default's fp32 masters"] = all(
            torch.equal(masters[n], default_masters[n]) for n in shapes)
    if config == "cpu_offload":
        checks["offloaded tensors"] = f"{n_off}/{len(shapes)} (fraction {offload_fraction:g})"
    checks["bf16 params equal their rounded masters"] = bf16_ok
    passed = math.isfinite(worst) and worst <= bound
    return ComponentResult(
        config=config, steps=steps, passed=passed, worst_tensor=worst_tensor, worst_error=worst,
        default_worst_error=default_worst, bound=bound, errors=errors, hyper=h,
        shape=shape_label or describe_shapes(shapes), device=str(device), checks=checks)
