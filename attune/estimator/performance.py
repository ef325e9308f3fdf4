"""Step time, tokens/s/GPU, MFU and cost of a layout, from the work each pipeline stage does.

Per microbatch and stage: GEMMs at a shape-dependent efficiency, softmax-attention and Gated DeltaNet
kernels, memory-bound elementwise work at HBM bandwidth, recompute as extra forward work, TP/SP/CP
collectives and PP sends at link bandwidth. Then the pipeline schedule (1F1B or interleaved) with uneven
stages, the DP gradient reduce-scatter and parameter all-gather, the optimizer step on the GPU or on the
CPU with its PCIe copies, and a fixed per-step overhead. Formulas: reference
megatron-memory-and-performance.md sections 6-8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .coefficients import DEFAULT, Coefficients
from attune.estimator.costs import BF16, FP32, LayerCost, Shape, layer_costs, logits_flops
from attune.estimator.metrics import model_flops_utilization, usd_per_million_tokens
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.placement import Placement, place, stage_params
from attune.spec.model import FULL, LINEAR, ModelSpec


@dataclass
class StageTime:
    stage: int
    forward_s: float  # one microbatch through all of this rank's chunks
    backward_s: float  # including recompute
    compute_s: float
    comm_s: float


@dataclass
class PerfEstimate:
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    usd_per_million_tokens: float
    pipeline_s: float
    bubble_s: float
    dp_comm_s: float
    optimizer_s: float
    overhead_s: float
    stages: list[StageTime] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "step_time_s": round(self.step_time_s, 4),
            "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 2),
            "mfu": round(self.mfu, 4),
            "usd_per_million_tokens": round(self.usd_per_million_tokens, 4),
            "breakdown_s": {
                "pipeline_s": round(self.pipeline_s, 4), "bubble_s": round(self.bubble_s, 4),
                "dp_comm_s": round(self.dp_comm_s, 4), "optimizer_s": round(self.optimizer_s, 4),
                "overhead_s": round(self.overhead_s, 4),
            },
            "stages": [{"stage": s.stage, "forward_s": round(s.forward_s, 5), "backward_s": round(s.backward_s, 5),
                        "compute_s": round(s.compute_s, 5), "comm_s": round(s.comm_s, 5)} for s in self.stages],
        }


def gemm_efficiency(min_dim: float, coef: Coefficients) -> float:
    """Fraction of peak for a GEMM whose smallest dimension is min_dim: saturates for large shapes."""
    return coef.gemm_efficiency * (1.0 - math.exp(-min_dim / coef.gemm_half_dim))


def _link_gbps(group: int, stride: int, cluster: Cluster, coef: Coefficients) -> float:
    """Achieved bandwidth per GPU for a collective over `group` ranks `stride` apart."""
    span = group * stride
    if span <= cluster.gpus_per_node:
        return cluster.gpu.nvlink_gbps * coef.nvlink_efficiency
    per_gpu_net = cluster.gpu.internode_gbps / cluster.gpus_per_node
    return per_gpu_net * coef.network_efficiency


def _layer_time(c: LayerCost, peak: float, hbm: float, tp_bw: float, cp_bw: float, tp: int,
                coef: Coefficients) -> tuple[float, float, float, float]:
    """(forward compute s, forward comm s, backward compute s, backward comm s) of one layer, one microbatch."""
    gemm = sum(fl / (peak * gemm_efficiency(d, coef)) for fl, d in c.gemm)
    attn = c.attn_flops / (peak * coef.attention_efficiency)
    gdn = c.gdn_flops / (peak * coef.gdn_kernel_efficiency)
    mem = coef.memory_passes * c.act_bytes / (hbm * coef.hbm_efficiency)
    fwd = gemm + attn + gdn + mem
    bwd = 2 * gemm + 2.5 * attn + 2 * gdn + 2 * mem  # dgrad + wgrad; FA backward does 5 GEMMs to forward's 2
    per = 0.0
    if tp > 1:
        vol = (tp - 1) / tp * c.tp_coll_bytes * (2 if c.tp_allreduce else 1)
        per = vol / tp_bw + coef.collective_latency_s
    cp = c.cp_bytes / cp_bw if c.cp_bytes else 0.0
    return fwd, c.tp_coll_fwd * per + cp, bwd, c.tp_coll_bwd * per + 2 * cp


def estimate_performance(model: ModelSpec, cluster: Cluster, layout: Layout, workload: Workload, engine: Engine,
                         coef: Coefficients = DEFAULT, placement: Placement | None = None) -> PerfEstimate:
    """Step time, throughput, MFU and cost; ``placement`` is derived here when the caller has none."""
    gpu = cluster.gpu
    if gpu.is_cpu:  # CPU BLAS reaches its peak at far smaller GEMMs than GPU tiles do
        coef = replace(coef, gemm_half_dim=coef.cpu_gemm_half_dim)
    peak = gpu.bf16_tflops * 1e12
    hbm = gpu.hbm_gbps * 1e9
    pl = placement or place(model, layout, workload, engine)
    b = pl.batch
    shape = Shape(layout.tp, layout.sp, layout.cp, b.tokens_per_gpu, workload.seq_length)
    costs = layer_costs(model, engine, shape)
    tp_bw = _link_gbps(layout.tp, 1, cluster, coef) * 1e9
    cp_bw = _link_gbps(layout.cp, layout.tp, cluster, coef) * 1e9
    times = {k: _layer_time(c, peak, hbm, tp_bw, cp_bw, layout.tp, coef) for k, c in costs.items()}
    rec_full = layout.recompute_granularity == "full"
    n_rec = layout.recompute_num_layers or 0
    p, v, m = layout.pp, layout.vpp, b.microbatches
    # PP point-to-point: one activation forward and one gradient backward per chunk boundary
    pp_bytes = BF16 * b.tokens_per_gpu * model.hidden / (layout.tp if layout.sp else 1)
    stride = layout.tp * layout.cp * layout.dp
    pp_bw = _link_gbps(2, stride, cluster, coef) * 1e9
    pp_send = pp_bytes / pp_bw + coef.collective_latency_s if p > 1 else 0.0
    stages: list[StageTime] = []
    for st in pl.stages:
        r = st.rank
        fwd = bwd = comm = 0.0
        for ch in st.chunks:
            a, n_full, n_lin = ch.start, ch.full, ch.linear
            k = min(n_rec, ch.layers) if (rec_full and layout.recompute_method == "block") else (ch.layers if rec_full else 0)
            f_rec, l_rec = model.count_types(a, a + k) if k else (0, 0)
            for kind, n, n_r in ((FULL, n_full, f_rec), (LINEAR, n_lin, l_rec)):
                if not n:
                    continue
                f_c, f_m, b_c, b_m = times[kind]
                fwd += n * (f_c + f_m)
                bwd += n * (b_c + b_m) + n_r * (f_c + f_m)  # recompute: one more forward, its collectives too
                comm += n * (f_m + b_m) + n_r * f_m
            if layout.recompute_granularity == "selective":
                sel = n_full * costs[FULL].attn_flops / (peak * coef.attention_efficiency)
                bwd += sel
            fwd += pp_send
            bwd += pp_send
            comm += 2 * pp_send
        if r == p - 1:
            fl, d = logits_flops(model, shape)
            t_gemm = fl / (peak * gemm_efficiency(d, coef))
            # softmax / log-prob / entropy over [tokens, vocab/TP] in fp32: several passes over HBM
            t_mem = coef.memory_passes * engine.logits_bytes_per_element * b.tokens_per_gpu * model.vocab / layout.tp / (
                hbm * coef.hbm_efficiency)
            fwd += t_gemm + t_mem
            bwd += 2 * t_gemm + t_mem
        if r == 0:
            fwd += BF16 * b.tokens_per_gpu * model.hidden / (hbm * coef.hbm_efficiency)  # embedding gather
        stages.append(StageTime(r, fwd, bwd, fwd + bwd - comm, comm))
    per_mb = [s.forward_s + s.backward_s for s in stages]
    slowest = max(per_mb)
    # 1F1B with uneven stages: sum over stages + (M - 1) x slowest (reference section 8.1); interleaving
    # divides the fill/drain by v.
    pipeline = m * slowest + (sum(per_mb) - slowest) / v
    bubble = pipeline - m * sum(per_mb) / p

    # DP: gradient reduce-scatter (fp32) + parameter all-gather (bf16) with the distributed optimizer, else an
    # fp32 all-reduce; over DP x CP ranks. slime does not overlap them (no --overlap-grad-reduce in its scripts).
    params = [stage_params(model, layout, st.rank, lambda kind: costs[kind].params_on_gpu, st.ranges)
              for st in pl.stages]
    d = layout.dp * layout.cp
    dp_s = 0.0
    if d > 1:
        bw = _link_gbps(d, layout.tp, cluster, coef) * 1e9
        vol = (d - 1) / d * (FP32 + BF16 if layout.distributed_optimizer else 2 * FP32)
        dp_s = max(params) * vol / bw + 2 * coef.collective_latency_s
        dp_s *= 1.0 if engine.name != "megatron" else 0.3  # Megatron recipes overlap grad reduce / param gather
    # optimizer step
    shard = max(params) / (d if layout.distributed_optimizer else 1)
    frac = layout.offload_fraction if layout.optimizer_cpu_offload else 0.0
    gpu_opt = (1 - frac) * shard * 30 / (hbm * coef.hbm_efficiency)  # Adam: ~30 bytes of HBM traffic per param
    cpu_opt = 0.0
    if frac:
        host_params = frac * sum(params) / p / (d if layout.distributed_optimizer else 1) * cluster.gpus_per_node
        # CPU AdamW over fp32 p, g, m, v: read 16 + write 12 bytes per param, the node's GPUs sharing host DRAM
        cpu_compute = host_params * 28 / (gpu.host_mem_gbps * 1e9 * coef.host_optimizer_efficiency)
        pcie = frac * shard * (FP32 + FP32) / (gpu.pcie_gbps * 1e9)  # grads down, params up
        cpu_opt = max(cpu_compute, pcie) if layout.overlap_cpu_optimizer else cpu_compute + pcie
    optimizer_s = gpu_opt + cpu_opt
    overhead = engine.step_overhead_s
    step = pipeline + dp_s + optimizer_s + overhead
    tps = workload.tokens_per_step / step / layout.world_size
    mfu = model_flops_utilization(tps, model, gpu)
    usd = usd_per_million_tokens(tps, gpu)
    return PerfEstimate(step, tps, mfu, usd, pipeline, bubble, dp_s, optimizer_s, overhead, stages)
