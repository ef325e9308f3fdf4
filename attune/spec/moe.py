"""Mixture-of-experts geometry and parameters: the routed experts, the router and the shared expert.

A ``MoESpec`` hangs off ``ModelSpec.moe`` (None for dense models). Every decoder layer of the bundled MoE
models is an MoE layer (Megatron ``--moe-layer-freq`` all ones; Hugging Face ``decoder_sparse_step`` 1 and
no ``mlp_only_layers``): the layer's MLP is the router, ``experts`` routed SwiGLU experts of width
``expert_ffn`` of which each token uses ``top_k``, and optionally a shared SwiGLU expert of width
``shared_ffn`` scaled by a sigmoid gate (``Linear(hidden, 1)``).

Families (``MoESpec.family``), with the Hugging Face ``model_type`` they are read from:

* ``qwen3_moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B): the llama-style Qwen3 decoder (QK-norm), no shared
  expert. transformers ``Qwen3MoeSparseMoeBlock``.
* ``qwen3_next`` (Qwen3-Next-80B-A3B) and ``qwen3_5_moe`` (Qwen3.5/3.6-35B-A3B): the Gated DeltaNet hybrid
  with MoE layers and a gated shared expert. transformers ``Qwen3NextSparseMoeBlock``.
* ``mixtral`` (Mixtral 8x7B): llama-style attention without QK-norm, no shared expert.
  transformers ``MixtralSparseMoeBlock``.

Two parameter conventions: ``ModelSpec.total_params`` counts every expert; ``ModelSpec.activated_params``
is the models' published "activated" count (the total less the routed experts a token does not use:
Qwen3-Next-80B-A3B 3,874,929,408); ``ModelSpec.active_params`` is the MFU convention (matmul weights a
token passes through, output layer included, no input embedding, no 1-D vectors).
"""

from __future__ import annotations

from dataclasses import dataclass

from attune.errors import ModelError

MOE_FAMILIES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "mixtral")
"""MoE families attune reads from a Hugging Face config."""

HF_MOE_TYPES = {"qwen3_moe": "qwen3_moe", "qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe",
                "qwen3_5_moe_text": "qwen3_5_moe", "mixtral": "mixtral"}
"""Hugging Face ``model_type`` -> MoE family."""


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """The mixture-of-experts part of every decoder layer."""

    family: str
    """One of ``MOE_FAMILIES``."""
    experts: int
    """Routed experts per layer (HF ``num_experts`` / ``num_local_experts``; Megatron ``--num-experts``)."""
    top_k: int
    """Experts each token is routed to (HF ``num_experts_per_tok``; ``--moe-router-topk``)."""
    expert_ffn: int
    """Intermediate width of one routed SwiGLU expert (HF ``moe_intermediate_size``; ``--moe-ffn-hidden-size``)."""
    shared_ffn: int = 0
    """Intermediate width of the shared SwiGLU expert, 0 for none (``--moe-shared-expert-intermediate-size``)."""
    shared_gate: bool = False
    """The shared expert's output is scaled by sigmoid(Linear(hidden, 1)) (``--moe-shared-expert-gate``)."""
    dense_ffn: int = 0
    """The config's dense ``intermediate_size`` (no layer uses it when every layer is MoE; slime's scripts
    still pass it as ``--ffn-hidden-size``); 0: not given."""

    def __post_init__(self) -> None:
        if self.family not in MOE_FAMILIES:
            raise ModelError(f"MoE family '{self.family}' is not modelled; allowed: {', '.join(MOE_FAMILIES)}")
        for k in ("experts", "top_k", "expert_ffn"):
            if getattr(self, k) < 1:
                raise ModelError(f"MoE {k} must be >= 1 (got {getattr(self, k)})")
        if self.top_k > self.experts:
            raise ModelError(f"MoE top-k {self.top_k} exceeds the {self.experts} experts")
        if self.shared_ffn < 0:
            raise ModelError(f"MoE shared expert width must be >= 0 (got {self.shared_ffn})")
        if self.shared_gate and not self.shared_ffn:
            raise ModelError("MoE shared-expert gate without a shared expert (shared_ffn 0)")

    # ---------------------------------------------------------------- parameters of one MoE layer
    def expert_params(self, hidden: int) -> int:
        """One routed SwiGLU expert: gate and up (hidden x ffn each) and down (ffn x hidden)."""
        return 3 * hidden * self.expert_ffn

    def routed_params(self, hidden: int) -> int:
        """All routed experts of one layer (sharded by EP x ETP in Megatron)."""
        return self.experts * self.expert_params(hidden)

    def active_routed_params(self, hidden: int) -> int:
        """The routed experts one token passes through (top-k of them)."""
        return self.top_k * self.expert_params(hidden)

    def router_params(self, hidden: int) -> int:
        """The router's Linear(hidden, experts), no bias (HF ``gate``; Megatron ``TopKRouter.weight``)."""
        return self.experts * hidden

    def shared_params(self, hidden: int) -> int:
        """The shared SwiGLU expert plus its Linear(hidden, 1) gate."""
        return 3 * hidden * self.shared_ffn + (hidden if self.shared_gate else 0)

    def dense_params(self, hidden: int) -> int:
        """The MoE block's matrices outside the routed experts: router, shared expert and its gate (sharded by
        TP and replicated over EP, like the attention)."""
        return self.router_params(hidden) + self.shared_params(hidden)

    def summary(self) -> dict:
        return {"moe_family": self.family, "experts": self.experts, "top_k": self.top_k,
                "expert_ffn": self.expert_ffn, "shared_ffn": self.shared_ffn, "shared_gate": self.shared_gate}


