"""Verifying a low-precision recipe (issue 22): the numerics-class tolerance of its loss curve against a bf16
reference run, the ``component:precision`` test, and the negative controls the two must catch.

**The tolerance.** A layout change must reproduce the reference curve up to reduction-order noise; a precision
change may not, so it gets its own bound, from what published fp8-vs-bf16 runs of the same model and data show:

* DeepSeek-V3 technical report (arXiv 2412.19437, section 3.3.1, "FP8 mixed precision framework"): with their
  fine-grained (1 x 128 / 128 x 128) fp8 recipe, "the relative loss error of our FP8-training model remains
  consistently below 0.25%" against BF16 at ~16B and ~230B parameters over ~1T tokens;
* Micikevicius et al., "FP8 Formats for Deep Learning" (arXiv 2209.05433, section 4): fp8 (E4M3 forward, E5M2
  gradients, per-tensor scaling) training of GPT-3-style models up to 175B tracks the bf16 loss curves, the final
  perplexities within run-to-run variation;
* NVIDIA Transformer Engine and NeMo publish their fp8 recipes as loss-matching (delayed, current, blockwise and
  MXFP8 scaling).

So ``PRECISION_THRESHOLDS``: every point and the final loss within 0.5% relative of the bf16 reference (twice the
DeepSeek-V3 bound, since a 20-step check sees one seed and no averaging), correlation as for layouts. The emulated
recipes on the torch runner stay within 0.2% on tiny-llama (E4M3 delayed 0.15%, tensorwise 0.20%, blockwise 0.07%,
MXFP8 0.18%, hybrid 0.19%: max point-wise relative difference over 20 steps); a wrong scale is 47% off.

**The component test** (``component:precision`` in numerics_rules.yaml, "forward/backward of the changed precision
against float64"): each linear of one of the model's decoder layers (its real shapes) runs its forward GEMM, its
dgrad and its wgrad on operands quantized by the recipe, against float64 on the exact operands. With
round-to-nearest every operand element is off by at most the format's unit roundoff u = 2^-(mantissa bits + 1), so
the relative Frobenius error of a GEMM of two such operands stays below u (E4M3: 2^-4 = 6.25%; E5M2: 2^-3; E2M1:
2^-2); measured ~3.7-4.2% for the E4M3 recipes on a 1024 x 2816 GEMM. A format with one mantissa bit fewer (an
E5M2 forward: ~7.5%) or a wrong scale (saturation: ~100%) breaks it.

**Negative controls** (with ``--negative-control`` on a low-precision candidate): the candidate arm with every scale
``attune.torchmodels.lowp.WRONG_SCALE`` times too large, and with an E5M2 forward; each must fail the check above
(its loss curve or its component test).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace

from attune import torchmodels as lowp
from attune.correctness.arms import Arms, compare_arms
from attune.correctness.component import decoder_layer_shapes
from attune.correctness.convergence import Thresholds
from attune.correctness.verdict import ArmRun, NegativeControl, one_line
from attune.errors import require
from attune.spec.layout import Layout
from attune.spec.model import ModelSpec
from attune.spec.precision import recipe_of

PRECISION_THRESHOLDS = Thresholds(high_loss_tolerance=0.005, medium_loss_tolerance=0.005, low_loss_tolerance=0.005,
                                  final_loss_tolerance=0.005)
"""The numerics-class tolerance of a low-precision candidate against its bf16 reference (see the module docstring)."""
MANTISSA_BITS = {"e4m3": 3, "e5m2": 2, "e2m1": 1}
"""Explicit mantissa bits of the element formats (OCP FP8 / MX specifications)."""
TOKENS = 256
"""Rows of the component test's GEMM inputs (tokens)."""
MAX_OUTPUTS = 1024
"""Output features tested per linear (the first rows of the weight; a multiple of 128 keeps the blockwise tiles): the
error is a per-element statistic, so a slice of a large model's matrix measures it as well, at a fraction of the
float64 work; the input (reduction) dimension is kept whole."""
LOWP_CONTROL_ENV = "ATTUNE_LOWP_CONTROL"
"""The torch worker's negative-control switch (attune.runners.torch_worker reads it)."""


def unit_roundoff(fmt: str) -> float:
    """2^-(mantissa bits + 1): the largest relative rounding error of a normal number in the format."""
    return 2.0 ** -(MANTISSA_BITS[fmt] + 1)


def thresholds_for(layout: Layout) -> Thresholds | None:
    """The loss-curve thresholds of a candidate: the precision tolerance for low precision, else None (layout)."""
    return PRECISION_THRESHOLDS if recipe_of(layout) != "bf16" else None


