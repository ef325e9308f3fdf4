"""The routed experts of MoE models in the array engine: ``attune.estimator.moe`` over a batch of layouts.

What an MoE layer adds to a dense one (``attune.estimator.moe``: the routed tokens' saved tensors and backward working
set, the expert GEMMs, router, permutation passes, the dispatch / combine all-to-all with its overlaps, the host launch
time a routing sync exposes; the expert weights, gradients and optimizer states sharded by EP x ETP and the expert
data-parallel group, their DP communication and optimizer step) depends on a few fields besides the shape:
``MOE_FIELDS``. ``batch_tables.kind_tables`` groups the rows by them too (``moe_keys``) and calls ``moe_group`` once per
group, which runs the scalar functions (``moe.with_expert_activations``, ``moe.moe_layer_times``,
``moe.expert_activation_bytes``); the per-row, per-stage arithmetic that bb2a96d's scalar composition
(``performance._pipeline``, ``estimate_performance``, ``estimate_memory``, since deleted) did around them is here as
arrays, in its order, so every term equals what it gave (tests/test_batch_moe.py's frozen reference).
Dense models: ``moe_keys`` is empty and nothing here runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attune.estimator import moe as moe_terms
from attune.estimator import offload as knob_terms
from attune.estimator.batch_place import BatchPlacement
from attune.estimator.costs import BF16, LayerCost, Shape
from attune.spec.columns import NONE_INT, LayoutColumns
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster, GiB
from attune.spec.layout import Layout
from attune.spec.model import FULL, ModelSpec, is_dense_kind

from .coefficients import Coefficients

MOE_FIELDS = ("ep", "etp", "moe_force_balance", "moe_capacity_factor", "moe_grouped_gemm", "moe_permute_fusion",
              "moe_dispatcher", "moe_shared_expert_overlap", "moe_ep_overlap")
"""The Layout fields ``moe.with_expert_activations`` and ``moe.moe_layer_times`` read besides the shape (TP, SP, CP,
tokens per GPU): with them a kind-table group holds one routed-expert cost and time."""

MOE_TIME_KEYS = ("fwd_gemm", "bwd_gemm", "fwd_memory", "bwd_memory", "ep_fwd", "ep_bwd", "ep_fwd_alone",
                 "ep_bwd_alone", "fwd_act_memory")
"""The per-layer times of ``moe.moe_layer_times``, in the order of ``KindTables.moe``'s last axis."""
_M = {k: i for i, k in enumerate(MOE_TIME_KEYS)}
_FWD6 = ("fwd_gemm", "fwd_attention", "fwd_gdn", "fwd_memory", "tp_fwd", "cp_fwd")


def _value_ids(col: np.ndarray) -> np.ndarray:
    """An int id per distinct value of a column (NaN, None and strings included)."""
    if col.dtype == object:
        seen: dict = {}
        return np.array([seen.setdefault(v, len(seen)) for v in col], dtype=np.int64)
    if len(col) and (col == col[0]).all():  # one value (a target's rows mostly share them): what np.unique gives
        return np.zeros(len(col), dtype=np.int64)
    return np.unique(np.nan_to_num(col.astype(np.float64), nan=-1.0), return_inverse=True)[1].reshape(-1)


def moe_keys(model: ModelSpec, cols: LayoutColumns) -> list[np.ndarray]:
    """The extra kind-table group columns of an MoE model (``MOE_FIELDS`` as ints); none for a dense model."""
    if model.moe is None:
        return []
    return [_value_ids(cols[f]) for f in MOE_FIELDS]


def moe_group(model: ModelSpec, cluster: Cluster, lay: Layout, shape: Shape, costs: dict[str, LayerCost],
              coef: Coefficients) -> tuple[dict[str, LayerCost], dict[str, float], float]:
    """For one kind-table group (``lay``: its representative row): (the layer costs memory reads, with the routed
    experts' saved tensors; the routed part's times of one MoE layer, ``moe.moe_layer_times``, {} for a dense model;
    bytes one MoE layer's routed part saves per microbatch). ``coef``: the performance model's coefficients."""
    if model.moe is None:
        return costs, {}, 0.0
    mem = moe_terms.with_expert_activations(costs, model, lay, shape)
    return (mem, moe_terms.moe_layer_times(model, cluster, lay, shape, coef),
            moe_terms.expert_activation_bytes(model, lay, shape))


def moe_time_row(moe_t: dict[str, float]) -> list[float]:
    """``moe_layer_times``' dict in ``MOE_TIME_KEYS`` order (zeros for a dense model)."""
    return [moe_t.get(k, 0.0) for k in MOE_TIME_KEYS]


