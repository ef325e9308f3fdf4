"""Every rule a layout must satisfy for a model, a cluster size, a workload and an engine.

``check`` returns one message per broken rule (naming the rule and what is allowed); ``validate`` raises
them as one ``LayoutError``. Both the flag parser, the recipe validator and the search use these.
"""

from __future__ import annotations

from attune.errors import LayoutError

from .engine import Engine
from .flag_data import engine_choices
from .knobs import MLA_ONLY, MOE_ONLY, OFFLOAD_MODULES, RECOMPUTE_MODULES
from .layout import Layout, Workload
from .model import ModelSpec
from .moe import moe_rules
from .pipeline_layout import check_layout_string
from .placement import chunk_ranges, stage_layer_counts, virtual_stage_counts
from .precision import precision_rules


def index_sharing_rule(L, model: ModelSpec) -> list[str]:
    """DSA cross-layer index sharing (GLM-5.2) keeps the top-k within a pipeline stage: every (virtual) stage
    starts on a computing layer (slime 624b824a slime_plugins/models/glm5/glm5.py lines 1023-1047, asserted when
    the model is built; scripts/run-glm5.2-744B-A40B.sh lines 67-72 pick first 14 / last 16 layers for it).
    ``L``: a Layout or anything with the fields ``attune.spec.placement.chunk_ranges`` reads (the search's split)."""
    mla = model.mla
    if mla is None or mla.index_topk_freq == 1 or L.pp * L.vpp == 1:
        return []
    bad = sorted(a + 1 for chunks in chunk_ranges(L, model.num_layers) for a, b in chunks
                 if b > a and not mla.computes_index(a))
    if not bad:
        return []
    return [f"a pipeline stage starts on layer {', '.join(map(str, bad))} (1-indexed), which reuses the DSA top-k "
            f"of a layer on an earlier stage (index_topk_freq {mla.index_topk_freq}, index_skip_topk_offset "
            f"{mla.index_skip_topk_offset}); every stage must start on a computing layer (slime glm5.py)"]


def check(layout: Layout, model: ModelSpec, world_size: int, workload: Workload, engine: Engine) -> list[str]:
    """Every rule the layout breaks, one message each (empty when valid)."""
    L = layout
    e = [f"{name} must be >= 1 (got {getattr(L, name)})"
         for name in ("tp", "pp", "dp", "cp", "vpp", "micro_batch_size") if getattr(L, name) < 1]
    if e:
        return e
    e += _size_rules(L, model, world_size, engine)
    e += _pipeline_string_rules(L, model, engine)
    counts = None
    if not e:  # the layer split is derived only from sizes that passed their rules
        split_errors, counts = _split_rules(L, model)
        e += split_errors
    e += _recompute_rules(L, model, counts)
    e += check_knobs(L, model, engine)
    e += precision_rules(L)
    e += _optimizer_rules(L, engine)
    e += _batch_rules(L, workload, engine)
    return e


def _size_rules(L: Layout, model: ModelSpec, world_size: int, engine: Engine) -> list[str]:
    """The parallel sizes against the GPUs and the model: world size, experts, MTP, heads, the family's rules, SP, PP."""
    e: list[str] = []
    if L.world_size != world_size:
        e.append(f"world size {world_size} GPUs != TP {L.tp} x PP {L.pp} x CP {L.cp} x DP {L.dp} = {L.world_size}")
    e += moe_rules(L, model)
    e += dispatcher_rules(L, model, engine)
    if L.mtp_layers and L.mtp_layers > model.mtp_layers:
        e.append(f"--mtp-num-layers {L.mtp_layers} needs a model with that many multi-token-prediction modules ("
                 f"{model.name} has {model.mtp_layers}: config num_nextn_predict_layers); allowed: 0"
                 + (f" to {model.mtp_layers}" if model.mtp_layers > 1 else " or 1" if model.mtp_layers else ""))
    if model.heads % L.tp:
        e.append(f"TP {L.tp} must divide the {model.heads} attention heads")
    if model.kv_heads % L.tp:
        e.append(f"TP {L.tp} must divide the {model.kv_heads} query groups (KV heads)")
    e += model.traits.layout_rules(L, model, engine)  # the family's own rules (attune.spec.families)
    if L.sp and L.tp == 1:
        e.append("sequence parallelism needs TP > 1")
    if L.pp > model.num_layers:
        e.append(f"PP {L.pp} exceeds the {model.num_layers} layers")
    if L.pp == 1 and (L.first is not None or L.last is not None):
        e.append("first/last stage layer counts need PP > 1")
    return e


