"""Step time of a batch of layouts as arrays (what bb2a96d's scalar ``estimate_performance`` computed row by row).

Per stage and microbatch, the parts of ``performance.PARTS`` as ``[rows, stages]`` arrays, accumulated chunk by chunk
and layer kind by layer kind in the deleted scalar composition's order (so every sum is the same floating-point sum; absent chunks and
kinds add exact zeros); then the pipeline schedule, its one bubble, the DP communication and the optimizer step.
Covers dense, GDN-hybrid and MoE models (routed experts: ``batch_moe``) in bf16 / fp16 and with low-precision GEMMs
(``batch_precision``), with their multi-token-prediction layers (``batch_mtp``).
The per-layer times come from the scalar functions through ``batch_tables``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attune.estimator import batch_mtp as mtp_batch
from attune.estimator import batch_precision as lp_batch
from attune.estimator.batch_moe import MoeRows, add_chunk
from attune.estimator.batch_place import BatchPlacement, kind_prefix, kinds_between
from attune.estimator.batch_tables import TIME_KEYS, KindTables, KnobTables
from attune.estimator.costs import BF16, FP32
from attune.estimator.performance import (
    COMM_PARTS,
    CPU_ADAM_BYTES_PER_PARAM,
    DDP_BUCKET_MIN_PARAMS,
    DDP_BUCKET_PARAMS_PER_DP_RANK,
    OFFLOAD_PCIE_BYTES_PER_PARAM,
    PARTS,
)
from attune.spec.columns import NONE_INT, LayoutColumns
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.model import ModelSpec

from .coefficients import Coefficients

_T = {k: i for i, k in enumerate(TIME_KEYS)}


@dataclass
class BatchStageTime:
    """One microbatch through each stage (all its chunks), seconds, ``[rows, stages]`` (0 for absent stages): the
    parts of ``performance.PARTS`` (compute by kind, recompute, exposed communication by kind) and their sums."""

    fwd_gemm: np.ndarray
    fwd_attention: np.ndarray
    fwd_gdn: np.ndarray
    fwd_memory: np.ndarray
    bwd_gemm: np.ndarray
    bwd_attention: np.ndarray
    bwd_gdn: np.ndarray
    bwd_memory: np.ndarray
    recompute: np.ndarray
    tp_comm: np.ndarray
    cp_comm: np.ndarray
    pp_comm: np.ndarray
    ep_comm: np.ndarray
    act_offload: np.ndarray
    moe_host: np.ndarray
    forward_s: np.ndarray
    """Forward through all of the stage's chunks, exposed forward communication included."""
    backward_s: np.ndarray
    """Backward, recompute and the rest of the exposed communication."""
    compute_s: np.ndarray
    comm_s: np.ndarray

    def part(self, name: str) -> np.ndarray:
        """One of ``performance.PARTS`` by name."""
        return getattr(self, name)


@dataclass
class BatchStep:
    """The step of each row, ``[rows]``: the pipeline (with its one bubble), DP, optimizer and overhead, seconds."""

    pipeline_s: np.ndarray
    bubble_s: np.ndarray
    """Fill and drain beyond the critical stage's m microbatches: pipeline_s - m x the critical stage's time."""
    dp_comm_s: np.ndarray
    optimizer_s: np.ndarray
    overhead_s: np.ndarray
    step_time_s: np.ndarray
    critical_stage: np.ndarray
    """The stage with the longest per-microbatch time (first of equals)."""
    microbatches: np.ndarray


def link_bytes_per_s(span: np.ndarray, cluster: Cluster, coef: Coefficients) -> np.ndarray:
    """``performance._link_gbps`` x 1e9 for collectives spanning ``span`` GPUs (NVLink inside the domain)."""
    nv = cluster.gpu.nvlink_gbps * coef.nvlink_efficiency
    net = cluster.gpu.internode_gbps / cluster.gpus_per_node * coef.network_efficiency
    return np.where(span <= max(cluster.gpus_per_node, cluster.gpu.nvlink_domain), nv, net) * 1e9


def pp_send_seconds(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, tokens: np.ndarray, engine: Engine,
                    coef: Coefficients) -> np.ndarray:
    """[N] one PP send or receive per chunk boundary, exposed seconds (bb2a96d's ``performance._pipeline``)."""
    tp, sp, cp, dp, p, v = (cols[k] for k in ("tp", "sp", "cp", "dp", "pp", "vpp"))
    scatter = (tp > 1) & ~sp & engine.p2p_scatter_gather
    pp_bytes = BF16 * tokens * model.hidden / np.where(sp | scatter, tp, 1)
    pp_bw = link_bytes_per_s(2 * (tp * cp * dp), cluster, coef)
    send = np.where(p > 1, pp_bytes / pp_bw + coef.collective_latency_s, 0.0)
    tp_bw = link_bytes_per_s(tp, cluster, coef)
    send = np.where(scatter & (p > 1), send + ((tp - 1) * pp_bytes / tp_bw + coef.collective_latency_s), send)
    if engine.overlap_p2p_interleaved:
        send = np.where(v > 1, send * coef.interleaved_p2p_exposed, send)
    return send


