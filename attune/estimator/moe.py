"""Memory and time terms of the routed experts of an MoE layer, per pipeline stage and microbatch.

The dense part of an MoE layer (attention or Gated DeltaNet, the pre-MLP norm, the router's input, the
shared expert: ``ModelSpec.ffn`` is its width) is costed by ``attune.estimator.costs`` like any layer; this
module adds what the routed experts bring (megatron-core ``MoELayer``: router -> token dispatcher ->
``GroupedMLP`` / ``TEGroupedMLP`` -> combine; megatron/core/transformer/moe/):

* memory: expert weights, gradients and optimizer states sharded by EP x ETP, their optimizer states by
  the expert data-parallel group (world / (PP x EP x ETP)); the tensors the routed tokens save (the
  permuted expert input, fc1 output, SwiGLU output, the expert output kept for the probability-weighted
  combine), the router's logits and softmax in the router dtype, the permutation maps, and the
  all-to-all send / receive buffers alive during dispatch and combine in the backward working set.
* time: the expert GEMMs at the efficiency of their per-expert shape (tokens per local expert is small:
  where MoE loses MFU) and of their widths padded to whole output tiles (``tile_utilisation``), times a
  grouped-GEMM factor (a loop of per-expert GEMMs without ``--moe-grouped-gemm``), the router GEMM and
  softmax/top-k, permutation passes over HBM (with GPT-OSS's expert-bias path and clamped gate), the dispatch and
  combine all-to-all over NVLink inside a node and the network across nodes, the shared expert overlapped
  with the all-to-all when ``--moe-shared-expert-overlap`` says so.
"""

from __future__ import annotations

import math
from dataclasses import replace

from attune.estimator.coefficients import peak_ratio
from attune.estimator.costs import BF16, FP32, LayerCost, Saved, Shape
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout
from attune.spec.model import ModelSpec, is_dense_kind
from attune.spec.moe import expert_data_parallel

DROPLESS_IMBALANCE = 1.25
"""Routed tokens on the busiest EP rank over the mean, dropless routing with EP > 1 [unverified assumption:
slime's MoE scripts set --moe-aux-loss-coeff 0, so nothing balances the load during SFT; megatron-core's
dropless GroupedMLP sizes its buffers by the tokens actually received (moe/token_dispatcher.py), so the
busiest rank sets the step's pace and peak]. 1.0 with EP 1 (one rank holds every expert)."""

ROUTER_BYTES = {"fp32": FP32, "fp64": 8, None: BF16}
"""Bytes per router logit by ``--moe-router-dtype`` (absent: the model dtype)."""

INT32 = 4  # bytes of one permutation-map entry (row_id_map, int32: moe/moe_utils.py permute)

ALLTOALL_SORT_PASSES = 4
"""HBM passes over the routed tokens' hidden states the alltoall dispatcher adds with more than one local expert:
``sort_chunks_by_idxs`` after the dispatch all-to-all (by local expert) and again before the combine (back by
source rank), each reading and writing every row (Megatron-LM 1dcf0daf moe/token_dispatcher.py lines 734-740 and
769-774); the flex dispatcher's DeepEP / HybridEP kernels permute once, in its permute step."""

EP_OVERLAP_SM_SHARE = 20 / 132
"""Fraction of the GPU's SMs the dispatch / combine kernels hold while they run under compute
(--overlap-moe-expert-parallel-comm): DeepEP's normal kernels take ``moe_deepep_num_sms`` = 20 by default
(Megatron-LM 1dcf0daf transformer_config.py line 734) of an H100's 132; the overlapped compute runs that much
slower. NCCL's all-to-all channels and HybridEP (16 SMs by default, line 737) hold a similar share."""

EXPERT_BIAS_BYTES = 2 + 4 + 4 + 4 + 4 + 4 + 4 + 2
"""HBM bytes per element of the experts' fc2 output that megatron-core's bias path moves in forward, experts with
biases only (GPT-OSS): ``TEGroupedMLP._apply_bias`` (Megatron-LM 1dcf0daf megatron/core/transformer/moe/experts.py
lines 626-643) splits the output by expert and adds bias x probability in a Python loop: read the bf16 output (2),
write and read the fp32 bias x prob product (4 + 4), write the fp32 sum (4), torch.cat reads and writes it (4 + 4),
the cast to bf16 reads fp32 and writes bf16 (4 + 2). Backward moves ``backward_memory_ratio`` times that."""

