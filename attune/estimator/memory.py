"""Per-pipeline-stage peak GPU memory of a layout, in GiB, and the fit verdict.

A stage's allocated peak (what ``torch.cuda.max_memory_allocated`` shows) = weights + gradients + optimizer
states (GPU share) + the tensors each layer saves for backward (``attune.estimator.costs``: named per
kernel, no global multiplier) for the in-flight microbatches of 1F1B / interleaved schedules under the
recompute policy + the backward working set (one layer rebuilt by recompute, its gradients and kernel
state; the embedding's dense gradient on the first stage) + the logits and loss buffers on the last stage
(and its multi-token-prediction layers with their fp32 logits: ``Layout.mtp_layers``) + GEMM workspaces
(and TE userbuffers with TP overlap). The reserved peak (``max_memory_reserved``) adds allocator
fragmentation as a fraction of the allocated peak; the device holds on top the CUDA context and the NCCL
buffers of every communicator the layout creates. The verdict compares that total with the GPU's memory.
Formulas: reference megatron-memory-and-performance.md sections 1-5, slime-and-qwen.md 4.3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import attrgetter

from attune.estimator import moe as moe_terms
from attune.estimator import offload as knob_terms
from attune.estimator import precision as lp_terms
from attune.estimator import reuse
from attune.estimator.costs import BF16, FP32, Shape, layer_costs, mtp_logits_bytes, mtp_saved
from attune.estimator.reuse import placement as shared_placement
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster, GiB
from attune.spec.layout import Layout, Workload
from attune.spec.model import FULL, LINEAR, ModelSpec, is_dense_kind
from attune.spec.placement import Batching, Placement, mtp_kind, stage_params

from .coefficients import Coefficients

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of the optimizer-state dtypes (``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``)."""

# TE userbuffers (--tp-comm-overlap): megatron-core's _initialize_tp_communicators allocates one buffer per
# overlapped GEMM input/output of the full-sequence shape [seq x mbs, hidden] in bf16: qkv and fc1 all-gathers,
# proj and fc2 reduce-scatters, and their dgrad/wgrad counterparts; about 6 such buffers are alive
# [unverified count; transformer_engine/pytorch/module/base.py initialize_ub].
TP_OVERLAP_BUFFERS = 6


