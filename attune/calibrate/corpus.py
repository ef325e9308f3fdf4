"""The public corpus of measured runs (``shared/measurements``) as typed rows the estimator can predict.

Every row of ``dense.yaml``, ``moe.yaml`` and ``memory.yaml`` becomes a ``CorpusRow``. A row attune can
express carries a model, a cluster, a layout, a workload and an engine; one it cannot (fp8 and other
low-precision regimes, MoE, an unknown GPU, a missing field, a layout that breaks a rule) is kept with the
reason. Fields the source does not state are filled with the documented default of the engine that ran
and named in ``assumptions``. The seed recipe's four observations are rows too (series ``seed``).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import yaml

import attune
from attune.calibrate.moe_rows import moe_settings, resolve_moe_model
from attune.calibrate.precision_rows import NotModelled, row_precision
from attune.calibrate.regressions import known_regression
from attune.calibrate.rows import MEMORY, THROUGHPUT, Corpus, CorpusError, CorpusRow, MemoryObservation
from attune.calibrate.seed import SEED_SERIES, seed_observations
from attune.errors import AttuneError, UserInputError
from attune.spec.engine import ENGINES, Engine, for_release, get_engine
from attune.spec.hardware import GPUS, GiB, parse_cluster
from attune.spec.knobs import RECOMPUTE_MODULES
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec, from_geometry
from attune.spec.moe import ep_overlap_rules
from attune.spec.precision import hardware_refusal
from attune.spec.rules import check

CORPUS_FILES = ("dense.yaml", "moe.yaml", "memory.yaml")
"""The corpus files read, in this order (shared/measurements/README.md)."""

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when built in: the corpus parses ~10x faster

# GPU strings of the corpus -> GPU table keys. Longest names first: "GB200" contains "B200".
_GPU_NAMES = tuple(sorted(GPUS, key=len, reverse=True))  # the GPU table's keys, one place to add a GPU

def default_corpus_dir() -> Path | None:
    """``shared/measurements`` beside the checkout (``<checkout>/../shared/measurements``), if it exists."""
    p = Path(attune.__file__).resolve().parents[2] / "shared" / "measurements"
    return p if p.is_dir() else None


# ---------------------------------------------------------------------- reading
class _Unexpressed(Exception):
    """Internal: the row cannot be expressed; the message is the reason."""


def _gpu_key(name: str) -> str:
    up = (name or "").upper()
    for key in _GPU_NAMES:
        if key in up:
            return key
    raise _Unexpressed(f"unknown GPU: '{name}'")


LEGACY_BEFORE = 2023
"""Megatron-LM releases before this year ran without FlashAttention and Transformer Engine (Megatron-LM added
TE's FlashAttention path in 2023, core_r0.2.0 / NeMo 23.x); rows stating an older engine version use the
``megatron-legacy`` engine."""


def _year(version: str) -> int | None:
    m = re.search(r"\b(20[12]\d)\b", version or "")
    return int(m.group(1)) if m else None


# Flags a row's notes state (e.g. "communication overlap on (--overlap-grad-reduce, ...)") -> Layout fields
NOTE_FLAGS = {"--overlap-grad-reduce": "overlap_grad_reduce", "--overlap-param-gather": "overlap_param_gather",
              "--tp-comm-overlap": "tp_comm_overlap"}

# NeMo's performance recipes: the interleaving each model's recipe sets, for rows whose table leaves VPP out.
# NVIDIA/NeMo nemo/collections/llm/recipes/nemotron4_340b.py (pretrain_recipe:
# virtual_pipeline_parallelism=12) and gpt3_175b.py (virtual_pipeline_parallelism=6), 24.09-25.04 releases.
NEMO_RECIPE_VPP = {"Nemotron-4 340B": 12, "GPT-3 175B": 6}

# Models whose NeMo / Megatron-Bridge performance recipe runs TP 1 on every GPU, by geometry (layers, hidden, ffn):
# Llama 3 / 3.1 8B (Megatron-Bridge v0.2.0 scripts/performance/configs/llama3/workload_base_configs.py:
# BASE_LLAMA3_8B_CONFIG and its per-GPU presets leave tensor_model_parallel_size at 1). The perf scripts build
# CommOverlapConfig(tp_comm_overlap=bool(TP > 1)) from the recipe's own TP (llama3_llm_pretrain.py line 262) and a
# later TP override (utils/helpers.py set_user_overrides) leaves it: a sweep of such a recipe over TP ran without
# TP communication overlap and without its userbuffers.
RECIPE_TP1 = {(32, 4096, 14336): "Llama 3 8B"}


def _engine(name: str, assumptions: list[str], version: str = "") -> Engine:
    """attune's engine for the source's engine string. NeMo and Megatron-Bridge run megatron-core with
    their recipes' defaults; they get their own engine where one exists."""
    low = (name or "").lower()
    if "slime" in low:
        return get_engine("slime")
    if ("nemo" in low or "bridge" in low) and "megatron-bridge" in ENGINES:
        e = for_release(get_engine("megatron-bridge"), version)  # the release's launch defaults (spec.engine)
        if e.label != get_engine("megatron-bridge").label:
            assumptions.append(f"engine: {e.label}")
        return e
    if "deepspeed" in low:
        assumptions.append("engine: Megatron-DeepSpeed (megatron-legacy's model code: unfused attention with dropout, "
                           "ZeRO-1 as the distributed optimizer; DeepSpeed's pipeline sends whole tensors)")
        return get_engine("megatron-deepspeed")
    if "megatron" in low or "nemo" in low:
        year = _year(version)
        if year is not None and year < LEGACY_BEFORE:
            assumptions.append(f"engine: Megatron-LM of {year} (megatron-legacy: before FlashAttention and Transformer "
                               f"Engine, attention and hidden dropout on)")
            return get_engine("megatron-legacy")
        return get_engine("megatron")
    raise _Unexpressed(f"unknown engine '{name}'")


def _need(row: dict, key: str):
    v = row.get(key)
    if v is None:
        raise _Unexpressed(f"missing field: {key}")
    return v


def model_from_geometry(g: dict, seq_length: int) -> ModelSpec:
    """A dense decoder from the row's geometry (``attune.spec.model.from_geometry``); BLOOM uses ALiBi. A
    row without a vocabulary (component rows counting the transformer layers only) gets vocab 0."""
    name = str(_need(g, "name"))
    dims = {k: int(_need(g, k)) for k in ("layers", "hidden", "ffn", "heads")}
    return from_geometry(name=name, **dims, kv_heads=int(g.get("kv_heads") or dims["heads"]),
                         vocab=int(g.get("vocab") or 0), mlp=str(g.get("mlp") or "gelu"), seq_length=seq_length,
                         positions="alibi" if "bloom" in name.lower() else None,
                         source=str(g.get("arch_source") or ""))


def _recompute(value, assumptions: list[str]) -> dict:
    if value is None:
        assumptions.append("recompute: not stated, none (the NeMo / Megatron-LM performance recipes' default)")
        return dict(recompute_granularity="none")
    v = str(value).lower()
    if v.startswith("none"):
        return dict(recompute_granularity="none")
    if v.startswith("selective"):
        if "recompute_modules" in v:
            # "selective recompute_modules `mla_up_proj`, `mlp`": the named modules (Megatron --recompute-modules)
            names = tuple(re.findall(r"`(\w+)`", str(value)))
            unknown = [n for n in names if n not in RECOMPUTE_MODULES]
            if unknown:
                raise _Unexpressed(f"recompute '{value}': module(s) {', '.join(unknown)} not modelled; allowed: "
                                   f"{', '.join(RECOMPUTE_MODULES)}")
            if not names:
                return dict(recompute_granularity="none")  # recompute_modules `[]`: nothing recomputed
            return dict(recompute_granularity="selective", recompute_modules=names)
        return dict(recompute_granularity="selective")
    if v.startswith("full"):
        # DeepSpeed's --checkpoint-activations and Megatron's full recompute keep each layer's input
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    raise _Unexpressed(f"recompute '{value}' is not understood")


def _layout(row: dict, model: ModelSpec, engine: Engine, assumptions: list[str],
            check_rules: bool = True) -> tuple[Layout, Workload]:
    """The row's dense layout and workload; ``check_rules`` False for a MoE row (``_moe_layout`` checks the
    layout once its expert settings are on). Each default taken is appended to ``assumptions``, in this order:
    DP, the layer split, VPP, SP, the distributed optimizer, micro batch, flags from the notes, the uneven split,
    recompute."""
    n, tp, pp, cp, dp = _sizes(row, assumptions)
    first, last = _embedding_stages(model, pp, assumptions)
    vpp = _vpp(row, model, engine, pp, assumptions)
    sp, dist = _sp_and_dist_optimizer(row, engine, tp, assumptions)
    mbs = row.get("micro_batch")
    if mbs is None:
        mbs = 1
        assumptions.append("micro_batch: not stated, 1")
    seq, gbs = int(_need(row, "seq_len")), int(_need(row, "global_batch"))
    if gbs % (dp * int(mbs)):
        raise _Unexpressed(f"layout: global batch {gbs} is not a multiple of DP {dp} x micro batch {mbs}")
    precision = "fp16" if row.get("precision_class") == "fp16" else "bf16"
    notes = str(row.get("notes") or "")
    stated = {field: True for flag, field in NOTE_FLAGS.items() if re.search(re.escape(flag) + r"(?![\w-])", notes)}
    if stated:
        assumptions.append("from the notes: " + ", ".join(f for f in NOTE_FLAGS if NOTE_FLAGS[f] in stated))
    account, first, last = _uneven_split(model, pp, int(vpp), first, last, assumptions)
    try:
        layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, vpp=int(vpp), sp=bool(sp), micro_batch_size=int(mbs), first=first, last=last,
                        distributed_optimizer=bool(dist), precision=precision, **stated, **account,
                        **_recompute(row.get("recompute"), assumptions))
        wl = Workload(seq_length=seq, global_batch=gbs)
    except UserInputError as e:
        raise _Unexpressed(f"layout: {e}") from None
    broken = check(layout, model, n, wl, engine) if check_rules else []
    if broken:
        raise _Unexpressed(f"layout rule: {broken[0]}")
    return layout, wl