def recomputed_kinds(model: ModelSpec, cols: LayoutColumns, pl: BatchPlacement) -> np.ndarray | None:
    """[N, S, C, K] layers of each kind a chunk recomputes in full: the first N (block) or all (uniform); None when
    no row recomputes in full."""
    full = cols["recompute_granularity"] == "full"
    if not full.any():
        return None
    block = full & (cols["recompute_method"] == "block")
    n_rec = np.where(cols["recompute_num_layers"] == NONE_INT, 0, cols["recompute_num_layers"])
    k = np.where(block[:, None, None], np.minimum(n_rec[:, None, None], pl.layers),
                 np.where(full[:, None, None], pl.layers, 0))
    return kinds_between(kind_prefix(model), pl.start, pl.start + k)


def _chunk_kinds(parts: dict, fwd_comm: np.ndarray, n: np.ndarray, nr: np.ndarray | None, t: np.ndarray,
                 tmp: np.ndarray) -> None:
    """One chunk's layers of one kind (``n``, of which ``nr`` recomputed in full; ``t``: the kind's TIME_KEYS x
    rows): forward and backward compute, full recompute, TP and CP comm. ``tmp``: scratch of parts' shape."""
    def add(key: str, count: np.ndarray, col: int) -> None:
        np.multiply(count, t[col][:, None], out=tmp)
        np.add(parts[key], tmp, out=parts[key])

    for key in ("gemm", "attention", "gdn", "memory"):
        add("fwd_" + key, n, _T["fwd_" + key])
        add("bwd_" + key, n, _T["bwd_" + key])
    both = n
    if nr is not None:  # None: no row of the group recomputes in full (nothing to add)
        f = t[_T["fwd_gemm"]] + t[_T["fwd_attention"]] + t[_T["fwd_gdn"]] + t[_T["fwd_memory"]]
        parts["recompute"] += nr * f[:, None]
        both = n + nr
    parts["tp_comm"] += both * t[_T["tp_fwd"]][:, None] + n * t[_T["tp_bwd"]][:, None]
    parts["cp_comm"] += both * t[_T["cp_fwd"]][:, None] + n * t[_T["cp_bwd"]][:, None]
    fwd_comm += t[_T["tp_fwd"]][:, None] * n + t[_T["cp_fwd"]][:, None] * n


def _offload_exposed(n: np.ndarray, nr: np.ndarray, T: np.ndarray, off: np.ndarray, pcie_gbps: float) -> np.ndarray:
    """A chunk's exposed activation-offload seconds (``offload.offload_exposed_seconds`` over its kinds)."""
    off_b = fwd_c = bwd_c = 0.0
    for k in range(T.shape[1]):
        t = T[:, k]
        f = t[:, _T["fwd_gemm"]] + t[:, _T["fwd_attention"]] + t[:, _T["fwd_gdn"]] + t[:, _T["fwd_memory"]]
        b = t[:, _T["bwd_gemm"]] + t[:, _T["bwd_attention"]] + t[:, _T["bwd_gdn"]] + t[:, _T["bwd_memory"]]
        off_b = off_b + (n[..., k] - nr[..., k]) * off[:, k, None]
        fwd_c = fwd_c + n[..., k] * f[:, None]
        bwd_c = bwd_c + n[..., k] * b[:, None]
    link = off_b / (pcie_gbps * 1e9)
    return np.where(off_b > 0, np.maximum(0.0, link - fwd_c) + np.maximum(0.0, link - bwd_c), 0.0)