@dataclass
class StageMemory:
    stage: int
    layers: int
    params: float  # parameters held by one GPU of this stage
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    logits_gib: float
    overhead_gib: float  # the sum of ``overheads``
    host_optimizer_gib: float  # optimizer state moved to host memory by CPU offload
    inflight_microbatches: float
    expert_params: float = 0.0
    """MoE: routed-expert parameters one GPU of this stage holds (all experts / EP x ETP); not in ``params``."""
    expert_weights_gib: float = 0.0
    """MoE: routed-expert weights, GiB (not in ``weights_gib``, which is the dense part)."""
    expert_grads_gib: float = 0.0
    """MoE: routed-expert gradients, GiB."""
    expert_optimizer_gib: float = 0.0
    """MoE: routed-expert optimizer states on the GPU, sharded over the expert data-parallel group, GiB."""
    expert_activations_gib: float = 0.0
    """MoE: of ``activations_gib``, the routed tokens' tensors (dispatched tokens x top-k), GiB."""
    overheads: dict[str, float] = field(default_factory=dict)
    """Named fixed and proportional terms, GiB: gemm_workspaces, tp_overlap_buffers, optimizer_step_peak (the
    optimizer step's excess over the forward/backward peak, when it has one; inside the allocator),
    fragmentation (reserved - allocated), cuda_context and nccl_buffers (outside the allocator)."""

    @property
    def allocated_gib(self) -> float:
        """Peak allocated by PyTorch's caching allocator (``torch.cuda.max_memory_allocated``)."""
        return (self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib + self.logits_gib
                + self.expert_state_gib + self.overheads.get("gemm_workspaces", 0.0) + self.overheads.get("tp_overlap_buffers", 0.0)
                + self.overheads.get("optimizer_step_peak", 0.0)
                + sum(v for k, v in self.overheads.items() if k.startswith("low_precision")))

    @property
    def reserved_gib(self) -> float:
        """Peak reserved by the allocator (``torch.cuda.max_memory_reserved``): allocated + fragmentation."""
        return self.allocated_gib + self.overheads.get("fragmentation", 0.0)

    @property
    def total_gib(self) -> float:
        """What the device holds at the peak and the verdict compares with its memory: the reserved peak plus
        the CUDA context and NCCL buffers outside the allocator (what nvidia-smi shows)."""
        return (self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib + self.logits_gib
                + self.expert_state_gib + self.overhead_gib)

    @property
    def expert_state_gib(self) -> float:
        """MoE: routed-expert weights + gradients + optimizer states, GiB (0 for dense models)."""
        return self.expert_weights_gib + self.expert_grads_gib + self.expert_optimizer_gib

    def to_dict(self) -> dict:
        return {
            "stage": self.stage, "layers": self.layers, "params": int(self.params),
            "total_gib": round(self.total_gib, 3),
            "allocated_gib": round(self.allocated_gib, 3), "reserved_gib": round(self.reserved_gib, 3),
            "breakdown": {
                "weights_gib": round(self.weights_gib, 3), "grads_gib": round(self.grads_gib, 3),
                "optimizer_gib": round(self.optimizer_gib, 3), "activations_gib": round(self.activations_gib, 3),
                "logits_gib": round(self.logits_gib, 3), "overhead_gib": round(self.overhead_gib, 3),
            },
            **({"experts": {"params": int(self.expert_params), "weights_gib": round(self.expert_weights_gib, 3),
                            "grads_gib": round(self.expert_grads_gib, 3),
                            "optimizer_gib": round(self.expert_optimizer_gib, 3),
                            "activations_gib": round(self.expert_activations_gib, 3)}} if self.expert_params else {}),
            "overheads_gib": {k: round(v, 3) for k, v in self.overheads.items()},
            "host_optimizer_gib": round(self.host_optimizer_gib, 3),
            "inflight_microbatches": round(self.inflight_microbatches, 2),
        }


@dataclass
class MemoryEstimate:
    stages: list[StageMemory]
    capacity_gib: float
    host_capacity_gib: float  # host RAM per node
    host_needed_gib: float  # CPU-offloaded optimizer state per node
    batch: Batching
    notes: list[str] = field(default_factory=list)

    @property
    def peak_gib(self) -> float:
        return max(s.total_gib for s in self.stages)

    @property
    def peak_allocated_gib(self) -> float:
        """The largest stage's allocated peak (``max_memory_allocated``)."""
        return max(s.allocated_gib for s in self.stages)

    @property
    def peak_reserved_gib(self) -> float:
        """The largest stage's reserved peak (``max_memory_reserved``)."""
        return max(s.reserved_gib for s in self.stages)

    @property
    def peak_stage(self) -> int:
        return max(self.stages, key=lambda s: s.total_gib).stage

    @property
    def host_fits(self) -> bool:
        return self.host_needed_gib <= self.host_capacity_gib

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.capacity_gib and self.host_fits

    @property
    def shortfall_gib(self) -> float:
        """How far the worst stage is over capacity (negative: headroom)."""
        return self.peak_gib - self.capacity_gib

    def verdict(self) -> str:
        if self.fits:
            return f"fits: peak {self.peak_gib:.1f} GiB on stage {self.peak_stage} of {self.capacity_gib:.1f} GiB"
        if not self.host_fits and self.peak_gib <= self.capacity_gib:
            return (f"does not fit: CPU-offloaded optimizer needs {self.host_needed_gib:.0f} GiB of host memory per node, "
                    f"{self.host_capacity_gib:.0f} GiB available")
        over = [s for s in self.stages if s.total_gib > self.capacity_gib]
        where = ", ".join(f"stage {s.stage} {s.total_gib:.1f} GiB" for s in over)
        return f"does not fit: {where} > {self.capacity_gib:.1f} GiB capacity"