def moe_kind_mask(model: ModelSpec) -> np.ndarray:
    """[K] the layer kinds (``ModelSpec.kinds`` order) whose MLP is routed experts."""
    return np.array([model.moe is not None and not is_dense_kind(k) for k in model.kinds])


def unpaired(cols: LayoutColumns, pl: BatchPlacement) -> np.ndarray:
    """[N, S] ``moe.ep_overlap_unpaired`` of every stage: the fraction of forwards whose dispatch runs alone."""
    S = pl.stage.shape[1]
    m, p, v = pl.microbatches[:, None], pl.pp[:, None], pl.vpp[:, None]
    warmup = (p - np.arange(S)[None, :] - 1) * 2 + (v - 1) * p + 1
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.where(p == 1, 1.0 / m, np.minimum(1.0, warmup / (m * v)))
    return np.where(cols["moe_ep_overlap"][:, None] & (m >= 1), u, 0.0)


@dataclass
class MoeRows:
    """What the per-stage loops of one group of rows need: the routed-expert times per row and the constants of
    ``moe.host_exposed_s``."""

    moe_mask: np.ndarray  # [K] MoE kinds
    times: list  # per MOE_TIME_KEYS: [N] seconds, one MoE layer, one microbatch
    dense_fwd: list  # per kind: [N] the six forward parts' sum (performance._pipeline's dense_fwd terms)
    unpaired: np.ndarray  # [N, S]
    host_s: np.ndarray | None  # [N] the eager launch time of one MoE layer; None with full-iteration CUDA graphs


def moe_rows(model: ModelSpec, cols: LayoutColumns, pl: BatchPlacement, kt, time_keys: tuple[str, ...],
             engine: Engine, coef: Coefficients) -> MoeRows | None:
    """The routed-expert inputs of ``add_chunk`` for one group of rows (``kt``: its ``batch_tables.KindTables``,
    ``time_keys`` the order of their times' last axis); None for a dense model."""
    if model.moe is None:
        return None
    M = kt.moe[kt.gid]
    T = kt.times[kt.gid]
    idx = [time_keys.index(x) for x in _FWD6]
    dense = []
    for k in range(len(model.kinds)):
        s = 0
        for j in idx:
            s = s + T[:, k, j]
        dense.append(s)
    mode = getattr(engine, "cuda_graphs", "none")
    host = None
    if mode != "full":
        local = model.moe.experts / cols["ep"]
        host = (coef.moe_host_layer_s * (coef.moe_host_scoped_fraction if mode == "scoped" else 1.0)
                + coef.moe_host_per_expert_s * local)
    return MoeRows(moe_kind_mask(model), [M[:, i] for i in range(len(MOE_TIME_KEYS))], dense,
                   unpaired(cols, pl), host)


def add_chunk(parts: dict, mr: MoeRows, n: np.ndarray, nr: np.ndarray | None) -> None:
    """Add one chunk's routed experts to the per-stage ``parts`` ([N, S] seconds), as bb2a96d's ``performance._pipeline``
    does after the chunk's layer kinds: compute, full recompute, exposed dispatch / combine (the unpaired share of
    the a2a overlap alone), the host launch time. ``n``: [N, S, K] the chunk's layers of each kind; ``nr``: of them
    recomputed in full (None: none)."""
    t = mr.times
    mask = mr.moe_mask
    n_moe = n[..., mask].sum(axis=-1)
    k_moe = nr[..., mask].sum(axis=-1) if nr is not None else 0
    for key in ("fwd_gemm", "bwd_gemm", "fwd_memory", "bwd_memory"):
        parts[key] += n_moe * t[_M[key]][:, None]
    parts["recompute"] += k_moe * (t[_M["fwd_gemm"]] + t[_M["fwd_memory"]])[:, None]
    u = mr.unpaired
    ep_f = (1 - u) * t[_M["ep_fwd"]][:, None] + u * t[_M["ep_fwd_alone"]][:, None]
    ep_b = (1 - u) * t[_M["ep_bwd"]][:, None] + u * t[_M["ep_bwd_alone"]][:, None]
    parts["ep_comm"] += (n_moe + k_moe) * ep_f + n_moe * ep_b
    if mr.host_s is None:
        return
    dense = 0
    for k in np.flatnonzero(mask):
        dense = dense + n[..., k] * mr.dense_fwd[k][:, None]
    dense = dense / np.maximum(1, n_moe)
    gpu_fwd = dense + t[_M["fwd_gemm"]][:, None] + t[_M["fwd_memory"]][:, None] + t[_M["ep_fwd"]][:, None]
    parts["moe_host"] += n_moe * np.maximum(0.0, mr.host_s[:, None] - gpu_fwd)