@dataclass(frozen=True)
class GemmError:
    """One GEMM of the component test."""

    name: str
    """Which linear and pass (``mlp.down_proj wgrad``)."""
    error: float
    """Relative Frobenius error against float64 on the exact operands."""
    bound: float
    """The format's unit roundoff it must stay below."""

    @property
    def passed(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.bound


@dataclass(frozen=True)
class PrecisionComponent:
    """The ``component:precision`` test of one recipe on one model's layer shapes."""

    recipe: str
    """The precision class tested."""
    gemms: tuple[GemmError, ...] = field(default_factory=tuple)
    """Every GEMM tested."""
    control: str | None = None
    """The negative control applied (None: the recipe as it is)."""

    @property
    def passed(self) -> bool:
        return bool(self.gemms) and all(g.passed for g in self.gemms)

    @property
    def worst(self) -> GemmError | None:
        return max(self.gemms, key=lambda g: g.error / g.bound if math.isfinite(g.error) else math.inf, default=None)

    def line(self) -> str:
        w = self.worst
        head = f"component:precision ({self.recipe}{', control ' + self.control if self.control else ''})"
        if w is None:
            return f"{head}: nothing tested"
        return (f"{head} {'passed' if self.passed else 'FAILED'}: worst {w.name} relative error "
                f"{100 * w.error:.2f}% against the bound {100 * w.bound:.2f}% ({len(self.gemms)} GEMMs)")


def _linear_shapes(model: ModelSpec) -> dict[str, tuple[int, int]]:
    ffn = model.moe.expert_ffn if model.moe is not None else model.ffn
    shapes = decoder_layer_shapes(model.hidden, ffn, model.heads, model.kv_heads, model.head_dim,
                                  qk_norm=bool(model.qk_norm), attention_output_gate=bool(model.attn_output_gate),
                                  bias=False)
    return {k: v for k, v in shapes.items() if len(v) == 2 and k.endswith("proj.weight")}


def precision_component(model: ModelSpec, layout: Layout, control: str | None = None, seed: int = 0
                        ) -> PrecisionComponent:
    """Forward, dgrad and wgrad of each linear of one decoder layer on quantized operands against float64."""
    torch = require("torch", "torch")
    recipe = "nvfp4" if layout.fp4_format is not None else layout.fp8_recipe
    fwd, bwd = lowp.formats(layout.fp8_format, layout.fp4_format, control)
    err = lowp.WRONG_SCALE if control == "wrong_scale" else 1.0
    # the bounds are the recipe's own formats, whatever the control did to the operands
    u_fwd = unit_roundoff(lowp.formats(layout.fp8_format, layout.fp4_format)[0])
    u_bwd = max(u_fwd, unit_roundoff(lowp.formats(layout.fp8_format, layout.fp4_format)[1]))
    gen = torch.Generator().manual_seed(seed)
    out = []

    def rel(a, b) -> float:
        return float((a - b).norm() / b.norm())

    for name, (n_out, n_in) in _linear_shapes(model).items():
        n_out = min(n_out, MAX_OUTPUTS)
        x = torch.randn(TOKENS, n_in, generator=gen, dtype=torch.float64)
        w = torch.randn(n_out, n_in, generator=gen, dtype=torch.float64) * 0.02
        gy = torch.randn(TOKENS, n_out, generator=gen, dtype=torch.float64)
        qx = lowp.quantize(x, fwd, recipe, scale_error=err)
        qw = lowp.quantize(w, fwd, recipe, weight=True, scale_error=err)
        qg = lowp.quantize(gy, bwd, recipe, scale_error=err)
        short = name.removesuffix(".weight")
        out += [GemmError(f"{short} forward", rel(qx @ qw.T, x @ w.T), u_fwd),
                GemmError(f"{short} dgrad", rel(qg @ qw, gy @ w), u_bwd),
                GemmError(f"{short} wgrad", rel(qg.T @ qx, gy.T @ x), u_bwd)]
    return PrecisionComponent(recipe=recipe_of(layout), gemms=tuple(out), control=control)


CONTROL_TEXT = {"wrong_scale": "candidate arm with every fp8 scale {factor:g}x too large (operands saturate)",
                "e5m2_forward": "candidate arm with E5M2 forward operands instead of E4M3"}


def _with_env(runner, env: dict):
    """A copy of a torch runner whose workers get ``env`` too (the control switch)."""
    if not hasattr(runner, "extra_env"):
        return None
    r = copy.copy(runner)
    r.extra_env = {**runner.extra_env, **env}
    return r


def precision_controls(arms: Arms, reference: ArmRun, candidate: Layout, model: ModelSpec
                       ) -> tuple[list[NegativeControl], list[ArmRun]]:
    """The wrong-scale and E5M2-forward arms of a low-precision candidate; each must fail its loss curve against
    the bf16 reference (precision tolerance) or its component test."""
    require("torch", "torch")
    controls, runs = [], []
    for control in lowp.CONTROLS:
        changed = CONTROL_TEXT[control].format(factor=lowp.WRONG_SCALE)
        runner = _with_env(arms.runner, {LOWP_CONTROL_ENV: control})
        comp = precision_component(model, candidate, control)
        if runner is None:
            controls.append(NegativeControl(changed=changed, observed="fail" if not comp.passed else "pass",
                                            detail=f"no arm ({arms.runner.name} runner cannot inject it); " + comp.line()))
            continue
        arm = replace(arms, runner=runner).run(f"negative_{control}", candidate, folder=f"neg-{control.replace('_', '-')}",
                           label=f"negative control {control}")
        runs.append(arm)
        conv = compare_arms(reference, arm, "negative control", PRECISION_THRESHOLDS)
        rec = conv.to_record()
        failed = not arm.ok or not conv.passed or not comp.passed
        controls.append(NegativeControl(
            changed=changed, observed="fail" if failed else "pass", arm=True, correlation=rec.get("correlation"),
            final_loss_difference=rec.get("final_loss_difference"), pointwise_failures=rec.get("pointwise_failures"),
            detail=(f"arm {arm.result.status} in {arm.seconds:.1f} s"
                    + ("" if arm.ok else f": {one_line(arm.result.reason)}")
                    + f"; loss curve {'within' if conv.passed else 'outside'} the precision tolerance; "
                    + comp.line())))
    return controls, runs


__all__ = ["PRECISION_THRESHOLDS", "thresholds_for", "unit_roundoff", "precision_component", "PrecisionComponent",
           "GemmError", "precision_controls", "LOWP_CONTROL_ENV"]
