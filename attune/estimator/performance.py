"""Step time, tokens/s/GPU, MFU and cost of a layout, from the work each pipeline stage does.

Per microbatch and stage: GEMMs at a shape-dependent efficiency, softmax-attention and Gated DeltaNet
kernels, memory-bound elementwise work at HBM bandwidth, recompute as extra forward work, TP/SP/CP
collectives (hidden under their GEMMs with TE userbuffers) and PP sends (hidden with interleaved 1F1B's
p2p overlap). Then the pipeline schedule (1F1B or interleaved) with uneven stages, the DP gradient
reduce-scatter and parameter all-gather (bucket by bucket under the last backward / first forward when
the overlap flags are on), the optimizer step on the GPU or on the CPU with its PCIe copies, and a
per-step overhead. ``PerfEstimate.breakdown`` is the step as a sum a user can check against a profile.
Formulas: reference megatron-memory-and-performance.md sections 6-8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from attune.estimator import moe as moe_terms
from attune.estimator import offload as knob_terms
from attune.estimator import precision as lp_terms
from attune.estimator import reuse
from attune.estimator.costs import BF16, FP32, LayerCost, Shape, layer_costs, logits_flops, mtp_gemm
from attune.estimator.metrics import model_flops_utilization, usd_per_million_tokens
from attune.estimator.reuse import placement as shared_placement
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import FULL, LINEAR, ModelSpec, is_dense_kind
from attune.spec.placement import Placement, StagePlacement, mtp_kind, stage_params

from .coefficients import Coefficients, peak_ratio

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


@dataclass
class StageTime:
    stage: int
    forward_s: float  # one microbatch through all of this rank's chunks
    backward_s: float  # including recompute
    compute_s: float
    comm_s: float
    parts: dict[str, float] = field(default_factory=dict)
    """One microbatch's time by PARTS, seconds; sums to forward_s + backward_s."""


@dataclass
class StepBreakdown:
    """The step as a sum of terms a profile shows, on the pipeline stage that sets the pace."""

    critical_stage: int
    """The stage with the longest per-microbatch time."""
    microbatches: int
    """Microbatches per step per DP rank."""
    compute_s: dict[str, float]
    """Critical stage, all microbatches: fwd_/bwd_ gemm, attention, gdn, memory and recompute, seconds."""
    exposed_comm_s: dict[str, float]
    """Communication not hidden under compute: tp, cp, pp (critical stage, all microbatches) and dp, seconds."""
    bubble_s: float
    """Pipeline fill and drain (and waiting on slower stages), seconds."""
    optimizer_s: float
    """Optimizer step on the GPU and/or the CPU with its copies, seconds."""
    overhead_s: float
    """The engine's per-step overhead outside forward/backward, seconds."""

    @property
    def total_s(self) -> float:
        return (sum(self.compute_s.values()) + sum(self.exposed_comm_s.values()) + self.bubble_s + self.optimizer_s
                + self.overhead_s)

    def to_dict(self) -> dict:
        return {"critical_stage": self.critical_stage, "microbatches": self.microbatches,
                "compute_s": {k: round(v, 5) for k, v in self.compute_s.items()},
                "exposed_comm_s": {k: round(v, 5) for k, v in self.exposed_comm_s.items()},
                "bubble_s": round(self.bubble_s, 5), "optimizer_s": round(self.optimizer_s, 5),
                "overhead_s": round(self.overhead_s, 5), "total_s": round(self.total_s, 5)}


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
    breakdown: StepBreakdown | None = None

    def to_dict(self) -> dict:
        out = {
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
                        "compute_s": round(s.compute_s, 5), "comm_s": round(s.comm_s, 5),
                        "parts_s": {k: round(v, 6) for k, v in s.parts.items()}} for s in self.stages],
        }
        if self.breakdown is not None:
            out["step"] = self.breakdown.to_dict()
        return out


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