def mtp_moe_layers(model: ModelSpec, cols: LayoutColumns, pl: BatchPlacement) -> np.ndarray:
    """[N, S] the multi-token-prediction layers of each stage whose MLP is an MoE block (``StagePlacement.mtp_moe``:
    the last stage's MTP layers when the model's last layer is an MoE layer, else none)."""
    if model.moe is None or not model.is_moe_layer(model.num_layers - 1):
        return np.zeros(pl.stage.shape)
    return np.where(pl.is_last, cols["mtp_layers"][:, None], 0).astype(np.float64)


def stage_expert_params(model: ModelSpec, cols: LayoutColumns, pl: BatchPlacement) -> np.ndarray:
    """[N, S] routed-expert parameters one GPU of each stage holds (``moe.stage_expert_params`` of its MoE layers,
    an MoE-kind MTP layer's too)."""
    if model.moe is None:
        return np.zeros(pl.stage.shape)
    layers = pl.kinds[..., moe_kind_mask(model)].sum(axis=(2, 3)) + mtp_moe_layers(model, cols, pl)
    per_layer = model.moe.routed_params(model.hidden) / (cols["ep"] * cols["etp"])
    return layers * per_layer[:, None]


def expert_dp_seconds(model: ModelSpec, cluster: Cluster, cols: LayoutColumns, ex: np.ndarray, grad_bytes: np.ndarray,
                      coef: Coefficients) -> np.ndarray:
    """[N, S] the expert gradients' reduce-scatter and parameter all-gather over the expert data-parallel group,
    seconds (``moe.expert_dp_comm_s``; ``ex``: ``stage_expert_params``, ``grad_bytes`` [N])."""
    d = edp(cols)[:, None]
    span = cols["tp"] * cols["cp"] * cols["dp"]
    fast = span <= max(cluster.gpus_per_node, cluster.gpu.nvlink_domain)
    bw = np.where(fast, cluster.gpu.nvlink_gbps * coef.nvlink_efficiency,
                  cluster.gpu.internode_gbps / cluster.gpus_per_node * coef.network_efficiency) * 1e9
    t = ex * (d - 1) / d * (grad_bytes + BF16)[:, None] / bw[:, None] + 2 * coef.collective_latency_s
    return np.where((d > 1) & (ex != 0), t, 0.0)


def add_mtp_experts(parts: dict, model: ModelSpec, cols: LayoutColumns, pl: BatchPlacement, kt,
                    uniform: np.ndarray) -> None:
    """Add the routed experts of the last stage's MoE-kind MTP layers to its per-microbatch ``parts`` ([N, S]
    seconds), as bb2a96d's ``performance._mtp_parts`` does after the layer's TP / CP communication: compute, full uniform
    recompute, dispatch / combine (no a2a overlap pairing, no host launch term). ``uniform``: [N] full uniform
    recompute."""
    nm = mtp_moe_layers(model, cols, pl)
    if not nm.any():
        return
    M = kt.moe[kt.gid]
    t = {k: M[:, i][:, None] for i, k in enumerate(MOE_TIME_KEYS)}
    for key in ("gemm", "memory"):
        parts["fwd_" + key] += nm * t["fwd_" + key]
        parts["bwd_" + key] += nm * t["bwd_" + key]
    u = uniform[:, None]
    parts["recompute"] += np.where(u, nm * (t["fwd_gemm"] + t["fwd_memory"]), 0.0)
    parts["ep_comm"] += nm * (np.where(u, 2, 1) * t["ep_fwd"] + t["ep_bwd"])


def cast_shard(cols: LayoutColumns, pl: BatchPlacement, params: np.ndarray, ex_shard: np.ndarray) -> np.ndarray:
    """[N] what bb2a96d's ``estimate_performance`` adds to the largest stage's parameters for an MoE model's low-precision
    weight cast: the optimizer's whole shard (the largest stage's parameters over DP x CP with the distributed
    optimizer, plus the routed-expert shard ``expert_shard``)."""
    div = np.where(cols["distributed_optimizer"], cols["dp"] * cols["cp"], 1)
    return np.where(pl.stage, params, -np.inf).max(axis=1) / div + ex_shard


