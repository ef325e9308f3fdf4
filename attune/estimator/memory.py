"""Per-pipeline-stage peak GPU memory of a layout, in GiB, and the fit verdict.

A stage's peak = weights + gradients + optimizer states (GPU share) + activations of the in-flight
microbatches (1F1B or interleaved) under the recompute policy + the backward transient (one layer
rebuilt by recompute, its gradients, the embedding's dense gradient on the first stage) + the logits
and loss buffers on the last stage + fixed overheads. Formulas: reference
megatron-memory-and-performance.md sections 1-5, slime-and-qwen.md 4.3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .coefficients import DEFAULT, Coefficients
from attune.estimator.costs import BF16, FP32, Shape, layer_costs
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster, GiB
from attune.spec.placement import Batching, Placement, place, stage_params
from attune.spec.layout import Layout, Workload
from attune.spec.model import FULL, LINEAR, ModelSpec


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
    overhead_gib: float
    host_optimizer_gib: float  # optimizer state moved to host memory by CPU offload
    inflight_microbatches: float

    @property
    def total_gib(self) -> float:
        return (self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib + self.logits_gib
                + self.overhead_gib)

    def to_dict(self) -> dict:
        return {
            "stage": self.stage, "layers": self.layers, "params": int(self.params),
            "total_gib": round(self.total_gib, 3),
            "breakdown": {
                "weights_gib": round(self.weights_gib, 3), "grads_gib": round(self.grads_gib, 3),
                "optimizer_gib": round(self.optimizer_gib, 3), "activations_gib": round(self.activations_gib, 3),
                "logits_gib": round(self.logits_gib, 3), "overhead_gib": round(self.overhead_gib, 3),
            },
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


def optimizer_bytes(layout: Layout, fp32_training: bool = False) -> tuple[float, float, float, float]:
    """(weight, grad, GPU optimizer, host optimizer) bytes per parameter held by a GPU.

    Megatron's table (docs dist_optimizer.md): bf16 params 2 + fp32 main grads 4 + fp32 master, m, v 12
    sharded over DP x CP with the distributed optimizer. The precision-aware optimizer keeps a 16-bit
    remainder instead of the fp32 master (2 + 4 + 4). CPU offload moves a fraction of the shard to pinned
    host memory as fp32 param, grad, m, v (16 bytes; cpu_offloading/hybrid_optimizer.py).
    """
    d = layout.dp * layout.cp if layout.distributed_optimizer else 1
    if fp32_training:  # the torch runner on CPU: fp32 params and grads, Adam m and v (ZeroRedundancyOptimizer)
        return FP32, FP32, 8 / d, 0.0
    states = (2 + 4 + 4) if layout.precision_aware_optimizer else (4 + 4 + 4)
    grad = FP32
    if layout.precision == "fp16" and not layout.precision_aware_optimizer:
        # fp16 params and grads; the optimizer keeps an fp32 copy of its grad shard: 4 + 16/d (dist_optimizer.md)
        grad, states = BF16, 4 + 4 + 4 + 4
    frac = layout.offload_fraction if layout.optimizer_cpu_offload else 0.0
    return BF16, grad, (1 - frac) * states / d, frac * 16 / d


def estimate_memory(model: ModelSpec, cluster: Cluster, layout: Layout, workload: Workload, engine: Engine,
                    coef: Coefficients = DEFAULT, placement: Placement | None = None) -> MemoryEstimate:
    """Each pipeline stage's peak memory; ``placement`` is derived here when the caller has none."""
    pl = placement or place(model, layout, workload, engine)
    b = pl.batch
    shape = Shape(layout.tp, layout.sp, layout.cp, b.tokens_per_gpu, workload.seq_length)
    costs = layer_costs(model, engine, shape)
    cpu = cluster.gpu.is_cpu
    # the torch runner keeps fp32 parameters (bf16 autocast on GPU, fp32 on CPU); Megatron/slime keep bf16 ones
    w_b, g_b, o_b, h_b = optimizer_bytes(layout, fp32_training=cpu or engine.attune_trainer)
    act_scale = 2.0 if cpu else 1.0  # activations are fp32 on CPU, bf16 on GPU
    stages: list[StageMemory] = []
    rec_full = layout.recompute_granularity == "full"
    n_rec = layout.recompute_num_layers or 0
    for st in pl.stages:
        r = st.rank
        stored = 0.0  # activation bytes of one microbatch through all of this rank's chunks
        worst_layer = 0.0
        rebuilt = 0.0  # bytes rebuilt at once during a recomputed backward
        for ch in st.chunks:
            a, n_full, n_lin = ch.start, ch.full, ch.linear
            kinds = [costs[FULL]] + ([costs[LINEAR]] if n_lin else [])
            worst = max(k.act_bytes for k in kinds)
            worst_layer = max(worst_layer, worst)
            if not rec_full:
                stored += n_full * costs[FULL].act_bytes + (n_lin * costs[LINEAR].act_bytes if n_lin else 0)
                continue
            n = ch.layers
            if layout.recompute_method == "block":
                k = min(n_rec, n)  # the first k layers of each chunk keep only their input
                f_rec, l_rec = model.count_types(a, a + k)
                f_keep, l_keep = n_full - f_rec, n_lin - l_rec
                stored += (k * costs[FULL].input_bytes
                           + f_keep * costs[FULL].act_bytes + (l_keep * costs[LINEAR].act_bytes if l_keep else 0))
                if k:
                    rebuilt = max(rebuilt, worst)
            else:  # uniform: every group of n_rec layers keeps its input; a whole group is rebuilt in backward
                groups = math.ceil(n / n_rec)
                stored += groups * costs[FULL].input_bytes
                rebuilt = max(rebuilt, min(n_rec, n) * worst)
        first, last = st.is_first, st.is_last
        params = stage_params(model, layout, r, lambda kind: costs[kind].params_on_gpu, st.ranges)
        inflight = st.inflight
        # backward transient: the layer being differentiated (rebuilt if recomputed) plus its gradients,
        # about one more layer's worth; the embedding's dense bf16 gradient on the first stage
        transient = rebuilt + worst_layer
        if first:
            transient = max(transient, BF16 * model.embedding_params / layout.tp)
        acts = act_scale * coef.activation_factor * (inflight * stored + transient)
        logits = 0.0
        if last:
            logits = engine.logits_bytes_per_element * b.tokens_per_gpu * model.vocab / layout.tp
            logits += BF16 * b.tokens_per_gpu * model.hidden  # output-layer input
        stages.append(StageMemory(
            stage=r, layers=st.layers, params=params,
            weights_gib=params * w_b / GiB, grads_gib=params * g_b / GiB, optimizer_gib=params * o_b / GiB,
            activations_gib=acts / GiB, logits_gib=logits / GiB,
            overhead_gib=coef.cpu_process_overhead_gib if cpu else coef.fixed_overhead_gib,
            host_optimizer_gib=params * h_b / GiB, inflight_microbatches=inflight,
        ))
    # host memory per node: GPUs of a node are spread over stages; take the mean stage times GPUs per node
    per_gpu_host = sum(s.host_optimizer_gib for s in stages) / len(stages)
    host_needed = per_gpu_host * cluster.gpus_per_node
    host_cap = 0.9 * cluster.gpu.host_memory_bytes / GiB  # leave 10% for the OS, Ray and data loaders
    capacity = cluster.gpu.capacity_gib
    if cpu:  # CPU workers share the host's memory
        capacity /= cluster.gpus_per_node
    return MemoryEstimate(stages, capacity, host_cap, host_needed, b)
