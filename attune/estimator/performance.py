"""The performance model's per-layer pieces (the parts of a stage's time, GEMM efficiency, link speeds, the DDP
bucket and optimizer constants). The per-stage composition (every row of a batch at once) is ``batch_time`` /
``batch``; what follows describes it: step time, tokens/s/GPU, MFU and cost from the work each pipeline stage does.

Per microbatch and stage: GEMMs at a shape-dependent efficiency, softmax-attention and Gated DeltaNet
kernels, memory-bound elementwise work at HBM bandwidth, recompute as extra forward work, TP/SP/CP
collectives (hidden under their GEMMs with TE userbuffers) and PP sends (hidden with interleaved 1F1B's
p2p overlap). Then the pipeline schedule (1F1B or interleaved) with uneven stages, the DP gradient
reduce-scatter and parameter all-gather (bucket by bucket under the last backward / first forward when
the overlap flags are on), the optimizer step on the GPU or on the CPU with its PCIe copies, and a
per-step overhead. ``terms.PerfTerms.breakdown`` is the step as a sum a user can check against a profile.
Formulas: reference megatron-memory-and-performance.md sections 6-8.
"""

from __future__ import annotations

import math

from attune.estimator.costs import FP32, LayerCost
from attune.spec.hardware import Cluster

from .coefficients import Coefficients

# megatron-core DistributedDataParallelConfig.bucket_size default: max(40,000,000, 1,000,000 x DP) parameters
DDP_BUCKET_MIN_PARAMS = 40_000_000
DDP_BUCKET_PARAMS_PER_DP_RANK = 1_000_000
# CPU AdamW (torch fused, fp32): reads param, grad, m, v (16 bytes) and writes param, m, v (12) per parameter
CPU_ADAM_BYTES_PER_PARAM = 28
# PCIe per offloaded parameter per step: the fp32 grad shard down and the fp32 param up (reference 4.4)
OFFLOAD_PCIE_BYTES_PER_PARAM = FP32 + FP32

PARTS = ("fwd_gemm", "fwd_attention", "fwd_gdn", "fwd_memory", "bwd_gemm", "bwd_attention", "bwd_gdn",
         "bwd_memory", "recompute", "tp_comm", "cp_comm", "pp_comm", "ep_comm", "act_offload", "moe_host")
"""Per-microbatch parts of a stage's time: compute by kind, recompute, exposed communication by kind (PCIe
activation offload traffic included: ``act_offload``), and the host launch time a MoE layer's routing sync exposes
(``moe_host``: attune.estimator.moe.host_exposed_s)."""
COMM_PARTS = ("tp_comm", "cp_comm", "pp_comm", "ep_comm", "act_offload", "moe_host")


def gemm_efficiency(min_dim: float, coef: Coefficients) -> float:
    """Fraction of peak for a GEMM whose smallest dimension is min_dim: saturates for large shapes."""
    return coef.gemm_efficiency * (1.0 - math.exp(-min_dim / coef.gemm_half_dim))


def _link_gbps(group: int, stride: int, cluster: Cluster, coef: Coefficients) -> float:
    """Achieved bandwidth per GPU for a collective over `group` ranks `stride` apart."""
    span = group * stride
    if span <= max(cluster.gpus_per_node, cluster.gpu.nvlink_domain):
        return cluster.gpu.nvlink_gbps * coef.nvlink_efficiency
    per_gpu_net = cluster.gpu.internode_gbps / cluster.gpus_per_node
    return per_gpu_net * coef.network_efficiency


def _layer_parts(c: LayerCost, peak: float, hbm: float, tp_bw: float, cp_bw: float, tp: int, tp_overlap: bool,
                 coef: Coefficients, async_dgrad: bool = True) -> dict[str, float]:
    """One layer, one microbatch: forward and backward compute by kind and exposed comm, seconds."""
    g_t = [fl / (peak * gemm_efficiency(d, coef)) if fl else 0.0 for fl, d in c.gemm]
    gemm = sum(g_t)  # MoE without a shared expert: 0
    attn = c.attn_flops / (peak * coef.attention_efficiency)
    gdn = c.gdn_flops / (peak * coef.gdn_kernel_efficiency)
    mem = coef.memory_passes * c.act_bytes / (hbm * coef.hbm_efficiency)
    per = 0.0
    if tp > 1:
        vol = (tp - 1) / tp * c.tp_coll_bytes * (2 if c.tp_allreduce else 1)
        per = vol / tp_bw + coef.collective_latency_s
    tp_f, tp_b = c.tp_coll_fwd * per, c.tp_coll_bwd * per
    if tp_overlap:
        # TE userbuffers split each TP all-gather / reduce-scatter into TP chunks pipelined with the adjacent
        # GEMM's chunks: only what the GEMMs cannot cover stays exposed (TE module/base.py, userbuffers)
        tp_f, tp_b = max(0.0, tp_f - gemm), max(0.0, tp_b - 2 * gemm)
    elif per and async_dgrad:
        # each column-parallel linear's input-gradient all-reduce / reduce-scatter runs under its own weight-gradient
        # GEMM (as many FLOPs as its forward GEMM): LayerCost.async_dgrad_gemms
        tp_b = max(0.0, tp_b - sum(min(per, g_t[i]) for i in c.async_dgrad_gemms))
    cp = c.cp_bytes / cp_bw if c.cp_bytes else 0.0
    # dgrad + wgrad: 2x the forward GEMMs; FlashAttention backward attention_backward_ratio x its forward
    return {"fwd_gemm": gemm, "fwd_attention": attn, "fwd_gdn": gdn, "fwd_memory": mem,
            "bwd_gemm": 2 * gemm, "bwd_attention": coef.attention_backward_ratio * attn, "bwd_gdn": 2 * gdn,
            "bwd_memory": coef.backward_memory_ratio * mem, "tp_fwd": tp_f, "tp_bwd": tp_b, "cp_fwd": cp,
            "cp_bwd": 2 * cp}
