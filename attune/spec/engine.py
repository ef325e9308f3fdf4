"""Training engines: where slime, Megatron-LM and attune's torch runner differ in memory and speed.

Each difference is a plain field with the source that documents it, so the memory and performance
models stay engine-agnostic and read these flags.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from attune.errors import EngineError


@dataclass(frozen=True)
class Engine:
    name: str
    # slime forces args.use_distributed_optimizer = True and args.bf16 = not args.fp16
    # (slime/backends/megatron_utils/arguments.py _set_default_megatron_args; reference slime-and-qwen.md 1.2)
    forces_distributed_optimizer: bool
    # bytes per logit element alive at the last stage's loss peak, over [tokens, vocab/TP]:
    # slime: fp32 logits (Float16Module upcast) + fp32 softmax saved for backward + one fp32 temporary for the
    # entropy it always logs = 12; Megatron's VocabParallelCrossEntropy: bf16 logits + fp32 copy reused as
    # exp_logits = 6 (reference megatron-memory-and-performance.md section 5).
    logits_bytes_per_element: float
    # slime's Qwen3.5 plugin wraps HF's GatedDeltaNet: not split by TP or CP, full weights and full-sequence
    # compute on every rank (slime-and-qwen.md 1.6); megatron-core's GDN is head-parallel over TP x CP.
    gdn_replicated: bool
    # slime packs rows with --use-dynamic-batch-size / --max-tokens-per-gpu (slime-and-qwen.md 1.5)
    dynamic_batching: bool
    # slime's HF GDN wrapper uses python RMSNorm with fp32 copies of the layer input (slime-and-qwen.md 4.3)
    gdn_fp32_norm_copies: bool
    # the Coefficients field holding this engine's per-step overhead outside forward/backward, seconds
    # (data hand-off, gradient clipping, logging; attune.estimator.coefficients has the values and sources)
    step_overhead: str
    label: str = ""
    # slime sets args.bf16 = not args.fp16 and trains in bf16 only (_set_default_megatron_args; slime-and-qwen.md 1.2)
    bf16_only: bool = False
    # trials run attune's own PyTorch trainer (attune.runners.torch_worker): fp32 parameters and gradients
    # (bf16 autocast on GPU), rows read on this machine, re-run with `attune run --runner torch`
    attune_trainer: bool = False
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the launch: less allocator fragmentation.
    # slime: its SFT script exports it (slime-and-qwen.md 1.3); Megatron-LM's examples do not.
    expandable_segments: bool = False
    # NCCL NVLink SHARP left on where the GPUs have it: slime exports NCCL_NVLS_ENABLE=${HAS_NVLINK}
    # (slime-and-qwen.md 1.3); Megatron-LM leaves NCCL's default (on); Megatron-Bridge / NeMo performance
    # launches export NCCL_NVLS_ENABLE=0 (Megatron-Bridge v0.2.0 scripts/performance/utils/executors.py line 42,
    # PERF_ENV_VARS: "Disable NVLink SHARP to save memory").
    nvls: bool = True
    # overlap flags the engine's recipes always set, whatever the layout says: Megatron-Bridge / NeMo
    # performance recipes set overlap_grad_reduce, overlap_param_gather (DistributedDataParallelConfig) and,
    # with TP > 1 and SP, tp_comm_overlap (TE userbuffers): the perf scripts build CommOverlapConfig(tp_comm_overlap=
    # bool(TP > 1)) from the model recipe's own TP (Megatron-Bridge v0.2.0 scripts/performance/configs/llama3/
    # llama3_llm_pretrain.py line 262), so a recipe run at TP 1 has it off (attune.calibrate.corpus.RECIPE_TP1);
    # what changed per release: MEGATRON_BRIDGE_RELEASES below
    recipe_overlap_grad_reduce: bool = False
    recipe_overlap_param_gather: bool = False
    recipe_tp_comm_overlap: bool = False
    # interleaved 1F1B overlaps the PP sends/receives with compute: Megatron-LM's overlap_p2p_comm is on
    # unless --no-overlap-p2p-communication (megatron/training/arguments.py) and applies to VPP > 1 only
    overlap_p2p_interleaved: bool = True
    # Megatron-LM before sequence parallelism sent each pipeline activation / gradient scattered over the TP ranks
    # (1/TP of the tensor per rank) and all-gathered it within TP on arrival (Narayanan et al. 2021, "Efficient
    # Large-Scale Language Model Training on GPU Clusters", section 4.1, "scatter/gather communication
    # optimization"; the --no-scatter-gather-tensors-in-pipeline flag still parses at Megatron-LM 1dcf0daf,
    # megatron/training/arguments.py lines 2305-2307, but megatron-core's p2p_communication no longer reads it)
    p2p_scatter_gather: bool = False
    # launches of Megatron-LM's 2021-2022 era: sequence parallelism (Korthikanti et al. 2022) and the distributed
    # optimizer were not yet the default, so a published run that does not state them ran without (the corpus
    # reader's assumption for unstated fields); later engines' performance recipes turn both on
    era_without_sp_and_dist_optimizer: bool = False
    # gradient buffer dtype on the bf16 path: megatron-core's DistributedDataParallelConfig.grad_reduce_in_fp32.
    # Megatron-LM turns it on for bf16 (megatron/training/arguments.py: accumulate_allreduce_grads_in_fp32 =
    # True with --bf16); NeMo / Megatron-Bridge performance launches turn it off (NeMo
    # scripts/performance/helpers.py set_primary_perf_configs: recipe.trainer.plugins.grad_reduce_in_fp32 =
    # False; consistent with the NeMo example log's 68.0 GiB reserved peak, which leaves no room for fp32 grads).
    # False: a bf16 grad buffer, reduced in bf16, and an fp32 copy of the optimizer's grad shard.
    grad_reduce_in_fp32: bool = True
    # the fp16 path with --accumulate-allreduce-grads-in-fp32: fp16 params, an fp32 main-grad buffer, fp32 master,
    # m, v = 18 bytes per parameter without the distributed optimizer (Megatron-LM docs dist_optimizer.md table,
    # "float16 param, float32 grads"); the 2022 Megatron papers count exactly these 18 bytes (Korthikanti et al.
    # 2022, "Reducing Activation Recomputation in Large Transformer Models", Section 2 memory of the model
    # states). Off: fp16 grads and an fp32 grad copy made only at the optimizer step (megatron-core default).
    fp16_grads_in_fp32: bool = False
    # core attention kernel: "flash" (FlashAttention / cuDNN fused attention: keeps q, k, v, the output and the
    # fp32 log-sum-exp; Megatron-LM with TE since 2023) or "unfused" (Megatron-LM <= v3.0 and
    # Megatron-DeepSpeed, 2022: FusedScaleMaskSoftmax keeps the bf16 softmax probabilities, the attention-dropout
    # mask (1 byte) and the dropped-out probabilities, 5 bytes per score: Korthikanti et al. 2022, section 4.1)
    attention_kernel: str = "flash"
    # dropout with a saved 1-byte mask after the attention out-projection and after the MLP (Korthikanti et al.
    # 2022 section 4.1: 2 x s*b*h bytes per layer); the 2023+ performance recipes train with hidden and
    # attention dropout 0 (NeMo / Megatron-Bridge GPT and Nemotron configs), which keeps no mask
    hidden_dropout_masks: bool = False
    # CUDA graphs of the training step (megatron-core --cuda-graph-impl / --cuda-graph-scope): "none" (eager: the
    # CPU launches every kernel; slime's and Megatron-LM's launches), "scoped" (transformer_engine graphs of some
    # modules: attn, moe_router, moe_preprocess; the rest eager) or "full" (full_iteration: the whole step replayed,
    # no host launches). Megatron-Bridge's performance recipes set it per model, GPU and release
    # (attune/calibrate/mbridge_recipes.yaml); it prices the host launch time the MoE layers' device-to-host syncs
    # expose (attune.estimator.moe.host_exposed_s)
    cuda_graphs: str = "none"
    # low-precision kernels a recipe turns on beyond the GEMMs (issue 22; read only with fp8 / fp4 GEMMs, see
    # attune.estimator.precision): fp8_attention = megatron-core fp8_dot_product_attention (transformer_config.py:482,
    # passed to TE as the recipe's fp8_dpa, extensions/transformer_engine.py:2210): cuDNN fused attention in FP8
    # (TransformerEngine d0067d0da transformer_engine/common/recipe/__init__.py:222-227); fused_grouped_mlp =
    # Megatron-Bridge's cutedsl_fused_grouped_mlp (NVTE_CUTEDSL_FUSED_GROUPED_MLP=1, v0.5.0 scripts/performance/
    # perf_plugins.py:308): TE's fused MXFP8 grouped MLP, fc1 grouped GEMM + SwiGLU + the fc2 input's MXFP8 quantize
    # in one kernel (TE d0067d0da docs/examples/te_mixtral/te_mixtral_mxfp8.py:5-17, ops/fused/grouped_mlp.py).
    # Megatron-Bridge's MXFP8 recipes set both from v0.5.0 (attune/calibrate/mbridge_recipes.yaml)
    fp8_attention: bool = False
    fused_grouped_mlp: bool = False
    # the column-parallel linears' backward launches the input-gradient TP all-reduce (reduce-scatter under SP)
    # asynchronously and computes the weight gradient under it: megatron-core tensor_parallel/layers.py lines
    # 548-566 at 1dcf0daf (and TE's linears); in Megatron-LM since 2021 (--no-async-tensor-model-parallel-allreduce,
    # so in the 2022 papers' v3.0). Off for Megatron-DeepSpeed, whose BigScience fork predates it [unverified]
    async_dgrad: bool = True


ENGINES: dict[str, Engine] = {
    "slime": Engine("slime", True, 12.0, True, True, True, step_overhead="step_overhead_slime_s", bf16_only=True,
                    expandable_segments=True, label="slime (Megatron-LM backend, Qwen3.5 HF GDN plugin)"),
    "megatron": Engine("megatron", False, 6.0, False, False, False, step_overhead="step_overhead_megatron_s",
                       label="Megatron-LM (megatron-core, its own defaults: no DP/TP overlap unless flagged)"),
    # NeMo 2 / Megatron-Bridge: megatron-core with the performance recipes' defaults (communication overlap
    # on; distributed optimizer and fp32 grad reduction as in Megatron-LM's bf16 path: the recipes'
    # bf16_mixed sets grad_reduce_in_fp32=True)
    "megatron-bridge": Engine("megatron-bridge", False, 6.0, False, False, False,
                              step_overhead="step_overhead_megatron_s", nvls=False, recipe_overlap_grad_reduce=True,
                              recipe_overlap_param_gather=True, recipe_tp_comm_overlap=True, grad_reduce_in_fp32=False,
                              label="Megatron-Bridge / NeMo (megatron-core with the performance recipes' overlap)"),
    # Megatron-LM as of the 2022 papers (v3.0) and Megatron-DeepSpeed: no FlashAttention, no Transformer Engine,
    # attention and hidden dropout 0.1 (GPT-3 / BLOOM configs); not a launch target, only for published runs
    "megatron-legacy": Engine("megatron-legacy", False, 6.0, False, False, False,
                              step_overhead="step_overhead_megatron_s", attention_kernel="unfused",
                              hidden_dropout_masks=True, fp16_grads_in_fp32=True, p2p_scatter_gather=True,
                              era_without_sp_and_dist_optimizer=True,
                              label="Megatron-LM v3.0 / Megatron-DeepSpeed (2022: unfused core attention, dropout)"),
    # Megatron-DeepSpeed (BigScience's BLOOM fork): megatron-legacy's model code, but DeepSpeed's pipeline engine
    # sends each stage's whole output tensor (deepspeed/runtime/pipe/engine.py _exec_send_activations,
    # lines 1037-1041 at DeepSpeed 38327e07f), without Megatron's scatter/gather over TP
    "megatron-deepspeed": Engine("megatron-deepspeed", False, 6.0, False, False, False,
                                 step_overhead="step_overhead_megatron_s", attention_kernel="unfused",
                                 hidden_dropout_masks=True, fp16_grads_in_fp32=True,
                                 era_without_sp_and_dist_optimizer=True, async_dgrad=False,
                                 label="Megatron-DeepSpeed (2022: megatron-legacy's model code, DeepSpeed's pipeline)"),
    # attune's own PyTorch runner: fp32 log-softmax over full logits (logits + log_softmax + grad)
    "torch": Engine("torch", False, 12.0, True, True, True, step_overhead="step_overhead_torch_s", attune_trainer=True,
                    nvls=False, label="attune torch runner (PyTorch, gloo/NCCL)"),
}
# the engine when neither the runner nor the caller names one: slime's launch, as the recipes' run blocks are
DEFAULT_ENGINE = "slime"


@dataclass(frozen=True)
class ReleaseChange:
    """One change in what NeMo / Megatron-Bridge's performance launches ran with, from a container release on."""

    since: tuple[int, int]
    """The first NeMo container (year, month) with the change: 25.09 -> (25, 9)."""
    fields: tuple[tuple[str, object], ...]
    """The ``Engine`` fields it sets."""
    source: str
    """Where the change is read (repository, file, line or commit)."""


