"""Model architectures read from a Hugging Face ``config.json``, and their exact parameter counts.

Every family is a plug-in (``attune.spec.families``, one module each, registered in
``attune.spec.family_registry``): it reads its Hugging Face ``model_type`` values into the fields below and
declares its layout rules, slime model arguments and builder traits; ``ModelSpec.traits`` is the model's family.
This module counts the parameters of whatever the family read and never compares the family's name.

Mixture-of-experts models have ``moe`` set (``attune.spec.moe.MoESpec``): ``ffn`` is then the shared expert's
width (0 for none) and each MoE layer's routed experts are ``LayerParams.expert_matrix``; the dense layers of an
MoE model (``MoESpec.pattern``) have a SwiGLU MLP of ``MoESpec.dense_ffn``. Multi-head latent attention is ``mla``
(``attune.spec.mla``); ``mtp_layers`` multi-token-prediction modules are counted in ``total_params``
(``mtp_params``; Megatron ``--mtp-num-layers``).

Layer kinds (the keys of ``attune.estimator.costs.layer_costs``): the mixer, ``FULL`` (softmax or latent
attention over the whole causal context), ``SLIDING`` (softmax attention over a window) or ``LINEAR`` (Gated
DeltaNet), with ``DENSE`` appended for the dense-MLP layers of an MoE model (``layer_kind``) and ``SHARED_INDEX``
before it for a DSA layer that reuses an earlier layer's top-k and has no indexer (GLM-5.2).

``from_geometry`` builds a spec from the bare geometry a published run states (layers, hidden, ffn,
heads, kv_heads, vocab, mlp).

Parameter counts follow the layer definitions in transformers / megatron-core; the convention for
"active" parameters (what MFU uses) is the recipe's: every matmul and conv weight including the
output layer, excluding the input embedding (and learned positions) and every 1-D vector.
Reference: shared/reference/slime-and-qwen.md section 3.1 (Qwen3.6-27B: 25,623,920,640).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path

from attune.errors import ModelError
from attune.spec import families  # noqa: F401 - registers the plug-in families (attune.spec.families)
from attune.spec.family_registry import Family, by_hf_type, for_mlp, hf_types, moe_hf_types
from attune.spec.family_registry import get as get_family
from attune.spec.hfconfig import check_hf_config
from attune.spec.layer_kinds import DENSE, FULL, LINEAR, SHARED_INDEX, SLIDING, is_dense_kind, mixer_of, shares_index
from attune.spec.mla import MLASpec
from attune.spec.moe import MoESpec
from attune.spec.textio import read_text

__all__ = ["DENSE", "FULL", "LINEAR", "SHARED_INDEX", "SLIDING", "is_dense_kind", "mixer_of", "shares_index", "LayerParams", "ModelSpec",
           "from_hf_config", "from_geometry", "load_model", "bundled_names"]

MLPS = ("swiglu", "gelu", "squared_relu")
NORMS = ("rmsnorm", "layernorm", "layernorm1p")
POSITIONS = ("rope", "learned", "alibi")


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer, split the way memory and parallelism need them."""

    mixer_matrix: int  # attention or GDN weights (2-D / conv), shardable by TP in Megatron
    mlp_matrix: int  # MLP weights
    vectors: int  # norms, biases, gates' 1-D params (replicated across TP)
    expert_matrix: int = 0  # MoE: all routed experts' weights (sharded by EP x ETP, not in ``matrix``)
    active_expert_matrix: int = 0  # MoE: the top-k routed experts one token passes through
    mixer_replicated: int = 0  # of ``mixer_matrix``: weights every TP rank holds whole (MLA down projections)

    @property
    def matrix(self) -> int:
        """The dense matrices (TP-sharded): mixer and MLP (for MoE: router, shared expert and its gate)."""
        return self.mixer_matrix + self.mlp_matrix

    @property
    def total(self) -> int:
        return self.matrix + self.expert_matrix + self.vectors


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # a registered family (attune.spec.families): ``traits``
    model_type: str
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    norm: str = "rmsnorm"  # rmsnorm | layernorm | layernorm1p (LayerNorm with zero-centred gamma)
    mlp: str = "swiglu"  # swiglu (gated: fc1 emits 2 x ffn) | gelu | squared_relu (ungated: fc1 emits ffn)
    positions: str = "rope"  # rope | learned | alibi (no parameters)
    max_positions: int = 4096
    rope_theta: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling_factor: float = 0.0  # HF rope_scaling factor (Llama-3 llama3 or DeepSeek yarn); 0: none
    rope_mscale: tuple[float, float] = ()  # YaRN (mscale, mscale_all_dim) of a yarn rope_scaling (DeepSeek-V3, Kimi K2)
    norm_eps: float = 1e-6
    qk_norm: bool = False
    qk_norm_full: bool = False  # q/k norms over the whole projection (MiniMax-M2 per_layer), not per head
    sandwich_norm: bool = False  # RMSNorms after attention and after the MLP too (GLM-4 post_self_attn/post_mlp)
    attn_bias: bool = False  # q/k/v biases (qwen2) or all biases (gpt2)
    attn_output_gate: bool = False
    layer_types: tuple[str, ...] = ()  # FULL or LINEAR per layer
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 0
    moe: MoESpec | None = None  # mixture-of-experts layers (attune.spec.moe); None: dense
    mla: MLASpec | None = None  # multi-head latent attention (attune.spec.mla); None: GQA / MHA
    window: int = 0  # sliding-window size in tokens of the SLIDING layers (GPT-OSS: 128); 0: none
    window_layers: tuple[bool, ...] = ()  # per layer: attends over ``window`` only (HF layer_types sliding_attention)
    attn_out_bias: bool = False  # o_proj bias besides q/k/v (GPT-OSS)
    attn_sinks: bool = False  # learned per-head attention sink logits (GPT-OSS ``sinks``, a vector of heads)
    mtp_layers: int = 0  # multi-token-prediction modules in the checkpoint (HF num_nextn_predict_layers)
    source: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        get_family(self.family)  # a one-line ModelError for a family no plug-in registers
        if self.mlp not in MLPS:
            raise ModelError(f"{self.name}: mlp '{self.mlp}' is not modelled; allowed: {', '.join(MLPS)}")
        if self.norm not in NORMS:
            raise ModelError(f"{self.name}: norm '{self.norm}' is not modelled; allowed: {', '.join(NORMS)}")
        if self.positions not in POSITIONS:
            raise ModelError(f"{self.name}: positions '{self.positions}' not modelled; allowed: {', '.join(POSITIONS)}")
        if self.ffn < (0 if self.moe is not None else 1):  # MoE: ffn is the shared expert's width, 0 for none
            raise ModelError(f"{self.name}: ffn must be >= 1 (got {self.ffn})")
        for k in ("num_layers", "hidden", "heads", "kv_heads", "head_dim"):
            if getattr(self, k) < 1:
                raise ModelError(f"{self.name}: {k} must be >= 1 (got {getattr(self, k)})")
        if self.vocab < 0:
            raise ModelError(f"{self.name}: vocab must be >= 0 (got {self.vocab})")
        if self.moe is not None and self.moe.pattern and len(self.moe.pattern) != self.num_layers:
            raise ModelError(f"{self.name}: MoE layer pattern has {len(self.moe.pattern)} entries for "
                             f"{self.num_layers} layers")
        if self.window_layers and (len(self.window_layers) != self.num_layers or self.window < 1):
            raise ModelError(f"{self.name}: sliding-window layers need one flag per layer ({self.num_layers}) and a "
                             f"window >= 1 (got {len(self.window_layers)} flags, window {self.window})")
        if self.mtp_layers < 0:
            raise ModelError(f"{self.name}: mtp_layers must be >= 0 (got {self.mtp_layers})")

    @property
    def traits(self) -> Family:
        """The model's family (``attune.spec.family_registry.Family``): its rules, launch and builder traits."""
        return get_family(self.family)

    # ------------------------------------------------------------------ geometry
    @property
    def mlp_gated(self) -> bool:
        """SwiGLU: fc1 emits gate and up halves (2 x ffn); GeLU and squared ReLU emit ffn."""
        return self.mlp == "swiglu"

    @property
    def fc1_width(self) -> int:
        """Output width of the MLP's first projection."""
        return (2 if self.mlp_gated else 1) * self.ffn

    @property
    def norm_vectors(self) -> int:
        """1-D parameters of one norm: gamma (RMSNorm), gamma and beta (LayerNorm, LayerNorm1p)."""
        return self.hidden * (1 if self.norm == "rmsnorm" else 2)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def lin_qk_dim(self) -> int:
        return self.lin_k_heads * self.lin_k_dim

    @property
    def lin_value_dim(self) -> int:
        return self.lin_v_heads * self.lin_v_dim

    @property
    def lin_conv_dim(self) -> int:
        return 2 * self.lin_qk_dim + self.lin_value_dim

    def layer_type(self, i: int) -> str:
        """The mixer of layer ``i``: FULL (softmax or latent attention, sliding-window included) or LINEAR."""
        return self.layer_types[i] if self.layer_types else FULL

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is an MoE block (False for every layer of a dense model)."""
        return self.moe is not None and self.moe.is_moe_layer(i)

    def layer_kind(self, i: int) -> str:
        """Layer ``i``'s cost kind: FULL, SLIDING or LINEAR, with DENSE appended for a dense-MLP layer of an MoE
        model."""
        t = self.layer_type(i)
        if t == FULL and self.window_layers and self.window_layers[i]:
            t = SLIDING
        if self.mla is not None and not self.mla.computes_index(i):
            t += SHARED_INDEX
        if self.moe is not None and not self.moe.is_moe_layer(i):
            t += DENSE
        return t

    @cached_property
    def kinds(self) -> tuple[str, ...]:
        """The layer kinds this model has, in order of first appearance."""
        return tuple(dict.fromkeys(self.layer_kind(i) for i in range(self.num_layers)))

    @cached_property
    def _kind_prefix(self) -> dict[str, tuple[int, ...]]:
        """Prefix counts of every layer kind, so a stage's layer mix is O(kinds)."""
        out: dict[str, list[int]] = {k: [0] for k in self.kinds}
        for i in range(self.num_layers):
            ki = self.layer_kind(i)
            for k, v in out.items():
                v.append(v[-1] + (k == ki))
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def _kind_counts(self) -> dict[tuple, tuple]:
        """count_kinds / count_types results by layer range: the estimator asks for the same few stage ranges."""
        return {}

    def count_kinds(self, start: int, stop: int) -> tuple[tuple[str, int], ...]:
        """(kind, layers) of every kind present among layers [start, stop), in ``kinds`` order."""
        got = self._kind_counts.get((start, stop))
        if got is None:
            pre = self._kind_prefix
            got = self._kind_counts[(start, stop)] = tuple(
                (k, n) for k in self.kinds if (n := pre[k][stop] - pre[k][start]))
        return got

    def count_types(self, start: int, stop: int) -> tuple[int, int]:
        """(softmax-attention layers, GDN layers) among layers [start, stop)."""
        key = ("types", start, stop)
        got = self._kind_counts.get(key)
        if got is None:
            lin = sum(n for k, n in self.count_kinds(start, stop) if mixer_of(k) == LINEAR)
            got = self._kind_counts[key] = (stop - start - lin, lin)
        return got

    def count_moe(self, start: int, stop: int) -> int:
        """MoE layers among layers [start, stop)."""
        if self.moe is None:
            return 0
        return sum(n for k, n in self.count_kinds(start, stop) if not is_dense_kind(k))

    # ------------------------------------------------------------------ parameters
    def _attention_params(self, kind: str = FULL) -> tuple[int, int, int]:
        """(matrices, of which TP-replicated, 1-D vectors) of one softmax / latent attention block."""
        h = self.hidden
        if self.mla is not None:
            idx = not shares_index(kind)
            return (self.mla.matrix(h, self.heads, idx), self.mla.replicated(h), self.mla.vectors(idx))
        q_out = self.q_dim * (2 if self.attn_output_gate else 1)  # q_proj also emits the output gate
        mixer = h * q_out + 2 * h * self.kv_dim + self.q_dim * h
        vec = 0
        if self.qk_norm:
            vec += self.q_dim + self.kv_dim if self.qk_norm_full else 2 * self.head_dim
        if self.attn_bias and (self.traits.linear_biases or self.attn_out_bias):
            vec += q_out + 2 * self.kv_dim + h
        elif self.attn_bias:
            vec += q_out + 2 * self.kv_dim
        if self.attn_sinks:
            vec += self.heads  # GptOssAttention.sinks: one learned logit per head
        return mixer, 0, vec

    def _gdn_params(self) -> tuple[int, int, int]:
        h = self.hidden
        in_proj = h * (self.lin_conv_dim + self.lin_value_dim + 2 * self.lin_v_heads)  # qkv, z, b, a
        conv = self.lin_conv_dim * self.conv_kernel  # depthwise conv1d, no bias
        out = self.lin_value_dim * h
        vec = 2 * self.lin_v_heads + self.lin_v_dim  # dt_bias, A_log, gated-norm weight
        return in_proj + conv + out, 0, vec

    @cached_property
    def _params_by_kind(self) -> dict[str, LayerParams]:
        return {k: self._kind_params(k) for k in (*self.kinds, FULL, LINEAR)}

    def _kind_params(self, kind: str) -> LayerParams:
        lin = mixer_of(kind) == LINEAR
        mixer, rep, vec = self._gdn_params() if lin else self._attention_params(kind)
        dense = is_dense_kind(kind) or self.moe is None
        experts = (0, 0) if dense else (self.moe.routed_params(self.hidden), self.moe.active_routed_params(self.hidden))
        mlp_vec = 0 if lin and self.traits.linear_biases else self.mlp_vectors(kind)
        return LayerParams(mixer, self.mlp_params(kind), vec + mlp_vec + self.layer_norm_vectors(),
                           *experts, mixer_replicated=rep)

    def kind_params(self, kind: str) -> LayerParams:
        """One layer of ``kind`` (``layer_kind``)."""
        hit = self._params_by_kind.get(kind)
        return hit if hit is not None else self._kind_params(kind)

    def full_layer(self) -> LayerParams:
        """A softmax (or latent) attention layer with the model's usual MLP (MoE for MoE models)."""
        return self.kind_params(FULL)

    def gdn_layer(self) -> LayerParams:
        """A Gated DeltaNet layer with the model's usual MLP."""
        return self.kind_params(LINEAR)

    def layer(self, i: int) -> LayerParams:
        return self.kind_params(self.layer_kind(i))

    def mlp_width(self, kind: str = FULL) -> int:
        """The dense MLP width of a layer kind: ``ffn`` (for MoE layers the shared expert's, 0 for none), the
        config's dense ``intermediate_size`` for the dense layers of an MoE model."""
        return self.moe.dense_ffn if (self.moe is not None and is_dense_kind(kind)) else self.ffn

    def mlp_params(self, kind: str = FULL) -> int:
        """The dense MLP; for an MoE layer the shared expert (``ffn`` is its width) plus the router and the
        shared gate."""
        f = self.mlp_width(kind)
        dense = ((2 if self.mlp_gated else 1) * f + f) * self.hidden
        if self.moe is not None and not is_dense_kind(kind):
            dense += self.moe.router_params(self.hidden) + (self.hidden if self.moe.shared_gate else 0)
        return dense

    def mlp_vectors(self, kind: str = FULL) -> int:
        if self.traits.linear_biases:
            return self.ffn + self.hidden  # c_fc and c_proj biases (GPT-2)
        if self.moe is not None and not is_dense_kind(kind):
            return self.moe.router_vectors()
        return 0

    @property
    def mtp_params(self) -> int:
        """The multi-token-prediction modules (DeepSeek-V3 ``num_nextn_predict_layers``; megatron-core
        ``MultiTokenPredictionLayer``): per module the enorm / hnorm pair, eh_proj Linear(2h, h), one decoder
        layer (the last layer's kind) and its final norm; the embedding and output layer are shared with the
        main model (the HF checkpoint stores copies of them, not counted here)."""
        if not self.mtp_layers:
            return 0
        last = self.kind_params(self.mtp_kind).total
        return self.mtp_layers * (2 * self.norm_vectors + 2 * self.hidden * self.hidden + last + self.norm_vectors)

    @property
    def mtp_kind(self) -> str:
        """The layer kind of a multi-token-prediction layer: the main model's last layer's (megatron-core builds the
        MTP block's transformer layer from the decoder's last layer spec), running its own DSA indexer when the
        sharing schedule says so at layer ``num_layers`` (megatron-core 1dcf0daf multi_token_prediction.py lines
        620 and 663-670 give its transformer layer the number ``num_layers + 1``; transformers' checkpoint index is
        ``num_layers``)."""
        k = self.layer_kind(self.num_layers - 1)
        if shares_index(k) and self.mla is not None and self.mla.computes_index(self.num_layers):
            k = k.replace(SHARED_INDEX, "")
        return k

    def layer_norm_vectors(self) -> int:
        """The decoder layer's norms: before attention and MLP, plus after each with ``sandwich_norm`` (GLM-4)."""
        return (4 if self.sandwich_norm else 2) * self.norm_vectors

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def position_params(self) -> int:
        return self.max_positions * self.hidden if self.positions == "learned" else 0

    @property
    def output_params(self) -> int:
        """The output layer's matmul weight (shared with the embedding when tied)."""
        return self.vocab * self.hidden

    @property
    def final_norm_params(self) -> int:
        return self.norm_vectors

    @property
    def total_params(self) -> int:
        """Every parameter, the multi-token-prediction modules of the config included (``mtp_params``)."""
        layers = sum(self.layer(i).total for i in range(self.num_layers))
        out = 0 if self.tied_embeddings else self.output_params
        return layers + self.embedding_params + self.position_params + out + self.final_norm_params + self.mtp_params

    @functools.cached_property
    def active_params(self) -> int:
        """Matmul and conv weights including the output layer; no input embedding, no 1-D vectors. Cached: the
        estimator's MFU reads it for every layout."""
        return sum(self.layer(i).matrix + self.layer(i).active_expert_matrix
                   for i in range(self.num_layers)) + self.output_params

    @property
    def activated_params(self) -> int:
        """The published "activated" count of an MoE model: every parameter less the routed experts a token does
        not use (Qwen3-Next-80B-A3B: 3,874,929,408). Dense models: the total."""
        unused = sum(self.layer(i).expert_matrix - self.layer(i).active_expert_matrix for i in range(self.num_layers))
        if self.mtp_layers:
            last = self.layer(self.num_layers - 1)
            unused += self.mtp_layers * (last.expert_matrix - last.active_expert_matrix)
        return self.total_params - unused

    @property
    def activated_nonembedding_params(self) -> int:
        """``activated_params`` less the input embedding (and learned positions): the convention of OpenAI's
        gpt-oss model card (Aug 2025: its "active parameters" count the unembedding, not the embedding)."""
        return self.activated_params - self.embedding_params - self.position_params
    def summary(self) -> dict:
        full, lin = self.count_types(0, self.num_layers)
        return {
            "name": self.name,
            "family": self.family,
            "layers": self.num_layers,
            "full_attention_layers": full,
            "gated_deltanet_layers": lin,
            "hidden": self.hidden,
            "ffn": self.ffn,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab": self.vocab,
            "tied_embeddings": self.tied_embeddings,
            "total_params": self.total_params,
            "active_params": self.active_params,
            **({"activated_params": self.activated_params, **self.moe.summary()} if self.moe is not None else {}),
            **({"mla": self.mla.summary()} if self.mla is not None else {}),
            **({"sliding_window": self.window, "sliding_layers": sum(self.window_layers)} if self.window else {}),
            **({"mtp_layers": self.mtp_layers, "mtp_params": self.mtp_params} if self.mtp_layers else {}),
        }