def _pipeline_string_rules(L: Layout, model: ModelSpec, engine: Engine) -> list[str]:
    """A layout string, or the embedding/loss accounting, against the other ways of stating the layer split."""
    e: list[str] = []
    account = L.account_for_embedding or L.account_for_loss
    if L.pipeline_layout is not None:
        if L.first is not None or L.last is not None or account:
            e.append("--pipeline-model-parallel-layout cannot be combined with --decoder-first/last-pipeline-num-layers "
                     "or --account-for-embedding/loss-in-pipeline-split")
        e.extend(check_layout_string(L.pipeline_layout, L.pp, L.vpp, model.num_layers))
        refused = layout_string_refusal(model, engine)
        if refused:
            e.append(refused)
    elif account and (L.first is not None or L.last is not None):
        e.append("--account-for-embedding/loss-in-pipeline-split cannot be combined with "
                 "--decoder-first/last-pipeline-num-layers")
    elif account and L.pp == 1:
        e.append("--account-for-embedding/loss-in-pipeline-split needs PP > 1")
    return e


def _split_rules(L: Layout, model: ModelSpec) -> tuple[list[str], list[int] | None]:
    """The stage layer counts (None when they cannot be derived) and the rules they break: at least one layer per
    stage, VPP dividing each stage, then DSA index sharing."""
    try:
        counts = stage_layer_counts(L, model.num_layers)
    except LayoutError as err:
        return [str(err)], None
    e: list[str] = []
    if any(c < 1 for c in counts) or sum(counts) != model.num_layers:
        e.append(f"layer split {'/'.join(map(str, counts))} must sum to {model.num_layers} with at least one layer per stage")
    if L.vpp > 1:
        if L.pp < 2:
            e.append("virtual pipeline stages need PP >= 2")
        bad = [c for c in counts if c % L.vpp]
        if bad and L.pipeline_layout is None and not (L.account_for_embedding or L.account_for_loss):
            e.append(f"VPP {L.vpp} must divide every stage's layers ({'/'.join(map(str, counts))})")
    if not e:
        e += index_sharing_rule(L, model)
    return e, counts