MEGATRON_BRIDGE_RELEASES: tuple[ReleaseChange, ...] = (
    # before 25.09 (NeMo 2 launches): ENGINES["megatron-bridge"] as it stands, megatron-core's fused "native"
    # cross entropy (megatron/core/fusions/fused_cross_entropy.py: bf16 logits + the fp32 exp_logits it saves)
    ReleaseChange((25, 9), (("logits_bytes_per_element", 2.0),),
                  "Megatron-Bridge perf configs set cross_entropy_fusion_impl 'te' (v0.1.0rc4 scripts/performance/"
                  "configs/llama3/llama3_8b_llm_pretrain.yaml line 17; v0.2.0 scripts/performance/utils/helpers.py "
                  "line 108 for every recipe; GPTModelProvider cross_entropy_loss_fusion=True): TE's "
                  "parallel_cross_entropy wrote the gradient into the bf16 logits in place, 2 bytes per element"),
    ReleaseChange((26, 6), (("expandable_segments", True),),
                  "Megatron-Bridge scripts/performance/utils/executors.py PERF_ENV_VARS "
                  "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for every performance launch (commit 6f24c71f3, "
                  "2026-05-12, in v0.5.0; before it only a few recipes set it in perf_plugins.py)"),
    ReleaseChange((26, 8), (("logits_bytes_per_element", 6.0),),
                  "TransformerEngine 01bbe3eea (2026-07-09, transformer_engine/pytorch/triton/cross_entropy.py): the "
                  "fused cross entropy keeps an fp32 gradient beside the bf16 logits [assumed in the 26.08 container]"),
)
"""What each NeMo / Megatron-Bridge release's performance launches ran with, beyond ``ENGINES['megatron-bridge']``
(the NeMo 2 launches, 24.xx-25.07 containers). Applied in order up to a row's container release."""


