"""Emulated low-precision GEMMs for the torch trainer (issue 22): where no fp8 GEMM exists (CPU workers), every
linear layer of the decoder layers casts its GEMM operands to the recipe's format with the recipe's scaling and
back, forward and backward, around an ordinary GEMM, so a low-precision recipe trains end to end and
``attune verify`` can compare it with a bf16 run.

What is emulated, per Transformer Engine's recipes (TE ``common/recipe``: ``DelayedScaling``,
``Float8CurrentScaling``, ``Float8BlockScaling``, ``MXFP8BlockScaling``, ``NVFP4BlockScaling``; Megatron-LM
1dcf0daf transformer_config.py:434-534 for the formats):

* operands: the GEMM input and the weight in forward (``--fp8-format e4m3``: E4M3; ``hybrid``: E4M3 too), the
  output gradient in backward (``e4m3``: E4M3; ``hybrid``: E5M2); dgrad and wgrad use the quantized copies
  (TE's default ``fp8_wgrad``);
* scaling: ``tensorwise`` one scale per tensor from its current amax (448 / amax for E4M3); ``delayed`` the same
  from the amax of the tensor's previous use (an amax history of 1, Megatron's default; the first use takes its
  own amax: TE starts from scale 1, a warm-up this emulation leaves out); ``blockwise`` one fp32 scale per 1 x 128
  block of activations and gradients and per 128 x 128 block of weights; ``mxfp8`` one power-of-two (E8M0) scale
  per 1 x 32 block; ``nvfp4`` E2M1 values with one E4M3 scale per 1 x 16 block (the tensor-level second scale and
  the random Hadamard transform of TE's NVFP4 recipe are left out);
* not emulated: the embedding, the output layer, norms, attention and the Gated DeltaNet kernels stay in the
  trainer's dtype, as they stay bf16 in Megatron (slime docs/en/advanced/low-precision.md:89).

Negative controls (``CONTROLS``): ``wrong_scale`` multiplies every scale by ``WRONG_SCALE`` (values saturate at
the format's largest number) and ``e5m2_forward`` quantizes the forward operands to E5M2 (two mantissa bits
instead of three); ``attune verify --negative-control`` runs both and each must fail.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes an E2M1 (fp4) element can hold (OCP MX spec v1.0, table 5)."""
E4M3_EMAX = 8
"""Exponent of E4M3's largest power of two (448 = 1.75 x 2^8): MXFP8's shared scale is 2^(floor(log2 amax) - 8)."""
BLOCK = {"blockwise": 128, "mxfp8": 32, "nvfp4": 16}
"""Elements per scaling block along a row (blockwise weights: 128 x 128 tiles)."""
CONTROLS = ("wrong_scale", "e5m2_forward")
"""Negative controls of the emulation (see the module docstring)."""
WRONG_SCALE = 2.0 ** 12
"""The wrong_scale control's factor on every scale: operands land far beyond the format's range and saturate."""
TINY = 1e-12


