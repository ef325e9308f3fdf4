"""The calibrated coefficients of the memory and performance models, in one place, with provenance.

Few and physical: efficiencies between 0 and 1, bandwidth fractions, fixed overheads in GiB or seconds.
They are fitted to measurements (``attune.estimator.fit``), never per layout. This module is a leaf of
the estimator (it imports only the GPU type), and nothing in the estimator imports the fitting code
(``attune.calibrate.fit``). The fitted values live in package data, ``coefficients.yaml``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources

import yaml

from attune.spec.hardware import GPU


def _c(default: float, unit: str, source: str, bounds: tuple[float, float] | None = None,
       per_generation: bool = False, moe: bool = False, precision: bool = False):
    """A coefficient field: its unit, its source and, for the few the global fit may move, the physically
    plausible range (the range's source in ``source``), whether it may differ between GPU generations and
    whether it belongs to the MoE kernels (fitted to the MoE rows only, after the dense fields)."""
    meta: dict = {"unit": unit, "source": source}
    if bounds is not None:
        meta["bounds"] = bounds
    if per_generation:
        meta["per_generation"] = True
    if moe:
        meta["moe"] = True
    if precision:
        meta["precision"] = True
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Coefficients:
    """Every number of the memory and performance models that is not a byte count read from a kernel.

    Fields with ``bounds`` in their metadata are fitted globally (``attune calibrate --fit``); the others are
    fixed from their source. ``per_generation`` marks the few that may differ between Ampere, Hopper and
    Blackwell. Never per model or per layout.
    """

    # ------------------------------------------------------------------ memory: outside the allocator
    cuda_context_gib: float = _c(
        0.6, "GiB", "CUDA context with lazy module loading (CUDA >= 12.2 default) plus PyTorch's and TE's kernel "
        "images: 0.5-0.7 GiB on Hopper as nvidia-smi minus torch.cuda.memory_reserved() of an idle process "
        "[unverified literature range]")
    nccl_buffers_gib_per_comm: float = _c(
        0.25, "GiB", "NCCL ring/tree connection buffers of one communicator with >= 2 ranks: per channel and peer "
        "NCCL_BUFFSIZE 4 MiB (Simple) + ~4.6 MiB (LL128) + 256 KiB (LL), 8-16 channels on NVLink, lazily "
        "connected per algorithm (NCCL_RUNTIME_CONNECT=1, NCCL >= 2.22 docs) [derived from the NCCL env docs]")
    nccl_nvls_gib_per_comm: float = _c(
        1.0, "GiB", "NVLink SHARP buffers (unicast + multicast mappings, NCCL_NVLS_CHUNKSIZE x channels x "
        "heads) of one intra-domain communicator when NCCL_NVLS_ENABLE is on; NCCL's environment docs note "
        "NVLS uses extra memory, user reports on github.com/NVIDIA/nccl issues put it at 0.5-2 GiB per "
        "communicator [unverified]")
    cpu_process_overhead_gib: float = _c(
        0.30, "GiB", "CPU workers (torch runner): resident memory of a Python process with torch, gloo and the "
        "worker imported, before the model: ~0.30 GiB measured here with torch 2.13.0 CPU (peak RSS of a "
        "0-layer run)")
    # ------------------------------------------------------------------ memory: inside the allocator
    gemm_workspace_gib: float = _c(
        0.25, "GiB", "cuBLAS/cuBLASLt workspaces (PyTorch: 32 MiB per handle on sm90, CUBLAS_WORKSPACE_CONFIG "
        "default; TE: 32 MiB per stream on sm90, get_cublas_workspace_size_bytes) plus the cuDNN fused-attention "
        "workspace, allocated through the PyTorch caching allocator [derived, unverified total]")
    fragmentation: float = _c(
        0.08, "fraction of the allocated peak", "PyTorch caching allocator without expandable_segments: freed "
        "blocks of 2 MiB-rounded segments that cannot be reused for larger requests; reserved/allocated peaks "
        "of 1.03-1.25 are typical in LLM training (PyTorch docs 'Optimizing memory usage with "
        "PYTORCH_CUDA_ALLOC_CONF', Megatron-LM memory reports) [range unverified]; the lower bound is the "
        "expandable-segments value below, since expandable segments can only reduce fragmentation",
        bounds=(0.05, 0.25))
    fragmentation_expandable: float = _c(
        0.05, "fraction of the allocated peak", "with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True segments "
        "grow in place (2 MiB pages) and freed blocks coalesce, but cached-but-free blocks of varying-size "
        "transients remain (PyTorch CUDA semantics docs, 'Memory management'); 0.02-0.10 [unverified range]")
    # ------------------------------------------------------------------ performance: kernels
    gemm_efficiency: float = _c(
        0.72, "fraction of dense BF16 peak", "large cuBLAS/TE GEMMs reach 0.6-0.8 of peak on Hopper "
        "(NVIDIA Transformer Engine and cuBLAS benchmarks) [range]", bounds=(0.45, 0.90), per_generation=True)
    gemm_half_dim: float = _c(
        384.0, "elements", "GEMM size (smallest of m, n, k) at which efficiency reaches 1 - 1/e of its maximum: "
        "tile/wave quantisation on 132-SM Hopper with 128x256 tiles [literature value]")
    cpu_gemm_half_dim: float = _c(
        64.0, "elements", "the same on CPU workers: oneDNN/MKL sgemm kernels block for L1/L2 caches and reach most "
        "of their peak with ~64-wide panels")
    attention_efficiency: float = _c(
        0.45, "fraction of dense BF16 peak", "FlashAttention-2/3 and cuDNN fused attention forward+backward on "
        "H100 bf16 reach 0.35-0.75 of peak (Dao 2023; Shah et al. 2024, FlashAttention-3) [range]",
        bounds=(0.25, 0.80), per_generation=True)
    attention_backward_ratio: float = _c(
        2.5, "backward FLOPs / forward FLOPs", "FlashAttention backward does 5 GEMM-sized matmuls "
        "(recomputing QK^T) to forward's 2 (Dao 2023, FlashAttention-2 section 3.1.2)")
    gdn_kernel_efficiency: float = _c(
        0.10, "fraction of dense BF16 peak", "FLA chunked gated-delta-rule kernels run far below GEMM efficiency "
        "(reference slime-and-qwen.md 4.4: small 64x128 chunk matmuls, sequential state pass)",
        bounds=(0.03, 0.30))
    hbm_efficiency: float = _c(
        0.70, "fraction of HBM bandwidth", "achieved by elementwise / normalisation kernels (STREAM-like "
        "copy on H100 reaches ~0.9; fused norm kernels 0.6-0.8) [range]")
    memory_passes: float = _c(
        3.0, "HBM crossings per saved activation byte in forward", "each saved tensor is written once and read by "
        "the next op, and norms/activations read their inputs again [derived]; backward is "
        "backward_memory_ratio times that. Fitted in [1.5, 4]: at least one write and most of one read per byte; "
        "fused kernels (TE norm+linear, FlashAttention, FLA) write their saved tensors once", bounds=(1.5, 4.0))
    backward_memory_ratio: float = _c(
        2.0, "backward HBM traffic / forward", "backward reads each saved tensor and writes its gradient "
        "[derived]")
    # ------------------------------------------------------------------ performance: communication
    nvlink_efficiency: float = _c(
        0.82, "fraction of per-direction NVLink line rate", "NCCL reaches ~370 of 450 GB/s busBW on 8-GPU "
        "NVSwitch for non-all-reduce collectives (nccl-tests#212); range 0.6-0.95", bounds=(0.60, 0.95),
        per_generation=True)
    network_efficiency: float = _c(
        0.80, "fraction of scale-out line rate", "NCCL over RDMA (InfiniBand NDR / EFA) busBW reaches 0.7-0.9 of "
        "line rate in nccl-tests [range]", bounds=(0.50, 0.95), per_generation=True)
    interleaved_p2p_exposed: float = _c(
        0.5, "fraction of a PP send/receive's time", "interleaved 1F1B with overlap_p2p_comm posts each chunk's "
        "isend/irecv before the next chunk's compute and waits on the receive before the chunk that needs it "
        "(megatron/core/pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving): the "
        "transfer hides only where a neighbour's chunk compute is longer and unjittered; NCCL p2p also shares "
        "SMs with the TP/DP collectives. 0 = fully hidden, 1 = as exposed as non-interleaved 1F1B [range, fitted]",
        bounds=(0.0, 1.0))
    collective_latency_s: float = _c(
        25e-6, "s per collective", "NCCL small-message latency on NVLink, launch plus synchronisation "
        "(nccl-tests at 8 B: 15-30 us) [range]")
    # ------------------------------------------------------------------ performance: MoE kernels (issue 14)
    # Fitted after the dense fields, with those held, to the MoE rows only (``moe`` in the metadata): a MoE row's
    # error never moves a dense coefficient.
    moe_grouped_gemm_efficiency: float = _c(
        0.85, "fraction of a single GEMM's efficiency at the same per-expert shape", "TE/cuBLASLt grouped GEMMs "
        "launch once for all local experts but schedule uneven, small per-expert problems: 0.5-1.0 of a dense GEMM "
        "of the same shape (megatron-core moe/experts.py TEGroupedMLP) [prior, fitted]",
        bounds=(0.3, 1.0), per_generation=True, moe=True)
    blackwell_ultra_compute_ratio: float = _c(
        1.0, "x the nominal dense tensor-core peak", "what a Blackwell Ultra GPU (B300, GB300) sustains over the peak its "
        "datasheet shares with B200 / GB200: 160 vs 148 SMs under a 1,400 vs 1,200 W (GB300 / GB200; B300 / B200: "
        "1,100 / 1,000 W) power limit, and twice the SFU exponent rate for softmax (NVIDIA Technical Blog 'Inside "
        "NVIDIA Blackwell Ultra', Aug 2025; GB300 NVL72 and DGX B300 datasheets). Source value 1.0 (the datasheets' "
        "peaks); upper bound 160/148 x 1,400/1,200 ~ 1.26 (clock headroom times SMs; GB300), on B300 capped at "
        "160/148 x 1,100/1,000 ~ 1.19 by ``peak_ratio`` [range, fitted to the MoE rows: "
        "the corpus's only Blackwell Ultra rows]", bounds=(1.0, 1.26), moe=True)
    moe_host_layer_s: float = _c(
        5e-3, "s per MoE layer forward", "CPU time to launch one MoE layer's forward in eager mode (norms, attention, "
        "router, permutation, dispatch, grouped GEMMs, combine: a few hundred PyTorch / TE ops at ~5-20 us of host "
        "dispatch each [range, fitted]). It is exposed where it exceeds the layer's GPU time, because the CPU cannot "
        "run ahead across a dropless MoE layer: megatron-core synchronises the host on the routing counts every MoE "
        "forward (Megatron-LM 1dcf0daf moe/experts.py line 663 tokens_per_expert.tolist(); the alltoall dispatcher's "
        "cuda_sync_point before the EP all-to-all, moe/token_dispatcher.py lines 427-448 and 566)",
        bounds=(0.0, 0.012), moe=True)
    moe_host_per_expert_s: float = _c(
        50e-6, "s per local expert per MoE layer forward", "host work per local expert that no scoped CUDA graph covers "
        "(the experts are outside the attn / moe_router / moe_preprocess scopes): TE's GroupedLinear loops in Python "
        "over its num_gemms = local experts (input split, per-GEMM quantizers, the weight list), and megatron-core "
        "adds biased experts' outputs per expert in a Python loop (Megatron-LM 1dcf0daf moe/experts.py lines 626-643); "
        "~10-100 us per expert [range, fitted]", bounds=(0.0, 5e-4), moe=True)
    moe_host_scoped_fraction: float = _c(
        0.6, "fraction of moe_host_layer_s", "what stays on the host with transformer_engine CUDA graphs of some "
        "modules (--cuda-graph-scope attn / moe_router / moe_preprocess: each graphed module is one launch); "
        "full-iteration graphs leave none [prior, fitted]", bounds=(0.1, 1.0), moe=True)
    moe_loop_gemm_ratio: float = _c(
        0.7, "fraction of the grouped GEMM's efficiency", "without --moe-grouped-gemm megatron-core's SequentialMLP "
        "loops over the local experts with a kernel launch and a Python step each, slower than one grouped GEMM "
        "[prior: 0.6 / 0.85 of the earlier priors; no corpus row runs without grouped GEMM, so it is not fitted]")
    moe_alltoall_efficiency: float = _c(
        0.6, "fraction of the link's collective bandwidth", "NCCL's dispatch/combine all-to-all (alltoall and allgather "
        "dispatchers) over NVLink: grouped p2p sends with uneven splits to many peers reach less than the ring "
        "collectives' bus bandwidth (nccl-tests alltoall_perf) [prior, fitted]. Lower bound 0.5: MB-sized messages "
        "per peer; below it the fit used it to absorb GPT-OSS-120B's own slowness (the only alltoall model of the bf16 "
        "corpus: 0.27) and priced the a2a-heavy Qwen3-30B-A3B at EP 8 ~30% slower [range, issue 21]",
        bounds=(0.5, 1.0), moe=True)
    moe_flex_efficiency: float = _c(
        0.9, "fraction of the NVLink / NIC line rate", "the flex dispatcher's DeepEP / HybridEP kernels: DeepEP's normal "
        "kernels reach 153-158 GB/s of H800's ~160 GB/s NVLink inside a node and 43-58 GB/s (logical) of a CX7 "
        "400 Gb/s NIC's ~50 GB/s across nodes at EP 16-64 (deepseek-ai/DeepEP docs/legacy.md, 'Normal kernels "
        "with NVLink and RDMA forwarding'; the V2 README: 90 GB/s logical RDMA at EP 8x2) [source value, not fitted: "
        "freed, the fit puts it at its upper bound 0.95, carried by DeepSeek-V3 and Qwen3-235B on NVL72 (issue 21/22)]")
    moe_permutation_passes: float = _c(
        4.0, "HBM passes over the routed tokens' hidden states (unfused; fused: half)", "permute and unpermute each "
        "read and write every routed token (moe/moe_utils.py permute / unpermute); the fused kernels "
        "(--moe-permute-fusion) do it in one pass each [prior, fitted]", bounds=(1.0, 8.0), moe=True)
    # ------------------------------------------------------------------ performance: optimizer and step
    host_optimizer_efficiency: float = _c(
        0.065, "fraction of host DRAM bandwidth", "CPU AdamW of 8 co-located ranks on pinned fp32 shards with the "
        "D2H/H2D copies; fitted to the seed's slime baseline (948.7 tokens/s/GPU, full CPU offload); range "
        "0.02-0.5 of STREAM bandwidth", bounds=(0.01, 0.5))
    step_overhead_slime_s: float = _c(
        1.0, "s per step", "slime's training loop outside forward/backward: rollout-data hand-off, "
        "per-microbatch data preprocessing and logging (slime-and-qwen.md 2.2 train_wait)")
    step_overhead_megatron_s: float = _c(
        0.3, "s per step", "Megatron-LM / NeMo loop outside forward/backward: data loader, gradient-norm "
        "clipping all-reduces, loss reduction, timers and logging [range 0.05-1.0 s]", bounds=(0.05, 1.0))
    # ------------------------------------------------------------------ performance: low precision (issue 22)
    # Fitted after the dense and MoE fields, with those held, to the fp8 / mxfp8 rows only (``precision`` in the
    # metadata; attune.calibrate.precision_fit): a low-precision row never moves a bf16 coefficient.
    fp8_gemm_efficiency: float = _c(
        0.60, "fraction of the dense FP8 peak", "tensor-scaled (delayed / tensorwise) fp8 GEMMs through TE/cuBLASLt "
        "reach 0.5-0.75 of the fp8 peak on large shapes: lower than bf16's fraction, the fp8 kernels being more "
        "bound by the epilogue and the operand loads (NVIDIA TE fp8 and cuBLAS benchmarks) [range, fitted]",
        bounds=(0.35, 0.90), per_generation=True, precision=True)
    fp8_blockwise_gemm_ratio: float = _c(
        0.85, "fraction of the tensor-scaled fp8 GEMM efficiency", "blockwise scaling (1x128 activation, 128x128 "
        "weight blocks, fp32 scales) applies the scales in the GEMM's main loop (DeepSeek-V3 tech report section "
        "3.3; TE Float8BlockScaling): 0.7-1.0 of a tensor-scaled fp8 GEMM [range; not fitted: the corpus has one "
        "blockwise row (DeepSeek-V3 on 1,024 H100, Megatron-Bridge 25.09's alternate granularity), whose error is "
        "its EP 64 all-to-all's as much as its GEMMs', and the fit drove the ratio to its bound]", precision=True)
    mxfp8_gemm_efficiency: float = _c(
        0.60, "fraction of the dense FP8 peak", "MXFP8 (E8M0 scale per 32 elements) GEMMs on Blackwell tensor cores, "
        "which apply the block scales in hardware: 0.5-0.8 of the fp8 peak (NVIDIA Blackwell architecture "
        "whitepaper; TE MXFP8BlockScaling) [range, fitted]", bounds=(0.35, 0.90), precision=True)
    fp8_attention_speedup: float = _c(
        1.5, "x the bf16 fused attention's speed", "cuDNN FP8 fused attention (TE fp8_dpa: q, k, v cast to FP8, both "
        "attention GEMMs on the FP8 tensor cores, TransformerEngine d0067d0da transformer_engine/common/recipe/"
        "__init__.py:222-227) over the bf16 kernel: at most the FP8 / BF16 dense peak ratio, 2 on Hopper and Blackwell "
        "(attune.spec.hardware); softmax and the casts stay at their bf16 cost [bounds derived, fitted]",
        bounds=(1.0, 2.0), precision=True)
    nvfp4_gemm_efficiency: float = _c(
        0.50, "fraction of the dense FP4 peak", "NVFP4 GEMMs on Blackwell (E4M3 scale per 16 elements plus a "
        "tensor scale): no expressible corpus row, so not fitted [prior]")
    step_overhead_torch_s: float = _c(
        0.05, "s per step", "attune's torch runner: Python loop, gloo barrier and logging on CPU workers")


# ---------------------------------------------------------------------- the fitted values (package data)
DATA_FILE = "coefficients.yaml"
"""attune/estimator/coefficients.yaml: the values ``attune calibrate --fit`` fitted, what they were fitted to
and the residuals per series. ``shared`` overrides the field defaults above; ``per_generation.<gen>``
overrides ``shared`` for the GPUs of that generation (fields whose metadata says ``per_generation``)."""


def load_data() -> dict:
    """The package's coefficient data file as a mapping ({} when the package ships none)."""
    f = resources.files("attune.estimator").joinpath(DATA_FILE)
    if not f.is_file():
        return {}
    return yaml.safe_load(f.read_text()) or {}


def coefficients_from_data(data: dict, base: Coefficients | None = None
                           ) -> tuple[Coefficients, dict[str, Coefficients], tuple[str, ...]]:
    """(shared coefficients, coefficients per GPU generation, names in the data that are no field)."""
    base = base if base is not None else Coefficients()
    known = {f.name: f for f in dataclasses.fields(Coefficients)}
    unknown: set[str] = set()

    def apply(c: Coefficients, values: dict | None) -> Coefficients:
        values = values or {}
        unknown.update(k for k in values if k not in known)
        return dataclasses.replace(c, **{k: type(getattr(c, k))(v) for k, v in values.items() if k in known})

    shared = apply(base, data.get("shared"))
    per = {gen: apply(shared, vals) for gen, vals in (data.get("per_generation") or {}).items()}
    return shared, per, tuple(sorted(unknown))


DEFAULT, BY_GENERATION, UNKNOWN_NAMES = coefficients_from_data(load_data())
"""DEFAULT: the field defaults overridden by the data file's shared values; BY_GENERATION: per GPU generation;
UNKNOWN_NAMES: names in the data file that are no field (stale after a rename; ``attune calibrate`` lists them)."""


def coefficients_for(gpu: GPU) -> Coefficients:
    """The coefficients for a GPU: its generation's fitted set (ampere, hopper, blackwell), else DEFAULT."""
    return BY_GENERATION.get(gpu.generation, DEFAULT)


def peak_ratio(gpu: GPU, coef: Coefficients) -> float:
    """Sustained over nominal tensor-core peak of ``gpu``: ``blackwell_ultra_compute_ratio`` on Blackwell Ultra parts,
    1 elsewhere (the datasheet peak is what the GEMM efficiencies are fractions of)."""
    if not gpu.blackwell_ultra:
        return 1.0
    # the bound's own argument per part: SMs x board power, 160/148 x 1,400/1,200 W for GB300 over GB200 (rack-scale
    # NVLink domain), 160/148 x 1,100/1,000 W for B300 over B200 (HGX) (the sources in the field's comment)
    cap = 160 / 148 * (1400 / 1200 if gpu.nvlink_domain > gpu.gpus_per_node else 1100 / 1000)
    return min(coef.blackwell_ultra_compute_ratio, cap)
