"""Low-precision GEMMs (fp8 / mxfp8 / nvfp4, issue 22) over a batch of layouts: the array engine's side of
``attune.estimator.precision``.

The per-layer physics stays in the scalar module and is evaluated once per distinct (shape, recipe) by
``batch_tables.kind_tables`` (``quantized_layer``: the recipe's GEMM speed, quantize / amax passes, FP8 attention and
TE userbuffers under the shorter GEMMs; the saved GEMM inputs at their quantized size, in each orientation
``Plan.act_copies``). What varies per row and stage is here, as arrays: the recipe of every row (``recipe_codes``),
the cast-weight cache, ``--fp8-param-gather``'s fp8 parameters and delayed scaling's state per stage
(``stage_overheads``, GiB), the weights cast once per step (``weight_cast_seconds``) and the parameter all-gather's
bytes (``param_gather_bytes``). Each equals the scalar path's term (tests/test_batch_engine.py). bf16 / fp16 rows
read code 0 and add nothing. Hardware refusals (fp8 on Ampere, mxfp8 off Blackwell) are layout rules, checked by
``estimate`` before any of this.
"""

from __future__ import annotations

import numpy as np

from attune.estimator import precision as lp_terms
from attune.estimator.costs import BF16, FP32, LayerCost, Shape
from attune.spec.columns import LayoutColumns
from attune.spec.engine import Engine
from attune.spec.hardware import GPU, Cluster, GiB
from attune.spec.layout import Layout
from attune.spec.model import LINEAR, ModelSpec, mixer_of
from attune.spec.precision import RECIPES

from .coefficients import Coefficients

_CODE = {r: i for i, r in enumerate(RECIPES)}
"""Recipe name -> code; ``RECIPES[0]`` is bf16 (no low-precision GEMM)."""
assert RECIPES[0] == "bf16"


def recipe_codes(cols: LayoutColumns) -> np.ndarray:
    """[N] each row's precision class as an index into ``attune.spec.precision.RECIPES`` (``recipe_of`` over rows:
    nvfp4 with an fp4 format, else bf16 without an fp8 format, else mxfp8 / fp8-<recipe>)."""
    fp4 = np.not_equal(cols["fp4_format"], None)
    fp8 = np.not_equal(cols["fp8_format"], None) & ~fp4
    code = np.where(fp4, _CODE["nvfp4"], 0)
    if fp8.any():
        rows = np.flatnonzero(fp8)
        names, inv = np.unique(cols["fp8_recipe"][rows].astype(str), return_inverse=True)
        named = np.array([_CODE["mxfp8" if r == "mxfp8" else f"fp8-{r}"] for r in names])
        code[rows] = named[inv.reshape(-1)]
    return code


def plans(cols: LayoutColumns, code: np.ndarray, gpu: GPU, coef: Coefficients) -> list:
    """Per recipe code, the scalar ``precision.plan`` on ``gpu`` (None for bf16 and for codes no row has). A plan's
    recipe fields do not depend on ``--fp8-param-gather``, which is read per row."""
    out: list = [None] * len(RECIPES)
    for c in np.unique(code):
        if c:
            out[int(c)] = lp_terms.plan(cols.layout(int(np.flatnonzero(code == c)[0])), gpu, coef)
    return out


def quantized_layer(costs: dict[str, LayerCost], mem_costs: dict[str, LayerCost], times: dict[str, dict],
                    layout: Layout, p, engine: Engine, gpu: GPU, coef: Coefficients, peak: float, tp_bw: float,
                    tp_overlap: bool) -> tuple[dict, dict]:
    """(per-layer times, memory-side layer costs) of one shape group (``layout``: a row of it) under plan ``p``: the
    scalar path's ``precision.layer_times`` (of ``costs``, the layer costs the times read) and
    ``precision.quantized_costs`` (of ``mem_costs``, the costs memory reads: an MoE model's with the routed experts'
    tensors); ``times`` and ``mem_costs`` unchanged (the same objects) for bf16 (``p`` None). ``peak``: the bf16 peak
    with its ratio, FLOP/s; ``tp_bw``: bytes/s."""
    if p is None:
        return times, mem_costs
    hbm = gpu.hbm_gbps * 1e9
    return (lp_terms.layer_times(times, costs, engine, p, peak, hbm, coef, layout.tp, tp_bw, tp_overlap),
            lp_terms.quantized_costs(mem_costs, layout, engine, gpu, coef))


def quantized_moe(moe_t: dict[str, float], model: ModelSpec, layout: Layout, shape: Shape, p, engine: Engine,
                  gpu: GPU, coef: Coefficients, peak: float) -> dict[str, float]:
    """One MoE layer's routed-part times under plan ``p`` (``precision.moe_times``, with TE's fused grouped MLP where
    the engine runs it: ``precision.fused_grouped_mlp``); unchanged for bf16 (``p`` None) and dense models."""
    if p is None or not moe_t:
        return moe_t
    return lp_terms.moe_times(moe_t, model, layout, shape, p, peak, gpu.hbm_gbps * 1e9, coef,
                              lp_terms.fused_grouped_mlp(p, engine))