ACTIVATION_CLAMP_BYTES = 2 + 2 + 2 + 2
"""HBM bytes per element of the experts' fc1 output (2 x ffn wide) that a clamped gated activation (GPT-OSS:
``MoESpec.activation_clamp``) adds in forward: megatron-core clamps the two halves outside the fused kernel, each
read and written once in bf16 (2 + 2), and concatenates them again before ``WeightedBiasQuickGeGLUFunction``
(read and write, 2 + 2) (Megatron-LM 1dcf0daf megatron/core/fusions/fused_bias_geglu.py lines 424-432,
``weighted_bias_quick_geglu_impl``, called from moe/experts.py lines 706-722; the unfused path, lines 737-745, clamps
without the cat but runs the gate unfused; Megatron-Bridge's GPT-OSS provider takes the fused path with the clamp:
v0.2.0-v0.3.0 models/gpt_oss/gpt_oss_provider.py lines 81-84, v0.5.1 gpt_oss_bridge.py lines 73 and 83). Backward moves ``backward_memory_ratio`` times that (clamp's masked
gradients and chunk's cat); ``moe_act`` recompute runs it again."""

EXPERT_GEMM_TILE = {"blackwell": (256, 256), "hopper": (128, 256), "ampere": (128, 256)}
"""Output tile (rows over tokens, columns over the weight's output features) of the grouped expert GEMMs per GPU
generation: Blackwell's 2-SM UMMA tiles 256 x 256 (tcgen05 cta_group::2, CUTLASS sm100 grouped-GEMM defaults),
Hopper's wgmma 128 x 256 (CUTLASS sm90 / cuBLASLt bf16 defaults), Ampere's 128 x 256 [kernel defaults; the exact
tile a library heuristic picks may differ]. A dimension that is not a multiple of its tile edge computes the padded
remainder: ``tile_utilisation``."""

# The MoE kernels' coefficients (grouped GEMM, all-to-all, permutation) are ``Coefficients`` fields marked
# ``moe`` (attune.estimator.coefficients): one set shared with dense models, fitted to the MoE corpus rows.


def imbalance(layout: Layout) -> float:
    """The busiest EP rank's routed tokens over the mean: DROPLESS_IMBALANCE with EP > 1, capped by the
    capacity factor when tokens are dropped."""
    f = DROPLESS_IMBALANCE if layout.ep > 1 and not layout.moe_force_balance else 1.0
    if layout.moe_capacity_factor is not None:
        f = min(f, layout.moe_capacity_factor)
    return f


def local_tokens(layout: Layout, shape: Shape) -> float:
    """Tokens one GPU routes per microbatch: the sequence-parallel shard under SP (megatron-core routes
    the SP-sharded hidden states), the whole microbatch without it."""
    return shape.tokens / (shape.tp if shape.sp else 1)


def routed_tokens(layout: Layout, shape: Shape, top_k: int) -> float:
    """Token-expert pairs one GPU's experts process per microbatch: local tokens x top-k, gathered over the
    ETP group (each ETP rank computes its slice of every token's expert), on the busiest rank."""
    return local_tokens(layout, shape) * top_k * layout.etp * imbalance(layout)