def stage_times(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, pl: BatchPlacement, kt: KindTables,
                kn: KnobTables, pp_send: np.ndarray, mr: MoeRows | None = None) -> BatchStageTime:
    """Per stage and microbatch: bb2a96d's ``performance._pipeline``'s per-stage loop over rows (``mr``: an MoE model's
    routed experts, ``batch_moe.moe_rows``)."""
    N, S, C, K = pl.kinds.shape
    T, rs, off = kt.times[kt.gid], kn.seconds[kn.gid], kn.offloaded_time[kn.gid]
    kinds = pl.kinds.astype(np.float64)
    rec = recomputed_kinds(model, cols, pl)
    rec = None if rec is None else rec.astype(np.float64)
    selective, offload = bool(rs.any()), bool(off.any())
    Tk = [np.ascontiguousarray(T[:, k].T) for k in range(K)]  # per kind: TIME_KEYS x rows
    parts = {k: np.zeros((N, S)) for k in PARTS}
    fwd_comm, tmp = np.zeros((N, S)), np.empty((N, S))
    for c in range(C):
        n_c, r_c = kinds[:, :, c], (np.zeros_like(kinds[:, :, c]) if rec is None else rec[:, :, c])
        for k in range(K):
            _chunk_kinds(parts, fwd_comm, n_c[..., k], None if rec is None else r_c[..., k], Tk[k], tmp)
        if mr is not None:
            add_chunk(parts, mr, n_c, None if rec is None else r_c)
        for k in range(K if selective else 0):  # selective recompute: the recomputed modules' forward again
            parts["recompute"] += n_c[..., k] * rs[:, k, None]
        if offload:
            parts["act_offload"] += _offload_exposed(n_c, r_c, T, off, cluster.gpu.pcie_gbps)
        parts["pp_comm"] += np.where(pl.chunk[:, :, c], 2 * pp_send[:, None], 0.0)
    if model.vocab:
        last = pl.is_last
        g = kt.logits_gemm_s[kt.gid][:, None]
        mem = kt.logits_memory_s[kt.gid][:, None]
        parts["fwd_gemm"] += np.where(last, g, 0.0)
        parts["fwd_memory"] += np.where(last, mem, 0.0)
        parts["bwd_gemm"] += np.where(last, 2 * g, 0.0)
        parts["bwd_memory"] += np.where(last, mem, 0.0)
    if kt.mtp is not None:  # the last stage's multi-token-prediction layers (batch_mtp)
        mtp_batch.add_mtp_times(parts, model, cols, pl, kt, kn)
    parts["fwd_memory"] += np.where(pl.is_first, kt.embedding_memory_s[kt.gid][:, None], 0.0)
    fwd = parts["fwd_gemm"] + parts["fwd_attention"] + parts["fwd_gdn"] + parts["fwd_memory"]
    fwd = np.where(pl.stage, fwd + fwd_comm + pp_send[:, None] * pl.vpp[:, None], 0.0)
    total = sum(parts[k] for k in PARTS)
    comm = sum(parts[k] for k in COMM_PARTS)
    return BatchStageTime(**parts, forward_s=fwd, backward_s=total - fwd, compute_s=total - comm, comm_s=comm)


def stage_params(model: ModelSpec, cols: LayoutColumns, pl: BatchPlacement, kt: KindTables) -> np.ndarray:
    """[N, S] parameters one GPU of each stage holds (``placement.stage_params`` with the TP-sharded layer costs)."""
    N, S, C, K = pl.kinds.shape
    P = kt.params[kt.gid]
    tp = cols["tp"][:, None]
    n = np.zeros((N, S))
    for c in range(C):
        chunk = 0.0
        for k in range(K):
            chunk = chunk + pl.kinds[:, :, c, k] * P[:, k, None]
        n = n + chunk
    first, last = pl.is_first, pl.is_last
    n = n + np.where(first, model.embedding_params / tp + model.position_params, 0.0)
    tied_single = first & model.tied_embeddings
    n = n + np.where(last & ~tied_single, model.output_params / tp, 0.0)
    n = n + np.where(last, float(model.final_norm_params), 0.0)
    return n if kt.mtp is None else n + mtp_batch.mtp_params(model, cols, pl, kt)


