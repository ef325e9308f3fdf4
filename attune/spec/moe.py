"""Mixture-of-experts geometry and parameters: the routed experts, the router and the shared expert.

A ``MoESpec`` hangs off ``ModelSpec.moe`` (None for dense models). ``MoESpec.pattern`` says which decoder
layers are MoE layers (Megatron ``--moe-layer-freq``; Hugging Face ``first_k_dense_replace`` /
``moe_layer_freq`` for DeepSeek-V3, ``mlp_only_layers`` / ``decoder_sparse_step`` for the Qwen MoE families;
empty: every layer). An MoE layer's MLP is the router, ``experts`` routed SwiGLU experts of width
``expert_ffn`` of which each token uses ``top_k``, and optionally a shared SwiGLU expert of width
``shared_ffn`` (scaled by a sigmoid gate ``Linear(hidden, 1)`` in the Qwen families); a dense layer's MLP is
a SwiGLU of ``dense_ffn``.

Families (``MoESpec.family``): each family plug-in (``attune.spec.families``) reads its MoE configs into a
``MoESpec`` (``qwen3_moe`` and ``mixtral`` in ``llama``, ``qwen3_next`` and ``qwen3_5_moe`` in ``qwen3_5``,
``deepseek_v3``, ``gpt_oss``, the GLM and MiniMax families) and declares the names it uses
(``attune.spec.family_registry.moe_family_names``).

Two parameter conventions: ``ModelSpec.total_params`` counts every expert; ``ModelSpec.activated_params``
is the models' published "activated" count (the total less the routed experts a token does not use:
Qwen3-Next-80B-A3B 3,874,929,408); ``ModelSpec.active_params`` is the MFU convention (matmul weights a
token passes through, output layer included, no input embedding, no 1-D vectors).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from attune.errors import ModelError
from attune.spec.family_registry import moe_family_names


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """The mixture-of-experts part of every decoder layer."""

    family: str
    """One of the registered MoE family names (``attune.spec.family_registry.moe_family_names``)."""
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
    """The config's dense ``intermediate_size``: the SwiGLU width of the dense (non-MoE) layers (slime's scripts
    pass it as ``--ffn-hidden-size`` even when every layer is MoE); 0: not given."""
    pattern: tuple[int, ...] = ()
    """Per decoder layer 1 (MoE) or 0 (dense MLP of ``dense_ffn``), Megatron ``--moe-layer-freq`` as a list;
    empty: every layer is an MoE layer."""
    shared_experts: int = 0
    """Shared experts (DeepSeek ``n_shared_experts``); ``shared_ffn`` is their summed width (informational)."""
    score: str = "softmax"
    """Router scoring: ``softmax`` or ``sigmoid`` (``--moe-router-score-function``); numerics only, the router's
    FLOPs and memory are the same."""
    router_bias: bool = False
    """The router has a per-expert bias vector: DeepSeek's ``e_score_correction_bias`` (``noaux_tc``;
    ``--moe-router-enable-expert-bias``) or GPT-OSS's Linear bias."""
    expert_bias: bool = False
    """Every routed expert's linears have biases (GPT-OSS: gate_up 2 x ffn, down hidden)."""
    activation_clamp: float = 0.0
    """The experts' gated activation clamps its two halves to this magnitude before the gate (GPT-OSS HF
    ``swiglu_limit`` 7.0; megatron-core ``activation_func_clamp_value``); 0: no clamp."""
    num_groups: int = 0
    """Expert groups of group-limited routing (HF ``n_group``; ``--moe-router-num-groups``); 0: none."""
    group_topk: int = 0
    """Groups each token may use (HF ``topk_group``; ``--moe-router-group-topk``); 0: none."""
    topk_scaling: float = 0.0
    """Scale on the routed experts' weights (HF ``routed_scaling_factor``; ``--moe-router-topk-scaling-factor``);
    0: none."""

    def __post_init__(self) -> None:
        known = moe_family_names()
        if self.family not in known:
            raise ModelError(f"MoE family '{self.family}' is not modelled; allowed: {', '.join(known)}")
        for k in ("experts", "top_k", "expert_ffn"):
            if getattr(self, k) < 1:
                raise ModelError(f"MoE {k} must be >= 1 (got {getattr(self, k)})")
        if self.top_k > self.experts:
            raise ModelError(f"MoE top-k {self.top_k} exceeds the {self.experts} experts")
        if self.shared_ffn < 0:
            raise ModelError(f"MoE shared expert width must be >= 0 (got {self.shared_ffn})")
        if self.shared_gate and not self.shared_ffn:
            raise ModelError("MoE shared-expert gate without a shared expert (shared_ffn 0)")
        if any(x not in (0, 1) for x in self.pattern):
            raise ModelError(f"MoE layer pattern must hold 0 (dense) or 1 (MoE) per layer (got {self.pattern})")
        if self.pattern and not any(self.pattern):
            raise ModelError("MoE layer pattern has no MoE layer; allowed: at least one 1")
        if self.score not in ("softmax", "sigmoid"):
            raise ModelError(f"MoE router score '{self.score}' is not modelled; allowed: softmax, sigmoid")
        if self.pattern and 0 in self.pattern and self.dense_ffn < 1:
            raise ModelError("MoE dense layers need the dense MLP width (intermediate_size)")

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` (0-based) is an MoE layer."""
        return not self.pattern or bool(self.pattern[i])

    # ---------------------------------------------------------------- parameters of one MoE layer
    def expert_params(self, hidden: int) -> int:
        """One routed SwiGLU expert: gate and up (hidden x ffn each) and down (ffn x hidden), plus GPT-OSS's
        biases (gate_up 2 x ffn, down hidden: sharded with the expert, so counted with it)."""
        bias = 2 * self.expert_ffn + hidden if self.expert_bias else 0
        return 3 * hidden * self.expert_ffn + bias

    def routed_params(self, hidden: int) -> int:
        """All routed experts of one layer (sharded by EP x ETP in Megatron)."""
        return self.experts * self.expert_params(hidden)

    def active_routed_params(self, hidden: int) -> int:
        """The routed experts one token passes through (top-k of them)."""
        return self.top_k * self.expert_params(hidden)

    def router_params(self, hidden: int) -> int:
        """The router's Linear(hidden, experts) weight (HF ``gate``; Megatron ``TopKRouter.weight``)."""
        return self.experts * hidden

    def router_vectors(self) -> int:
        """The router's per-expert bias (DeepSeek ``e_score_correction_bias``, GPT-OSS ``router.bias``), 0 without."""
        return self.experts if self.router_bias else 0

    def shared_params(self, hidden: int) -> int:
        """The shared SwiGLU expert plus its Linear(hidden, 1) gate."""
        return 3 * hidden * self.shared_ffn + (hidden if self.shared_gate else 0)

    def dense_params(self, hidden: int) -> int:
        """The MoE block's matrices outside the routed experts: router, shared expert and its gate (sharded by
        TP and replicated over EP, like the attention)."""
        return self.router_params(hidden) + self.shared_params(hidden)

    def summary(self) -> dict:
        return {"moe_family": self.family, "experts": self.experts, "top_k": self.top_k,
                "expert_ffn": self.expert_ffn, "shared_ffn": self.shared_ffn, "shared_gate": self.shared_gate,
                **({"dense_layers": self.pattern.count(0)} if self.pattern else {})}


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
        if (L.moe_dispatcher is not None or L.moe_grouped_gemm or L.moe_capacity_factor is not None
                or L.moe_force_balance):
            e.append(f"MoE options (dispatcher, grouped GEMM, capacity factor, forced balance) need a mixture-of-experts model; "
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
    if getattr(L, "moe_ep_overlap", False):
        e += ep_overlap_rules(L)
    return e


def ep_overlap_rules(L) -> list[str]:
    """--overlap-moe-expert-parallel-comm's constraints (megatron-core 1dcf0daf transformer_config.py lines
    1878-1931, ``TransformerConfig.__post_init__``), one message each."""
    e, flag = [], "--overlap-moe-expert-parallel-comm"
    if L.ep <= 1:
        e.append(f"{flag} needs EP > 1")
    if L.moe_dispatcher not in ("alltoall", "flex"):
        e.append(f"{flag} needs the alltoall or flex dispatcher (got {L.moe_dispatcher or 'allgather'})")
    if L.pp > 1 and L.vpp <= 1:
        e.append(f"{flag} with PP {L.pp} needs virtual pipeline stages (VPP > 1)")
    if L.recompute_granularity == "full":
        e.append(f"{flag} cannot work with full recompute")
    if L.moe_shared_expert_overlap:
        e.append(f"{flag} cannot work with --moe-shared-expert-overlap")
    if L.mtp_layers > 1 or (L.mtp_layers == 1 and L.pp <= 1):
        e.append(f"{flag} allows at most one MTP layer, and with one PP > 1")
    return e


# ---------------------------------------------------------------------- slime launch
SLIME_MOE_COMMON = ("--moe-router-score-function", "softmax", "--moe-token-drop-policy", "probs",
                    "--moe-router-dtype", "fp32", "--moe-aux-loss-coeff", "0")
"""The numerics-class MoE flags every slime MoE model script passes (slime-runtime-and-moe.md section 4:
``--moe-router-score-function softmax --moe-token-drop-policy probs --moe-router-dtype fp32
--moe-aux-loss-coeff 0``); the dispatcher, grouped GEMM and permute fusion are layout flags and come from
the layout (``attune.spec.flags.to_flags``)."""


LAYER_FREQ_CHARS = re.compile(r"[,\d\[\]\(\)\+\*]+")
"""The only characters Megatron accepts in a ``--moe-layer-freq`` list expression: Megatron-LM 1dcf0daf
megatron/training/arguments.py ``_eval_pattern`` (lines 198-206) raises ValueError on any other character,
so a space makes ``moe_freq_type`` fail ("invalid moe_freq_type value") and argparse exit 2."""


def layer_freq_arg(moe: MoESpec, num_layers: int) -> str:
    """``--moe-layer-freq`` as Megatron parses it (a Python list expression, arguments.py
    ``moe_freq_type`` / ``_eval_pattern``: no spaces): every layer MoE -> the explicit list of ones slime's
    scripts write (they join with ``IFS=', '``, whose first character is ``,``: ``[1,1,...]``); dense layers
    -> runs, e.g. DeepSeek-V3 ``([0]*3+[1]*58)`` (slime scripts/models/deepseek-v3.sh writes this form)."""
    pat = moe.pattern or (1,) * num_layers
    if all(pat):
        return _checked_freq("[" + ",".join(["1"] * num_layers) + "]")
    runs: list[list[int]] = []
    for x in pat:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    if len(runs) > 2:  # alternating patterns: the explicit list reads better than many runs
        return _checked_freq("[" + ",".join(str(x) for x in pat) + "]")
    return _checked_freq("(" + "+".join(f"[{x}]*{n}" for x, n in runs) + ")")


def _checked_freq(text: str) -> str:
    if not LAYER_FREQ_CHARS.fullmatch(text):  # a bug in this module, never user input
        raise AssertionError(f"--moe-layer-freq {text!r} has characters Megatron's _eval_pattern refuses")
    return text


def moe_model_args(moe: MoESpec, num_layers: int, frozen_expert_bias: bool = False) -> list[str]:
    """The MoE part of slime's MODEL_ARGS for a model (scripts/models/qwen3-30B-A3B.sh and the others);
    DeepSeek-V3 / Kimi K2 add the sigmoid router with its frozen expert bias (``frozen_expert_bias``: the family
    says so), group-limited routing and the top-k scaling factor where the config has them."""
    a = ["--num-experts", str(moe.experts), "--moe-router-topk", str(moe.top_k),
         "--moe-ffn-hidden-size", str(moe.expert_ffn)]
    if moe.shared_ffn:
        a += ["--moe-shared-expert-intermediate-size", str(moe.shared_ffn)]
    if moe.shared_gate:
        a.append("--moe-shared-expert-gate")
    common = list(SLIME_MOE_COMMON)
    common[common.index("--moe-router-score-function") + 1] = moe.score
    a += common
    if frozen_expert_bias:
        # e_score_correction_bias (noaux_tc), frozen (bias update rate 0), top-k weights normalised after the
        # sigmoid (pre-softmax) and sequence-level balancing at coefficient 0: slime's deepseek-v3.sh, kimi-k2.sh,
        # moonlight.sh at 624b824a (Megatron's default update rate 1e-3 would move the bias during training)
        a += ["--moe-router-enable-expert-bias", "--moe-router-pre-softmax", "--moe-router-load-balancing-type",
              "seq_aux_loss", "--moe-router-bias-update-rate", "0"]
    if moe.topk_scaling:
        a += ["--moe-router-topk-scaling-factor", f"{moe.topk_scaling:g}"]
    if moe.num_groups > 1:
        a += ["--moe-router-num-groups", str(moe.num_groups), "--moe-router-group-topk", str(moe.group_topk)]
    a += ["--moe-layer-freq", layer_freq_arg(moe, num_layers)]
    return a