def container_release(version: str) -> tuple[int, int] | None:
    """(year, month) of a NeMo container named in ``version`` ("NeMo 25.02.01 container" -> (25, 2)), else None."""
    m = re.search(r"\b(2\d)\.(\d{2})(?:\.\d+)*\b", version or "")
    return (int(m.group(1)), int(m.group(2))) if m and 1 <= int(m.group(2)) <= 12 else None


def for_release(engine: Engine, version: str) -> Engine:
    """``engine`` as the release named in ``version`` ran it: the megatron-bridge engine with every
    ``MEGATRON_BRIDGE_RELEASES`` change up to the release; any other engine, or an unparsed version, unchanged."""
    rel = container_release(version) if engine.name == "megatron-bridge" else None
    if rel is None:
        return engine
    fields: dict[str, object] = {}
    for ch in MEGATRON_BRIDGE_RELEASES:
        if ch.since <= rel:
            fields.update(ch.fields)
    if not fields:
        return engine
    return replace(engine, **fields, label=f"{engine.label}; NeMo {rel[0]}.{rel[1]:02d} launches")


def get_engine(name: str) -> Engine:
    if name not in ENGINES:
        raise EngineError(f"unknown engine '{name}'; allowed: {', '.join(ENGINES)}")
    return ENGINES[name]


def _check(e: Engine) -> None:
    if e.attention_kernel not in ("flash", "unfused"):
        raise EngineError(f"engine {e.name}: attention_kernel '{e.attention_kernel}'; allowed: flash, unfused")


for _e in ENGINES.values():
    _check(_e)