def pipeline(st: BatchStageTime, pl: BatchPlacement) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(pipeline seconds, bubble seconds, critical stage, per-microbatch time of every stage): 1F1B with uneven
    stages, fill and drain divided by VPP; the one bubble is the pipeline beyond m x the critical stage."""
    per_mb = st.forward_s + st.backward_s
    masked = np.where(pl.stage, per_mb, -np.inf)
    crit = np.argmax(masked, axis=1)
    slowest = masked[np.arange(len(crit)), crit]
    total = 0.0
    for s in range(per_mb.shape[1]):
        total = total + np.where(pl.stage[:, s], per_mb[:, s], 0.0)
    m = pl.microbatches
    pipe = m * slowest + (total - slowest) / pl.vpp
    return pipe, pipe - m * slowest, crit, per_mb


def grad_bytes(cols: LayoutColumns, engine: Engine) -> np.ndarray:
    """[N] bytes per gradient element the DP reduction moves (bb2a96d's ``estimate_performance``)."""
    fp16_grads = (cols["precision"] == "fp16") & (not engine.fp16_grads_in_fp32)
    return np.where(fp16_grads | (not engine.grad_reduce_in_fp32), BF16, FP32)


def dp_seconds(cluster: Cluster, cols: LayoutColumns, engine: Engine, coef: Coefficients, pl: BatchPlacement,
               st: BatchStageTime, params: np.ndarray, expert_s: np.ndarray | None = None) -> np.ndarray:
    """[N] exposed DP gradient reduce-scatter / all-reduce and parameter all-gather, the slowest stage's
    (``expert_s``: [N, S] an MoE model's expert-DP communication, ``batch_moe.expert_dp_seconds``)."""
    tp, dist = cols["tp"], cols["distributed_optimizer"]
    d = cols["dp"] * cols["cp"]
    gb, ag_bytes = grad_bytes(cols, engine), lp_batch.param_gather_bytes(cols)
    ov_grad = cols["overlap_grad_reduce"] | engine.recipe_overlap_grad_reduce
    ov_param = (cols["overlap_param_gather"] | engine.recipe_overlap_param_gather) & dist
    bw = link_bytes_per_s(d * tp, cluster, coef)
    bucket = np.maximum(DDP_BUCKET_MIN_PARAMS, DDP_BUCKET_PARAMS_PER_DP_RANK * d)
    lat = coef.collective_latency_s
    # every stage at once ([N, S]); drain = the backward of the stages before (an exclusive running sum, added in
    # stage order as the per-stage loop did: cumsum is sequential)
    p, bwd, fwd = params, st.backward_s, st.forward_s
    drain = np.zeros_like(bwd)
    np.cumsum(bwd[:, :-1], axis=1, out=drain[:, 1:])
    d, gb, ag_bytes, bw, dist, ov_grad, ov_param, bucket = (x[:, None] if np.ndim(x) else x for x in (
        d, gb, ag_bytes, bw, dist, ov_grad, ov_param, bucket))
    n_buckets = np.maximum(1.0, p / bucket)
    t_rs = np.where(dist, p * (d - 1) / d * gb / bw + lat, 2 * p * (d - 1) / d * gb / bw + lat)
    t_ag = np.where(dist, p * (d - 1) / d * ag_bytes / bw + lat, 0.0)
    t_rs = np.where(ov_grad, np.maximum(t_rs - bwd - drain, t_rs / n_buckets), t_rs)
    t_ag = np.where(ov_param, np.maximum(t_ag - fwd, t_ag / n_buckets), t_ag)
    per_stage = t_rs + t_ag + (0.0 if expert_s is None else expert_s)
    dp_s = np.where(pl.stage, per_stage, 0.0).max(axis=1, initial=0.0)  # max: order-free, exact
    return np.where(cols["dp"] * cols["cp"] > 1, dp_s, 0.0)


def optimizer_seconds(cluster: Cluster, cols: LayoutColumns, engine: Engine, coef: Coefficients,
                      pl: BatchPlacement, params: np.ndarray, expert_shard: np.ndarray | None = None) -> np.ndarray:
    """[N] the optimizer step on the GPU and / or the CPU with its PCIe copies (bb2a96d's ``estimate_performance``;
    ``expert_shard``: an MoE model's routed-expert shard, ``batch_moe.expert_shard``)."""
    gpu = cluster.gpu
    dist = cols["distributed_optimizer"]
    div = np.where(dist, cols["dp"] * cols["cp"], 1)
    shard = np.where(pl.stage, params, -np.inf).max(axis=1) / div
    if expert_shard is not None:
        shard = shard + expert_shard
    frac = np.where(cols["optimizer_cpu_offload"], cols["offload_fraction"], 0.0)
    pao = cols["precision_aware_optimizer"]
    states = np.where(pao, BF16 + 2 * FP32, 3 * FP32)
    g = np.where(pao, FP32, grad_bytes(cols, engine))
    gpu_opt = (1 - frac) * shard * (g + 2 * states + BF16) / (gpu.hbm_gbps * 1e9 * coef.hbm_efficiency)
    total = 0.0
    for s in range(params.shape[1]):
        total = total + np.where(pl.stage[:, s], params[:, s], 0.0)
    host_params = frac * total / pl.pp / div * cluster.gpus_per_node
    cpu_compute = host_params * CPU_ADAM_BYTES_PER_PARAM / (gpu.host_mem_gbps * 1e9 * coef.host_optimizer_efficiency)
    pcie = frac * shard * OFFLOAD_PCIE_BYTES_PER_PARAM / (gpu.pcie_gbps * 1e9)
    cpu_opt = np.where(cols["overlap_cpu_optimizer"], np.maximum(cpu_compute, pcie), cpu_compute + pcie)
    return gpu_opt + np.where(frac != 0, cpu_opt, 0.0)
