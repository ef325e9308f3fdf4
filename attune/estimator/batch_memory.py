"""Peak memory of a batch of layouts as arrays (what bb2a96d's scalar ``estimate_memory`` computed row by row).

Per stage ``[rows, stages]``: the activations kept for the in-flight microbatches under the row's recompute policy
(none / selective by module, full block, full uniform; activation offload), the backward transient, the logits; then
weights, gradients and optimizer states by byte counts per parameter, the named fixed overheads (``batch_tables``),
the optimizer step's own peak and fragmentation. Sums run in the deleted scalar composition's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from attune.estimator import batch_mtp as mtp_batch
from attune.estimator import batch_precision as lp_batch
from attune.estimator.batch_moe import expert_memory
from attune.estimator.batch_place import BatchPlacement, kind_prefix, kinds_between
from attune.estimator.batch_tables import KindTables, KnobTables, OverheadTables
from attune.estimator.costs import BF16, FP32
from attune.spec.columns import NONE_INT, LayoutColumns
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster, GiB
from attune.spec.model import ModelSpec

from .coefficients import Coefficients


@dataclass
class BatchStageMemory:
    """Each stage's peak memory terms, ``[rows, stages]`` (0 for absent stages): ``memory.StageMemory``'s fields."""

    params: np.ndarray
    weights_gib: np.ndarray
    grads_gib: np.ndarray
    optimizer_gib: np.ndarray
    activations_gib: np.ndarray
    logits_gib: np.ndarray
    overhead_gib: np.ndarray
    """The sum of ``overheads``."""
    host_optimizer_gib: np.ndarray
    inflight_microbatches: np.ndarray
    allocated_gib: np.ndarray
    """Peak allocated (``max_memory_allocated``)."""
    reserved_gib: np.ndarray
    """Peak reserved: allocated + fragmentation."""
    total_gib: np.ndarray
    """What the device holds at the peak (reserved + CUDA context + NCCL buffers): what the verdict compares."""
    expert_params: np.ndarray
    expert_weights_gib: np.ndarray
    expert_grads_gib: np.ndarray
    expert_optimizer_gib: np.ndarray
    expert_activations_gib: np.ndarray
    overheads: dict[str, np.ndarray] = field(default_factory=dict)
    """Named overheads, GiB, 0 where a row's stage has none (``memory.StageMemory.overheads``)."""


