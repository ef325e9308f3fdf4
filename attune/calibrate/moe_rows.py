"""MoE corpus rows: which bundled model a row ran, and the MoE settings its source states or its release's recipe
sets (issue 21).

A row's model is resolved by its Hugging Face id (``model.hf``), then by its geometry; never by a spelling of
``model.name`` (rows held outside this repository spell names their own way). Settings a row does not state
(dispatcher, expert all-to-all overlap, recompute modules) come from its text first (``notes``, the flags it
quotes), then, for Megatron-Bridge rows, from the performance recipe of the model and GPU, each named in the
row's assumptions.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

import yaml

from attune.errors import AttuneError
from attune.spec.model import ModelSpec, bundled_names, load_model

# Bundled models whose file name is not their Hugging Face repository's name (the repository the config was
# read from, in each config's ``_attune_source``).
HF_ALIASES = {"moonshotai/kimi-k2-instruct": "Kimi-K2", "moonshotai/kimi-k2-base": "Kimi-K2",
              "qwen/qwen3-next-80b-a3b-instruct": "Qwen3-Next-80B-A3B"}

# Suffixes of released variants with the same geometry as the base repository (post-trained or re-quantized
# checkpoints: Qwen's -Instruct-2507 / -Thinking-2507, -FP8, -Base): stripped before matching the repository name.
_VARIANT = re.compile(r"(-(instruct|thinking|base|chat|fp8|bf16|\d{4}))+$")

GEOMETRY_KEYS = {"layers": ("layers", "num_layers"), "hidden": ("hidden", "hidden_size"),
                 "heads": ("heads", "num_attention_heads"), "kv_heads": ("kv_heads", "num_key_value_heads"),
                 "vocab": ("vocab", "vocab_size"), "experts": ("experts", "num_experts", "n_routed_experts"),
                 "top_k": ("top_k", "topk", "moe_top_k", "num_experts_per_tok"),
                 "expert_ffn": ("expert_ffn", "moe_ffn", "moe_intermediate_size", "moe_ffn_hidden_size")}
"""Geometry a row may state -> the keys it may use (the corpus README's names first)."""

MIN_GEOMETRY = ("layers", "hidden", "experts")
"""A geometry match needs at least these stated."""


@lru_cache(maxsize=None)
def _bundled_moe() -> tuple[ModelSpec, ...]:
    out = []
    for n in bundled_names():
        try:
            m = load_model(n)
        except AttuneError:
            continue
        if m.moe is not None and not n.startswith("tiny-"):
            out.append(m)
    return tuple(out)


def geometry_of(m: ModelSpec) -> dict[str, int]:
    """A bundled model's geometry in the corpus's terms."""
    return {"layers": m.num_layers, "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads, "vocab": m.vocab,
            "experts": m.moe.experts, "top_k": m.moe.top_k, "expert_ffn": m.moe.expert_ffn}


def stated_geometry(g: dict) -> dict[str, int]:
    """The geometry fields a row's ``model`` block states (non-null), under the corpus's names."""
    out = {}
    for k, names in GEOMETRY_KEYS.items():
        for n in names:
            if g.get(n) is not None:
                try:
                    out[k] = int(g[n])
                except (TypeError, ValueError):
                    pass
                break
    return out


def by_hf(hf: str) -> ModelSpec | None:
    """The bundled MoE model of a Hugging Face repository id (``org/name``; case-insensitive; released variants
    of the same geometry included), or None."""
    key = str(hf or "").strip().lower()
    if not key:
        return None
    if key in HF_ALIASES:
        return load_model(HF_ALIASES[key])
    tail = _VARIANT.sub("", key.rsplit("/", 1)[-1])
    for m in _bundled_moe():
        if m.name.lower() == tail:
            return m
    return None


def by_geometry(g: dict) -> ModelSpec | None:
    """The bundled MoE model whose geometry equals every field the row states (at least ``MIN_GEOMETRY``); the
    first by name when several share it (Qwen3.5- and Qwen3.6-35B-A3B), None when none does."""
    st = stated_geometry(g)
    if any(k not in st for k in MIN_GEOMETRY):
        return None
    for m in _bundled_moe():
        geo = geometry_of(m)
        if all(geo[k] == v for k, v in st.items()):
            return m
    return None


def resolve_moe_model(g: dict) -> tuple[ModelSpec | None, str]:
    """(the bundled model a MoE row ran, how it was found) or (None, why not)."""
    m = by_hf(g.get("hf"))
    if m is not None:
        return m, f"model: the bundled {m.name} (by the row's Hugging Face id {g.get('hf')})"
    m = by_geometry(g)
    if m is not None:
        return m, f"model: the bundled {m.name} (by the row's geometry: {stated_geometry(g)})"
    what = f"Hugging Face id {g.get('hf')}" if g.get("hf") else "no Hugging Face id"
    return None, (f"not modelled: MoE model {g.get('name')!r} ({what}, geometry {stated_geometry(g) or 'not stated'}) "
                  f"matches no bundled MoE model ({', '.join(m.name for m in _bundled_moe())})")


# ---------------------------------------------------------------------- settings the row or its recipe states
# Megatron-Bridge's performance recipes of the 25.11 release line (NVIDIA-NeMo/Megatron-Bridge v0.2.0,
# scripts/performance/configs/{deepseek,qwen3,gpt_oss}/workload_base_configs.py): per model and GPU the flex
# dispatcher's backend (``moe_flex_dispatcher_backend``: hybridep / deepep set the flex dispatcher; absent: the
# model provider's alltoall, gpt_oss_provider.py ``moe_token_dispatcher_type = "alltoall"``), the expert
# all-to-all overlap (``moe_a2a_overlap`` -> overlap_moe_expert_parallel_comm, utils/overrides.py
# _set_moe_a2a_overlap_overrides) and ``recompute_modules``.
MBRIDGE_RECIPES: dict[tuple[str, str], dict] = {
    ("DeepSeek-V3", "GB300"): dict(dispatcher="flex", overlap=False, recompute=("moe_act",), graphs="scoped"),
    ("DeepSeek-V3", "GB200"): dict(dispatcher="flex", overlap=False, recompute=("mla_up_proj",), graphs="scoped"),
    ("DeepSeek-V3", "B200"): dict(dispatcher="alltoall", overlap=False, recompute=("mla_up_proj",)),
    ("DeepSeek-V3", "H100"): dict(dispatcher="flex", overlap=True, recompute=("mla_up_proj", "mlp")),
    ("Qwen3-235B-A22B", "GB300"): dict(dispatcher="flex", overlap=False, recompute=(), graphs="scoped"),
    ("Qwen3-235B-A22B", "GB200"): dict(dispatcher="flex", overlap=False, recompute=(), graphs="scoped"),
    ("Qwen3-235B-A22B", "B200"): dict(dispatcher="alltoall", overlap=True, recompute=()),
    ("Qwen3-235B-A22B", "H100"): dict(dispatcher="alltoall", overlap=True, recompute=()),
    ("Qwen3-30B-A3B", "GB300"): dict(dispatcher="flex", overlap=False, recompute=(), graphs="scoped"),
    ("Qwen3-30B-A3B", "GB200"): dict(dispatcher="flex", overlap=False, recompute=(), graphs="scoped"),
    ("GPT-OSS-120B", "GB300"): dict(dispatcher="alltoall", overlap=False, recompute=(), graphs="scoped"),
    ("GPT-OSS-120B", "GB200"): dict(dispatcher="alltoall", overlap=False, recompute=("layernorm", "moe_act")),
    ("GPT-OSS-120B", "B200"): dict(dispatcher="alltoall", overlap=False, recompute=("layernorm", "moe_act")),
    ("GPT-OSS-120B", "H100"): dict(dispatcher="alltoall", overlap=False, recompute=("layernorm", "moe_act")),
}
RECIPE_SOURCE = "Megatron-Bridge v0.2.0 scripts/performance/configs/*/workload_base_configs.py"
# (``graphs``: cuda_graph_impl "transformer_engine" with its cuda_graph_scope in the same files -> "scoped"; absent ->
# "none": attune.spec.engine.Engine.cuda_graphs)


@lru_cache(maxsize=1)
def release_recipes() -> dict:
    """Megatron-Bridge's performance recipes of the later releases (package data ``mbridge_recipes.yaml``)."""
    return yaml.safe_load(resources.files("attune.calibrate").joinpath("mbridge_recipes.yaml").read_text("utf-8"))


def release_recipe(row: dict, model: ModelSpec, gpu_key: str) -> tuple[dict | None, str]:
    """(the settings of the row's release recipe, where they were read) or (None, "") when the row's release (its
    ``series``, ``mbridge-perf-summary-<release>``) or its model / GPU / precision has no entry."""
    m = re.search(r"mbridge-perf-summary-([\d.]+)$", str(row.get("series") or ""))
    data = release_recipes()
    tag = data["releases"].get(m.group(1)) if m else None
    if tag is None:
        return None, ""
    entry = data["recipes"].get(tag, {}).get(f"{model.name}|{gpu_key}|{row.get('precision_class') or 'bf16'}")
    if entry is None:
        return None, ""
    dispatcher, overlap, graphs, recompute, *kernels = entry  # a fifth item: the recipe's low-precision kernels
    return (dict(dispatcher=dispatcher, overlap=overlap == "overlap", graphs=graphs, recompute=tuple(recompute),
                 kernels=tuple(kernels[0]) if kernels else ()),
            f"Megatron-Bridge {tag} {data['source']}")

_FLEX = re.compile(r"deepep|hybrid-?ep|\bflex\b|moe_flex_dispatcher_backend|moe-enable-deepep", re.I)
_A2A = re.compile(r"alltoall dispatcher|dispatcher(?:[-_]type)?[ =:]+alltoall", re.I)
_OVERLAP = re.compile(r"overlap[-_]moe[-_]expert[-_]parallel[-_]comm|moe_a2a_overlap|a2a overlap|ep overlap", re.I)


_SETTING_KEYS = re.compile(r"dispatch|deepep|hybridep|overlap|a2a|flags|launch|command", re.I)


def row_text(row: dict) -> str:
    """What a row says about how it ran: its notes, its model name's qualifiers and every top-level field naming a
    dispatcher, an overlap or its flags (``dispatcher: deepep``, ``moe_a2a_overlap: true``, ``flags: ...``), as
    ``key=value`` so a switch set true reads like its flag."""
    g = row.get("model") or {}
    parts = [str(x) for x in (row.get("notes"), g.get("name")) if x]
    for k, v in row.items():
        if _SETTING_KEYS.search(str(k)) and v not in (None, False, "", "false", "no"):
            parts.append(f"{k}={v}" if v is not True else str(k))
    return " ".join(parts)


def moe_settings(row: dict, model: ModelSpec, gpu_key: str, engine_name: str) -> tuple[dict, list[str]]:
    """(dispatcher, overlap, recompute-or-None) the row states or its recipe sets, with the assumptions named."""
    text = row_text(row)
    notes: list[str] = []
    recipe, source = release_recipe(row, model, gpu_key) if engine_name == "megatron-bridge" else (None, "")
    if recipe is None and engine_name == "megatron-bridge":
        recipe, source = MBRIDGE_RECIPES.get((model.name, gpu_key)), RECIPE_SOURCE
    if _FLEX.search(text):
        dispatcher = "flex"
        notes.append("MoE: flex dispatcher (DeepEP / HybridEP), as the row states")
    elif _A2A.search(text):
        dispatcher = "alltoall"
        notes.append("MoE: alltoall dispatcher, as the row states")
    elif recipe:
        dispatcher = recipe["dispatcher"]
        notes.append(f"MoE: {dispatcher} dispatcher (the {model.name} {gpu_key} recipe: {source}) [assumed]")
    else:
        dispatcher = "alltoall"
        notes.append("MoE: alltoall dispatcher (Megatron-Bridge's MoE model providers' default) [assumed]")
    if _OVERLAP.search(text):
        overlap = True
        notes.append("MoE: expert all-to-all overlap (--overlap-moe-expert-parallel-comm), as the row states")
    else:
        overlap = bool(recipe and recipe["overlap"])
        if overlap:
            notes.append(f"MoE: expert all-to-all overlap (moe_a2a_overlap in the recipe: {source}) [assumed]")
    recompute = recipe["recompute"] if recipe else None
    graphs = (recipe or {}).get("graphs", "none")
    if recipe and graphs != "none":
        notes.append(f"CUDA graphs: {graphs} (the recipe's cuda_graph_impl: {source}) [assumed]")
    kernels = (recipe or {}).get("kernels", ())
    if kernels:
        notes.append(f"low-precision kernels: {', '.join(kernels)} (the recipe: {source}) [assumed]")
    # Megatron-Bridge's "tokendrop" runs: apply_moe_token_drop (capacity factor 1, inputs padded to capacity) and
    # no forced balance (v0.2.0 scripts/performance/utils/helpers.py lines 226-229); "w/ MTP": the MTP layer trained
    label = f"{(row.get('model') or {}).get('name') or ''} {row.get('id') or ''}"  # the run's label, not the notes
    capacity = 1.0 if re.search(r"token-?drop(?!less)", label, re.I) else None
    if capacity:
        notes.append("MoE: token dropping at capacity factor 1.0, not force-balanced (the row's 'tokendrop')")
    mtp = 1 if (re.search(r"\bw/ ?mtp\b|with mtp", label, re.I) and model.moe is not None
                and model.mtp_layers) else 0
    if mtp:
        notes.append("MTP: one multi-token-prediction layer trained (the row's 'w/ MTP')")
    return dict(dispatcher=dispatcher, overlap=overlap, recompute=recompute, capacity=capacity, mtp=mtp,
                graphs=graphs, kernels=kernels), notes