def optimizer_bytes(layout: Layout, fp32_training: bool = False, *, grad_reduce_in_bf16: bool = False,
                    exp_avg_dtype: str = "fp32", exp_avg_sq_dtype: str = "fp32",
                    fp16_grads_in_fp32: bool = False) -> tuple[float, float, float, float]:
    """(weight, grad, GPU optimizer, host optimizer) bytes per parameter held by a GPU.

    * bf16 (Megatron-LM, Megatron-Bridge, slime): bf16 params 2 + fp32 main grads 4 (Megatron-LM turns
      accumulate-allreduce-grads-in-fp32 on for bf16, arguments.py; Megatron-Bridge's bf16_mixed sets
      grad_reduce_in_fp32) + fp32 master, m, v 12, sharded over DP x CP with the distributed optimizer
      (docs dist_optimizer.md: 6 + 12/d).
    * ``--grad-reduce-in-bf16``: a bf16 grad buffer (2) and an fp32 copy of the optimizer's grad shard
      (2 + 2 + 16/d; reference 4.2).
    * precision-aware optimizer (TE FusedAdam): the master weight as a 16-bit remainder
      (store_param_remainders, default on) and m, v in ``exp_avg_dtype`` / ``exp_avg_sq_dtype``
      (2 + G + (2 + Ea + Es)/d; reference 4.3); bf16 main grads with ``--grad-reduce-in-bf16``.
      The dtype options are numerics-class flags, not Layout fields: callers pass them here; the estimator
      uses Megatron's defaults (fp32 grads, fp32 moments).
    * fp16: fp16 params and grads, the optimizer keeps fp32 master, m, v and an fp32 grad copy (4 + 16/d,
      dist_optimizer.md); the dynamic loss scaler is a scalar and holds no per-parameter memory. With
      ``fp16_grads_in_fp32`` (--accumulate-allreduce-grads-in-fp32): an fp32 main-grad buffer and no copy
      (2 + 4 + 12/d, dist_optimizer.md "float16 param, float32 grads").
    * CPU offload moves a fraction of the optimizer shard to pinned host memory as fp32 param, grad, m, v
      (16 bytes; cpu_offloading/hybrid_optimizer.py).
    """
    d = layout.dp * layout.cp if layout.distributed_optimizer else 1
    grad_reduce_in_bf16 = grad_reduce_in_bf16 and layout.precision != "fp16"
    if fp32_training:  # the torch runner: fp32 params and grads, Adam m and v (ZeroRedundancyOptimizer)
        return FP32, FP32, 8 / d, 0.0
    if layout.precision_aware_optimizer:
        grad = BF16 if grad_reduce_in_bf16 else FP32
        states = BF16 + DTYPE_BYTES[exp_avg_dtype] + DTYPE_BYTES[exp_avg_sq_dtype]
    elif layout.precision == "fp16" and fp16_grads_in_fp32:
        grad, states = FP32, FP32 * 3
    elif layout.precision == "fp16" or grad_reduce_in_bf16:
        grad, states = BF16, FP32 * 4
    else:
        grad, states = FP32, FP32 * 3
    frac = layout.offload_fraction if layout.optimizer_cpu_offload else 0.0
    return BF16, grad, (1 - frac) * states / d, frac * 16 / d


def step_grad_copy_bytes(layout: Layout, fp32_training: bool = False, *, grad_reduce_in_bf16: bool = False,
                         fp16_grads_in_fp32: bool = False) -> float:
    """Of ``optimizer_bytes``' GPU optimizer bytes per parameter: the fp32 copy of a 16-bit gradient that exists
    only during the optimizer step. megatron-core makes it in ``_copy_model_grads_to_main_grads``
    (optimizer.py: ``main_param.grad = model_param.main_grad.float()``; the distributed optimizer the same for
    its shard) and frees it in ``zero_grad(set_to_none=True)`` at the start of the next step
    (training.py train_step), before any activation exists: it does not add to the activation peak."""
    if fp32_training or layout.precision_aware_optimizer:
        return 0.0
    if layout.precision != "fp16" and not grad_reduce_in_bf16:
        return 0.0
    if layout.precision == "fp16" and fp16_grads_in_fp32:
        return 0.0  # the main grads already are fp32: no copy
    d = layout.dp * layout.cp if layout.distributed_optimizer else 1
    frac = layout.offload_fraction if layout.optimizer_cpu_offload else 0.0
    return (1 - frac) * FP32 / d


