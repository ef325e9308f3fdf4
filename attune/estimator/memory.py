"""The memory model's per-layout pieces: optimizer and gradient bytes, communicators and their NCCL buffers, the fixed
overheads, DeepEP's buffers. The per-stage composition (every row of a batch at once, GiB, and the verdict) is
``batch_memory`` / ``batch``; what follows describes it.

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

from operator import attrgetter

from attune.estimator.costs import BF16, FP32
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster, GiB
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec

from .coefficients import Coefficients

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of the optimizer-state dtypes (``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``)."""

# TE userbuffers (--tp-comm-overlap): megatron-core's _initialize_tp_communicators allocates one buffer per
# overlapped GEMM input/output of the full-sequence shape [seq x mbs, hidden] in bf16: qkv and fc1 all-gathers,
# proj and fc2 reduce-scatters, and their dgrad/wgrad counterparts; about 6 such buffers are alive
# [unverified count; transformer_engine/pytorch/module/base.py initialize_ub].
TP_OVERLAP_BUFFERS = 6


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


def forget_overheads() -> None:
    """Drop the kept fixed overheads (``attune.estimator.forget``)."""
    _OVERHEADS.clear()


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
