"""The calibrated coefficients of the memory and performance models, in one place, with provenance.

Few and physical: efficiencies between 0 and 1, bandwidth fractions, fixed overheads in GiB or seconds.
They are fitted to measurements (``attune.estimator.fit``), never per layout. This module is a leaf: it
imports nothing of attune, and nothing in the estimator imports the fitting code.
"""

from __future__ import annotations

from dataclasses import dataclass


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