def _sizes(row: dict, assumptions: list[str]) -> tuple[int, int, int, int, int]:
    """GPUs, TP, PP, CP and DP (from the GPUs when not stated); they must multiply to the GPUs."""
    n = int(_need(row, "num_gpus"))
    tp, pp = int(_need(row, "tp")), int(_need(row, "pp"))
    cp = int(row.get("cp") or 1)
    dp = row.get("dp")
    if dp is None:
        if n % (tp * pp * cp):
            raise _Unexpressed(f"layout: {n} GPUs is not a multiple of TP x PP x CP = {tp * pp * cp}")
        dp = n // (tp * pp * cp)
        assumptions.append(f"dp: not stated, {dp} = GPUs / (TP x PP x CP)")
    dp = int(dp)
    if tp * pp * cp * dp != n:
        raise _Unexpressed(f"layout: TP {tp} x PP {pp} x CP {cp} x DP {dp} != {n} GPUs")
    return n, tp, pp, cp, dp


def _embedding_stages(model: ModelSpec, pp: int, assumptions: list[str]) -> tuple[int | None, int | None]:
    """First and last stage layers when PP > 2 does not divide the layers: the embedding stages take fewer, the
    middle stages ceil(L / PP), first and last share the rest (BLOOM's 5 + 6 x 10 + 5 over PP 12)."""
    if pp > 2 and model.num_layers % pp:
        mid = -(-model.num_layers // pp)
        rest = model.num_layers - mid * (pp - 2)
        if rest >= 2 and rest % 2 == 0:
            assumptions.append(f"layer split: {model.num_layers} layers over PP {pp} as {rest // 2} + {mid} x {pp - 2} "
                               f"+ {rest // 2}")
            return rest // 2, rest // 2
    return None, None


def _vpp(row: dict, model: ModelSpec, engine: Engine, pp: int, assumptions: list[str]):
    """The row's VPP; not stated: the NeMo performance recipe's where the model has one, else 1."""
    vpp = row.get("vpp")
    if vpp is None:
        vpp = 1
        recipe_vpp = NEMO_RECIPE_VPP.get(model.name) if engine.name == "megatron-bridge" else None
        if pp > 1 and recipe_vpp and model.num_layers % (pp * recipe_vpp) == 0:
            vpp = recipe_vpp
            assumptions.append(f"vpp: not stated, {vpp} (the NeMo performance recipe of {model.name} sets "
                               f"virtual_pipeline_parallelism={vpp})")
        elif pp > 1:
            assumptions.append("vpp: not stated, no interleaving")
    return vpp


def _sp_and_dist_optimizer(row: dict, engine: Engine, tp: int, assumptions: list[str]):
    """Sequence parallelism and the distributed optimizer; not stated: the engine era's defaults."""
    old_era = engine.era_without_sp_and_dist_optimizer
    sp = row.get("sp")
    if sp is None:
        sp = tp > 1 and not old_era
        if old_era:
            assumptions.append(f"sp: not stated, off ({engine.name}: before sequence parallelism was the default)")
        elif tp > 1:
            assumptions.append("sp: not stated, on (NeMo / Megatron-LM performance recipes enable it with TP > 1)")
    dist = row.get("dist_optimizer")
    if dist is None:
        dist = not old_era
        assumptions.append(f"dist_optimizer: not stated, off ({engine.name}: before the distributed optimizer)" if old_era
                           else "dist_optimizer: not stated, on (NeMo / Megatron-LM performance recipes' default)")
    elif isinstance(dist, str):
        dist = "zero" in dist.lower() or "distributed" in dist.lower()
    return sp, dist


def _uneven_split(model: ModelSpec, pp: int, vpp: int, first: int | None, last: int | None,
                  assumptions: list[str]) -> tuple[dict, int | None, int | None]:
    """The Layout fields of a split over PP x VPP stages that does not divide the layers and that the row does not
    spell out (embedding/loss accounting or a layout string), with the first/last stage layers left."""
    if vpp > 1 and model.num_layers % (pp * vpp) and (model.num_layers + 2) % (pp * vpp) == 0:
        # Megatron-Bridge's recipes for such splits (Qwen3-235B-A22B: 94 layers over PP 8 x VPP 3) count the
        # embedding and the loss as one layer each (--account-for-embedding/loss-in-pipeline-split)
        assumptions.append(f"layer split: {model.num_layers} layers + embedding + loss over PP {pp} x VPP {vpp} "
                           f"(account-for-embedding/loss-in-pipeline-split) [assumed]")
        return dict(account_for_embedding=True, account_for_loss=True), None, None
    stages = pp * vpp
    if not (stages > 1 and model.num_layers % stages and first is None):
        return {}, first, last
    # an uneven split the row does not spell out: the Megatron-Bridge DeepSeek-V3 recipes' shape, every virtual
    # stage ceil(layers / stages) layers (the first with the embedding), the last the rest with the loss
    # (61 layers on 16 stages: Et*4|(t*4|)*14t*1L) [recalled from Megatron-Bridge, unverified]
    n_ = -(-model.num_layers // stages)
    rest = model.num_layers - n_ * (stages - 1)
    if rest >= 1:
        text = f"Et*{n_}|" + (f"(t*{n_}|)*{stages - 2}" if stages > 2 else "") + f"t*{rest}L"
        assumptions.append(f"pipeline layout: not stated, {text} (the Megatron-Bridge DeepSeek-V3 recipes' uneven "
                           f"split) [assumed]")
        return dict(pipeline_layout=text), first, last
    if stages > 2 and (model.num_layers - 1) % (stages - 2) == 0:
        # one layer with the embedding, the loss alone on the last stage, the rest even: Megatron-Bridge v0.2.0
        # DeepSeek-V3 on H100, PP 8 x VPP 4: "Et|(tt|)*30mL" (scripts/performance/configs/deepseek/
        # deepseek_llm_pretrain.py), its MTP layer left out
        k = (model.num_layers - 1) // (stages - 2)
        text = f"Et*1|(t*{k}|)*{stages - 2}L"
        assumptions.append(f"pipeline layout: not stated, {text} (the Megatron-Bridge DeepSeek-V3 H100 recipe's "
                           f"split) [assumed]")
        return dict(pipeline_layout=text), first, last
    return {}, first, last


def _throughput(row: dict) -> float:
    d = row.get("derived") or {}
    if d.get("tokens_per_s_per_gpu"):
        return float(d["tokens_per_s_per_gpu"])
    m = row.get("measured") or {}
    if m.get("metric") == "tokens_per_s_per_gpu" and m.get("value"):  # the MoE rows state it as the measurement
        return float(m["value"])
    if m.get("metric") == "step_time_s" and m.get("value"):
        # tokens/s/GPU = global batch x sequence length / step time / GPUs (README "derived")
        return float(_need(row, "global_batch")) * float(_need(row, "seq_len")) / float(m["value"]) / float(
            _need(row, "num_gpus"))
    raise _Unexpressed("missing field: derived.tokens_per_s_per_gpu (and no step time)")


def _gib(value_gb: float) -> float:
    return value_gb * 1e9 / GiB


def _memory(mem: dict) -> MemoryObservation:
    metric = str(mem.get("metric") or "")
    fits = mem.get("fits")
    fits = None if fits is None else bool(fits)
    if "params_grads_optimizer_GiB" in mem or "activations_GiB" in mem:
        comps = {}
        if mem.get("params_grads_optimizer_GiB"):
            comps["states"] = float(mem["params_grads_optimizer_GiB"])
        if mem.get("activations_GiB"):
            comps["activations"] = float(mem["activations_GiB"])
        stage = 0 if "first pipeline stage" in metric else None
        return MemoryObservation(fits=fits, stage=stage, components_gib=comps, metric=metric)
    if "peak_memory_usage" in metric:
        # NeMo's MegatronStrategy logs peak_memory_usage = torch.cuda.max_memory_reserved() with
        # log_memory_usage on; its memory_allocated is the allocation at the step's end, not a peak
        gib = mem.get("value_GiB") or (mem.get("value_bytes") and mem["value_bytes"] / GiB)
        return MemoryObservation(fits=fits, peak_reserved_gib=float(gib) if gib else None, metric=metric)
    if "peak allocated" in metric.lower() and mem.get("value"):
        return MemoryObservation(fits=fits, peak_allocated_gib=_gib(float(mem["value"])), metric=metric)
    return MemoryObservation(fits=fits, metric=metric)


def _series(row: dict) -> str:
    """The row's series; memory rows name none: their id's first three parts (``mem-korthikanti2022-fig1``)."""
    if row.get("series"):
        return str(row["series"])
    return "-".join(str(row["id"]).split("-")[:3])


def _moe_layout(row: dict, layout: Layout, model: ModelSpec, engine: Engine, wl: Workload,
                assumptions: list[str], gpu_key: str = "") -> tuple[Layout, dict]:
    """The row's expert parallel sizes and MoE settings (``attune.calibrate.moe_rows``: dispatcher, expert
    all-to-all overlap, the recipe's recompute modules where the row states none) on top of its dense layout."""
    ep = int(row.get("ep") or 1)
    etp = row.get("etp")
    if etp is None:
        etp = 1
        assumptions.append("etp: not stated, 1 (the Megatron-Bridge Qwen3 MoE recipes' expert_tensor_parallel_size) [assumed]")
    assumptions.append("MoE: grouped GEMM, permute fusion (Megatron-Bridge MoE performance recipes) [assumed]")
    st, notes = moe_settings(row, model, gpu_key, engine.name)
    assumptions.extend(notes)
    extra: dict = {}
    if st["recompute"] and row.get("recompute") is None and layout.recompute_granularity == "none":
        extra = dict(recompute_granularity="selective", recompute_modules=tuple(st["recompute"]))
        assumptions.append(f"recompute: not stated, modules {', '.join(st['recompute'])} (the release's recipe) [assumed]")
    balanced = "force-balance" in str(row.get("notes") or "") and not st["capacity"]  # what the row's source says
    extra.update({"moe_capacity_factor": st["capacity"]} if st["capacity"] else {})
    extra.update({"mtp_layers": st["mtp"]} if st["mtp"] else {})
    if balanced:
        assumptions.append("MoE: tokens force-balanced over the experts (--moe-router-force-load-balancing; the source: "
                           "'we force-balance the token distribution among experts')")
    try:
        lay = Layout(**{**layout.to_dict(), **extra, "ep": ep, "etp": int(etp), "moe_dispatcher": st["dispatcher"],
                        "moe_grouped_gemm": True, "moe_permute_fusion": True, "moe_force_balance": balanced,
                        "moe_ep_overlap": st["overlap"]})
    except UserInputError as e:
        raise _Unexpressed(f"layout: {e}") from None
    if lay.moe_ep_overlap and ep_overlap_rules(lay):
        lay = replace(lay, moe_ep_overlap=False)
        assumptions.append(f"MoE: expert all-to-all overlap off ({ep_overlap_rules(replace(lay, moe_ep_overlap=True))[0]})")
    broken = check(lay, model, lay.world_size, wl, engine)
    if broken:
        raise _Unexpressed(f"layout rule: {broken[0]}")
    # the Engine fields the recipe sets: CUDA graphs; its low-precision kernels (moe_rows.release_recipe)
    return lay, dict(cuda_graphs=st["graphs"], fp8_attention="fp8_dpa" in st["kernels"],
                     fused_grouped_mlp="fused_grouped_mlp" in st["kernels"])


def _with_precision(layout: Layout, lp_fields: dict, model: ModelSpec, engine: Engine, wl: Workload, cluster) -> Layout:
    """The row's layout with its low-precision recipe, checked (issue 22)."""
    lay = replace(layout, **lp_fields)
    broken = check(lay, model, lay.world_size, wl, engine)
    refused = hardware_refusal(lay, cluster.gpu.generation, cluster.gpu.is_cpu)
    if broken or refused:
        raise _Unexpressed(f"layout rule: {broken[0] if broken else refused}")
    return lay


def read_row(row: dict, file: str) -> CorpusRow:
    """One corpus row, expressed or with the reason it is not."""
    base = _row_identity(row, file)
    if known_regression(row):  # the source itself marks the figure as a release's defect
        return CorpusRow(**base, reason=known_regression(row))
    assumptions: list[str] = []
    try:
        expressed = _express(row, file, assumptions)
    except _Unexpressed as e:
        return CorpusRow(**base, reason=str(e), assumptions=tuple(assumptions))
    except AttuneError as e:  # the spec refused the geometry or the GPU count
        return CorpusRow(**base, reason=f"not expressible: {e}", assumptions=tuple(assumptions))
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, ZeroDivisionError) as e:
        raise CorpusError(f"{file}: row {base['id']}: a malformed field ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:160]})") from None
    try:
        return CorpusRow(**base, **expressed, assumptions=tuple(assumptions))
    except ValueError as e:  # CorpusRow's own checks (a positive throughput, ...)
        raise CorpusError(f"{file}: {' '.join(str(e).split())[:200]}") from None


def _row_identity(row: dict, file: str) -> dict:
    """The CorpusRow fields every row has, expressed or not (id, series, file, kinds, source, GPU, engine, precision)."""
    if not isinstance(row, dict) or not row.get("id"):
        raise CorpusError(f"{file}: a row without an id (every row needs id, model, layout, measured)")
    rid = str(row["id"])
    src = row.get("source") or {}
    if not isinstance(src, dict) or not isinstance(row.get("model") or {}, dict):
        raise CorpusError(f"{file}: row {rid}: source and model must be mappings")
    try:
        series = _series(row)
    except (TypeError, ValueError, AttributeError) as e:
        raise CorpusError(f"{file}: row {rid}: a malformed field ({' '.join(str(e).split())[:160]})") from None
    return dict(id=rid, series=series, file=file, kinds=(MEMORY,) if file == "memory.yaml" else (THROUGHPUT,),
                source=str(src.get("url") or src.get("path") or ""), gpu_name=str(row.get("gpu") or ""),
                engine_name=str(row.get("engine") or ""), precision=str(row.get("precision_class") or ""))


def _express(row: dict, file: str, assumptions: list[str]) -> dict:
    """The CorpusRow fields of an expressed row (model, cluster, layout, workload, engine, the measurements);
    raises ``_Unexpressed`` with the reason it cannot be expressed."""
    g = row.get("model") or {}
    try:  # fp8 / mxfp8: the recipe's Layout fields (issue 22); nvfp4 and unknown classes are not modelled
        lp_fields = row_precision(row, GPUS[_gpu_key(str(row.get("gpu") or ""))].generation,
                                  str(row.get("engine") or ""), assumptions)
    except NotModelled as e:
        raise _Unexpressed(str(e)) from None
    is_moe = bool(g.get("moe") or file == "moe.yaml" or g.get("experts") or (row.get("ep") or 1) > 1)
    bundled, how = resolve_moe_model(g) if is_moe else (None, "")  # by model.hf, then geometry: never the name
    if is_moe and bundled is None:
        raise _Unexpressed(how)
    if row.get("precision_class") is None:
        raise _Unexpressed("missing field: precision_class")
    key = _gpu_key(str(row.get("gpu") or ""))
    engine = _engine(str(row.get("engine") or ""), assumptions, str(row.get("engine_version") or ""))
    seq = int(_need(row, "seq_len"))
    model = bundled or model_from_geometry(g, seq)
    if bundled:
        assumptions.append(how)
    elif not g.get("vocab"):
        assumptions.append("vocab: not stated, 0 (the row's figures count the transformer layers only)")
    cluster = parse_cluster(f"{int(_need(row, 'num_gpus'))}x{key}")
    recipe_tp1 = RECIPE_TP1.get((model.num_layers, model.hidden, model.ffn))
    if engine.recipe_tp_comm_overlap and recipe_tp1 and int(row.get("tp") or 1) > 1:
        engine = replace(engine, recipe_tp_comm_overlap=False)
        assumptions.append(f"tp_comm_overlap: off (the {recipe_tp1} performance recipe runs TP 1; a TP override "
                           f"keeps its tp_comm_overlap=False)")
    layout, wl = _layout(row, model, engine, assumptions, check_rules=not bundled)
    if bundled:
        layout, eng = _moe_layout(row, layout, model, engine, wl, assumptions, key)
        eng = {k: v for k, v in eng.items() if getattr(engine, k) != v}
        engine = replace(engine, **eng) if eng else engine
    if lp_fields:
        layout = _with_precision(layout, lp_fields, model, engine, wl, cluster)
    return dict(model=model, cluster=cluster, layout=layout, workload=wl, engine=engine,
                tokens_per_s_per_gpu=_throughput(row) if file != "memory.yaml" else None,
                memory=_memory(row["memory"]) if row.get("memory") else None)


def read_file(path: Path) -> list[dict]:
    try:
        data = yaml.load(path.read_text(), Loader=_LOADER)
    except yaml.YAMLError as e:
        raise CorpusError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except OSError as e:
        raise CorpusError(f"{path}: cannot be read ({e.strerror})") from None
    if data is None:
        return []
    if not isinstance(data, list):
        raise CorpusError(f"{path}: expected a list of rows, got {type(data).__name__}")
    return data


def load_corpus(directory: Path | str | None = None, include_seed: bool = True) -> Corpus:
    """Read the corpus folder (default: ``shared/measurements`` beside the checkout) into rows.

    The folder must hold at least one of ``dense.yaml``, ``moe.yaml``, ``memory.yaml``; raises
    ``CorpusError`` (exit 2) otherwise.
    """
    if directory is None:
        directory = default_corpus_dir()
        if directory is None:
            raise CorpusError("no corpus folder: pass --corpus DIR (a folder with dense.yaml, moe.yaml, memory.yaml "
                              "as in shared/measurements)")
    d = Path(directory)
    if not d.is_dir():
        raise CorpusError(f"--corpus {d}: no such folder (expected one with {', '.join(CORPUS_FILES)})")
    present = [f for f in CORPUS_FILES if (d / f).is_file()]
    if not present:
        raise CorpusError(f"--corpus {d}: holds none of {', '.join(CORPUS_FILES)}")
    rows: list[CorpusRow] = list(seed_observations()) if include_seed else []
    for f in present:
        rows.extend(read_row(r, f) for r in read_file(d / f))
    return Corpus(rows=tuple(rows), directory=str(d))


__all__ = ["Corpus", "CorpusRow", "CorpusError", "MemoryObservation", "load_corpus", "default_corpus_dir",
           "model_from_geometry", "read_row", "SEED_SERIES", "THROUGHPUT", "MEMORY"]