def moe_from_hf(cfg: dict, family: str, where: str) -> MoESpec:
    """The MoE part of a Hugging Face config (text config already unwrapped)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        raise ModelError(f"{where}: MoE config is missing the field 'num_experts'")
    top_k = cfg.get("num_experts_per_tok")
    if not top_k:
        raise ModelError(f"{where}: MoE config is missing the field 'num_experts_per_tok'")
    if cfg.get("mlp_only_layers") or (cfg.get("decoder_sparse_step") or 1) != 1:
        raise ModelError(f"{where}: MoE configs with dense layers (mlp_only_layers / decoder_sparse_step != 1) are "
                         f"not modelled; allowed: every layer an MoE layer")
    if family == "mixtral":
        ffn = cfg.get("intermediate_size")
    else:
        ffn = cfg.get("moe_intermediate_size")
    if not ffn:
        raise ModelError(f"{where}: MoE config is missing the expert width ('moe_intermediate_size')")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if family in ("qwen3_next", "qwen3_5_moe") else 0
    dense_ffn = int(ffn) if family == "mixtral" else int(cfg.get("intermediate_size") or 0)  # Megatron's Mixtral: ffn = expert width
    return MoESpec(family=family, experts=int(experts), top_k=int(top_k), expert_ffn=int(ffn), shared_ffn=shared,
                   shared_gate=shared > 0, dense_ffn=dense_ffn or shared)


# ---------------------------------------------------------------------- layout rules (called by attune.spec.rules)
def expert_data_parallel(layout) -> int:
    """Megatron's expert data-parallel size: world / (PP x EP x ETP) (parallel_state.py expert RankGenerator:
    the expert part folds TP x CP x DP into ETP x EP x expert-DP)."""
    dense = layout.tp * layout.cp * layout.dp
    return max(1, dense // (layout.ep * layout.etp))


def moe_rules(layout, model) -> list[str]:
    """Every expert-parallel rule the layout breaks, one message each. ``layout``: attune.spec.layout.Layout;
    ``model``: attune.spec.model.ModelSpec (not imported: model imports this module)."""
    L, moe, e = layout, model.moe, []
    if moe is None:
        if L.ep > 1 or L.etp > 1:
            e.append(f"EP {L.ep} / ETP {L.etp}: expert parallelism needs a mixture-of-experts model; "
                     f"{model.name} is dense (allowed: EP 1, ETP 1)")
        if L.moe_dispatcher is not None or L.moe_grouped_gemm or L.moe_capacity_factor is not None:
            e.append(f"MoE options (dispatcher, grouped GEMM, capacity factor) need a mixture-of-experts model; "
                     f"{model.name} is dense")
        return e
    if moe.experts % L.ep:
        e.append(f"EP {L.ep} must divide the {moe.experts} experts")
    if moe.expert_ffn % L.etp:
        e.append(f"ETP {L.etp} must divide the experts' intermediate width {moe.expert_ffn}")
    dense = L.tp * L.cp * L.dp
    if dense % (L.ep * L.etp):
        e.append(f"EP {L.ep} x ETP {L.etp} = {L.ep * L.etp} must divide TP x CP x DP = {dense} (Megatron folds the "
                 f"expert group into each pipeline stage's dense group)")
    if L.ep > 1 and L.tp > 1 and not L.sp:
        e.append("EP > 1 with TP > 1 needs sequence parallelism (Megatron validate_args)")
    return e


# ---------------------------------------------------------------------- slime launch
SLIME_MOE_COMMON = ("--moe-router-score-function", "softmax", "--moe-token-drop-policy", "probs",
                    "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0")
"""The numerics-class MoE flags every slime MoE model script passes (slime-runtime-and-moe.md section 4:
``--moe-router-score-function softmax --moe-token-drop-policy probs --moe-router-dtype fp32
--moe-aux-loss-coeff 0``); the dispatcher, grouped GEMM and permute fusion are layout flags and come from
the layout (``attune.spec.flags.to_flags``)."""


def moe_model_args(moe: MoESpec, num_layers: int) -> list[str]:
    """The MoE part of slime's MODEL_ARGS for a model (scripts/models/qwen3-30B-A3B.sh and the others)."""
    a = ["--num-experts", str(moe.experts), "--moe-router-topk", str(moe.top_k),
         "--moe-ffn-hidden-size", str(moe.expert_ffn)]
    if moe.shared_ffn:
        a += ["--moe-shared-expert-intermediate-size", str(moe.shared_ffn)]
    if moe.shared_gate:
        a.append("--moe-shared-expert-gate")
    a += list(SLIME_MOE_COMMON)
    a += ["--moe-layer-freq", "[" + ", ".join(["1"] * num_layers) + "]"]
    return a
