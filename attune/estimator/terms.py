"""The terms of one layout's estimate as typed records: one row of a ``BatchEstimate`` (issue 18).

``estimate()`` estimates a batch of one (``estimate_batch``) and reads its row through these views: per stage a
``StageTime`` (one microbatch: forward / backward GEMM, attention, GDN, memory-bound work, recompute, exposed TP / CP /
PP / EP communication, activation offload, MoE host time, and their sums) and a ``StageMemory`` (weights, grads,
optimizer states, activations, logits, the named overheads, the allocated / reserved / device peaks); the step as a
``StepBreakdown`` on the critical stage (compute by kind, exposed communication, the one bubble, optimizer,
overhead); and the layout's figures in ``MemoryTerms`` and ``PerfTerms``. Every number is the batch's own (no second
composition): the views copy row values, they compute nothing but sums a reader asks for by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from attune.estimator.batch import BatchEstimate
from attune.estimator.performance import COMM_PARTS, PARTS
from attune.spec.placement import Batching

CONDITIONAL_OVERHEADS = ("optimizer_step_peak", "fragmentation")
"""Named overheads a stage has only where they are not 0: the optimizer step's excess over the forward / backward
peak (when it has one) and fragmentation (none on CPU workers)."""


@dataclass(frozen=True)
class StageTime:
    """One microbatch through one pipeline stage (all its chunks), seconds."""

    stage: int
    fwd_gemm: float
    fwd_attention: float
    fwd_gdn: float
    fwd_memory: float
    bwd_gemm: float
    bwd_attention: float
    bwd_gdn: float
    bwd_memory: float
    recompute: float
    tp_comm: float
    cp_comm: float
    pp_comm: float
    ep_comm: float
    act_offload: float
    moe_host: float
    forward_s: float
    """Forward through all of the stage's chunks, exposed forward communication included."""
    backward_s: float
    """Backward, recompute and the rest of the exposed communication."""
    compute_s: float
    comm_s: float

    @property
    def parts(self) -> dict[str, float]:
        """The parts (``performance.PARTS``) by name, for display; they sum to forward_s + backward_s."""
        return {k: getattr(self, k) for k in PARTS}


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's peak memory, GiB (``params``: parameters one GPU of the stage holds)."""

    stage: int
    layers: int
    params: float
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    logits_gib: float
    overhead_gib: float
    """The sum of ``overheads``."""
    host_optimizer_gib: float
    """Optimizer state moved to host memory by CPU offload."""
    inflight_microbatches: float
    allocated_gib: float
    """Peak allocated by PyTorch's caching allocator (``torch.cuda.max_memory_allocated``)."""
    reserved_gib: float
    """Peak reserved (``max_memory_reserved``): allocated + fragmentation."""
    total_gib: float
    """What the device holds at the peak (reserved + CUDA context + NCCL buffers): what the verdict compares."""
    expert_params: float
    """MoE: routed-expert parameters one GPU of this stage holds (not in ``params``)."""
    expert_weights_gib: float
    expert_grads_gib: float
    expert_optimizer_gib: float
    expert_activations_gib: float
    """MoE: of ``activations_gib``, the routed tokens' tensors."""
    overheads: dict[str, float] = field(default_factory=dict)
    """Named terms, GiB: gemm_workspaces, tp_overlap_buffers, optimizer_step_peak, fragmentation, cuda_context,
    nccl_buffers, deepep_buffers, low_precision_* (the ones the stage has)."""

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


