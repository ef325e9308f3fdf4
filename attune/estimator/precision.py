"""Low-precision GEMMs (fp8, mxfp8, nvfp4; issue 22): what they change in memory and time.

Called from ``memory`` and ``performance`` only when the layout's GEMMs run in low precision
(``attune.spec.precision.recipe_of`` is not bf16); a bf16 layout never enters this module.

What Transformer Engine does (TE 2.x ``transformer_engine/pytorch/module/{linear,layernorm_linear,
grouped_linear}.py`` and ``tensor/{float8,mxfp8,float8_blockwise,nvfp4}_tensor.py``, as megatron-core 1dcf0daf
drives it through ``extensions/transformer_engine.py``; [recalled from the TE sources, not pinned here]):

* Only TE ``Linear`` / ``LayerNormLinear`` / ``GroupedLinear`` run in fp8 (slime docs/en/advanced/low-precision.md:89:
  "embedding and lm_head remain in their original precision"); attention (FlashAttention / cuDNN, unless
  ``fp8_dot_product_attention``), the Gated DeltaNet kernels, norms, the router and the output layer stay bf16.
  slime's Qwen3.5 GDN mixer is a Hugging Face module of plain ``nn.Linear`` (``Engine.gdn_replicated``): its
  projections stay bf16 too.
* A GEMM input is quantized on the fly (read bf16, write fp8 data plus scales); the backward quantizes the output
  gradient the same way. Tensor-wise current scaling (``tensorwise``) takes the amax of the whole tensor first:
  one more read. Delayed scaling uses the previous amax (kept in an ``fp8_amax_history_len`` window);
  blockwise (1x128 activations, 128x128 weights, fp32 scales) and MXFP8 (1x32 blocks, E8M0 scales) compute the
  block amax inside the cast kernel.
* The input a GEMM keeps for its weight gradient is the quantized copy (one byte per element plus scales)
  instead of the bf16 tensor; where another kernel keeps the bf16 tensor too (FlashAttention's output is also
  the out-projection input), the fp8 copy is kept on top.
* Weights are cast once per step (the first microbatch; megatron-core passes ``is_first_microbatch`` so TE caches
  the cast weights for the later microbatches): the cache holds the row-wise copy and, where the GEMMs need it,
  the column-wise (transposed) copy: Hopper's fp8 tensor cores take only the TN layout, so the dgrad and wgrad
  GEMMs need transposes; MXFP8 scales run along one axis, so Blackwell keeps both MXFP8 copies too; Blackwell's
  tensor-scaled fp8 GEMMs take any layout (one copy). With ``--fp8-param-gather`` the parameter itself is the
  fp8 row-wise copy (the bf16 weight is gone; the fp32 master stays in the optimizer) and the all-gather moves
  one byte per parameter (Megatron-LM arguments.py:1421).
* A quantized activation (a GEMM input in forward, an output gradient in backward) is written in each orientation
  the GEMMs read it in: the fprop / dgrad GEMMs read it row-wise, the wgrad GEMM column-wise. MXFP8's 1x32 scale
  blocks run along one axis, so TE computes both copies from the bf16 tensor ("when Transformer Engine needs both
  the MXFP8 tensor and its transpose ... both versions are computed from the high precision input":
  TransformerEngine d0067d0da transformer_engine/common/recipe/__init__.py:342-352); blockwise's 1x128 blocks
  likewise; Hopper's fp8 GEMMs take only the TN layout, so a tensor-scaled fp8 tensor is written with its transpose
  too; Blackwell's tensor-scaled fp8 GEMMs read either layout of one copy (``Plan.weight_copies`` counts the same
  orientations for the cached weights).
* Recipe kernels beyond the GEMMs (``Engine.fp8_attention`` / ``fused_grouped_mlp``, set by Megatron-Bridge's MXFP8
  recipes from v0.5.0): FP8 dot-product attention runs the attention GEMMs on the FP8 tensor cores (fitted
  ``fp8_attention_speedup``, bounded by the FP8 / BF16 peak ratio); TE's fused MXFP8 grouped MLP writes the
  routed experts' SwiGLU output straight into the fc2 GEMM's MXFP8 input in the fc1 GEMM's epilogue (and fuses
  dSwiGLU into the fc2 dgrad in backward), so the experts' activation pass and that quantize pass are gone.
* Delayed scaling keeps, per fp8 GEMM, an amax history and a scale and inverse scale for each of its fp8
  tensors (input, weight and output gradient: 3), fp32 (TE ``DelayedScaling``, ``FP8GlobalStateManager``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from attune.estimator import moe as moe_terms
from attune.estimator.costs import BF16, FP32, LayerCost, Shape
from attune.spec.engine import Engine
from attune.spec.hardware import GPU, GiB
from attune.spec.layout import Layout
from attune.spec.model import FULL, LINEAR, ModelSpec, mixer_of
from attune.spec.precision import recipe_of

from .coefficients import Coefficients, peak_ratio

# Saved tensors (attune.estimator.costs / moe names) that only a TE linear keeps, for its weight gradient: they
# are kept quantized. Matched on the name's wording, which costs.py documents per kernel.
GEMM_ONLY_INPUTS = ("(TE ln_out, GEMM input)", "= fc2 input", "(grouped fc1 GEMM input", "down-projection input",
                    "up-projection input)", "attention context (out-projection input)",
                    "gated attention output (out-projection input)", "MTP eh_proj input")
# ...and those another kernel keeps in bf16 as well: the fp8 copy is kept on top
SHARED_INPUTS = ("(also the out-projection input)",)
# slime's HF Gated DeltaNet projections (plain nn.Linear): fp8 only in megatron-core's native GDN
GDN_INPUTS = ("GDN in_proj input", "(out_proj input)")

BACKWARD_QUANTIZE_RATIO = 1.5
"""Elements quantized in backward (the output gradients of the fp8 GEMMs) per element quantized in forward (their
inputs): for a SwiGLU decoder layer the GEMM outputs are q + 2 kv + h + 2 f + h wide against inputs h + q + h + f
(f ~ 2.7 h: ~8.4 h / ~5.7 h) [derived]."""
GEMMS_PER_LAYER = 4
"""fp8 GEMMs per decoder layer for the delayed-scaling state (qkv, proj, fc1, fc2) [derived]."""
DELAYED_TENSORS_PER_GEMM = 3
"""fp8 tensors per GEMM with delayed-scaling meta: input, weight, output gradient (TE DelayedScaling)."""


@dataclass(frozen=True)
class Plan:
    """How one layout's low-precision GEMMs run on one GPU."""

    recipe: str
    """fp8-delayed, fp8-tensorwise, fp8-blockwise, mxfp8 or nvfp4."""
    peak: float
    """Dense tensor-core peak for the recipe, FLOP/s (the GPU's fp8 or fp4 peak; the bf16 peak on CPU workers)."""
    efficiency: float
    """Fraction of that peak a large GEMM reaches (fitted per recipe: ``Coefficients``)."""
    data_bytes: float
    """Bytes per element of one quantized copy (fp8: 1, fp4: 0.5)."""
    scale_bytes: float
    """Scale bytes per element: blockwise fp32 per 128 (4/128), MXFP8 E8M0 per 32 (1/32), NVFP4 E4M3 per 16
    (1/16); tensor-wise scales are one number per tensor (0)."""
    weight_copies: int
    """Quantized weight copies cached per step (row-wise, plus column-wise where the GEMMs need it)."""
    amax_pass: bool
    """Tensor-wise current scaling reads each input once more for its amax; so does NVFP4, whose second-level scale
    is one fp32 number per tensor from the tensor's amax (TransformerEngine d0067d0da transformer_engine/common/
    recipe/__init__.py:493-497: 16-element blocks with E4M3 scales, "a global per tensor FP32 scaling factor")."""
    param_gather: bool
    """``--fp8-param-gather``."""
    amax_history: int
    """Delayed scaling's amax window (Megatron's ``--fp8-amax-history-len`` default 1); 0 for other recipes."""
    act_copies: int = 1
    """Orientations each quantized activation is written in (row-wise, plus column-wise where the wgrad GEMM
    cannot read the row-wise copy: the same rule as ``weight_copies``)."""

    @property
    def bytes_per_element(self) -> float:
        """Bytes of one quantized copy with its scales."""
        return self.data_bytes + self.scale_bytes

    @property
    def quantize_bytes(self) -> float:
        """HBM traffic per quantized input element: read bf16 (twice with an amax pass), write each orientation's
        copy (the GEMM input in forward; in backward the same for the output gradient)."""
        return BF16 * (2 if self.amax_pass else 1) + self.act_copies * self.bytes_per_element


