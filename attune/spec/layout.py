"""One parallel layout and its workload: pure value types with their field invariants.

Rules that need the model, the cluster or the engine (divisibility, recompute ranges) live in
``attune.spec.rules``; the per-stage placement derived from a layout in ``attune.spec.placement``;
Megatron-LM / slime flags in and out in ``attune.spec.flags``.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, replace
from typing import Literal

from attune.errors import LayoutError

Granularity = Literal["none", "selective", "full"]
RecomputeMethod = Literal["block", "uniform"]
Precision = Literal["bf16", "fp16"]

GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("block", "uniform")
PRECISIONS = ("bf16", "fp16")
MOE_DISPATCHERS = ("alltoall", "allgather", "flex")  # Megatron-LM _add_moe_args --moe-token-dispatcher-type choices
# Low precision (issue 22; attune.spec.precision): Megatron-LM 1dcf0daf transformer_config.py:434-526 Literal choices
# of --fp8-format, --fp8-recipe (less 'custom': a user's quantizer factory, not modelled) and --fp4-format
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")
FP4_FORMATS = ("e2m1",)


def _positive(owner: str, **values) -> None:
    for name, v in values.items():
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise LayoutError(f"{owner}.{name} must be an integer (got {v!r})")
        if v < 1:
            raise LayoutError(f"{owner}.{name} must be >= 1 (got {v})")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one training step consumes and how a measured run is set up; independent of the layout."""

    seq_length: int = 8192
    """Tokens per packed row (Megatron's ``--seq-length``)."""
    global_batch: int = 128
    """Rows per optimizer step (``--global-batch-size``)."""
    steps: int = 20
    """Optimizer steps of a measured run (slime's ``--num-rollout``)."""
    window: tuple[int, int] = (5, 19)
    """Measured steps, 0-based and inclusive: the first steps warm up and are not timed."""
    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 1e-6
    """Learning rate at the end of the decay."""
    lr_decay_style: str = "cosine"
    """Megatron's ``--lr-decay-style``."""
    warmup_fraction: float = 0.1
    """Fraction of the steps spent warming the learning rate up."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.98
    """AdamW beta2."""
    seed: int = 42
    """Random seed of the run (data order and initialisation)."""

    def __post_init__(self) -> None:
        _positive("workload", seq_length=self.seq_length, global_batch=self.global_batch, steps=self.steps)
        a, b = self.window
        if not (0 <= a <= b):
            raise LayoutError(f"workload.window {self.window}: needs 0 <= first <= last")
        if self.lr <= 0 or self.min_lr < 0:
            raise LayoutError(f"workload learning rates must be positive (lr {self.lr}, min_lr {self.min_lr})")

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step: rows x row length."""
        return self.seq_length * self.global_batch

    def with_steps(self, steps: int) -> "Workload":
        """This workload run for ``steps`` steps; the one rule for shortening the measurement window.

        A window that ends inside the run is kept; otherwise it ends at the last step and starts after a
        warm-up of a quarter of the run (at most the window's own start).
        """
        a, b = self.window
        window = self.window if b < steps else (min(a, max(0, steps // 4)), steps - 1)
        return replace(self, steps=steps, window=window)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one training step is split over the GPUs (Megatron-LM's parallel and memory knobs)."""

    tp: int = 1
    """Tensor-parallel size (``--tensor-model-parallel-size``)."""
    pp: int = 1
    """Pipeline-parallel size (``--pipeline-model-parallel-size``)."""
    dp: int = 1
    """Data-parallel size: world / (TP x PP x CP); derived, never a flag."""
    cp: int = 1
    """Context-parallel size (``--context-parallel-size``)."""
    ep: int = 1
    """Expert-parallel size (``--expert-model-parallel-size``): routed experts split over EP ranks; MoE only."""
    etp: int = 1
    """Expert tensor-parallel size (``--expert-tensor-parallel-size``): each expert's matrices split over ETP
    ranks. Expert data parallelism is derived as Megatron does: world / (PP x EP x ETP)."""
    moe_dispatcher: str | None = None
    """MoE token dispatcher (``--moe-token-dispatcher-type``): alltoall, allgather or flex (DeepEP); None:
    the flag is absent (Megatron's default allgather) or the model is dense."""
    moe_grouped_gemm: bool = False
    """All local experts in one grouped GEMM (``--moe-grouped-gemm``) instead of a loop of per-expert GEMMs."""
    moe_permute_fusion: bool = False
    """Fused token permutation / unpermutation kernels (``--moe-permute-fusion``)."""
    moe_shared_expert_overlap: bool = False
    """The shared expert runs under the dispatch / combine all-to-all (``--moe-shared-expert-overlap``)."""
    moe_capacity_factor: float | None = None
    """Token dropping: each expert takes at most capacity x tokens x top-k / experts tokens
    (``--moe-expert-capacity-factor``); None: dropless."""
    moe_force_balance: bool = False
    """Routing replaced by an even spread of tokens over the experts (``--moe-router-force-load-balancing``,
    megatron-core: for benchmarking only; Megatron-Bridge's published MoE runs "force-balance the token
    distribution among experts"): no load imbalance, and not the model's own routing."""
    moe_ep_overlap: bool = False
    """The dispatch / combine all-to-all of one microbatch runs under another's compute
    (``--overlap-moe-expert-parallel-comm``: megatron-core's combined 1F1B schedule; constraints in rules.py)."""
    sp: bool = False
    """Sequence parallelism (``--sequence-parallel``); needs TP > 1."""
    first: int | None = None
    """Layers on the first pipeline stage (``--decoder-first-pipeline-num-layers``); None: even split."""
    last: int | None = None
    """Layers on the last pipeline stage (``--decoder-last-pipeline-num-layers``); None: even split."""
    vpp: int = 1
    """Virtual pipeline stages per rank (``--num-virtual-stages-per-pipeline-rank``)."""
    micro_batch_size: int = 1
    """Rows per microbatch with static batching (``--micro-batch-size``)."""
    max_tokens_per_gpu: int | None = None
    """slime's dynamic batching: tokens per GPU per microbatch (``--max-tokens-per-gpu``); None: static."""
    recompute_granularity: Granularity = "none"
    """Activation recompute: none, selective (core attention) or full layers."""
    recompute_method: RecomputeMethod | None = None
    """Full recompute only: block (the first N layers of each chunk) or uniform (groups of N)."""
    recompute_num_layers: int | None = None
    """Full recompute only: N of ``--recompute-num-layers``."""
    mtp_layers: int = 0
    """Multi-token-prediction layers trained on the last pipeline stage (``--mtp-num-layers``; megatron-core
    multi_token_prediction.py): at most the model's MTP modules (DeepSeek-V3 ``num_nextn_predict_layers``); 0:
    none. Numerics, not layout: each adds a loss term."""
    distributed_optimizer: bool = True
    """Optimizer states sharded over DP x CP (``--use-distributed-optimizer``; slime forces it)."""
    precision_aware_optimizer: bool = False
    """16-bit master-weight remainders (``--use-precision-aware-optimizer``); Megatron's default is off."""
    optimizer_cpu_offload: bool = False
    """Optimizer states and step on the host CPU (``--optimizer-cpu-offload``)."""
    offload_fraction: float = 1.0
    """Fraction of the optimizer offloaded (``--optimizer-offload-fraction``), in (0, 1]."""
    overlap_cpu_optimizer: bool = False
    """Overlap the offloaded optimizer's copies with compute (``--overlap-cpu-optimizer-d2h-h2d``)."""
    precision: Precision = "bf16"
    """Training precision: bf16 or fp16 (``--bf16`` / ``--fp16``)."""
    fp8_format: str | None = None
    """fp8 GEMMs through Transformer Engine (``--fp8-format``: e4m3, or hybrid = e5m2 gradients); None: off.
    Numerics, not layout (``attune.spec.precision``)."""
    fp8_recipe: str = "delayed"
    """fp8 scaling recipe (``--fp8-recipe``: delayed, tensorwise, blockwise, mxfp8 on Blackwell); read only with
    ``fp8_format``."""
    fp8_param_gather: bool = False
    """Parameters kept in fp8 and all-gathered in fp8 (``--fp8-param-gather``; needs the distributed optimizer)."""
    fp4_format: str | None = None
    """NVFP4 GEMMs (``--fp4-format e2m1``, Blackwell); None: off."""
    overlap_grad_reduce: bool = False
    """Overlap the DP gradient reduce-scatter / all-reduce with backward (``--overlap-grad-reduce``); engines
    whose recipes always set it (Megatron-Bridge / NeMo) turn it on regardless."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward
    (``--overlap-param-gather``)."""
    tp_comm_overlap: bool = False
    """TE userbuffers: TP all-gathers / reduce-scatters pipelined with their GEMMs (``--tp-comm-overlap``;
    needs SP)."""
    # ---- knobs beyond the seed (issue 15): pipeline layout strings, module recompute, activation offload
    pipeline_layout: str | None = None
    """Megatron's explicit per-stage layout (``--pipeline-model-parallel-layout``: ``E``, ``t``, ``L``, ``|``;
    see ``attune.spec.pipeline_layout``); None: the first/last/even split."""
    account_for_embedding: bool = False
    """Count the input embedding as one layer of the even split (``--account-for-embedding-in-pipeline-split``)."""
    account_for_loss: bool = False
    """Count the output layer and loss as one layer of the even split (``--account-for-loss-in-pipeline-split``)."""
    recompute_modules: tuple[str, ...] = ()
    """Selective recompute only: the modules recomputed (``--recompute-modules``); (): Megatron's default
    (core_attn)."""
    offload_modules: tuple[str, ...] = ()
    """Fine-grained activation offloading: modules whose inputs go to host memory in forward
    (``--fine-grained-activation-offloading --offload-modules``); (): off."""

    def __post_init__(self) -> None:
        # (module lists read back from JSON / YAML become tuples below; no other field is a sequence)
        _positive("layout", tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp, ep=self.ep, etp=self.etp, vpp=self.vpp,
                  micro_batch_size=self.micro_batch_size, max_tokens_per_gpu=self.max_tokens_per_gpu)
        for name in ("first", "last", "recompute_num_layers"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise LayoutError(f"layout.{name} must be an integer (got {v!r})")
        if self.recompute_granularity not in GRANULARITIES:
            raise LayoutError(f"recompute granularity '{self.recompute_granularity}'; allowed: {', '.join(GRANULARITIES)}")
        if self.recompute_method is not None and self.recompute_method not in RECOMPUTE_METHODS:
            raise LayoutError(f"recompute method '{self.recompute_method}'; allowed: {', '.join(RECOMPUTE_METHODS)}")
        if self.precision not in PRECISIONS:
            raise LayoutError(f"precision '{self.precision}'; allowed: {', '.join(PRECISIONS)}")
        if self.fp8_format is not None and self.fp8_format not in FP8_FORMATS:
            raise LayoutError(f"fp8 format '{self.fp8_format}'; allowed: {', '.join(FP8_FORMATS)}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise LayoutError(f"fp8 recipe '{self.fp8_recipe}' is not modelled; allowed: {', '.join(FP8_RECIPES)}")
        if self.fp4_format is not None and self.fp4_format not in FP4_FORMATS:
            raise LayoutError(f"fp4 format '{self.fp4_format}'; allowed: {', '.join(FP4_FORMATS)}")
        if self.fp8_format is None and self.fp8_recipe != "delayed":
            object.__setattr__(self, "fp8_recipe", "delayed")  # the recipe does nothing without --fp8-format
        if not 0.0 < self.offload_fraction <= 1.0:
            raise LayoutError(f"offload fraction {self.offload_fraction} must be in (0, 1]")
        if self.moe_dispatcher is not None and self.moe_dispatcher not in MOE_DISPATCHERS:
            raise LayoutError(f"MoE token dispatcher '{self.moe_dispatcher}'; allowed: {', '.join(MOE_DISPATCHERS)}")
        if isinstance(self.mtp_layers, bool) or not isinstance(self.mtp_layers, int) or self.mtp_layers < 0:
            raise LayoutError(f"layout.mtp_layers must be an integer >= 0 (got {self.mtp_layers!r})")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise LayoutError(f"MoE capacity factor {self.moe_capacity_factor} must be > 0 (or absent: dropless)")
        for name in ("recompute_modules", "offload_modules"):
            v = getattr(self, name)
            if isinstance(v, list):  # read back from JSON / YAML
                v = tuple(v)
                object.__setattr__(self, name, v)
            if not isinstance(v, tuple) or not all(isinstance(x, str) and x for x in v):
                raise LayoutError(f"layout.{name} must be a tuple of module names (got {v!r})")
        if self.pipeline_layout is not None and (not isinstance(self.pipeline_layout, str) or not self.pipeline_layout):
            raise LayoutError(f"layout.pipeline_layout must be a non-empty string or None (got {self.pipeline_layout!r})")

    @property
    def effective_recompute_modules(self) -> tuple[str, ...]:
        """Modules selective recompute recomputes (Megatron's default core_attn when none are named); ()
        without selective recompute."""
        if self.recompute_granularity != "selective":
            return ()
        return self.recompute_modules or ("core_attn",)

    @property
    def world_size(self) -> int:
        """GPUs the layout spans: TP x PP x CP x DP."""
        return self.tp * self.pp * self.cp * self.dp

    def label(self) -> str:
        """A short human label, e.g. ``TP1 PP4 16/14 DP2 Rb12 mt8192``."""
        parts = [f"TP{self.tp}"] + (["SP"] if self.sp else []) + [f"PP{self.pp}"]
        if self.pp > 1 and (self.first is not None or self.last is not None):
            parts.append(f"{self.first if self.first is not None else '-'}/{self.last if self.last is not None else '-'}")
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        parts.append(f"DP{self.dp}")
        if self.ep > 1 or self.etp > 1:
            parts.append(f"EP{self.ep}" + (f" ETP{self.etp}" if self.etp > 1 else "")
                         + {"alltoall": " a2a", "allgather": " ag", "flex": " flex"}.get(self.moe_dispatcher or "", "")
                         + (" overlap" if self.moe_ep_overlap else ""))
        if self.recompute_granularity == "full":
            parts.append(f"R{(self.recompute_method or '?')[0]}{self.recompute_num_layers}")
        elif self.recompute_granularity == "selective":
            parts.append("Rsel" + (f"[{','.join(self.recompute_modules)}]" if self.recompute_modules else ""))
        if self.pipeline_layout is not None:
            parts.append(f"layout={self.pipeline_layout}")
        elif self.account_for_embedding or self.account_for_loss:
            parts.append("acc" + ("E" if self.account_for_embedding else "") + ("L" if self.account_for_loss else ""))
        if self.offload_modules:
            parts.append(f"actoff[{','.join(self.offload_modules)}]")
        if self.optimizer_cpu_offload:
            parts.append(f"off{self.offload_fraction:g}")
        if self.mtp_layers:
            parts.append(f"MTP{self.mtp_layers}")
        if self.fp4_format is not None:
            parts.append("nvfp4")
        elif self.fp8_format is not None:
            parts.append(("mxfp8" if self.fp8_recipe == "mxfp8" else f"fp8-{self.fp8_recipe}")
                         + ("-hybrid" if self.fp8_format == "hybrid" else "") + ("+pg" if self.fp8_param_gather else ""))
        if self.max_tokens_per_gpu:
            parts.append(f"mt{self.max_tokens_per_gpu}")
        elif self.micro_batch_size > 1:
            parts.append(f"mbs{self.micro_batch_size}")
        return " ".join(parts)

    def slug(self) -> str:
        """A file-name-safe name, e.g. ``tp1-pp4-split16-rb12``."""
        s = f"tp{self.tp}-pp{self.pp}"
        if self.pp > 1 and self.first is not None:
            s += f"-split{self.first}"
        if self.vpp > 1:
            s += f"-vpp{self.vpp}"
        if self.cp > 1:
            s += f"-cp{self.cp}"
        if self.ep > 1:
            s += f"-ep{self.ep}"
        if self.etp > 1:
            s += f"-etp{self.etp}"
        if self.recompute_granularity == "full":
            s += f"-r{(self.recompute_method or '?')[0]}{self.recompute_num_layers}"
        elif self.recompute_granularity == "selective":
            s += "-rsel" + "".join(f"-{m.replace('_', '')}" for m in self.recompute_modules)
        if self.pipeline_layout is not None:
            s += f"-pl{zlib.crc32(self.pipeline_layout.encode()):08x}"
        elif self.account_for_embedding or self.account_for_loss:
            s += "-acc" + ("e" if self.account_for_embedding else "") + ("l" if self.account_for_loss else "")
        if self.offload_modules:
            s += "-actoff"
        if self.optimizer_cpu_offload:
            s += "-offload"
        if self.mtp_layers:
            s += f"-mtp{self.mtp_layers}"
        if self.fp4_format is not None:
            s += "-nvfp4"
        elif self.fp8_format is not None:
            s += "-" + ("mxfp8" if self.fp8_recipe == "mxfp8" else f"fp8{self.fp8_recipe}") + ("-pg" if self.fp8_param_gather else "")
        return s

    def to_dict(self) -> dict:
        return asdict(self)