# ---------------------------------------------------------------------- reading configs
def from_hf_config(cfg: dict, name: str = "model", where: str | None = None) -> ModelSpec:
    """Build a ModelSpec from a parsed Hugging Face config.json."""
    where = where or name
    cfg = check_hf_config(cfg, where)  # types and ranges of every field read below; null fields dropped
    outer_type = cfg.get("model_type")
    src = cfg.get("_attune_source", "")
    if "text_config" in cfg and isinstance(cfg["text_config"], dict):
        text = dict(cfg["text_config"])
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        text.setdefault("model_type", outer_type)
        cfg = text
    mt = cfg.get("model_type") or outer_type
    if mt is None:
        raise ModelError(f"{where}: config is missing the field 'model_type'")
    family = by_hf_type(mt)  # the family plug-in reading this model_type (attune.spec.families)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if experts and experts > 1 and (family is None or mt not in family.moe_hf_types):
        raise ModelError(f"{where}: mixture-of-experts model_type '{mt}' is not modelled; allowed: "
                         f"{', '.join(sorted(moe_hf_types()))}")
    if family is None:
        raise ModelError(f"{where}: model_type '{mt}' is not supported; allowed: {', '.join(hf_types())}")
    if cfg.get("model_type") != mt:
        cfg = {**cfg, "model_type": mt}
    return ModelSpec(name=name, family=family.name, model_type=mt, source=src, **family.read(cfg, where))