def communicators(layout: Layout, stage: int, cluster: Cluster) -> list[tuple[str, int, bool]]:
    """(group, ranks, intra-NVLink-domain) of every NCCL communicator of more than one rank that a GPU of
    ``stage`` joins (megatron/core/parallel_state.py initialize_model_parallel; PyTorch creates the NCCL
    communicator lazily on a group's first collective, so groups of one rank cost nothing)."""
    span = cluster.gpu.nvlink_span
    tp, cp, dp, pp = layout.tp, layout.cp, layout.dp, layout.pp
    groups = [
        ("tp", tp, tp <= span),  # TP collectives
        ("cp", cp, tp * cp <= span),  # CP ring exchange
        ("dp_cp", dp * cp, tp * cp * dp <= span),  # gradient reduce-scatter / all-reduce, param all-gather
        ("pp", pp, layout.world_size <= span),  # pipeline send/receive
        ("model_parallel", tp * pp, tp * pp * (cp if cp > 1 else 1) <= span),  # grad-norm / loss all-reduces
        ("world", layout.world_size, layout.world_size <= span),  # barriers, global reductions
    ]
    if cp > 1 and dp > 1:
        groups.append(("dp", dp, tp * cp * dp <= span))  # the DP-only group (data-loader / loss averaging)
    if pp > 1 and stage in (0, pp - 1):
        groups.append(("embedding", 2, layout.world_size <= span))  # first and last stage: tied embedding grads
    if layout.ep * layout.etp > 1:
        # MoE: the expert groups of parallel_state's expert RankGenerator (tp-ep-dp-pp with tp = ETP): the EP
        # group (dispatch / combine), ETP, and the expert data-parallel group (expert gradients, optimizer)
        edp = max(1, tp * cp * dp // (layout.ep * layout.etp))
        groups += [("ep", layout.ep, layout.ep * layout.etp <= span), ("etp", layout.etp, layout.etp <= span),
                   ("expert_dp", edp, tp * cp * dp <= span)]
    return [g for g in groups if g[1] > 1]


def fixed_overheads(layout: Layout, workload: Workload, engine: Engine, cluster: Cluster, stage: int,
                    model: ModelSpec, coef: Coefficients) -> dict[str, float]:
    """The named terms that do not scale with the allocated peak, GiB (fragmentation is added by the caller).
    Shared between layouts with the same OVERHEAD_FIELDS (a search asks for the same few thousand times)."""
    key = (id(model), id(engine), id(cluster), id(coef), workload.seq_length, stage == 0, stage == layout.pp - 1,
           *_overhead_fields(layout))
    hit = _OVERHEADS.get(key)
    if hit is None or not (hit[0] is model and hit[1] is engine and hit[2] is cluster and hit[3] is coef):
        if len(_OVERHEADS) >= 65536:
            _OVERHEADS.clear()
        hit = _OVERHEADS[key] = (model, engine, cluster, coef,
                                 _fixed_overheads(layout, workload, engine, cluster, stage, model, coef))
    return dict(hit[4])


OVERHEAD_FIELDS = ("tp", "cp", "dp", "pp", "ep", "etp", "moe_dispatcher", "sp", "tp_comm_overlap", "micro_batch_size")
"""Every Layout field ``_fixed_overheads`` reads (with ``communicators``); the stage enters only as first / last."""
_overhead_fields = attrgetter(*OVERHEAD_FIELDS)
_OVERHEADS: dict[tuple, tuple] = {}


def _fixed_overheads(layout: Layout, workload: Workload, engine: Engine, cluster: Cluster, stage: int,
                     model: ModelSpec, coef: Coefficients) -> dict[str, float]:
    if cluster.gpu.is_cpu:
        return {"process": coef.cpu_process_overhead_gib}
    out = {"cuda_context": coef.cuda_context_gib, "gemm_workspaces": coef.gemm_workspace_gib}
    nccl = 0.0
    nvls_on = engine.nvls and cluster.gpu.nvls
    for name, _ranks, intra in communicators(layout, stage, cluster):
        nccl += coef.nccl_buffers_gib_per_comm
        if nvls_on and intra and name not in ("pp", "ep"):  # NVLS serves collectives, not point-to-point / all-to-all
            nccl += coef.nccl_nvls_gib_per_comm
    out["nccl_buffers"] = nccl
    if layout.moe_dispatcher == "flex" and model.moe is not None and layout.ep > 1:
        out["deepep_buffers"] = deepep_buffer_bytes(model.hidden, layout.ep, cluster.gpus_per_node) / GiB
    if layout.tp > 1 and layout.sp and (layout.tp_comm_overlap or engine.recipe_tp_comm_overlap):
        # Megatron sizes the userbuffers once at start-up from seq_length x micro_batch_size / CP, not from the
        # tokens of a microbatch (megatron/training/initialize.py lines 267-272 at 1dcf0daf)
        tokens = workload.seq_length * layout.micro_batch_size // layout.cp
        out["tp_overlap_buffers"] = TP_OVERLAP_BUFFERS * BF16 * tokens * model.hidden / GiB
    return out


# DeepEP's buffer sizing (deep_ep Buffer with the dispatch / combine Config defaults megatron-core's fused_a2a.py
# get_buffer asks for: 20 SMs -> 10 channels, 256 tokens per NVLink receive chunk, 128 per RDMA one; NVLink peers
# at most 8) [recalled from DeepEP csrc/config.hpp get_nvl_buffer_size_hint / get_rdma_buffer_size_hint, unverified]
DEEPEP_CHANNELS, DEEPEP_NVL_RECV_TOKENS, DEEPEP_RDMA_RECV_TOKENS, DEEPEP_MAX_NVL_PEERS = 10, 256, 128, 8


def deepep_buffer_bytes(hidden: int, ep: int, gpus_per_node: int) -> float:
    """DeepEP's NVLink and RDMA buffers of one GPU (the flex dispatcher), bytes: channels x NVLink peers x receive
    chunk x token bytes, plus twice channels x RDMA peers (other nodes) x receive chunk x token bytes."""
    token = BF16 * hidden
    nvl = min(ep, gpus_per_node, DEEPEP_MAX_NVL_PEERS)
    rdma = max(1, ep // max(1, min(gpus_per_node, DEEPEP_MAX_NVL_PEERS)))
    out = DEEPEP_CHANNELS * nvl * DEEPEP_NVL_RECV_TOKENS * token
    if rdma > 1:
        out += 2 * DEEPEP_CHANNELS * rdma * DEEPEP_RDMA_RECV_TOKENS * token
    return float(out)


def _stored_layers(layout: Layout, st) -> int:
    """Layers of a stage that keep their full activations under the recompute policy."""
    if layout.recompute_granularity != "full":
        return st.layers
    if layout.recompute_method == "block":
        return sum(max(0, c.layers - (layout.recompute_num_layers or 0)) for c in st.chunks)
    return 0


def _stage_bytes(model: ModelSpec, cluster: Cluster, layout: Layout, workload: Workload, engine: Engine,
                 coef: Coefficients, pl: Placement) -> tuple:
    """(layer costs, per stage (parameters on one GPU, activation bytes at the peak, logits bytes)): the terms
    that read no optimizer field of the layout (``reuse.OPTIMIZER_FIELDS``), so layouts differing only there share
    them."""
    b = pl.batch
    shape = Shape(layout.tp, layout.sp, layout.cp, b.tokens_per_gpu, workload.seq_length)
    costs = moe_terms.with_expert_activations(layer_costs(model, engine, shape), model, layout, shape)
    lp = lp_terms.plan(layout, cluster.gpu, coef)  # low-precision GEMMs (issue 22); None for bf16
    if lp is not None:
        costs = lp_terms.quantized_costs(costs, layout, engine, cluster.gpu, coef)
    cpu = cluster.gpu.is_cpu
    selective = layout.recompute_granularity == "selective"
    act_scale = FP32 / BF16 if cpu else 1.0  # activations are fp32 on CPU workers, bf16 on GPUs
    rec_full = layout.recompute_granularity == "full"
    n_rec = layout.recompute_num_layers or 0
    full = costs[FULL]
    # selective recompute of core attention: FlashAttention already keeps no s x s matrix, so it frees nothing
    # but the attention-internal tensors it re-creates (its output and LSE are rebuilt): the saved set stays
    # the same with FlashAttention (reference 2.1), so selective keeps the counts above.
    out = []
    for st in pl.stages:
        r = st.rank
        stored = 0.0  # activation bytes of one microbatch through all of this rank's chunks
        work = 0.0  # the backward working set of the worst layer
        rebuilt = 0.0  # bytes rebuilt at once during a recomputed backward
        if selective:  # the reference kind's rebuilt set (also when a chunk holds none of it)
            rebuilt = knob_terms.recompute_freed_bytes(full, FULL, layout, model, engine)
        for ch in st.chunks:
            a = ch.start
            # (kind, layers) of the chunk: FULL / SLIDING / LINEAR and the dense-MLP kinds of MoE models
            kinds = ch.kinds or tuple((k, n) for k, n in ((FULL, ch.full), (LINEAR, ch.linear)) if n)
            present = [full] + [costs[k] for k, n in kinds if n and k != FULL]
            worst = max(c.act_bytes for c in present)
            work = max(work, max(c.bwd_work_bytes for c in present))
            if not rec_full:
                # issue 15: selective recompute by module and activation offloading (attune.estimator.offload)
                kept_off = 0.0
                for kind, n in kinds:
                    c = costs[kind]  # the full kind: the MoE / dense-MLP layers of an MoE model differ (knobs.honoured)
                    k_rec = knob_terms.recompute_freed_bytes(c, kind, layout, model, engine) if selective else 0.0
                    k_off = knob_terms.offloaded_bytes(c, kind, layout, model, engine)
                    stored += n * (c.act_bytes - k_rec - k_off)
                    rebuilt = max(rebuilt, k_rec)
                    kept_off = max(kept_off, k_off)
                stored += kept_off  # the chunk's last layer stays on the GPU (its backward follows at once)
                continue
            n = ch.layers
            if layout.recompute_method == "block":
                k = min(n_rec, n)  # the first k layers of each chunk keep only their input
                rec = dict(model.count_kinds(a, a + k)) if k else {}
                # activation offload acts on the layers that keep their activations (attune.estimator.offload)
                offs = [0.0]
                for kind, nk in kinds:
                    keep = nk - rec.get(kind, 0)
                    if keep:
                        c = costs[kind]
                        off = knob_terms.offloaded_bytes(c, kind, layout, model, engine)
                        stored += keep * (c.act_bytes - off)
                        offs.append(off)
                stored += k * full.input_bytes + max(offs)
                if k:
                    rebuilt = max(rebuilt, worst)
            else:  # uniform: every group of n_rec layers keeps its input; a whole group is rebuilt in backward
                groups = math.ceil(n / n_rec)
                stored += groups * full.input_bytes
                rebuilt = max(rebuilt, min(n_rec, n) * worst)
        first, last = st.is_first, st.is_last
        mtp_b = 0.0  # multi-token-prediction layers (last stage): one microbatch, like the logits
        if st.mtp:
            mk = mtp_kind(model)
            c = costs[mk]
            extra = mtp_saved(model, shape)
            if rec_full and layout.recompute_method == "uniform":
                # megatron-core 0.16.1 MultiTokenPredictionLayer._checkpointed_forward: uniform (of 1 layer)
                # checkpoints _proj_and_transformer_layer (enorm, hnorm, eh_proj, the transformer layer), keeping
                # its two inputs (hidden state, embedding); the final norm and the output layer run outside it.
                # Block recompute is "not supported for MTP yet" and skipped (the layer keeps everything).
                layer_b = 2 * c.input_bytes
                extra = tuple(x for x in extra if x.name.startswith(("MTP final norm", "MTP output-layer")))
                rebuilt = max(rebuilt, c.act_bytes)
            else:
                k_rec = knob_terms.recompute_freed_bytes(c, mk, layout, model, engine) if selective else 0.0
                layer_b = c.act_bytes - k_rec
                rebuilt = max(rebuilt, k_rec)
            mtp_b = st.mtp * (layer_b + sum(x.bytes for x in extra))
            work = max(work, c.bwd_work_bytes)
        params = stage_params(model, layout, r, lambda kind: costs[kind].params_on_gpu, st.ranges)
        inflight = st.inflight
        # backward transient: the layer being differentiated (rebuilt if recomputed) plus its gradient working
        # set; on the first stage the embedding's dense bf16 weight gradient (megatron-core
        # VocabParallelEmbedding backward) before it is added into the main-grad buffer
        transient = rebuilt + work
        if first:
            transient = max(transient, BF16 * model.embedding_params / layout.tp)
        acts = act_scale * (inflight * stored + transient + mtp_b)
        logits = 0.0
        if last and model.vocab:  # a model counted without its output layer (vocab 0) has no logits
            logits = engine.logits_bytes_per_element * b.tokens_per_gpu * model.vocab / layout.tp
            logits += BF16 * b.tokens_per_gpu * model.hidden  # output-layer input
            logits += st.mtp * mtp_logits_bytes(model, shape)  # each MTP layer's loss: a second fp32 logits tensor
        out.append((params, acts, logits))
    return costs, out


def estimate_memory(model: ModelSpec, cluster: Cluster, layout: Layout, workload: Workload, engine: Engine,
                    coef: Coefficients, placement: Placement | None = None) -> MemoryEstimate:
    """Each pipeline stage's peak memory (the scalar composition: ``estimate_batch``'s rows that ``scalar_rows``
    sends here); ``placement`` is derived here when the caller has none. ``coef`` as ``estimate_batch`` chose it."""
    pl = placement or shared_placement(model, layout, workload, engine)
    b = pl.batch
    shape = Shape(layout.tp, layout.sp, layout.cp, b.tokens_per_gpu, workload.seq_length)
    costs, per_stage = reuse.shared("stage_bytes", _stage_bytes, (model, cluster, layout, workload, engine, coef, pl),
                                    layout, reuse.OPTIMIZER_FIELDS)
    lp = lp_terms.plan(layout, cluster.gpu, coef)  # low-precision GEMMs (issue 22); None for bf16
    cpu = cluster.gpu.is_cpu
    # the torch runner keeps fp32 parameters (bf16 autocast on GPU, fp32 on CPU); Megatron/slime keep bf16 ones
    fp32_training = cpu or engine.attune_trainer
    bf16_grads = not engine.grad_reduce_in_fp32
    w_b, g_b, o_b, h_b = optimizer_bytes(layout, fp32_training=fp32_training, grad_reduce_in_bf16=bf16_grads,
                                         fp16_grads_in_fp32=engine.fp16_grads_in_fp32)
    copy_b = step_grad_copy_bytes(layout, fp32_training, grad_reduce_in_bf16=bf16_grads,
                                  fp16_grads_in_fp32=engine.fp16_grads_in_fp32)
    o_b -= copy_b  # held during forward/backward; the copy is the optimizer step's own peak (below)
    # MoE: the routed experts' optimizer is sharded over the expert data-parallel group (attune.estimator.moe)
    ew_b = eg_b = eo_b = eh_b = ecopy_b = 0.0
    if model.moe is not None:
        e_lay = moe_terms.expert_layout(layout)
        ew_b, eg_b, eo_b, eh_b = optimizer_bytes(e_lay, fp32_training=fp32_training, grad_reduce_in_bf16=bf16_grads,
                                                 fp16_grads_in_fp32=engine.fp16_grads_in_fp32)
        ecopy_b = step_grad_copy_bytes(e_lay, fp32_training, grad_reduce_in_bf16=bf16_grads,
                                       fp16_grads_in_fp32=engine.fp16_grads_in_fp32)
        eo_b -= ecopy_b
    e_act = moe_terms.expert_activation_bytes(model, layout, shape)
    if layout.recompute_granularity == "selective" and model.moe is not None:
        # moe / moe_act recompute: the routed tensors they do not keep leave the breakdown's expert activations
        moe_kind = next((k for k in costs if not is_dense_kind(k)), None)
        if moe_kind is not None:
            e_act -= knob_terms.routed_freed_bytes(costs[moe_kind], moe_kind, layout, model, engine)
    act_scale = FP32 / BF16 if cpu else 1.0  # activations are fp32 on CPU workers, bf16 on GPUs
    frag = 0.0 if cpu else (coef.fragmentation_expandable if engine.expandable_segments else coef.fragmentation)
    stages: list[StageMemory] = []
    rec_full = layout.recompute_granularity == "full"
    for st, (params, acts, logits) in zip(pl.stages, per_stage):
        r = st.rank
        # MoE layers only, not the dense ones; an MTP layer of an MoE kind holds routed experts too
        ex = moe_terms.stage_expert_params(model, layout, st.moe_layers + st.mtp_moe)
        inflight = st.inflight
        over = fixed_overheads(layout, workload, engine, cluster, r, model, coef)
        if lp is not None:  # fp8 weight copies, fp8 params, scaling state (attune.estimator.precision)
            over = {**over, **lp_terms.stage_memory(lp, lp_terms.linear_params(
                model, engine, costs, lp_terms.dense_kinds(st.chunks), layout.tp), ex, st.layers)}
        lp_gib = sum(v for k, v in over.items() if k.startswith("low_precision"))
        allocated = (params * (w_b + g_b + o_b) + ex * (ew_b + eg_b + eo_b) + acts + logits) / GiB + over.get(
            "gemm_workspaces", 0.0) + over.get("tp_overlap_buffers", 0.0) + lp_gib
        # the optimizer step's peak: the states plus the fp32 grad copies, no activations; it sets the stage's
        # peak only when it exceeds the forward/backward one
        step_peak = (params * (w_b + g_b + o_b + copy_b) + ex * (ew_b + eg_b + eo_b + ecopy_b)) / GiB + over.get(
            "gemm_workspaces", 0.0) + lp_gib
        if step_peak > allocated:
            over["optimizer_step_peak"] = step_peak - allocated
            allocated = step_peak
        if not cpu:
            over["fragmentation"] = frag * allocated
        stages.append(StageMemory(
            stage=r, layers=st.layers, params=params,
            weights_gib=params * w_b / GiB, grads_gib=params * g_b / GiB, optimizer_gib=params * o_b / GiB,
            activations_gib=acts / GiB, logits_gib=logits / GiB, overhead_gib=sum(over.values()),
            host_optimizer_gib=(params * h_b + ex * eh_b) / GiB, inflight_microbatches=inflight, overheads=over,
            expert_params=ex, expert_weights_gib=ex * ew_b / GiB, expert_grads_gib=ex * eg_b / GiB,
            expert_optimizer_gib=ex * eo_b / GiB,
            expert_activations_gib=(act_scale * inflight * e_act * _stored_layers(layout, st) / GiB
                                    * (st.moe_layers / st.layers if st.layers else 0.0)
                                    + (act_scale * st.mtp_moe * e_act / GiB
                                       if not (rec_full and layout.recompute_method == "uniform") else 0.0)),
        ))
    # host memory per node: GPUs of a node are spread over stages; take the mean stage times GPUs per node
    per_gpu_host = sum(s.host_optimizer_gib for s in stages) / len(stages)
    host_needed = per_gpu_host * cluster.gpus_per_node
    host_cap = 0.9 * cluster.gpu.host_memory_bytes / GiB  # leave 10% for the OS, Ray and data loaders
    capacity = cluster.gpu.capacity_gib
    if cpu:  # CPU workers share the host's memory
        capacity /= cluster.gpus_per_node
    return MemoryEstimate(stages, capacity, host_cap, host_needed, b)