def _per_row(code: np.ndarray, plan_list: list, attr: str, empty: float = 0.0) -> np.ndarray:
    """[N] one ``Plan`` field per row (``empty`` for bf16 rows)."""
    table = np.array([empty if p is None else float(getattr(p, attr)) for p in plan_list])
    return table[code]


def linear_params(model: ModelSpec, engine: Engine, tp: np.ndarray, per_kind: np.ndarray,
                  layer_params: np.ndarray) -> np.ndarray:
    """[N, S] parameters of a stage's low-precision linears on one GPU (``precision.linear_params``; ``per_kind``:
    [N, S, K] layers of each kind, ``layer_params``: [N, K] one layer's parameters on one GPU): the layers'
    parameters, for slime's replicated GDN mixer (nn.Linear, bf16) only the MLP matrices / TP."""
    n = 0.0
    for k, kind in enumerate(model.kinds):
        if mixer_of(kind) == LINEAR and engine.gdn_replicated:
            n = n + per_kind[..., k] * model.kind_params(kind).mlp_matrix / tp[:, None]
        else:
            n = n + per_kind[..., k] * layer_params[:, k, None]
    return n


def stage_overheads(model: ModelSpec, engine: Engine, cols: LayoutColumns, code: np.ndarray, plan_list: list,
                    stage: np.ndarray, kinds: np.ndarray, layer_params: np.ndarray,
                    expert_params: np.ndarray | float = 0.0) -> dict[str, np.ndarray]:
    """Each stage's low-precision memory terms, GiB ``[N, S]`` (``precision.stage_memory`` for dense layers): the
    cast-weight cache, ``--fp8-param-gather``'s fp8 parameters (negative: the bf16 weight is gone) and delayed
    scaling's amax history and scales; {} when no row is low precision. ``kinds``: [N, S, C, K] layers per chunk
    and kind; ``layer_params``: [N, K] parameters of one layer on one GPU; ``expert_params``: [N, S] the routed
    experts' parameters one GPU of the stage holds (MoE: their grouped linears are cast too; 0 for dense)."""
    low = code != 0
    if not low.any():
        return {}
    pg = cols["fp8_param_gather"] & low
    bpe = _per_row(code, plan_list, "bytes_per_element")[:, None]
    copies = (_per_row(code, plan_list, "weight_copies") - pg)[:, None]
    n = linear_params(model, engine, cols["tp"], kinds.sum(axis=2), layer_params)
    n = n + expert_params
    mask = stage & low[:, None]
    out = {"low_precision_weight_cache": np.where(mask, n * copies * bpe / GiB, 0.0)}
    if pg.any():
        out["low_precision_params"] = np.where(mask & pg[:, None], n * (bpe - BF16) / GiB, 0.0)
    hist = _per_row(code, plan_list, "amax_history")[:, None]
    if (hist > 0).any():
        layers = kinds.sum(axis=(2, 3))
        scaling = (layers * lp_terms.GEMMS_PER_LAYER * lp_terms.DELAYED_TENSORS_PER_GEMM * (hist + 2) * FP32 / GiB)
        out["low_precision_scaling"] = np.where(mask & (hist > 0), scaling, 0.0)
    return out


def weight_cast_seconds(cluster: Cluster, cols: LayoutColumns, code: np.ndarray, plan_list: list,
                        coef: Coefficients, stage: np.ndarray, params: np.ndarray,
                        expert_shard: np.ndarray | float = 0.0) -> np.ndarray | None:
    """[N] seconds casting the largest stage's weights to the recipe once per step (``precision.weight_cast_seconds``
    on ``max(params)``, plus an MoE model's expert optimizer shard ``expert_shard``): read bf16 (fp32 masters with
    param gather), write the cached copies; None when no row is low precision."""
    low = code != 0
    if not low.any():
        return None
    read = np.where(cols["fp8_param_gather"], FP32, BF16)
    write = _per_row(code, plan_list, "weight_copies") * _per_row(code, plan_list, "bytes_per_element")
    biggest = np.where(stage, params, -np.inf).max(axis=1) + expert_shard
    hbm = cluster.gpu.hbm_gbps * 1e9
    return np.where(low, biggest * (read + write) / (hbm * coef.hbm_efficiency), 0.0)


def param_gather_bytes(cols: LayoutColumns) -> np.ndarray | np.float64:
    """[N] bytes per parameter of the distributed optimizer's parameter all-gather (``precision.param_gather_bytes``):
    1 with ``--fp8-param-gather`` on an fp8 layout, else bf16's 2 (a scalar when no row gathers fp8)."""
    if not cols["fp8_param_gather"].any():
        return np.float64(BF16)
    return np.where(cols["fp8_param_gather"] & np.not_equal(cols["fp8_format"], None), 1.0, BF16)


__all__ = ["recipe_codes", "plans", "quantized_layer", "quantized_moe", "linear_params", "stage_overheads", "weight_cast_seconds",
           "param_gather_bytes"]