@dataclass(frozen=True)
class StepBreakdown:
    """The step as a sum of terms a profile shows, on the pipeline stage that sets the pace: m x the critical
    stage's compute and exposed communication, the one bubble, exposed DP communication, optimizer, overhead."""

    critical: StageTime
    """The stage with the longest per-microbatch time."""
    microbatches: int
    """Microbatches per step per DP rank."""
    dp_comm_s: float
    bubble_s: float
    """Pipeline fill and drain (and waiting on slower stages), seconds: ``PerfTerms.bubble_s``, the same number."""
    optimizer_s: float
    overhead_s: float
    moe: bool
    """The model routes tokens to experts (EP communication and MoE host time are reported)."""
    offload: bool
    """The layout offloads activations (their exposed PCIe time is reported)."""

    @property
    def critical_stage(self) -> int:
        return self.critical.stage

    @property
    def compute_s(self) -> dict[str, float]:
        """Critical stage, all microbatches: fwd_/bwd_ gemm, attention, gdn, memory and recompute, seconds."""
        m, c = self.microbatches, self.critical
        return {k: m * getattr(c, k) for k in PARTS if k not in COMM_PARTS}

    @property
    def exposed_comm_s(self) -> dict[str, float]:
        """Communication not hidden under compute: tp, cp, pp (critical stage, all microbatches) and dp, seconds."""
        m, c = self.microbatches, self.critical
        return {"tp": m * c.tp_comm, "cp": m * c.cp_comm, "pp": m * c.pp_comm,
                **({"ep": m * c.ep_comm, "moe_host": m * c.moe_host} if self.moe else {}),
                **({"act_offload": m * c.act_offload} if self.offload else {}), "dp": self.dp_comm_s}

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


@dataclass(frozen=True)
class MemoryTerms:
    """Each pipeline stage's peak memory of one layout and the verdict."""

    stages: list[StageMemory]
    capacity_gib: float
    host_capacity_gib: float
    """Host RAM per node the CPU-offloaded optimizer may use."""
    host_needed_gib: float
    """CPU-offloaded optimizer state per node."""
    batch: Batching
    peak_gib: float
    """The largest stage's total (what the verdict compares with capacity_gib)."""
    peak_allocated_gib: float
    peak_reserved_gib: float
    peak_stage: int
    fits: bool

    @property
    def host_fits(self) -> bool:
        return self.host_needed_gib <= self.host_capacity_gib

    @property
    def shortfall_gib(self) -> float:
        """How far the worst stage is over capacity (negative: headroom)."""
        return self.peak_gib - self.capacity_gib

    def verdict(self) -> str:
        if self.fits:
            return f"fits: peak {self.peak_gib:.1f} GiB on stage {self.peak_stage} of {self.capacity_gib:.1f} GiB"
        if not self.host_fits and self.peak_gib <= self.capacity_gib:
            return (f"does not fit: CPU-offloaded optimizer needs {self.host_needed_gib:.0f} GiB of host memory per "
                    f"node, {self.host_capacity_gib:.0f} GiB available")
        over = [s for s in self.stages if s.total_gib > self.capacity_gib]
        where = ", ".join(f"stage {s.stage} {s.total_gib:.1f} GiB" for s in over)
        return f"does not fit: {where} > {self.capacity_gib:.1f} GiB capacity"


@dataclass(frozen=True)
class PerfTerms:
    """Step time, throughput, MFU and cost of one layout, with its stages and the step as a sum."""

    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    usd_per_million_tokens: float
    pipeline_s: float
    bubble_s: float
    dp_comm_s: float
    optimizer_s: float
    overhead_s: float
    stages: list[StageTime]
    breakdown: StepBreakdown

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
                        "compute_s": round(s.compute_s, 5), "comm_s": round(s.comm_s, 5),
                        "parts_s": {k: round(v, 6) for k, v in s.parts.items()}} for s in self.stages],
            "step": self.breakdown.to_dict(),
        }


_TIME = tuple(f.name for f in fields(StageTime) if f.name != "stage")
"""The per-stage seconds a ``StageTime`` reads from ``BatchStageTime`` by name."""
_MEMORY = tuple(f.name for f in fields(StageMemory) if f.name not in ("stage", "layers", "overheads"))
"""The per-stage terms a ``StageMemory`` reads from ``BatchStageMemory`` by name."""