def edp(cols: LayoutColumns) -> np.ndarray:
    """[N] the expert data-parallel size (``attune.spec.moe.expert_data_parallel``)."""
    return np.maximum(1, (cols["tp"] * cols["cp"] * cols["dp"]) // (cols["ep"] * cols["etp"]))


def expert_shard(model: ModelSpec, cols: LayoutColumns, pl: BatchPlacement, ex: np.ndarray) -> np.ndarray:
    """[N] the optimizer's routed-expert shard (bb2a96d's ``estimate_performance``: the stage with the most MoE layers, over
    the expert data-parallel group with the distributed optimizer)."""
    most = np.where(pl.stage, ex, -np.inf).max(axis=1)
    return most / np.where(cols["distributed_optimizer"], edp(cols), 1)


def expert_columns(cols: LayoutColumns) -> LayoutColumns:
    """The rows as the expert optimizer sees them (``moe.expert_layout``): DP = expert-DP, CP 1."""
    return LayoutColumns({**cols.columns(), "dp": edp(cols), "cp": np.ones(len(cols), dtype=np.int64)}, n=len(cols))


@dataclass
class ExpertMemory:
    """The routed experts' memory terms of each stage, ``[rows, stages]``: parameters, and bytes of the states
    in the order bb2a96d's ``estimate_memory`` adds them."""

    params: np.ndarray
    state_b: np.ndarray  # ex x (weight + grad + optimizer bytes)
    step_b: np.ndarray  # the optimizer step's: ex x (weight + grad + optimizer + the step's fp32 grad copy)
    host_b: np.ndarray  # ex x host optimizer bytes
    weights_gib: np.ndarray
    grads_gib: np.ndarray
    optimizer_gib: np.ndarray
    activations_gib: np.ndarray

    @property
    def state_gib(self) -> np.ndarray:
        """Weights + gradients + optimizer states, GiB (``StageMemory.expert_state_gib``)."""
        return self.weights_gib + self.grads_gib + self.optimizer_gib


def expert_act_bytes(model: ModelSpec, cols: LayoutColumns, engine: Engine, kt, kn) -> np.ndarray:
    """[N] bytes one MoE layer's routed part keeps per microbatch (``moe.expert_activation_bytes``), less what
    selective ``moe`` / ``moe_act`` recompute frees (``offload.routed_freed_bytes`` of the reference kind, FULL, the
    first MoE kind of ``layer_costs``, as memory reads it: quantized under a low-precision recipe)."""
    e_act = kt.expert_act[kt.gid]
    sel = cols["recompute_granularity"] == "selective"
    if not sel.any():
        return e_act
    _, first = np.unique(kn.gid, return_index=True)
    freed = np.zeros(int(kn.gid.max()) + 1)
    for i in first:
        if sel[i]:
            freed[kn.gid[i]] = knob_terms.routed_freed_bytes(kt.mem_costs[kt.gid[i]][FULL], FULL,
                                                             cols.layout(int(i)), model, engine)
    return np.where(sel, e_act - freed[kn.gid], e_act)


def stored_layer_counts(cols: LayoutColumns, pl: BatchPlacement) -> np.ndarray:
    """[N, S] layers of each stage that keep their full activations under the recompute policy
    (bb2a96d's ``memory._stored_layers``)."""
    layers = pl.layers
    full = cols["recompute_granularity"] == "full"
    block = full & (cols["recompute_method"] == "block")
    n_rec = np.where(cols["recompute_num_layers"] == NONE_INT, 0, cols["recompute_num_layers"])[:, None, None]
    kept = np.where(pl.chunk, np.maximum(0, layers - n_rec), 0).sum(axis=2)
    return np.where(full[:, None], np.where(block[:, None], kept, 0), layers.sum(axis=2))


def expert_memory(model: ModelSpec, cols: LayoutColumns, engine: Engine, pl: BatchPlacement, kt, kn,
                  opt_bytes, fp32_training: bool, act_scale: float) -> ExpertMemory | None:
    """The routed experts' memory of every stage (bb2a96d's ``estimate_memory``'s expert terms); None for a dense model.
    ``opt_bytes``: ``batch_memory.optimizer_bytes`` (called on the expert columns)."""
    if model.moe is None:
        return None
    ex = stage_expert_params(model, cols, pl)
    w, g, o, h, copy = (a[:, None] for a in opt_bytes(expert_columns(cols), engine, fp32_training))
    e_act = expert_act_bytes(model, cols, engine, kt, kn)[:, None]
    layers = pl.layers.sum(axis=2)
    moe_layers = pl.kinds[..., moe_kind_mask(model)].sum(axis=(2, 3))
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(layers > 0, moe_layers / layers, 0.0)
    acts = act_scale * pl.inflight * e_act * stored_layer_counts(cols, pl) / GiB * share
    # an MoE-kind MTP layer's routed tensors, one microbatch (checkpointed away by full uniform recompute)
    uniform = (cols["recompute_granularity"] == "full") & (cols["recompute_method"] == "uniform")
    acts = acts + np.where(uniform[:, None], 0.0, act_scale * mtp_moe_layers(model, cols, pl) * e_act / GiB)
    return ExpertMemory(params=ex, state_b=ex * (w + g + o), step_b=ex * (w + g + o + copy), host_b=ex * h,
                        weights_gib=ex * w / GiB, grads_gib=ex * g / GiB, optimizer_gib=ex * o / GiB,
                        activations_gib=np.where(pl.stage, acts, 0.0))