def _cast(x: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "e2m1":
        grid = torch.tensor(E2M1_GRID, dtype=x.dtype, device=x.device)
        mag = x.abs().clamp(max=E2M1_GRID[-1])
        idx = torch.bucketize(mag, (grid[1:] + grid[:-1]) / 2)  # round to the nearest grid point
        return grid[idx] * x.sign()
    return x.to(FORMATS[fmt]).to(x.dtype)


def _fmax(fmt: str) -> float:
    return E2M1_GRID[-1] if fmt == "e2m1" else float(torch.finfo(FORMATS[fmt]).max)


def _blocks(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, tuple]:
    """x (2-D) padded to whole rows x cols tiles, as [R, rows, C, cols]."""
    r, c = x.shape
    pr, pc = (-r) % rows, (-c) % cols
    xp = F.pad(x, (0, pc, 0, pr))
    return xp.reshape((r + pr) // rows, rows, (c + pc) // cols, cols), (r, c)


def quantize(x: torch.Tensor, fmt: str, recipe: str, *, weight: bool = False, amax: torch.Tensor | None = None,
             scale_error: float = 1.0) -> torch.Tensor:
    """x cast to ``fmt`` with the recipe's scaling and back (same dtype and shape)."""
    if recipe in ("delayed", "tensorwise"):
        a = (x.abs().amax() if amax is None else amax).clamp(min=TINY)
        s = _fmax(fmt) / a * scale_error
        return _cast(x * s, fmt) / s
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n = BLOCK[recipe]
    rows = n if (weight and recipe == "blockwise") else 1
    xb, (r, c) = _blocks(x2, rows, n)
    a = xb.abs().amax(dim=(1, 3), keepdim=True).clamp(min=TINY)
    if recipe == "mxfp8":
        s = 2.0 ** (E4M3_EMAX - torch.floor(torch.log2(a)))  # power-of-two (E8M0) scale
    elif recipe == "nvfp4":
        s = 1.0 / _cast(a / E2M1_GRID[-1], "e4m3").clamp(min=TINY)  # E4M3 block scale
    else:
        s = _fmax(fmt) / a
    s = s * scale_error
    q = _cast(xb * s, fmt) / s
    return q.reshape(xb.shape[0] * rows, xb.shape[2] * n)[:r, :c].reshape(shape)


class _State:
    """The amax of each operand's previous use (delayed scaling)."""

    def __init__(self) -> None:
        self.amax: dict[str, torch.Tensor] = {}

    def take(self, role: str, x: torch.Tensor) -> torch.Tensor | None:
        prev = self.amax.get(role)
        self.amax[role] = x.detach().abs().amax()
        return prev


class _QuantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, cfg):
        fwd, bwd, recipe, err, state = cfg
        qx = quantize(x, fwd, recipe, amax=state.take("x", x) if recipe == "delayed" else None, scale_error=err)
        qw = quantize(w, fwd, recipe, weight=True, amax=state.take("w", w) if recipe == "delayed" else None,
                      scale_error=err)
        ctx.save_for_backward(qx, qw)
        ctx.cfg, ctx.has_bias = cfg, b is not None
        return F.linear(qx, qw, b)

    @staticmethod
    def backward(ctx, gy):
        qx, qw = ctx.saved_tensors
        fwd, bwd, recipe, err, state = ctx.cfg
        qg = quantize(gy, bwd, recipe, amax=state.take("g", gy) if recipe == "delayed" else None, scale_error=err)
        gx = qg @ qw
        gw = qg.reshape(-1, qg.shape[-1]).t() @ qx.reshape(-1, qx.shape[-1])
        gb = gy.reshape(-1, gy.shape[-1]).sum(0) if ctx.has_bias else None
        return gx, gw, gb, None


class EmulatedLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run on operands quantized by the recipe (set by ``apply_low_precision``)."""

    lowp: tuple

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _QuantLinear.apply(x, self.weight, self.bias, self.lowp)


def formats(fp8_format: str | None, fp4_format: str | None, control: str | None = None) -> tuple[str, str]:
    """(forward operand format, output-gradient format) of a layout's precision (and a negative control)."""
    if fp4_format is not None:
        return "e2m1", "e2m1"
    fwd, bwd = "e4m3", ("e5m2" if fp8_format == "hybrid" else "e4m3")
    if control == "e5m2_forward":
        fwd = "e5m2"
    return fwd, bwd


def apply_low_precision(layers: nn.Module, fp8_format: str | None, fp8_recipe: str, fp4_format: str | None = None,
                        control: str | None = None) -> int:
    """Turn every ``nn.Linear`` under ``layers`` (the decoder layers: not the embedding or the output layer) into
    an emulated low-precision linear, in place (the parameters stay the same objects); returns how many."""
    if fp8_format is None and fp4_format is None:
        return 0
    if control is not None and control not in CONTROLS:
        raise ValueError(f"low-precision control '{control}'; allowed: {', '.join(CONTROLS)}")
    recipe = "nvfp4" if fp4_format is not None else fp8_recipe
    fwd, bwd = formats(fp8_format, fp4_format, control)
    err = WRONG_SCALE if control == "wrong_scale" else 1.0
    n = 0
    for m in layers.modules():
        if type(m) is nn.Linear:
            m.__class__ = EmulatedLinear
            m.lowp = (fwd, bwd, recipe, err, _State())
            n += 1
    return n


__all__ = ["quantize", "apply_low_precision", "formats", "EmulatedLinear", "CONTROLS", "WRONG_SCALE", "FORMATS"]