def plan(layout: Layout, gpu: GPU, coef: Coefficients) -> Plan | None:
    """The layout's low-precision plan on ``gpu``; None for bf16 (or fp16) GEMMs."""
    recipe = recipe_of(layout)
    if recipe == "bf16":
        return None
    blackwell = gpu.generation == "blackwell"
    if gpu.is_cpu:  # the torch runner emulates the casts around bf16/fp32 GEMMs: no faster tensor cores
        peak, eff = gpu.bf16_tflops, coef.gemm_efficiency
    elif recipe == "nvfp4":
        peak, eff = gpu.fp4_tflops, coef.nvfp4_gemm_efficiency
    elif recipe == "mxfp8":
        peak, eff = gpu.fp8_tflops, coef.mxfp8_gemm_efficiency
    else:
        peak = gpu.fp8_tflops
        eff = coef.fp8_gemm_efficiency * (coef.fp8_blockwise_gemm_ratio if recipe == "fp8-blockwise" else 1.0)
    if not peak:  # a GPU without the tensor cores: rules refuse it before; price it as bf16 if asked anyway
        peak, eff = gpu.bf16_tflops, coef.gemm_efficiency
    data = 0.5 if recipe == "nvfp4" else 1.0
    scale = {"fp8-blockwise": FP32 / 128, "mxfp8": 1 / 32, "nvfp4": 1 / 16}.get(recipe, 0.0)
    copies = 1 if (blackwell and recipe in ("fp8-delayed", "fp8-tensorwise")) else 2
    return Plan(recipe=recipe, peak=peak * 1e12 * peak_ratio(gpu, coef), efficiency=eff, data_bytes=data, scale_bytes=scale,
                weight_copies=copies, amax_pass=recipe in ("fp8-tensorwise", "nvfp4"), param_gather=layout.fp8_param_gather,
                amax_history=1 if recipe == "fp8-delayed" else 0, act_copies=copies)