def from_geometry(*, name: str, layers: int, hidden: int, ffn: int, heads: int, vocab: int, mlp: str,
                  kv_heads: int | None = None, head_dim: int | None = None, seq_length: int = 4096,
                  positions: str | None = None, tied_embeddings: bool | None = None, source: str = "") -> ModelSpec:
    """A dense decoder from the geometry a published run states.

    ``mlp``: ``squared_relu`` -> the ``nemotron`` family (NeMo ``Nemotron4Config``: LayerNorm1p, rotary on
    half the head, no biases, untied output layer); ``gelu`` -> the ``gpt2`` family (Megatron-LM's GPT
    defaults: LayerNorm, 4h-style GeLU MLP of ``ffn``, biases, learned absolute positions, tied output
    layer; ``positions='rope'`` or ``'alibi'`` where the run says so); ``swiglu`` -> ``llama`` (RMSNorm,
    rotary, no biases, untied). ``vocab`` 0 builds the transformer layers only (no embedding, no output
    layer), for sources that count the layers alone.
    """
    kind = str(mlp).strip().lower().split()[0] if str(mlp).strip() else ""
    kv = kv_heads or heads
    if hidden % heads and head_dim is None:
        raise ModelError(f"{name}: hidden {hidden} is not a multiple of {heads} heads; give head_dim")
    common = dict(name=name, model_type="", num_layers=int(layers), hidden=int(hidden), ffn=int(ffn), heads=int(heads),
                  kv_heads=int(kv), head_dim=int(head_dim or hidden // heads), vocab=int(vocab),
                  max_positions=int(seq_length), source=source)
    family = for_mlp(kind)
    if family is None or family.geometry is None:
        raise ModelError(f"{name}: mlp '{mlp}' is not modelled; allowed: {', '.join(MLPS)}")
    return ModelSpec(family=family.name, **family.geometry(common, positions, tied_embeddings))


def bundled_names() -> list[str]:
    files = resources.files("attune.spec").joinpath("model_configs")
    return sorted(p.name[: -len(".json")] for p in files.iterdir() if p.name.endswith(".json"))


def _no_constant(name: str):
    raise ModelError(f"config.json holds {name}; allowed: finite numbers only")


def load_model(name_or_path: str) -> ModelSpec:
    """A bundled model by name (case-insensitive), or a config.json path (or a folder holding one)."""
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if p.suffix == ".json" or p.exists():
        if not p.exists():
            raise ModelError(f"{name_or_path}: no such config file")
        try:
            cfg = json.loads(read_text(p, "config file", ModelError), parse_constant=_no_constant)
        except json.JSONDecodeError as e:
            raise ModelError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
        except RecursionError:
            raise ModelError(f"{p}: JSON nested too deeply") from None
        return from_hf_config(cfg, name=p.parent.name if p.name == "config.json" else p.stem, where=str(p))
    by_lower = {n.lower(): n for n in bundled_names()}
    key = by_lower.get(name_or_path.lower())
    if key is None:
        raise ModelError(f"unknown model '{name_or_path}'; bundled: {', '.join(bundled_names())} (or pass a config.json path)")
    text = resources.files("attune.spec").joinpath("model_configs", f"{key}.json").read_text()
    return from_hf_config(json.loads(text), name=key)