def row_terms(b: BatchEstimate, i: int, batching: Batching, moe: bool, offload: bool) -> tuple[MemoryTerms, PerfTerms]:
    """Row ``i`` of a batch as typed records. ``batching``: the row's microbatching (``spec.placement.batching``);
    ``moe`` / ``offload``: which optional exposed terms its breakdown names."""
    piece, j = b.piece_of(i)
    S = int(piece.stage[j].sum())
    t, m = piece.time, piece.memory
    # per stage, the values in the records' field order (``_TIME`` / ``_MEMORY`` follow StageTime / StageMemory)
    tv = zip(*(getattr(t, k)[j, :S].tolist() for k in _TIME))
    mv = zip(*(getattr(m, k)[j, :S].tolist() for k in _MEMORY))
    ov = [(k, v[j, :S].tolist()) for k, v in m.overheads.items()]
    layers = piece.layers[j, :S].tolist()
    times = [StageTime(s, *vals) for s, vals in enumerate(tv)]
    mems = [StageMemory(s, int(layers[s]), *vals, overheads={k: v[s] for k, v in ov
                                                             if v[s] != 0.0 or k not in CONDITIONAL_OVERHEADS})
            for s, vals in enumerate(mv)]
    step = b.step
    m_b = int(step.microbatches[i])
    peak_stage = int(b.peak_stage[i])
    mem = MemoryTerms(stages=mems, capacity_gib=b.capacity_gib, host_capacity_gib=b.host_capacity_gib,
                      host_needed_gib=float(b.host_needed_gib[i]), batch=batching, peak_gib=float(b.peak_gib[i]),
                      peak_allocated_gib=float(b.peak_allocated_gib[i]),
                      peak_reserved_gib=float(b.peak_reserved_gib[i]), peak_stage=peak_stage, fits=bool(b.fits[i]))
    dp, bubble, opt, over = (float(getattr(step, k)[i]) for k in ("dp_comm_s", "bubble_s", "optimizer_s", "overhead_s"))
    breakdown = StepBreakdown(critical=times[int(step.critical_stage[i])], microbatches=m_b, dp_comm_s=dp,
                              bubble_s=bubble, optimizer_s=opt, overhead_s=over, moe=moe, offload=offload)
    perf = PerfTerms(step_time_s=float(step.step_time_s[i]), tokens_per_s_per_gpu=float(b.tokens_per_s_per_gpu[i]),
                     mfu=float(b.mfu[i]), usd_per_million_tokens=float(b.usd_per_million_tokens[i]),
                     pipeline_s=float(step.pipeline_s[i]), bubble_s=bubble, dp_comm_s=dp, optimizer_s=opt,
                     overhead_s=over, stages=times, breakdown=breakdown)
    return mem, perf


def estimate_terms(mem: MemoryTerms, perf: PerfTerms) -> dict[str, float]:
    """Every term of one layout's estimate by the names ``BatchEstimate.terms`` gives a row's (stage terms as
    ``name[stage]``; named overheads as ``overhead.name[stage]``)."""
    out = {k: float(getattr(perf, k)) for k in ("pipeline_s", "bubble_s", "dp_comm_s", "optimizer_s", "overhead_s",
                                                "step_time_s")}
    out.update(tokens_per_s_per_gpu=perf.tokens_per_s_per_gpu, mfu=perf.mfu,
               usd_per_million_tokens=perf.usd_per_million_tokens, peak_gib=mem.peak_gib,
               peak_allocated_gib=mem.peak_allocated_gib, peak_reserved_gib=mem.peak_reserved_gib,
               peak_stage=float(mem.peak_stage), host_needed_gib=mem.host_needed_gib, fits=float(mem.fits),
               critical_stage=float(perf.breakdown.critical_stage), microbatches=float(mem.batch.microbatches))
    for s, (ts, ms) in enumerate(zip(perf.stages, mem.stages)):
        out.update({f"{k}[{s}]": float(getattr(ts, k)) for k in _TIME})
        out.update({f"{k}[{s}]": float(getattr(ms, k)) for k in _MEMORY})
        out.update({f"overhead.{k}[{s}]": float(v) for k, v in ms.overheads.items()})
    return out