# ---------------------------------------------------------------------- memory
def with_expert_activations(costs: dict[str, LayerCost], model: ModelSpec, layout: Layout, shape: Shape,
                            router_dtype: str | None = "fp32") -> dict[str, LayerCost]:
    """Each MoE layer kind's cost with the routed experts' saved tensors and backward working set added (so the
    recompute rules in memory.py cover them); the dense-MLP kinds of an MoE model (``DENSE``) and dense models
    come back unchanged."""
    moe = model.moe
    if moe is None:
        return costs
    h, f = model.hidden, moe.expert_ffn / layout.etp
    R = routed_tokens(layout, shape, moe.top_k)
    t = local_tokens(layout, shape)
    saved = (
        Saved("router logits and softmax probabilities (router dtype; TopKRouter)", 2 * t * moe.experts
              * ROUTER_BYTES.get(router_dtype, FP32)),
        Saved("permutation maps (int32 row_id_map per routed token)", R * INT32),
        Saved("permuted expert input (grouped fc1 GEMM input, bf16)", R * BF16 * h),
        Saved("expert fc1 output = SwiGLU input (bf16)", R * BF16 * 2 * f),
        Saved("expert SwiGLU output = fc2 input (bf16)", R * BF16 * f),
        Saved("expert output kept for the probability-weighted combine (bf16)", R * BF16 * h),
    )
    # backward: the all-to-all send and receive buffers of the combine gradient and the dispatch, plus the
    # expert MLP's own gradients d(fc2 input), d(fc1 output)
    work = 2 * R * BF16 * h + R * BF16 * 3 * f
    return {k: c if is_dense_kind(k) else replace(c, saved=c.saved + saved, bwd_work_bytes=max(c.bwd_work_bytes, work))
            for k, c in costs.items()}


def expert_activation_bytes(model: ModelSpec, layout: Layout, shape: Shape, router_dtype: str | None = "fp32") -> float:
    """Bytes one MoE layer's routed part saves per microbatch (what ``with_expert_activations`` adds)."""
    if model.moe is None:
        return 0.0
    probe = {"x": LayerCost(saved=(), input_bytes=0.0, bwd_work_bytes=0.0, gemm=(), attn_flops=0.0, gdn_flops=0.0,
                            tp_coll_fwd=0, tp_coll_bwd=0, tp_coll_bytes=0.0, tp_allreduce=False, cp_bytes=0.0,
                            params_on_gpu=0.0)}
    return with_expert_activations(probe, model, layout, shape, router_dtype)["x"].act_bytes


def expert_params_per_layer(model: ModelSpec, layout: Layout) -> float:
    """Routed-expert parameters of one layer on one GPU: all experts / (EP x ETP)."""
    if model.moe is None:
        return 0.0
    return model.moe.routed_params(model.hidden) / (layout.ep * layout.etp)


def stage_expert_params(model: ModelSpec, layout: Layout, layers: int) -> float:
    """Routed-expert parameters one GPU of a stage holding ``layers`` MoE layers keeps (the stage's MoE layers
    only: ``StagePlacement.moe_layers``; a dense layer of an MoE model holds no experts)."""
    return layers * expert_params_per_layer(model, layout)


def expert_layout(layout: Layout) -> Layout:
    """The layout as the expert optimizer sees it: its states sharded over the expert data-parallel group
    instead of DP x CP (megatron-core builds a separate distributed optimizer over expert-DP)."""
    return replace(layout, dp=expert_data_parallel(layout), cp=1)


# ---------------------------------------------------------------------- time
def _gemm_eff(min_dim: float, coef) -> float:
    return coef.gemm_efficiency * (1.0 - math.exp(-min_dim / coef.gemm_half_dim))


def tile_utilisation(tokens: float, h: int, f: int, generation: str) -> float:
    """Useful over computed FLOPs of one local expert's six GEMMs (fc1 / fc2 forward, their input gradients and
    weight gradients), each output padded up to whole tiles (``EXPERT_GEMM_TILE``): tokens x 2f, tokens x h; tokens x
    h, tokens x f; h x 2f, f x h. Experts whose widths are multiples of 256 (DeepSeek-V3, Qwen3) lose only the token
    remainder; GPT-OSS's 2,880 pads to 3,072 on 256-wide tiles."""
    tm, tn = EXPERT_GEMM_TILE.get(generation, (128, 128))

    def pad(x: float, t: int) -> float:
        return math.ceil(x / t) * t / x if x > 0 else 1.0

    m = max(tokens, 1.0)
    # (FLOPs weight of the GEMM, padded / useful), FLOPs per expert = 2 m h f x {2, 1} per pass
    gemms = ((2, pad(m, tm) * pad(2 * f, tn)), (1, pad(m, tm) * pad(h, tn)),  # forward
             (2, pad(m, tm) * pad(h, tn)), (1, pad(m, tm) * pad(f, tn)),  # input gradients
             (2, pad(h, tm) * pad(2 * f, tn)), (1, pad(f, tm) * pad(h, tn)))  # weight gradients
    return sum(w for w, _ in gemms) / sum(w * p for w, p in gemms)