def _recompute_rules(L: Layout, model: ModelSpec, counts: list[int] | None) -> list[str]:
    """Recompute granularity, method and layer count (against the smallest and largest chunk of ``counts``)."""
    e: list[str] = []
    g, meth, n = L.recompute_granularity, L.recompute_method, L.recompute_num_layers
    if L.mtp_layers and g == "full" and meth == "uniform" and n not in (None, 1):
        # megatron-core 0.16.1 MultiTokenPredictionLayer._checkpointed_forward asserts it
        e.append(f"--mtp-num-layers with uniform full recompute needs --recompute-num-layers 1 (got {n})")
    if g not in ("none", "selective", "full"):
        e.append(f"recompute granularity '{g}'; allowed: none, selective, full")
    elif g == "full":
        if meth not in ("block", "uniform"):
            e.append(f"full recompute needs a method: block or uniform (got {meth})")
        if n is None or n < 1:
            e.append("full recompute needs --recompute-num-layers >= 1")
        elif counts is not None and L.vpp >= 1 and not any(c < 1 for c in counts):
            chunk_sizes = virtual_stage_counts(L, model.num_layers) or [c // L.vpp for c in counts]
            per_chunk = min(c for c in chunk_sizes if c > 0) if any(chunk_sizes) else 0
            if meth == "uniform" and n > per_chunk:
                e.append(f"uniform recompute of {n} layers exceeds the {per_chunk} layers of the smallest chunk")
            if meth == "block" and n > max(chunk_sizes):
                e.append(f"block recompute of {n} layers exceeds the {max(chunk_sizes)} layers per chunk")
    elif meth is not None or n is not None:
        e.append(f"recompute method/num-layers only apply to full recompute (granularity is {g})")
    return e


def _optimizer_rules(L: Layout, engine: Engine) -> list[str]:
    """Training precision and the optimizer: distributed, precision-aware, CPU offload."""
    e: list[str] = []
    if L.precision not in ("bf16", "fp16"):
        e.append(f"precision '{L.precision}'; allowed: bf16, fp16")
    if engine.forces_distributed_optimizer and not L.distributed_optimizer:
        e.append(f"{engine.name} always uses the distributed optimizer")
    if engine.bf16_only and L.precision != "bf16":
        e.append("slime trains in bf16 only")
    if L.optimizer_cpu_offload:
        if not L.precision_aware_optimizer:
            e.append("optimizer CPU offload needs --use-precision-aware-optimizer (Megatron asserts it)")
        if not 0.0 < L.offload_fraction <= 1.0:
            e.append(f"offload fraction {L.offload_fraction} must be in (0, 1]")
    if L.precision_aware_optimizer and not L.distributed_optimizer:
        e.append("the precision-aware optimizer needs the distributed optimizer")
    return e


def _batch_rules(L: Layout, workload: Workload, engine: Engine) -> list[str]:
    """The global batch over DP and micro batches, the sequence over CP, the dynamic-batching token cap."""
    e: list[str] = []
    if workload.global_batch % L.dp:
        e.append(f"global batch {workload.global_batch} rows must be divisible by DP {L.dp}")
    elif not (engine.dynamic_batching and L.max_tokens_per_gpu) and workload.global_batch % (L.dp * L.micro_batch_size):
        e.append(f"global batch {workload.global_batch} must be divisible by micro batch {L.micro_batch_size} x DP {L.dp}")
    if L.cp > 1 and workload.seq_length % (2 * L.cp):
        e.append(f"sequence length {workload.seq_length} must be divisible by 2 x CP = {2 * L.cp} (load-balanced chunks)")
    if L.max_tokens_per_gpu is not None and L.max_tokens_per_gpu < 1:
        e.append("max tokens per GPU must be positive")
    return e


DISPATCHER_FLAG = "--moe-token-dispatcher-type"
MEGATRON_DEFAULT_DISPATCHER = "allgather"  # Megatron-LM 1dcf0daf transformer_config.py:690 (the flag absent)


def dispatcher_rules(L: Layout, model: ModelSpec, engine: Engine) -> list[str]:
    """The MoE token dispatcher must be one the engine runs as given (the flag table's ``engine_choices``):
    slime rewrites allgather (also Megatron's default when the flag is absent) to alltoall after validation
    (slime/backends/megatron_utils/arguments.py lines 83-88 at 624b824a), so a layout with it would be priced
    and reported as a dispatcher slime never runs."""
    if getattr(model, "moe", None) is None:
        return []
    allowed = engine_choices(DISPATCHER_FLAG, engine.name)
    dsp = L.moe_dispatcher or MEGATRON_DEFAULT_DISPATCHER
    if allowed is None or dsp in allowed:
        return []
    given = L.moe_dispatcher or f"absent ({MEGATRON_DEFAULT_DISPATCHER}, Megatron's default)"
    return [f"{DISPATCHER_FLAG} {given}: {engine.name} does not run it (slime's validate_args rewrites allgather to "
            f"alltoall: allgather does not support variable sequence lengths); allowed on {engine.name}: "
            f"{', '.join(allowed)}"]


def layout_string_refusal(model: ModelSpec, engine: Engine) -> str | None:
    """Why this model on this engine cannot take ``--pipeline-model-parallel-layout`` (None: it can)."""
    return model.traits.layout_string_refusal(engine)


def check_knobs(L: Layout, model: ModelSpec, engine: Engine) -> list[str]:
    """The module-recompute and activation-offload rules (issue 15), one message each."""
    e: list[str] = []
    if L.recompute_modules:
        if L.recompute_granularity != "selective":
            e.append(f"--recompute-modules needs --recompute-granularity selective (granularity is {L.recompute_granularity})")
        bad = [m for m in L.recompute_modules if m not in RECOMPUTE_MODULES]
        if bad:
            e.append(f"recompute module(s) {', '.join(bad)}; allowed: {', '.join(RECOMPUTE_MODULES)}")
        if len(set(L.recompute_modules)) != len(L.recompute_modules):
            e.append(f"recompute modules {' '.join(L.recompute_modules)} name a module twice")
        if getattr(model, "moe", None) is None and any(m in MOE_ONLY for m in L.recompute_modules):
            e.append(f"recompute module(s) {', '.join(m for m in L.recompute_modules if m in MOE_ONLY)} need a "
                     f"mixture-of-experts model")
        # megatron-core 0.16.1 TransformerConfig.__post_init__ raises the next three
        if "moe_act" in L.recompute_modules and getattr(model, "moe", None) is not None and not L.moe_grouped_gemm:
            e.append("recompute module moe_act needs --moe-grouped-gemm (megatron-core recomputes the experts' "
                     "activation inside the grouped MLP only)")
        if getattr(model, "mla", None) is None and any(m in MLA_ONLY for m in L.recompute_modules):
            e.append("recompute module mla_up_proj needs a multi-latent-attention model (DeepSeek-V3, Kimi K2)")
        if ("shared_experts" in L.recompute_modules and L.moe_shared_expert_overlap
                and getattr(model, "moe", None) is not None and model.ffn):
            e.append("recompute module shared_experts cannot work with --moe-shared-expert-overlap")
    if L.offload_modules:
        bad = [m for m in L.offload_modules if m not in OFFLOAD_MODULES]
        if bad:
            e.append(f"offload module(s) {', '.join(bad)}; allowed: {', '.join(OFFLOAD_MODULES)}")
        if len(set(L.offload_modules)) != len(L.offload_modules):
            e.append(f"offload modules {' '.join(L.offload_modules)} name a module twice")
        if "attn_proj" in L.offload_modules and "core_attn" not in L.offload_modules:
            # megatron-core 0.16.1 transformer_config.py __post_init__ raises the same
            e.append("offload module attn_proj needs core_attn too (the input of attn_proj is the output of core_attn, "
                     "which core_attn's backward needs)")
    return e


def validate(layout: Layout, model: ModelSpec, world_size: int, workload: Workload, engine: Engine) -> None:
    errs = check(layout, model, world_size, workload, engine)
    if errs:
        raise LayoutError("; ".join(errs))


def derive_dp(world_size: int, tp: int, pp: int, cp: int) -> int:
    mp = tp * pp * cp
    if mp < 1 or world_size % mp:
        raise LayoutError(f"TP {tp} x PP {pp} x CP {cp} = {mp} does not divide the {world_size} GPUs")
    return world_size // mp