def _chunk_worst(pl: BatchPlacement, kt: KindTables, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(present kinds [N,S,K], largest saved bytes, largest backward working set) of chunk c, FULL always counted."""
    g = kt.gid
    present = pl.kinds[:, :, c] > 0
    act, work = kt.act[g][:, None, :], kt.work[g][:, None, :]
    worst = np.maximum(kt.full_act[g][:, None], np.where(present, act, 0.0).max(axis=2))
    wmax = np.maximum(kt.full_work[g][:, None], np.where(present, work, 0.0).max(axis=2))
    return present, worst, wmax


def _kept_no_full(stored, n, present, act, k_rec, off) -> tuple[np.ndarray, np.ndarray]:
    """``stored`` plus one chunk without full recompute (each kind less what selective recompute frees and offload
    sends away, plus the chunk's last offloaded layer kept on the GPU), and the most selective recompute rebuilds."""
    kept_off = 0.0
    for k in range(n.shape[-1]):
        stored = stored + n[..., k] * (act[:, k, None] - k_rec[:, k, None] - off[:, k, None])
        kept_off = np.maximum(kept_off, np.where(present[..., k], off[:, k, None], 0.0))
    return stored + kept_off, np.where(present, k_rec[:, None, :], 0.0).max(axis=2)


def _kept_block(stored, n, rec, kk, act, off, inp) -> np.ndarray:
    """``stored`` plus one chunk under full block recompute: the first kk layers keep their input, the rest
    everything less offload (the largest offloaded layer kept)."""
    offs = 0.0
    for k in range(n.shape[-1]):
        keep = n[..., k] - rec[..., k]
        stored = stored + keep * (act[:, k, None] - off[:, k, None])
        offs = np.maximum(offs, np.where(keep > 0, off[:, k, None], 0.0))
    return stored + (kk * inp + offs)


def stored_bytes(model: ModelSpec, cols: LayoutColumns, pl: BatchPlacement, kt: KindTables,
                 kn: KnobTables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(activation bytes one microbatch keeps per stage, bytes rebuilt at once in backward, backward working set).
    Each recompute policy's branch runs only where a row takes it; the row's own branch is kept."""
    N, S, C, K = pl.kinds.shape
    gran = cols["recompute_granularity"]
    full_r, sel = gran == "full", gran == "selective"
    block = full_r & (cols["recompute_method"] == "block")
    uniform = full_r & ~block
    any_nf, any_b, any_u = (~full_r).any(), block.any(), uniform.any()
    n_rec = np.where(cols["recompute_num_layers"] == NONE_INT, 0, cols["recompute_num_layers"])[:, None]
    act, inp = kt.act[kt.gid], kt.full_input[kt.gid][:, None]
    k_rec, off = np.where(sel[:, None], kn.freed[kn.gid], 0.0), kn.offloaded[kn.gid]
    prefix = kind_prefix(model)
    st_nf, st_b, st_u, work = np.zeros((N, S)), np.zeros((N, S)), np.zeros((N, S)), np.zeros((N, S))
    rebuilt = np.where(sel, kn.freed_full[kn.gid], 0.0)[:, None] * np.ones((1, S))
    for c in range(C):
        exists, n, layers = pl.chunk[:, :, c], pl.kinds[:, :, c], pl.layers[:, :, c]
        present, worst, wmax = _chunk_worst(pl, kt, c)
        work = np.where(exists, np.maximum(work, wmax), work)
        if any_nf:
            st_nf, rb = _kept_no_full(st_nf, n, present, act, k_rec, off)
            rebuilt = np.where((~full_r[:, None]) & exists, np.maximum(rebuilt, rb), rebuilt)
        if any_b:
            kk = np.minimum(n_rec, layers)
            rec = kinds_between(prefix, pl.start[:, :, c], pl.start[:, :, c] + kk)
            st_b = _kept_block(st_b, n, rec, kk, act, off, inp)
            rebuilt = np.where(block[:, None] & (kk > 0), np.maximum(rebuilt, worst), rebuilt)
        if any_u:  # every group of N layers keeps its input; a whole group is rebuilt in backward
            st_u = st_u + (-(-layers // np.maximum(n_rec, 1))) * inp
            rebuilt = np.where(uniform[:, None] & exists, np.maximum(rebuilt, np.minimum(n_rec, layers) * worst),
                               rebuilt)
    stored = np.where(~full_r[:, None], st_nf, np.where(block[:, None], st_b, st_u))
    return stored, rebuilt, work


def optimizer_bytes(cols: LayoutColumns, engine: Engine, fp32_training: bool) -> tuple[np.ndarray, ...]:
    """[N] each (weight, grad, GPU optimizer during forward/backward, host optimizer, the step's fp32 grad copy) bytes
    per parameter (``memory.optimizer_bytes`` less ``step_grad_copy_bytes``, and the copy). ``fp32_training``: the
    torch runner's fp32 parameters and Adam (CPU workers, attune's trainer)."""
    fp16 = cols["precision"] == "fp16"
    d = np.where(cols["distributed_optimizer"], cols["dp"] * cols["cp"], 1)
    if fp32_training:
        zero = np.zeros(len(d))
        return np.full(len(d), FP32), np.full(len(d), FP32), 8 / d - 0.0, zero, zero
    grib = (not engine.grad_reduce_in_fp32) & ~fp16
    pao = cols["precision_aware_optimizer"]
    fp16_32 = fp16 & engine.fp16_grads_in_fp32
    grad = np.where(pao, np.where(grib, BF16, FP32), np.where(fp16_32, FP32, np.where(fp16 | grib, BF16, FP32)))
    states = np.where(pao, BF16 + FP32 + FP32, np.where(fp16_32, FP32 * 3, np.where(fp16 | grib, FP32 * 4, FP32 * 3)))
    frac = np.where(cols["optimizer_cpu_offload"], cols["offload_fraction"], 0.0)
    copy = np.where(pao | (~fp16 & ~grib) | fp16_32, 0.0, (1 - frac) * FP32 / d)
    return np.full(len(d), BF16), grad, (1 - frac) * states / d - copy, frac * 16 / d, copy


def stage_memory(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, engine: Engine, coef: Coefficients,
                 pl: BatchPlacement, kt: KindTables, kn: KnobTables, ot: OverheadTables,
                 params: np.ndarray) -> BatchStageMemory:
    """Every stage's memory terms (bb2a96d's ``estimate_memory`` for dense layers, bf16 / fp16 or low-precision GEMMs, MTP; an
    MoE model's routed experts by ``batch_moe.expert_memory``)."""
    N, S = pl.stage.shape
    stored, rebuilt, work = stored_bytes(model, cols, pl, kt, kn)
    mtp_b = mtp_lg = 0.0  # the last stage's multi-token-prediction layers (batch_mtp)
    if kt.mtp is not None:
        rebuilt, work, mtp_b, mtp_lg = mtp_batch.mtp_memory(model, cols, pl, kt, kn, rebuilt, work)
    tp, tokens = cols["tp"][:, None], pl.tokens_per_gpu[:, None]
    transient = rebuilt + work
    transient = np.where(pl.is_first, np.maximum(transient, BF16 * model.embedding_params / tp), transient)
    cpu = cluster.gpu.is_cpu
    act_scale = FP32 / BF16 if cpu else 1.0  # activations are fp32 on CPU workers, bf16 on GPUs
    acts = np.where(pl.stage, act_scale * (pl.inflight * stored + transient + mtp_b), 0.0)
    logits = np.zeros((N, S))
    if model.vocab:
        lg = engine.logits_bytes_per_element * tokens * model.vocab / tp + BF16 * tokens * model.hidden + mtp_lg
        logits = np.where(pl.is_last, lg, 0.0)
    w_b, g_b, o_b, h_b, copy_b = (a[:, None] for a in optimizer_bytes(cols, engine, cpu or engine.attune_trainer))
    em = expert_memory(model, cols, engine, pl, kt, kn, optimizer_bytes, cpu or engine.attune_trainer, act_scale)
    e_state, e_step, e_host, e_gib = (0.0, 0.0, 0.0, 0.0) if em is None else (em.state_b, em.step_b, em.host_b,
                                                                            em.state_gib)
    cls = 2 * pl.is_first + pl.is_last
    over = {n: np.where(pl.stage, ot.values[ot.gid[:, None], cls, j], 0.0) for j, n in enumerate(ot.names)}
    lp = lp_batch.stage_overheads(model, engine, cols, kt.recipe, kt.plans, pl.stage, pl.kinds, kt.params[kt.gid],
                                  0.0 if em is None else em.params)
    over.update(lp)  # low-precision weight cache, fp8 params, scaling state (batch_precision)
    lp_gib = sum(lp.values(), 0)
    zero = np.zeros((N, S))
    gws, tpob = over.get("gemm_workspaces", zero), over.get("tp_overlap_buffers", zero)
    allocated = (params * (w_b + g_b + o_b) + e_state + acts + logits) / GiB + gws + tpob + lp_gib
    step_peak = (params * (w_b + g_b + o_b + copy_b) + e_step) / GiB + gws + lp_gib
    higher = step_peak > allocated
    over["optimizer_step_peak"] = np.where(higher & pl.stage, step_peak - allocated, 0.0)
    allocated = np.where(higher, step_peak, allocated)
    frag = 0.0 if cpu else (coef.fragmentation_expandable if engine.expandable_segments else coef.fragmentation)
    over["fragmentation"] = np.where(pl.stage, frag * allocated, 0.0)  # (none on CPU workers: 0 here)
    overhead = sum(over.values())
    w, g, o = params * w_b / GiB, params * g_b / GiB, params * o_b / GiB
    a, lo = acts / GiB, logits / GiB
    alloc_gib = w + g + o + a + lo + e_gib + gws + tpob + over["optimizer_step_peak"] + lp_gib
    mask = lambda x: np.where(pl.stage, x, 0.0)  # noqa: E731
    return BatchStageMemory(
        params=params, weights_gib=w, grads_gib=g, optimizer_gib=o, activations_gib=a, logits_gib=lo,
        overhead_gib=overhead, host_optimizer_gib=(params * h_b + e_host) / GiB, inflight_microbatches=pl.inflight,
        allocated_gib=mask(alloc_gib), reserved_gib=mask(alloc_gib + over["fragmentation"]),
        total_gib=mask(w + g + o + a + lo + e_gib + overhead), overheads=over,
        **(dict.fromkeys(("expert_params", "expert_weights_gib", "expert_grads_gib", "expert_optimizer_gib",
                          "expert_activations_gib"), zero) if em is None else
           dict(expert_params=em.params, expert_weights_gib=em.weights_gib, expert_grads_gib=em.grads_gib,
                expert_optimizer_gib=em.optimizer_gib, expert_activations_gib=em.activations_gib)))