def _fp8_gemm(kind: str, engine: Engine, n_gemms: int) -> tuple[bool, ...]:
    """Which of a layer kind's GEMMs (``LayerCost.gemm`` order) run in low precision: all TE linears; in slime's
    Gated DeltaNet layers the mixer's two projections (nn.Linear) stay bf16."""
    if mixer_of(kind) == LINEAR and engine.gdn_replicated:
        return tuple(i >= 2 for i in range(n_gemms))
    return (True,) * n_gemms


def _is_input(name: str, kind: str, engine: Engine) -> str | None:
    """'only' | 'shared' when the saved tensor is an fp8 GEMM's input, else None."""
    if any(p in name for p in GDN_INPUTS):
        return None if engine.gdn_replicated else "only"
    if any(p in name for p in GEMM_ONLY_INPUTS):
        return "only"
    if any(p in name for p in SHARED_INPUTS):
        return "shared"
    return None


_COSTS: dict[tuple, tuple[dict, dict]] = {}


def quantized_costs(costs: dict[str, LayerCost], layout: Layout, engine: Engine, gpu: GPU,
                    coef: Coefficients) -> dict[str, LayerCost]:
    """Each layer kind's cost with the fp8 GEMM inputs it keeps for backward at their quantized size (and the fp8
    copies kept beside a bf16 tensor another kernel keeps); unchanged for bf16."""
    p = plan(layout, gpu, coef)
    if p is None:
        return costs
    key = (id(costs), p.bytes_per_element, engine.gdn_replicated)
    hit = _COSTS.get(key)
    if hit is not None and hit[0] is costs:
        return hit[1]
    q = p.bytes_per_element / BF16
    out = {}
    for kind, c in costs.items():
        saved = []
        for s in c.saved:
            how = _is_input(s.name, kind, engine)
            if how == "only":
                s = replace(s, name=s.name + f" [kept as {p.recipe}]", bytes=s.bytes * q)
            elif how == "shared":
                saved.append(replace(s, name=s.name.split(" (")[0] + f" {p.recipe} copy for the out-projection wgrad",
                                     bytes=s.bytes * q))
            saved.append(s)
        out[kind] = replace(c, saved=tuple(saved))
    if len(_COSTS) > 4096:
        _COSTS.clear()
    _COSTS[key] = (costs, out)
    return out


