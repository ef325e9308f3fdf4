"""Multi-token prediction (``Layout.mtp_layers``, megatron-core's MTP block) over a batch of layouts: the array
engine's side of bb2a96d's ``performance._mtp_parts`` and the MTP terms of its ``memory._stage_bytes`` /
``placement.stage_params``.

The MTP layers sit on the last pipeline stage. Per MTP layer: one transformer layer of the model's last layer's kind
(its per-layer time, saved tensors and parameters are the kind tables' own, low-precision GEMMs included), eh_proj
and the shared output layer run again (bf16 GEMMs), the MTP loss's softmax over an fp32 logits copy (HBM passes,
and the logits kept), the enorm / hnorm inputs and statistics it saves. Full uniform recompute checkpoints the MTP
layer (its two inputs kept, eh_proj recomputed); block recompute skips it (megatron-core 0.16.1). The figures that
depend only on the shape are computed once per kind-table group by the scalar functions (``costs.mtp_gemm``,
``mtp_saved``, ``mtp_logits_bytes``); an MoE-kind MTP layer's routed experts are ``batch_moe``'s (``add_mtp_experts``,
and the MTP layers in ``stage_expert_params`` and the expert activations).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from attune.estimator import batch_moe
from attune.estimator.costs import FP32, Shape, mtp_gemm, mtp_logits_bytes, mtp_saved
from attune.estimator.performance import gemm_efficiency
from attune.spec.columns import LayoutColumns
from attune.spec.hardware import Cluster
from attune.spec.layout import Workload
from attune.spec.model import ModelSpec
from attune.spec.placement import mtp_kind

from .coefficients import Coefficients, peak_ratio

UNIFORM_KEPT = ("MTP final norm", "MTP output-layer")
"""Of ``mtp_saved``: what an MTP layer checkpointed by full uniform recompute still keeps (run outside the
checkpoint: memory._stage_bytes)."""


@dataclass(frozen=True)
class MtpTables:
    """Per kind-table group (``KindTables.gid``): one MTP layer's shape-only figures."""

    eh_s: np.ndarray  # [G] eh_proj forward GEMM, seconds
    out_s: np.ndarray  # [G] the shared output layer's forward GEMM again, seconds
    loss_s: np.ndarray  # [G] the MTP loss's HBM passes over the fp32 logits, seconds
    extra_b: np.ndarray  # [G] bytes mtp_saved keeps besides the transformer layer
    extra_uniform_b: np.ndarray  # [G] of those, what full uniform recompute keeps
    input_b: np.ndarray  # [G] the MTP transformer layer's input bytes (kept twice under uniform recompute)
    logits_b: np.ndarray  # [G] the MTP loss's fp32 logits, bytes


def with_mtp_tables(kt, model: ModelSpec, cluster: Cluster, cols: LayoutColumns, first: np.ndarray,
                    tokens: np.ndarray, workload: Workload, coef: Coefficients):
    """``kt`` (KindTables, groups headed by the rows ``first``) with its ``mtp`` tables when a row has MTP layers."""
    if not (cols["mtp_layers"] > 0).any():
        return kt
    gpu = cluster.gpu
    peak = gpu.bf16_tflops * 1e12 * peak_ratio(gpu, coef)
    hbm = gpu.hbm_gbps * 1e9
    mk = mtp_kind(model)
    rows = np.zeros((7, len(first)))
    for g, i in enumerate(first):
        shape = Shape(int(cols["tp"][i]), bool(cols["sp"][i]), int(cols["cp"][i]), int(tokens[i]), workload.seq_length)
        g_eh, g_out = (fl / (peak * gemm_efficiency(d, coef)) if fl else 0.0 for fl, d in mtp_gemm(model, shape))
        loss = coef.memory_passes * FP32 * shape.tokens * model.vocab / shape.tp / (hbm * coef.hbm_efficiency)
        extra = mtp_saved(model, shape)
        kept = sum(x.bytes for x in extra if x.name.startswith(UNIFORM_KEPT))
        rows[:, g] = (g_eh, g_out, loss, sum(x.bytes for x in extra), kept, kt.mem_costs[g][mk].input_bytes,
                      mtp_logits_bytes(model, shape))
    return replace(kt, mtp=MtpTables(*rows))


def _rows(model: ModelSpec, cols: LayoutColumns, pl) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """([N, S] MTP layers per stage (last stage only), the MTP kind's index, [N] full uniform recompute, [N]
    selective recompute)."""
    n = np.where(pl.is_last, cols["mtp_layers"][:, None], 0).astype(np.float64)
    gran = cols["recompute_granularity"]
    uniform = (gran == "full") & (cols["recompute_method"] == "uniform")
    return n, model.kinds.index(mtp_kind(model)), uniform, gran == "selective"