def _mtp_parts(parts: dict[str, float], st: StagePlacement, model: ModelSpec, layout: Layout, engine: Engine,
               costs: dict[str, LayerCost], times: dict[str, dict], moe_t: dict[str, float], shape: Shape,
               peak: float, hbm: float, coef: Coefficients) -> None:
    """Add the last stage's multi-token-prediction layers to its per-microbatch ``parts``: per layer one
    transformer layer of the last layer's kind (its routed experts too), eh_proj and the shared output layer
    again (GEMMs), the MTP loss's softmax over the fp32 logits (HBM passes), recompute as for a decoder layer.
    MFU stays on the main model's active parameters (``ModelSpec.active_params``): the MTP work is overhead."""
    n, mk = st.mtp, mtp_kind(model)
    t = times[mk]
    for key in ("gemm", "attention", "gdn", "memory"):
        parts["fwd_" + key] += n * t["fwd_" + key]
        parts["bwd_" + key] += n * t["bwd_" + key]
    # full recompute: megatron-core 0.16.1 checkpoints the MTP layer with the uniform method only (block: skipped)
    rec_full = layout.recompute_granularity == "full" and layout.recompute_method == "uniform"
    fwd_layer = t["fwd_gemm"] + t["fwd_attention"] + t["fwd_gdn"] + t["fwd_memory"]
    if rec_full:
        parts["recompute"] += n * fwd_layer
    elif layout.recompute_granularity == "selective":
        parts["recompute"] += n * knob_terms.recompute_seconds(costs[mk], t, mk, layout, model, engine, moe_t or None)
    parts["tp_comm"] += n * ((2 if rec_full else 1) * t["tp_fwd"] + t["tp_bwd"])
    parts["cp_comm"] += n * ((2 if rec_full else 1) * t["cp_fwd"] + t["cp_bwd"])
    if moe_t and st.mtp_moe:
        for key in ("gemm", "memory"):
            parts["fwd_" + key] += st.mtp_moe * moe_t["fwd_" + key]
            parts["bwd_" + key] += st.mtp_moe * moe_t["bwd_" + key]
        if rec_full:
            parts["recompute"] += st.mtp_moe * (moe_t["fwd_gemm"] + moe_t["fwd_memory"])
        parts["ep_comm"] += st.mtp_moe * ((2 if rec_full else 1) * moe_t["ep_fwd"] + moe_t["ep_bwd"])
    g_eh, g_out = (fl / (peak * gemm_efficiency(d, coef)) if fl else 0.0 for fl, d in mtp_gemm(model, shape))
    g = g_eh + g_out
    if rec_full:  # eh_proj is inside the checkpoint too
        parts["recompute"] += n * g_eh
    # vocab_parallel_cross_entropy over the fp32 [tokens, vocab / TP] logits: memory_passes over HBM
    mem = coef.memory_passes * FP32 * shape.tokens * model.vocab / shape.tp / (hbm * coef.hbm_efficiency)
    parts["fwd_gemm"] += n * g
    parts["bwd_gemm"] += 2 * n * g
    parts["fwd_memory"] += n * mem
    parts["bwd_memory"] += n * mem


_TIMES: dict[tuple, tuple[dict, dict]] = {}
"""Per-layer times by (layer costs, peak, bandwidths, TP, overlap, coefficients): the search estimates many
layouts sharing a (model, engine, shape), so each layer kind is timed once per shape and link speed."""


