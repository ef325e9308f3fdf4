"""The torch runner's mixture-of-experts block, with expert parallelism (plain PyTorch).

Router: ``Linear(hidden, experts)`` without bias, softmax over the experts in fp32 (slime's
``--moe-router-dtype fp32``, ``--moe-router-score-function softmax``; autocast is off for it), the top-k
probabilities renormalised to sum to one (Hugging Face ``norm_topk_prob`` of Qwen3-MoE / Qwen3-Next; Mixtral
the same), no token dropping. Experts: SwiGLU MLPs of ``moe.expert_ffn``. Shared expert (Qwen3-Next,
Qwen3.5-MoE): a SwiGLU MLP of ``moe.shared_ffn`` on every token, scaled by sigmoid(Linear(hidden, 1)). With
EP 1 the parameter count equals ``ModelSpec`` 's (router + experts + shared expert + gate); with EP > 1 a rank
holds experts / EP of the routed experts (:class:`LocalExperts`) and the rest of the block whole.

Forward (Megatron's alltoall dispatcher, without capacity): each (token, slot) pair is sorted by its expert
(stable, so ties keep token order), the per-expert counts and then the tokens go to the experts' EP ranks
(:mod:`attune.torchmodels.expert_parallel`), each local expert runs on its tokens from every source rank
at once, the outputs come back by the reverse all-to-all and are summed into their tokens weighted by the
fp32 router probabilities. EP 1 runs the same code with the all-to-alls the identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attune.spec.model import ModelSpec
from attune.torchmodels.expert_parallel import ExpertParallel, all_to_all, exchange_counts


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden: int, ffn: int, device=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False, device=device)
        self.up_proj = nn.Linear(hidden, ffn, bias=False, device=device)
        self.down_proj = nn.Linear(ffn, hidden, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LocalExperts(nn.ModuleList):
    """The routed experts one rank holds: global ids ``first .. first + len(self) - 1`` of ``total``."""

    def __init__(self, experts, first: int, total: int):
        super().__init__(experts)
        self.first, self.total = first, total


class MoEBlock(nn.Module):
    """Top-k routed experts (this rank's share under EP) plus the optional gated shared expert, in place of a
    layer's MLP."""

    def __init__(self, spec: ModelSpec, device=None, ep: ExpertParallel | None = None):
        super().__init__()
        moe = spec.moe
        if moe is None:
            raise ValueError(f"{spec.name} is dense: it has no MoE block")
        h = spec.hidden
        self.ep = ep or ExpertParallel()
        self.num_experts = moe.experts
        self.top_k = moe.top_k
        self.gate = nn.Linear(h, moe.experts, bias=False, device=device)  # the router (HF name: gate)
        local = self.ep.local_experts(moe.experts)
        self.experts = LocalExperts((SwiGLU(h, moe.expert_ffn, device) for _ in local), local.start, moe.experts)
        self.shared_expert = SwiGLU(h, moe.shared_ffn, device) if moe.shared_ffn else None
        self.shared_expert_gate = nn.Linear(h, 1, bias=False, device=device) if moe.shared_gate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights summing to one, top-k expert ids) per token; x is [tokens, hidden]."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
            probs = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            return weights / weights.sum(dim=-1, keepdim=True), ids

    def routed(self, flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum per token (dispatch, local experts, combine)."""
        ep, k, n_local = self.ep, self.top_k, len(self.experts)
        pair_expert = ids.reshape(-1)  # pair p = token * k + slot
        order = torch.argsort(pair_expert, stable=True)
        tok = torch.div(order, k, rounding_mode="floor")
        send_counts = torch.bincount(pair_expert, minlength=self.num_experts)
        recv_counts = exchange_counts(send_counts, ep)  # [EP source ranks, local experts]
        in_splits = send_counts.reshape(ep.size, n_local).sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        xs = all_to_all(flat[tok], out_splits, in_splits, ep)  # source-major, then by local expert
        # expert-major order of the received rows (sources in order within an expert)
        local_id = torch.repeat_interleave(torch.arange(n_local, device=flat.device).repeat(ep.size),
                                           recv_counts.reshape(-1))
        by_expert = torch.argsort(local_id, stable=True)
        per_expert = recv_counts.sum(0).tolist()
        xe = xs[by_expert]
        outs, lo = [], 0
        for j, n in enumerate(per_expert):
            if n:
                outs.append(self.experts[j](xe[lo: lo + n]))
            lo += n
        # an idle rank still joins the combine all-to-all (and its backward): keep the graph through xs
        ye = torch.cat(outs) if outs else xe[:0]
        ys = torch.empty_like(ye).index_copy(0, by_expert, ye)  # back to source-major
        back = all_to_all(ys, in_splits, out_splits, ep)  # rows in the sorted pair order
        w = weights.reshape(-1)[order].unsqueeze(-1)
        y = (back.float() * w).to(flat.dtype)
        return torch.zeros_like(flat).index_add(0, tok, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.route(flat)
        out = self.routed(flat, weights, ids)
        if self.shared_expert is not None:
            s = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                s = s * torch.sigmoid(self.shared_expert_gate(flat))
            out = out + s
        return out.reshape(shape)