def gemm_input_bytes(c: LayerCost, kind: str, engine: Engine) -> float:
    """bf16 bytes of the inputs a layer's fp8 GEMMs quantize in forward (the saved GEMM inputs, at bf16)."""
    return sum(s.bytes for s in c.saved if _is_input(s.name, kind, engine))


def _sat(d: float, coef: Coefficients) -> float:
    return 1.0 - math.exp(-d / coef.gemm_half_dim)


def layer_times(times: dict[str, dict], costs: dict[str, LayerCost], engine: Engine, p: Plan, peak: float,
                hbm: float, coef: Coefficients, tp: int = 1, tp_bw: float = 0.0, tp_overlap: bool = False
                ) -> dict[str, dict]:
    """Per-layer times with the fp8 GEMMs at the recipe's peak and efficiency, and the quantize passes (forward
    inputs, backward output gradients) as memory-bound work; attention and GDN kernels unchanged (bf16). With TE
    userbuffers (``tp_overlap``) the TP collectives hide under the now shorter GEMMs: what stays exposed is taken
    again from the collectives' time (performance._layer_parts' formula) less the low-precision GEMMs."""
    out = {}
    for kind, t in times.items():
        c = costs[kind]
        mask = _fp8_gemm(kind, engine, len(c.gemm))
        g = 0.0
        for (fl, d), lo in zip(c.gemm, mask):
            if fl:
                g += fl / (p.peak * p.efficiency * _sat(d, coef)) if lo else fl / (peak * coef.gemm_efficiency * _sat(d, coef))
        quant = p.quantize_bytes * gemm_input_bytes(c, kind, engine) / BF16 / (hbm * coef.hbm_efficiency)
        out[kind] = {**t, "fwd_gemm": g, "bwd_gemm": 2 * g, "fwd_memory": t["fwd_memory"] + quant,
                     "bwd_memory": t["bwd_memory"] + BACKWARD_QUANTIZE_RATIO * quant}
        if engine.fp8_attention:  # cuDNN FP8 fused attention, forward and backward (Engine.fp8_attention)
            out[kind]["fwd_attention"] = t["fwd_attention"] / coef.fp8_attention_speedup
            out[kind]["bwd_attention"] = t["bwd_attention"] / coef.fp8_attention_speedup
        if tp_overlap and tp > 1 and tp_bw > 0:
            vol = (tp - 1) / tp * c.tp_coll_bytes * (2 if c.tp_allreduce else 1)
            per = vol / tp_bw + coef.collective_latency_s
            out[kind]["tp_fwd"] = max(0.0, c.tp_coll_fwd * per - g)
            out[kind]["tp_bwd"] = max(0.0, c.tp_coll_bwd * per - 2 * g)
    return out


def fused_grouped_mlp(p: Plan, engine: Engine) -> bool:
    """TE's fused grouped MLP runs: the recipe turns it on (``Engine.fused_grouped_mlp``) and the GEMMs are MXFP8 or
    NVFP4, the block-scaled formats its kernels take (TE d0067d0da ops/fused/grouped_mlp.py: MXFP8Tensor /
    NVFP4Tensor inputs; docs/examples/te_mixtral/te_mixtral_mxfp8.py:9-10 ``ForwardGroupedMLP_CuTeGEMMSwiGLU_MXFP8``)."""
    return engine.fused_grouped_mlp and p.recipe in ("mxfp8", "nvfp4")