def _pipeline(model: ModelSpec, cluster: Cluster, layout: Layout, workload: Workload, engine: Engine,
              coef: Coefficients, pl: Placement) -> tuple:
    """The pipeline part of the step: (per-stage StageTime list, critical stage, pipeline seconds, bubble seconds,
    layer costs, routed-expert times, low-precision plan, parameters per stage on one GPU). Reads no optimizer /
    DP-overlap field of the layout (``reuse.OPTIMIZER_FIELDS``), so layouts differing only there share it."""
    gpu = cluster.gpu
    peak = gpu.bf16_tflops * 1e12 * peak_ratio(gpu, coef)
    hbm = gpu.hbm_gbps * 1e9
    b = pl.batch
    shape = Shape(layout.tp, layout.sp, layout.cp, b.tokens_per_gpu, workload.seq_length)
    costs = layer_costs(model, engine, shape)
    tp_bw = _link_gbps(layout.tp, 1, cluster, coef) * 1e9
    cp_bw = _link_gbps(layout.cp, layout.tp, cluster, coef) * 1e9
    tp_overlap = layout.tp > 1 and layout.sp and (layout.tp_comm_overlap or engine.recipe_tp_comm_overlap)
    key = (id(costs), peak, hbm, tp_bw, cp_bw, layout.tp, tp_overlap, coef, engine.async_dgrad)
    hit = _TIMES.get(key)
    if hit is None or hit[0] is not costs:  # the held reference makes an id reused after eviction a miss
        if len(_TIMES) > 8192:
            _TIMES.clear()
        hit = _TIMES[key] = (costs, {k: _layer_parts(c, peak, hbm, tp_bw, cp_bw, layout.tp, tp_overlap, coef,
                                                     engine.async_dgrad) for k, c in costs.items()})
    times = hit[1]
    moe_t = moe_terms.moe_layer_times(model, cluster, layout, shape, coef)  # routed experts per MoE layer; {} if dense
    lp = lp_terms.plan(layout, gpu, coef)  # low-precision GEMMs and their quantize passes (issue 22)
    if lp is not None:
        times = lp_terms.layer_times(times, costs, engine, lp, peak, hbm, coef, layout.tp, tp_bw, tp_overlap)
        moe_t = lp_terms.moe_times(moe_t, model, layout, shape, lp, peak, hbm, coef,
                                   lp_terms.fused_grouped_mlp(lp, engine))
    rec_full = layout.recompute_granularity == "full"
    n_rec = layout.recompute_num_layers or 0
    p, v, m = layout.pp, layout.vpp, b.microbatches
    # PP point-to-point: one activation forward and one gradient backward per chunk boundary
    scatter = layout.tp > 1 and not layout.sp and engine.p2p_scatter_gather
    pp_bytes = BF16 * b.tokens_per_gpu * model.hidden / (layout.tp if (layout.sp or scatter) else 1)
    stride = layout.tp * layout.cp * layout.dp
    pp_bw = _link_gbps(2, stride, cluster, coef) * 1e9
    pp_send = pp_bytes / pp_bw + coef.collective_latency_s if p > 1 else 0.0
    if scatter and p > 1:  # the receiver all-gathers the TP slices back into the full tensor
        pp_send += (layout.tp - 1) * pp_bytes / tp_bw + coef.collective_latency_s
    if v > 1 and engine.overlap_p2p_interleaved:
        # interleaved 1F1B posts its sends/receives asynchronously under the next chunk's compute: what stays
        # exposed per chunk boundary is a fitted fraction (coefficients.py)
        pp_send *= coef.interleaved_p2p_exposed
    stages: list[StageTime] = []
    for st in pl.stages:
        r = st.rank
        parts = dict.fromkeys(PARTS, 0.0)
        for ch in st.chunks:
            a = ch.start
            # (kind, layers) of the chunk: FULL / SLIDING / LINEAR and the dense-MLP kinds of MoE models
            kinds = ch.kinds or tuple((kk, n) for kk, n in ((FULL, ch.full), (LINEAR, ch.linear)) if n)
            k = min(n_rec, ch.layers) if (rec_full and layout.recompute_method == "block") else (ch.layers if rec_full else 0)
            rec = dict(model.count_kinds(a, a + k)) if k else {}
            for kind, n in kinds:
                n_r = rec.get(kind, 0)
                t = times[kind]
                for key in ("gemm", "attention", "gdn", "memory"):
                    parts["fwd_" + key] += n * t["fwd_" + key]
                    parts["bwd_" + key] += n * t["bwd_" + key]
                # recompute: one more forward of the recomputed layers, their collectives too
                parts["recompute"] += n_r * (t["fwd_gemm"] + t["fwd_attention"] + t["fwd_gdn"] + t["fwd_memory"])
                parts["tp_comm"] += (n + n_r) * t["tp_fwd"] + n * t["tp_bwd"]
                parts["cp_comm"] += (n + n_r) * t["cp_fwd"] + n * t["cp_bwd"]
            if moe_t and ch.moe:  # the routed experts of the chunk's MoE layers (not its dense-MLP layers)
                k_moe = model.count_moe(a, a + k) if k else 0
                for key in ("gemm", "memory"):
                    parts["fwd_" + key] += ch.moe * moe_t["fwd_" + key]
                    parts["bwd_" + key] += ch.moe * moe_t["bwd_" + key]
                parts["recompute"] += k_moe * (moe_t["fwd_gemm"] + moe_t["fwd_memory"])
                # microbatches the a2a overlap cannot pair run their dispatch / combine alone (moe.ep_overlap_unpaired)
                u = moe_terms.ep_overlap_unpaired(layout, m, r)
                ep_f, ep_b = ((1 - u) * moe_t["ep_" + d] + u * moe_t["ep_" + d + "_alone"] for d in ("fwd", "bwd"))
                parts["ep_comm"] += (ch.moe + k_moe) * ep_f + ch.moe * ep_b
                # the host launch time a MoE layer's routing sync exposes (attune.estimator.moe.host_exposed_s)
                mk = [(kk, n) for kk, n in kinds if not is_dense_kind(kk)] or list(kinds)
                dense_fwd = sum(n * sum(times[kk][x] for x in ("fwd_gemm", "fwd_attention", "fwd_gdn", "fwd_memory",
                                                               "tp_fwd", "cp_fwd")) for kk, n in mk) / max(1, sum(n for _, n in mk))
                gpu_fwd = dense_fwd + moe_t["fwd_gemm"] + moe_t["fwd_memory"] + moe_t["ep_fwd"]
                parts["moe_host"] += ch.moe * moe_terms.host_exposed_s(gpu_fwd, engine, coef,
                                                                       model.moe.experts / layout.ep)
            if layout.recompute_granularity == "selective":
                # the recomputed modules' forward re-run in backward (core_attn by default; attune.estimator.offload)
                for kind, n in kinds:  # the full kind: MoE and dense-MLP layers take different modules
                    parts["recompute"] += n * knob_terms.recompute_seconds(costs[kind], times[kind], kind, layout, model,
                                                                           engine, moe_t or None)
            if layout.offload_modules:
                # offloaded: the layers that keep their activations (not the recomputed ones); the routed experts'
                # tensors (expert_fc1, moe_act) are named by attune.estimator.moe
                off_costs = moe_terms.with_expert_activations(costs, model, layout, shape)
                off_b = sum((n - rec.get(kind, 0)) * knob_terms.offloaded_bytes(off_costs[kind], kind, layout,
                                                                               model, engine) for kind, n in kinds)
                fwd_c = sum(n * (times[kind]["fwd_gemm"] + times[kind]["fwd_attention"] + times[kind]["fwd_gdn"]
                                 + times[kind]["fwd_memory"]) for kind, n in kinds)
                bwd_c = sum(n * (times[kind]["bwd_gemm"] + times[kind]["bwd_attention"] + times[kind]["bwd_gdn"]
                                 + times[kind]["bwd_memory"]) for kind, n in kinds)
                parts["act_offload"] += knob_terms.offload_exposed_seconds(off_b, fwd_c, bwd_c, cluster.gpu.pcie_gbps)
            parts["pp_comm"] += 2 * pp_send
        if r == p - 1 and model.vocab:  # a row counting the transformer layers only has no output layer
            fl, d = logits_flops(model, shape)
            t_gemm = fl / (peak * gemm_efficiency(d, coef))
            # softmax / log-prob / entropy over [tokens, vocab/TP] in fp32: several passes over HBM
            t_mem = coef.memory_passes * engine.logits_bytes_per_element * b.tokens_per_gpu * model.vocab / layout.tp / (
                hbm * coef.hbm_efficiency)
            parts["fwd_gemm"] += t_gemm
            parts["fwd_memory"] += t_mem
            parts["bwd_gemm"] += 2 * t_gemm
            parts["bwd_memory"] += t_mem
        if st.mtp:
            _mtp_parts(parts, st, model, layout, engine, costs, times, moe_t, shape, peak, hbm, coef)
        if r == 0:
            parts["fwd_memory"] += BF16 * b.tokens_per_gpu * model.hidden / (hbm * coef.hbm_efficiency)  # embedding
        fwd = sum(parts[k] for k in PARTS if k.startswith("fwd_")) + sum(
            times[kind]["tp_fwd"] * n + times[kind]["cp_fwd"] * n
            for ch in st.chunks for kind, n in (ch.kinds or ((FULL, ch.full), (LINEAR, ch.linear))) if n
        ) + pp_send * len(st.chunks)
        total = sum(parts.values())
        comm = sum(parts[k] for k in COMM_PARTS)
        stages.append(StageTime(r, fwd, total - fwd, total - comm, comm, parts))
    per_mb = [s.forward_s + s.backward_s for s in stages]
    slowest = max(per_mb)
    crit = per_mb.index(slowest)
    # 1F1B with uneven stages: sum over stages + (M - 1) x slowest (reference section 8.1); interleaving
    # divides the fill/drain by v.
    pipeline = m * slowest + (sum(per_mb) - slowest) / v
    # the one bubble: the pipeline's fill and drain beyond the critical stage's own work, so that the step is
    # exactly the sum --explain prints (m x the critical stage's parts + bubble + DP + optimizer + overhead)
    bubble = pipeline - m * slowest
    params = [stage_params(model, layout, st.rank, lambda kind: costs[kind].params_on_gpu, st.ranges)
              for st in pl.stages]
    return stages, crit, pipeline, bubble, costs, moe_t, lp, params