def _link_gbps(span: int, cluster: Cluster, coef) -> float:
    if span <= max(cluster.gpus_per_node, cluster.gpu.nvlink_domain):
        return cluster.gpu.nvlink_gbps * coef.nvlink_efficiency
    return cluster.gpu.internode_gbps / cluster.gpus_per_node * coef.network_efficiency


def hit_fraction(experts: int, top_k: int, held: float) -> float:
    """Probability that a token's top-k (distinct) experts include at least one of ``held`` given experts,
    routing uniform over the experts (force-balanced, or balanced on average): 1 - C(E - held, k) / C(E, k)."""
    if held >= experts:
        return 1.0
    miss = 1.0
    for i in range(top_k):
        miss *= max(0.0, (experts - held - i) / (experts - i))
    return 1.0 - miss


def ep_domain_ranks(layout: Layout, cluster: Cluster) -> int:
    """EP ranks of one expert group inside one NVLink domain (the node, or the NVL rack): Megatron's expert rank
    order is tp-ep-dp-pp with tp = ETP, so an EP group is EP ranks ETP apart."""
    span = max(cluster.gpus_per_node, cluster.gpu.nvlink_domain)
    return max(1, min(layout.ep, span // layout.etp))


def dispatch_bytes(model: ModelSpec, layout: Layout, cluster: Cluster, shape: Shape) -> tuple[float, float]:
    """(NVLink bytes, network bytes) one GPU sends in one dispatch (the combine sends the same back), per
    microbatch and MoE layer.

    * alltoall / allgather-free dispatchers send one row per routed token copy (token x top-k; megatron-core
      ``MoEAlltoAllTokenDispatcher`` permutes by expert, moe/token_dispatcher.py): a fraction (EP - 1) / EP leaves
      the GPU, the part to ranks outside the NVLink domain over the node's NICs.
    * flex (DeepEP / HybridEP, moe/fused_a2a.py): one row per token and destination rank holding any of its experts
      (``is_token_in_rank``), and across nodes one row per destination node over RDMA, forwarded inside the node
      over NVLink (DeepEP docs/legacy.md "Normal kernels with NVLink and RDMA forwarding").
    * allgather: every rank gathers the tokens of the EP x ETP group and reduce-scatters the outputs.
    """
    moe, h = model.moe, model.hidden
    t = local_tokens(layout, shape)
    row = BF16 * h
    ep, local = layout.ep, ep_domain_ranks(layout, cluster)
    group = layout.ep * layout.etp
    if layout.moe_dispatcher in (None, "allgather"):
        vol = (group - 1) * t * row
        off = (group - max(1, min(group, max(cluster.gpus_per_node, cluster.gpu.nvlink_domain)))) / max(1, group - 1)
        return vol * (1 - off), vol * off
    imb = imbalance(layout)
    if layout.moe_dispatcher == "flex":
        p_rank = hit_fraction(moe.experts, moe.top_k, moe.experts / ep)
        nodes = ep // local
        p_node = hit_fraction(moe.experts, moe.top_k, moe.experts * local / ep)
        # every delivery to another rank crosses NVLink once (directly, or forwarded on the destination node)
        nvl = (ep - 1) * p_rank * t * row * imb
        net = (nodes - 1) * p_node * t * row * imb
        return nvl, net
    copies = t * moe.top_k * imb
    return copies * (local - 1) / ep * row, copies * (ep - local) / ep * row


def dispatch_seconds(model: ModelSpec, cluster: Cluster, layout: Layout, shape: Shape, coef) -> float:
    """One dispatch (or combine) of one microbatch and MoE layer, seconds: NVLink and NIC traffic run at once,
    the slower sets the time. NCCL's all-to-all (alltoall, allgather): over NVLink at the collectives' link efficiency
    times ``moe_alltoall_efficiency`` (fitted: p2p sends to many peers), over the NICs at the collectives' network
    efficiency; DeepEP / HybridEP kernels at ``moe_flex_efficiency`` of the line rates
    (their README figures). A node's NICs are shared by its GPUs."""
    gpu = cluster.gpu
    nvl_b, net_b = dispatch_bytes(model, layout, cluster, shape)
    net_line = gpu.internode_gbps / cluster.gpus_per_node * 1e9
    if layout.moe_dispatcher == "flex":
        nvl_bw = gpu.nvlink_gbps * 1e9 * coef.moe_flex_efficiency
        net_bw = net_line * coef.moe_flex_efficiency
    else:
        nvl_bw = gpu.nvlink_gbps * 1e9 * coef.nvlink_efficiency * coef.moe_alltoall_efficiency
        net_bw = net_line * coef.network_efficiency  # the NICs bind: NCCL's p2p all-to-all saturates them
    return max(nvl_b / nvl_bw, net_b / net_bw if net_b else 0.0) + coef.collective_latency_s


def moe_layer_times(model: ModelSpec, cluster: Cluster, layout: Layout, shape: Shape, coef,
                    ) -> dict[str, float]:
    """One MoE layer's routed part, one microbatch, seconds: fwd_/bwd_ gemm and memory, the exposed
    dispatch + combine all-to-all (ep_fwd, ep_bwd), and of fwd_memory the experts' activation (fwd_act_memory)."""
    moe = model.moe
    if moe is None:
        return {}
    gpu = cluster.gpu
    peak, hbm = gpu.bf16_tflops * 1e12 * peak_ratio(gpu, coef), gpu.hbm_gbps * 1e9 * coef.hbm_efficiency
    h, f = model.hidden, moe.expert_ffn / layout.etp
    R = routed_tokens(layout, shape, moe.top_k)
    t = local_tokens(layout, shape)
    local_experts = moe.experts / layout.ep
    per_expert = R / local_experts  # tokens one local expert sees: the small GEMM dimension
    kind = coef.moe_grouped_gemm_efficiency * (1.0 if layout.moe_grouped_gemm else coef.moe_loop_gemm_ratio)
    flops = 2 * R * h * 3 * f  # fc1 (2f wide) + fc2
    gemm = flops / (peak * _gemm_eff(min(per_expert, h, f), coef) * kind
                    * tile_utilisation(per_expert, h, f, gpu.generation))
    router = 2 * t * h * moe.experts / (peak * _gemm_eff(min(t, h, moe.experts), coef))
    clamp = ACTIVATION_CLAMP_BYTES * R * 2 * f if moe.activation_clamp else 0.0  # a clamped gate's extra passes
    passes = coef.moe_permutation_passes / (2 if layout.moe_permute_fusion else 1)
    if layout.moe_dispatcher == "alltoall" and local_experts > 1:
        passes += ALLTOALL_SORT_PASSES
    mem = (passes * R * BF16 * h + 3 * t * moe.experts * FP32 + 3 * R * BF16 * f
           + (EXPERT_BIAS_BYTES * R * h if moe.expert_bias else 0.0) + clamp) / hbm
    ep_fwd = ep_bwd = raw_fwd = raw_bwd = 0.0
    if layout.ep * layout.etp > 1:
        ep_fwd = ep_bwd = 2 * dispatch_seconds(model, cluster, layout, shape, coef)  # dispatch + combine
        if layout.moe_shared_expert_overlap and moe.shared_ffn:
            shared = 2 * t * h * 3 * moe.shared_ffn / max(1, layout.tp if not shape.sp else 1) / (peak * coef.gemm_efficiency)
            ep_fwd = max(0.0, ep_fwd - shared)
            ep_bwd = max(0.0, ep_bwd - 2 * shared)
        raw_fwd, raw_bwd = ep_fwd, ep_bwd
        if layout.moe_ep_overlap:
            # --overlap-moe-expert-parallel-comm (megatron-core combined 1F1B: one microbatch's dispatch / combine
            # under another's forward / backward compute of the same layer): what the routed experts' compute
            # cannot cover stays exposed, and the overlapped part slows that compute by the SMs the communication
            # kernels hold (EP_OVERLAP_SM_SHARE)
            cover = 3 * (gemm + router) + (1 + coef.backward_memory_ratio) * mem
            ep_fwd, ep_bwd = (max(0.0, e - c) + EP_OVERLAP_SM_SHARE * min(e, c)
                              for e, c in ((e, cover * e / (ep_fwd + ep_bwd)) for e in (ep_fwd, ep_bwd)))
    # the experts' activation alone (read fc1 output 2f wide, write f; a clamp's passes): what ``moe_act`` recompute
    # runs again
    act = (3 * R * BF16 * f + clamp) / hbm
    return {"fwd_gemm": gemm + router, "bwd_gemm": 2 * (gemm + router), "fwd_memory": mem,
            "bwd_memory": coef.backward_memory_ratio * mem, "ep_fwd": ep_fwd, "ep_bwd": ep_bwd,
            "ep_fwd_alone": raw_fwd, "ep_bwd_alone": raw_bwd, "fwd_act_memory": act}


def ep_overlap_unpaired(layout: Layout, microbatches: int, rank: int) -> float:
    """Fraction of one stage's forwards (and as many backwards) that --overlap-moe-expert-parallel-comm cannot pair
    with another microbatch's backward, so their dispatch / combine runs exposed (``ep_fwd_alone``); 0 without it.

    * PP 1 (``combined_1f1b_schedule_for_no_pipelining``, Megatron-LM 1dcf0daf
      megatron/core/pipeline_parallel/combined_1f1b.py lines 34-47, 50-67 and 93-95): the first microbatch's forward
      and the last one's backward run alone: 1 of m.
    * PP > 1 (VPP required, transformer_config.py lines 1882-1886; schedules.py lines 775-781): the interleaved
      warm-up forwards, (PP - rank - 1) x 2 + (VPP - 1) x PP + 1 of the m x VPP chunk-microbatches (the
      microbatch group per VPP stage defaults to PP), and as many cool-down backwards.
    """
    if not layout.moe_ep_overlap or microbatches < 1:
        return 0.0
    if layout.pp == 1:
        return 1.0 / microbatches
    total = microbatches * layout.vpp
    warmup = (layout.pp - rank - 1) * 2 + (layout.vpp - 1) * layout.pp + 1
    return min(1.0, warmup / total)


def host_exposed_s(gpu_fwd_layer_s: float, engine, coef, local_experts: float = 1.0) -> float:
    """Seconds the GPU waits for the host in one MoE layer's forward: the layer's eager launch time
    (``moe_host_layer_s``, less with scoped CUDA graphs, plus ``moe_host_per_expert_s`` per local expert; none with
    full-iteration graphs: ``Engine.cuda_graphs``) beyond
    its GPU time. Dropless MoE synchronises the host on the routing counts every MoE forward, so the CPU cannot queue
    the next layers ahead (see ``Coefficients.moe_host_layer_s``). The backward is launched by autograd's C++ engine
    without such a sync, and is left out."""
    mode = getattr(engine, "cuda_graphs", "none")
    if mode == "full":
        return 0.0
    host = (coef.moe_host_layer_s * (coef.moe_host_scoped_fraction if mode == "scoped" else 1.0)
            + coef.moe_host_per_expert_s * local_experts)
    return max(0.0, host - gpu_fwd_layer_s)


def expert_dp_comm_s(model: ModelSpec, cluster: Cluster, layout: Layout, layers: int, grad_bytes: float, coef) -> float:
    """The expert gradients' reduce-scatter and parameter all-gather over the expert data-parallel group,
    seconds (not overlapped: the conservative case); ``layers``: the stage's MoE layers."""
    d = expert_data_parallel(layout)
    n = stage_expert_params(model, layout, layers)
    if d <= 1 or not n:
        return 0.0
    span = layout.tp * layout.cp * layout.dp
    bw = _link_gbps(span, cluster, coef) * 1e9
    return n * (d - 1) / d * (grad_bytes + BF16) / bw + 2 * coef.collective_latency_s
