"""Multi-head latent attention (MLA) geometry and parameters: DeepSeek-V2/V3, Kimi K2.

A ``MLASpec`` hangs off ``ModelSpec.mla`` (None for GQA/MHA models). Layer definitions: transformers
``DeepseekV3Attention`` (modeling_deepseek_v3.py) and megatron-core ``MLASelfAttention``
(megatron/core/transformer/multi_latent_attention.py):

* queries: ``q_a_proj`` Linear(hidden, q_lora_rank) -> ``q_a_layernorm`` RMSNorm(q_lora_rank) -> ``q_b_proj``
  Linear(q_lora_rank, heads x (qk_nope + qk_rope)); or a plain ``q_proj`` Linear(hidden, heads x (qk_nope +
  qk_rope)) when ``q_lora_rank`` is null (DeepSeek-V2-Lite).
* keys/values: ``kv_a_proj_with_mqa`` Linear(hidden, kv_lora_rank + qk_rope) (the compressed latent plus one
  shared rotary key) -> ``kv_a_layernorm`` RMSNorm(kv_lora_rank) -> ``kv_b_proj`` Linear(kv_lora_rank, heads x
  (qk_nope + v_head)).
* ``o_proj`` Linear(heads x v_head, hidden). No biases (``attention_bias: false``).

Tensor parallelism (megatron-core MLA): the down projections (``linear_q_down_proj``,
``linear_kv_down_proj``) are built with ``parallel_mode='duplicated'``: replicated on every TP rank, not
split; the up projections are column-parallel and ``linear_proj`` row-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

from attune.errors import ModelError


@dataclass(frozen=True, kw_only=True)
class MLASpec:
    """The latent-attention geometry of every decoder layer."""

    q_lora_rank: int
    """Rank of the query's low-rank projection (HF ``q_lora_rank``; Megatron ``--q-lora-rank``); 0: plain q_proj."""
    kv_lora_rank: int
    """Width of the compressed key/value latent (HF ``kv_lora_rank``; ``--kv-lora-rank``)."""
    qk_nope_head_dim: int
    """Per-head query/key width without rotary (HF ``qk_nope_head_dim``; ``--qk-head-dim``)."""
    qk_rope_head_dim: int
    """Per-head rotary query/key width (HF ``qk_rope_head_dim``; ``--qk-pos-emb-head-dim``)."""
    v_head_dim: int
    """Per-head value width (HF ``v_head_dim``; ``--v-head-dim``)."""
    index_heads: int = 0
    """DeepSeek sparse attention's indexer heads (GLM-5 ``index_n_heads``); 0: dense MLA. The indexer (transformers
    ``GlmMoeDsaIndexer``): ``wq_b`` Linear(q_lora_rank, heads x dim), ``wk`` Linear(hidden, dim), ``k_norm``
    LayerNorm(dim), ``weights_proj`` Linear(hidden, heads). Counted in the parameters; its top-k selection is not
    priced (the estimator prices MLA over the whole causal context)."""
    index_head_dim: int = 0
    """The indexer's head width (GLM-5 ``index_head_dim``)."""
    index_topk_freq: int = 1
    """DSA cross-layer index sharing (GLM-5.2 HF ``index_topk_freq``): 1, every layer runs its indexer (GLM-5);
    above 1, only the computing layers do (``computes_index``) and the others reuse the most recent computing
    layer's top-k and carry no indexer weights."""
    index_skip_topk_offset: int = 0
    """The sharing schedule's offset (HF ``index_skip_topk_offset``; read only when ``index_topk_freq`` > 1)."""

    def __post_init__(self) -> None:
        if self.q_lora_rank < 0:
            raise ModelError(f"MLA q_lora_rank must be >= 0 (0: plain q_proj; got {self.q_lora_rank})")
        for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, k) < 1:
                raise ModelError(f"MLA {k} must be >= 1 (got {getattr(self, k)})")
        if self.index_topk_freq < 1 or self.index_skip_topk_offset < 0:
            raise ModelError(f"MLA index_topk_freq must be >= 1 and index_skip_topk_offset >= 0 (got "
                             f"{self.index_topk_freq}, {self.index_skip_topk_offset})")

    def computes_index(self, i: int) -> bool:
        """Whether decoder layer ``i`` (0-indexed; ``num_layers`` is the MTP layer) runs its own DSA indexer.
        transformers 5.24 ``GlmMoeDsaConfig.__post_init__`` (configuration_glm_moe_dsa.py): ``indexer_types[i]`` is
        "full" when ``max(i - offset + 1, 0) % freq == 0``, else "shared" (``GlmMoeDsaAttention``: no ``indexer``
        module); slime 624b824a slime_plugins/models/glm5/glm5.py lines 264-271 ``is_skip_topk_layer`` is the
        same rule on Megatron's 1-indexed layer numbers (``max(L - offset, 0) % freq != 0``: skip) and lines
        727-734 drop the indexer modules of a skip layer. GLM-5.2 (freq 4, offset 3): layers 1, 2, 3, 7, 11, ...,
        75 (1-indexed) compute, 21 of 78; the MTP layer (Megatron layer number 79) computes."""
        if not self.index_heads or self.index_topk_freq == 1:
            return True
        return max(i - self.index_skip_topk_offset + 1, 0) % self.index_topk_freq == 0

    @property
    def qk_head_dim(self) -> int:
        """Query/key head dimension fed to attention: qk_nope + qk_rope (DeepSeek-V3: 192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def q_down(self, hidden: int) -> int:
        """q_a_proj weights (replicated across TP); 0 without q LoRA."""
        return hidden * self.q_lora_rank if self.q_lora_rank else 0

    def q_up(self, hidden: int, heads: int) -> int:
        """q_b_proj (from the q latent) or q_proj (from the hidden state) weights, column-parallel."""
        return (self.q_lora_rank or hidden) * heads * self.qk_head_dim

    def kv_down(self, hidden: int) -> int:
        """kv_a_proj_with_mqa weights (replicated across TP): the latent plus the shared rotary key."""
        return hidden * (self.kv_lora_rank + self.qk_rope_head_dim)

    def kv_up(self, heads: int) -> int:
        """kv_b_proj weights, column-parallel."""
        return self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)

    def out(self, hidden: int, heads: int) -> int:
        """o_proj weights, row-parallel."""
        return heads * self.v_head_dim * hidden

    def indexer(self, hidden: int) -> int:
        """The sparse-attention indexer's weight matrices (0 without one)."""
        if not self.index_heads:
            return 0
        return (self.q_lora_rank * self.index_heads * self.index_head_dim + hidden * self.index_head_dim
                + hidden * self.index_heads)

    def matrix(self, hidden: int, heads: int, indexer: bool = True) -> int:
        """Every MLA weight matrix of one layer (the sparse-attention indexer's included unless ``indexer`` is
        False: a layer that reuses an earlier layer's indices)."""
        return (self.q_down(hidden) + self.q_up(hidden, heads) + self.kv_down(hidden) + self.kv_up(heads)
                + self.out(hidden, heads) + (self.indexer(hidden) if indexer else 0))

    def replicated(self, hidden: int) -> int:
        """Of ``matrix``: the down projections, held whole by every TP rank."""
        return self.q_down(hidden) + self.kv_down(hidden)

    def vectors(self, indexer: bool = True) -> int:
        """q_a_layernorm and kv_a_layernorm gammas, and the indexer's k_norm LayerNorm (weight and bias)."""
        return self.q_lora_rank + self.kv_lora_rank + (2 * self.index_head_dim if self.index_heads and indexer else 0)

    def summary(self) -> dict:
        return {"q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
                "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
                "v_head_dim": self.v_head_dim}


def mla_from_hf(cfg: dict, where: str) -> MLASpec:
    """The MLA part of a DeepSeek-V3 / Kimi K2 Hugging Face config."""
    for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not cfg.get(k):
            raise ModelError(f"{where}: multi-head latent attention config is missing the field '{k}'")
    return MLASpec(q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(cfg["kv_lora_rank"]),
                   qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                   v_head_dim=int(cfg["v_head_dim"]))


def mla_model_args(mla: MLASpec) -> list[str]:
    """Megatron-LM's MLA model arguments (megatron-core ``MLATransformerConfig``; slime
    scripts/models/deepseek-v3.sh passes the same): ``--qk-head-dim`` is the non-rotary part, ``--qk-layernorm``
    turns on q_a_layernorm / kv_a_layernorm."""
    a = ["--multi-latent-attention"]
    if mla.q_lora_rank:
        a += ["--q-lora-rank", str(mla.q_lora_rank)]
    a += ["--kv-lora-rank", str(mla.kv_lora_rank), "--qk-head-dim", str(mla.qk_nope_head_dim),
          "--qk-pos-emb-head-dim", str(mla.qk_rope_head_dim), "--v-head-dim", str(mla.v_head_dim), "--qk-layernorm"]
    return a