def estimate_performance(model: ModelSpec, cluster: Cluster, layout: Layout, workload: Workload, engine: Engine,
                         coef: Coefficients, placement: Placement | None = None) -> PerfEstimate:
    """Step time, throughput, MFU and cost (the scalar composition: ``estimate_batch``'s rows that ``scalar_rows``
    sends here); ``placement`` is derived here when the caller has none. ``coef`` as ``estimate_batch`` chose it."""
    gpu = cluster.gpu
    if gpu.is_cpu:  # CPU BLAS reaches its peak at far smaller GEMMs than GPU tiles do
        coef = replace(coef, gemm_half_dim=coef.cpu_gemm_half_dim)
    hbm = gpu.hbm_gbps * 1e9
    pl = placement or shared_placement(model, layout, workload, engine)
    b = pl.batch
    stages, crit, pipeline, bubble, costs, moe_t, lp, params = reuse.shared(
        "pipeline", _pipeline, (model, cluster, layout, workload, engine, coef, pl), layout,
        reuse.OPTIMIZER_FIELDS)
    p, m = layout.pp, b.microbatches

    # DP over DP x CP ranks: gradient reduce-scatter in the grad dtype + parameter all-gather in bf16 with the
    # distributed optimizer, else an all-reduce of the grads. Without the overlap flags both run after the
    # last backward (finalize_model_grads) and before the next forward; with --overlap-grad-reduce the buckets
    # are reduced as the last microbatch's backward produces them (and, on stages after the first, during the
    # pipeline drain: megatron-core disables bucketing there since it is off the critical path), with
    # --overlap-param-gather the all-gathers run under the first forward (distributed_data_parallel.py).
    d = layout.dp * layout.cp
    # MoE layers per stage (an MoE-kind MTP layer's too): the expert terms count these only
    st_layers = [st.moe_layers + st.mtp_moe for st in pl.stages]
    # the grad buffer's dtype (memory.py): fp32 main grads on Megatron-LM's bf16 path, 16-bit with fp16 or where
    # the engine reduces in bf16 (Megatron-Bridge / NeMo performance launches)
    fp16_grads = layout.precision == "fp16" and not engine.fp16_grads_in_fp32
    grad_bytes = BF16 if (fp16_grads or not engine.grad_reduce_in_fp32) else FP32
    ov_grad = layout.overlap_grad_reduce or engine.recipe_overlap_grad_reduce
    ov_param = (layout.overlap_param_gather or engine.recipe_overlap_param_gather) and layout.distributed_optimizer
    dp_s = 0.0
    if d > 1:
        bw = _link_gbps(d, layout.tp, cluster, coef) * 1e9
        bucket = max(DDP_BUCKET_MIN_PARAMS, DDP_BUCKET_PARAMS_PER_DP_RANK * d)
        drain = 0.0
        for i, st in enumerate(stages):
            n_buckets = max(1.0, params[i] / bucket)
            if layout.distributed_optimizer:
                t_rs = params[i] * (d - 1) / d * grad_bytes / bw + coef.collective_latency_s
                t_ag = params[i] * (d - 1) / d * lp_terms.param_gather_bytes(layout) / bw + coef.collective_latency_s
            else:
                t_rs, t_ag = 2 * params[i] * (d - 1) / d * grad_bytes / bw + coef.collective_latency_s, 0.0
            if ov_grad:
                t_rs = max(t_rs - st.backward_s - drain, t_rs / n_buckets)
            if ov_param:
                t_ag = max(t_ag - st.forward_s, t_ag / n_buckets)
            dp_s = max(dp_s, t_rs + t_ag + moe_terms.expert_dp_comm_s(model, cluster, layout, st_layers[i], grad_bytes, coef))
            drain += st.backward_s
    # optimizer step on the GPU: HBM traffic per parameter of the shard: read the grad, read and write the
    # master (or its 16-bit remainder), m and v, write the bf16 param (Adam: 4 + 2 x 12 + 2 = 30 bytes for the
    # default bf16 path)
    shard = max(params) / (d if layout.distributed_optimizer else 1)
    if model.moe is not None:  # the routed experts' shard over the expert data-parallel group
        shard += moe_terms.stage_expert_params(model, layout, max(st_layers)) / (
            moe_terms.expert_data_parallel(layout) if layout.distributed_optimizer else 1)
    frac = layout.offload_fraction if layout.optimizer_cpu_offload else 0.0
    if layout.precision_aware_optimizer:
        states, g = BF16 + 2 * FP32, FP32  # 16-bit master remainder, fp32 m and v (Megatron's defaults)
    else:
        states, g = 3 * FP32, grad_bytes
    gpu_opt = (1 - frac) * shard * (g + 2 * states + BF16) / (hbm * coef.hbm_efficiency)
    cpu_opt = 0.0
    if frac:
        host_params = frac * sum(params) / p / (d if layout.distributed_optimizer else 1) * cluster.gpus_per_node
        # CPU AdamW over fp32 p, g, m, v, the node's GPUs sharing host DRAM
        cpu_compute = host_params * CPU_ADAM_BYTES_PER_PARAM / (gpu.host_mem_gbps * 1e9 * coef.host_optimizer_efficiency)
        pcie = frac * shard * OFFLOAD_PCIE_BYTES_PER_PARAM / (gpu.pcie_gbps * 1e9)
        cpu_opt = max(cpu_compute, pcie) if layout.overlap_cpu_optimizer else cpu_compute + pcie
    optimizer_s = gpu_opt + cpu_opt
    if lp is not None:  # the weights cast to the recipe once per step
        optimizer_s += lp_terms.weight_cast_seconds(lp, max(params) + (shard if model.moe is not None else 0.0), hbm, coef)
    overhead = getattr(coef, engine.step_overhead)
    step = pipeline + dp_s + optimizer_s + overhead
    tps = workload.tokens_per_step / step / layout.world_size
    mfu = model_flops_utilization(tps, model, gpu)
    usd = usd_per_million_tokens(tps, gpu)
    cp_ = stages[crit].parts
    breakdown = StepBreakdown(
        critical_stage=stages[crit].stage, microbatches=m,
        compute_s={k: m * cp_[k] for k in PARTS if k not in COMM_PARTS},
        exposed_comm_s={"tp": m * cp_["tp_comm"], "cp": m * cp_["cp_comm"], "pp": m * cp_["pp_comm"],
                        **({"ep": m * cp_["ep_comm"], "moe_host": m * cp_["moe_host"]} if moe_t else {}),
                        **({"act_offload": m * cp_["act_offload"]} if layout.offload_modules else {}), "dp": dp_s},
        bubble_s=bubble, optimizer_s=optimizer_s, overhead_s=overhead)
    return PerfEstimate(step, tps, mfu, usd, pipeline, bubble, dp_s, optimizer_s, overhead, list(stages), breakdown)