def add_mtp_times(parts: dict, model: ModelSpec, cols: LayoutColumns, pl, kt, kn) -> None:
    """Add the last stage's MTP layers to its per-microbatch ``parts`` ([N, S] seconds, ``performance.PARTS``),
    in bb2a96d's ``performance._mtp_parts``' order: the layer's compute, its recompute (full uniform: its forward and eh_proj;
    selective: the recomputed modules), its TP / CP communication, eh_proj and the output layer (GEMMs), the loss."""
    n, j, uniform, selective = _rows(model, cols, pl)
    t = kt.times[kt.gid, j].T  # TIME_KEYS x rows
    key = {k: i for i, k in enumerate(("fwd_gemm", "fwd_attention", "fwd_gdn", "fwd_memory", "bwd_gemm",
                                       "bwd_attention", "bwd_gdn", "bwd_memory", "tp_fwd", "tp_bwd", "cp_fwd",
                                       "cp_bwd"))}
    col = lambda name: t[key[name]][:, None]  # noqa: E731
    for k in ("gemm", "attention", "gdn", "memory"):
        parts["fwd_" + k] += n * col("fwd_" + k)
        parts["bwd_" + k] += n * col("bwd_" + k)
    fwd_layer = col("fwd_gemm") + col("fwd_attention") + col("fwd_gdn") + col("fwd_memory")
    rec = np.where(uniform[:, None], n * fwd_layer, np.where(selective[:, None], n * kn.seconds[kn.gid, j][:, None], 0))
    parts["recompute"] += rec
    twice = np.where(uniform, 2, 1)[:, None]
    parts["tp_comm"] += n * (twice * col("tp_fwd") + col("tp_bwd"))
    parts["cp_comm"] += n * (twice * col("cp_fwd") + col("cp_bwd"))
    if model.moe is not None:  # an MoE-kind MTP layer's routed experts
        batch_moe.add_mtp_experts(parts, model, cols, pl, kt, uniform)
    mt = kt.mtp
    eh, out, loss = (a[kt.gid][:, None] for a in (mt.eh_s, mt.out_s, mt.loss_s))
    parts["recompute"] += np.where(uniform[:, None], n * eh, 0.0)
    g = eh + out
    parts["fwd_gemm"] += n * g
    parts["bwd_gemm"] += 2 * n * g
    parts["fwd_memory"] += n * loss
    parts["bwd_memory"] += n * loss


def mtp_memory(model: ModelSpec, cols: LayoutColumns, pl, kt, kn, rebuilt: np.ndarray,
               work: np.ndarray) -> tuple[np.ndarray, ...]:
    """(rebuilt, backward working set, MTP activation bytes, MTP logits bytes), [N, S] per stage and microbatch
    (bb2a96d's ``memory._stage_bytes``): the MTP layers' saved tensors (full uniform recompute: the two inputs and what runs
    outside the checkpoint; selective: less what it frees), what their backward rebuilds and works on, and each
    MTP loss's fp32 logits."""
    n, j, uniform, selective = _rows(model, cols, pl)
    mt, g = kt.mtp, kt.gid
    act, wk = kt.act[g, j], kt.work[g, j]
    freed = np.where(selective, kn.freed[kn.gid, j], 0.0)
    layer_b = np.where(uniform, 2 * mt.input_b[g], act - freed)
    extra = np.where(uniform, mt.extra_uniform_b[g], mt.extra_b[g])
    has = n > 0
    rebuilt = np.where(has, np.maximum(rebuilt, np.where(uniform, act, freed)[:, None]), rebuilt)
    work = np.where(has, np.maximum(work, wk[:, None]), work)
    return rebuilt, work, n * (layer_b + extra)[:, None], n * mt.logits_b[g][:, None]


def mtp_params(model: ModelSpec, cols: LayoutColumns, pl, kt) -> np.ndarray:
    """[N, S] parameters of the MTP layers on one GPU of the last stage (``placement.mtp_layer_params``: the
    transformer layer, eh_proj split by TP, enorm / hnorm / final norm)."""
    n, j, _, _ = _rows(model, cols, pl)
    h = model.hidden
    one = kt.params[kt.gid, j] + 2 * h * h / cols["tp"] + 3 * model.norm_vectors
    return np.where(pl.is_last, n * one[:, None], 0.0)


__all__ = ["MtpTables", "with_mtp_tables", "add_mtp_times", "mtp_memory", "mtp_params", "UNIFORM_KEPT"]
