"""The calibrated coefficients of the memory and performance models, in one place, with provenance.

Few and physical: efficiencies between 0 and 1, bandwidth fractions, fixed overheads in GiB or seconds.
They are fitted to measurements (the observations below), never per layout; `fit()` redoes the fit and
`benchmarks/calibrate.py` prints it. Everything else in the models is arithmetic from the architecture,
the engine's documented behaviour and the hardware table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Coefficients:
    # --- memory
    # Real saved activations / counted saved tensors: allocator rounding, un-modelled temporaries (GDN fp32
    # gate copies, FLA chunk-state scratch, dropout-free TE workspaces). Physically >= 1.
    # Fitted: the seed's block-recompute 12 fits on stage 0 and 10 does not (see OBSERVATIONS).
    activation_factor: float = 1.30  # fitted (fit(): grid 1.00-1.60)
    # CUDA context, cuBLAS/cuDNN/TE workspaces and NCCL communicator buffers per GPU, GiB.
    # Literature: CUDA 12 context on Hopper ~0.5-0.7 GiB; NCCL with NVLS ~1-2 GiB; TE/cuBLAS ~0.5 GiB.
    # Fitted on a grid bounded by that physical range (1.5-6.0 GiB).
    fixed_overhead_gib: float = 6.0
    # CPU workers (torch runner): resident memory of a Python process with torch, gloo and the worker imported,
    # before the model: ~0.30 GiB measured here with torch 2.13.0 CPU (peak RSS of a 0-layer run). Not fitted.
    cpu_process_overhead_gib: float = 0.30
    # --- performance
    # Fraction of dense BF16 peak reached by large GEMMs (cuBLAS/TE on Hopper reach 0.6-0.8).
    # Fitted to the seed's tuned layout (2,499.5 tokens/s/GPU on 8 x H200).
    gemm_efficiency: float = 0.72  # fitted: 0.7194
    # GEMM size (smallest of m, n, k) at which efficiency reaches 1 - 1/e of its maximum: tile/wave
    # quantisation on 132-SM Hopper with 128x256 tiles. Literature value, not fitted.
    gemm_half_dim: float = 384.0
    # The same on CPU workers: oneDNN/MKL sgemm kernels block for L1/L2 caches and reach most of their peak
    # with ~64-wide panels. Not fitted.
    cpu_gemm_half_dim: float = 64.0
    # FlashAttention forward+backward fraction of peak (FA2/FA3 on H100 bf16 reach 0.35-0.75); not fitted.
    attention_efficiency: float = 0.45
    # FLA chunked gated-delta-rule kernels: far below GEMM efficiency (reference slime-and-qwen.md 4.4);
    # not fitted.
    gdn_kernel_efficiency: float = 0.10
    # Achieved fraction of HBM bandwidth for elementwise / normalisation kernels; not fitted.
    hbm_efficiency: float = 0.70
    # Times each saved activation byte crosses HBM in forward (write + read by the next op, norms and
    # activation functions); backward is twice that. Not fitted.
    memory_passes: float = 3.0
    # Achieved NCCL bus bandwidth / per-direction NVLink line rate: 370 of 450 GB/s (nccl-tests#212).
    nvlink_efficiency: float = 0.82
    # Same for the scale-out network (EFA / InfiniBand): ~0.8 typical for NCCL over RDMA.
    network_efficiency: float = 0.80
    # Per-collective launch + synchronisation latency, seconds (NCCL small-message latency on NVLink).
    collective_latency_s: float = 25e-6
    # Fraction of STREAM-class host memory bandwidth reached by the CPU Adam step of 8 co-located ranks
    # (torch AdamW on pinned fp32 shards, with the D2H/H2D copies). Fitted to the seed's slime baseline
    # (948.7 tokens/s/GPU, full CPU optimizer offload).
    host_optimizer_efficiency: float = 0.065  # fitted: 0.0652 (about 39 GB/s of a 600 GB/s host)


DEFAULT = Coefficients()

# The measurements the coefficients are fitted to: the seed recipe (8 x H200, Qwen3.6-27B, slime,
# 8,192-token rows, global batch 128; shared/seeds/attune-tp1-pp4-split16-rb12.yaml). Layouts as the
# Megatron/slime flags that ran.
_SEED = dict(model="Qwen3.6-27B", gpus="8xH200", engine="slime", seq_length=8192, global_batch=128)
_TUNED = ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 16 "
          "--decoder-last-pipeline-num-layers 14 --recompute-granularity full --recompute-method block "
          "--use-dynamic-batch-size --max-tokens-per-gpu 8192 --use-distributed-optimizer --use-precision-aware-optimizer")
_SLIME = ("--tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 2 "
          "--decoder-last-pipeline-num-layers 30 --recompute-granularity full --recompute-method uniform "
          "--recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 8192 --use-distributed-optimizer "
          "--use-precision-aware-optimizer --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d")
_PP2 = ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 8192 "
        "--use-distributed-optimizer --use-precision-aware-optimizer")
OBSERVATIONS = [
    dict(_SEED, what="tuned layout, measured 2026-10-18", flags=_TUNED + " --recompute-num-layers 12",
         tokens_per_s_per_gpu=2499.52, fits=True),
    dict(_SEED, what="slime's layout, measured", flags=_SLIME, tokens_per_s_per_gpu=948.7, fits=True),
    dict(_SEED, what="block recompute of 10: OOM on stage 0", flags=_TUNED + " --recompute-num-layers 10",
         fits=False, stage=0),
    dict(_SEED, what="TP1 PP2: OOM on the last stage", flags=_PP2, fits=False, stage=1),
]


def _evaluate(obs: dict, coef: "Coefficients"):
    from .engines import get_engine
    from .hardware import parse_cluster
    from .layout import Workload, from_flags
    from .memory import estimate_memory
    from .models import load_model
    from .performance import estimate_performance

    model, cluster, engine = load_model(obs["model"]), parse_cluster(obs["gpus"]), get_engine(obs["engine"])
    wl = Workload(seq_length=obs["seq_length"], global_batch=obs["global_batch"])
    layout = from_flags(obs["flags"], model, cluster.world_size, wl).layout
    return (estimate_memory(model, cluster, layout, wl, engine, coef),
            estimate_performance(model, cluster, layout, wl, engine, coef))


def _bisect(f, lo: float, hi: float, iters: int = 40) -> float:
    """Root of a monotone f on [lo, hi] (clamped to the bounds)."""
    flo = f(lo)
    if flo * f(hi) > 0:
        return lo if abs(flo) < abs(f(hi)) else hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if (f(mid) > 0) == (flo > 0):
            lo, flo = mid, f(mid)
        else:
            hi = mid
    return 0.5 * (lo + hi)


def fit(coef: "Coefficients | None" = None, observations: list[dict] | None = None) -> tuple["Coefficients", list[dict]]:
    """Fit the four fitted coefficients to the observations; returns them and a per-observation report.

    Throughput: gemm_efficiency to the layouts without CPU offload, host_optimizer_efficiency to those with it
    (alternating, both monotone). Memory: activation_factor and fixed_overhead_gib on a grid, maximising the
    smallest relative margin of the fit / out-of-memory verdicts.
    """
    coef = coef or DEFAULT
    obs = observations or OBSERVATIONS
    speed = [o for o in obs if "tokens_per_s_per_gpu" in o]
    plain = [o for o in speed if "--optimizer-cpu-offload" not in o["flags"]]
    offl = [o for o in speed if "--optimizer-cpu-offload" in o["flags"]]

    def err(os_, c):
        return sum(_evaluate(o, c)[1].tokens_per_s_per_gpu / o["tokens_per_s_per_gpu"] - 1 for o in os_) / len(os_)

    for _ in range(3):
        if plain:
            coef = replace(coef, gemm_efficiency=_bisect(lambda x: err(plain, replace(coef, gemm_efficiency=x)), 0.2, 1.0))
        if offl:
            coef = replace(coef, host_optimizer_efficiency=_bisect(
                lambda x: err(offl, replace(coef, host_optimizer_efficiency=x)), 0.005, 1.0))
    verdicts = [o for o in obs if "fits" in o]
    best, best_margin = coef, -1e9
    for a in [1.0 + 0.05 * i for i in range(13)]:
        for ovh in [1.5 + 0.5 * j for j in range(10)]:
            c = replace(coef, activation_factor=round(a, 2), fixed_overhead_gib=ovh)
            margin = min((1 if o["fits"] else -1) * (1 - _evaluate(o, c)[0].peak_gib / _evaluate(o, c)[0].capacity_gib)
                         for o in verdicts)
            if margin > best_margin + 1e-9:
                best, best_margin = c, margin
    coef = best
    report = []
    for o in obs:
        mem, perf = _evaluate(o, coef)
        report.append({"what": o["what"], "predicted_tokens_per_s_per_gpu": round(perf.tokens_per_s_per_gpu, 1),
                       "measured_tokens_per_s_per_gpu": o.get("tokens_per_s_per_gpu"),
                       "fits": mem.fits, "observed_fits": o.get("fits"), "peak_gib": round(mem.peak_gib, 1),
                       "peak_stage": mem.peak_stage})
    return coef, report