def moe_times(moe_t: dict[str, float], model: ModelSpec, layout: Layout, shape: Shape, p: Plan, peak: float,
              hbm: float, coef: Coefficients, fused: bool = False) -> dict[str, float]:
    """The routed experts' grouped GEMMs in low precision (the router stays bf16: it is a small share of the
    GEMM time and is kept in it) and the quantize passes over the routed tokens' GEMM inputs. ``fused``
    (``fused_grouped_mlp``): the SwiGLU pass (``fwd_act_memory``) and the fc2 input's quantize pass are in the fc1
    GEMM's epilogue, forward and backward."""
    if not moe_t:
        return moe_t
    ratio = peak * coef.gemm_efficiency / (p.peak * p.efficiency)
    R = moe_terms.routed_tokens(layout, shape, model.moe.top_k)
    f = model.moe.expert_ffn / layout.etp
    elems = R * (model.hidden + (0.0 if fused else f))  # grouped fc1 and fc2 inputs quantized by their own pass
    quant = p.quantize_bytes * elems / (hbm * coef.hbm_efficiency)
    act = moe_t.get("fwd_act_memory", 0.0) if fused else 0.0
    return {**moe_t, "fwd_gemm": moe_t["fwd_gemm"] * ratio, "bwd_gemm": moe_t["bwd_gemm"] * ratio,
            "fwd_memory": moe_t["fwd_memory"] - act + quant,
            "bwd_memory": moe_t["bwd_memory"] - coef.backward_memory_ratio * act + BACKWARD_QUANTIZE_RATIO * quant}


def param_gather_bytes(layout: Layout) -> float:
    """Bytes per parameter of the distributed optimizer's parameter all-gather: fp8 with --fp8-param-gather."""
    return 1.0 if layout.fp8_param_gather and layout.fp8_format is not None else BF16


def linear_params(model: ModelSpec, engine: Engine, costs: dict[str, LayerCost], kinds, tp: int) -> float:
    """Parameters of a stage's fp8 linears on one GPU (``kinds``: (kind, layers) pairs): the decoder layers' TE
    linears, not the embedding and output layer; slime's GDN mixer projections excluded."""
    n = 0.0
    for kind, k in kinds:
        if mixer_of(kind) == LINEAR and engine.gdn_replicated:
            n += k * model.kind_params(kind).mlp_matrix / tp
        else:
            n += k * costs[kind].params_on_gpu
    return n


def stage_memory(p: Plan, dense_linear_params: float, expert_params: float, layers: int) -> dict[str, float]:
    """The stage's low-precision memory terms, GiB, named as the report shows them (negative: saved).

    ``low_precision_weight_cache``: the cast weights kept for the step (copies x bytes per element per linear
    parameter; with --fp8-param-gather the row-wise copy is the parameter itself, so one copy fewer and the bf16
    weight is gone: ``low_precision_params``); ``low_precision_scaling``: delayed scaling's amax history and
    scales."""
    n = dense_linear_params + expert_params
    out = {}
    copies = p.weight_copies - (1 if p.param_gather else 0)
    out["low_precision_weight_cache"] = n * copies * p.bytes_per_element / GiB
    if p.param_gather:
        out["low_precision_params"] = n * (p.bytes_per_element - BF16) / GiB
    if p.amax_history:
        out["low_precision_scaling"] = (layers * GEMMS_PER_LAYER * DELAYED_TENSORS_PER_GEMM
                                        * (p.amax_history + 2) * FP32 / GiB)
    return out


def weight_cast_seconds(p: Plan, params: float, hbm: float, coef: Coefficients) -> float:
    """Casting the weights once per step (first microbatch, or the optimizer writing fp8 params): read bf16 (fp32
    master with param gather), write the cached copies."""
    read = FP32 if p.param_gather else BF16
    return params * (read + p.weight_copies * p.bytes_per_element) / (hbm * coef.hbm_efficiency)


def dense_kinds(chunks) -> list[tuple[str, int]]:
    """(kind, layers) over a stage's chunks (the placement's kinds, or full / linear counts)."""
    from_kinds: dict[str, int] = {}
    for ch in chunks:
        for kind, n in (ch.kinds or ((FULL, ch.full), (LINEAR, ch.linear))):
            if n:
                from_kinds[kind] = from_kinds.get(kind, 0) + n
    return list(from_kinds.items())


__all__ = ["Plan", "plan", "quantized_costs", "layer_times", "moe_times", "fused_grouped_mlp", "param_gather_bytes", "linear_params",
           "stage_memory", "weight_cast_seconds", "dense_kinds", "gemm_input_bytes"]
