"""The torch runner's mixture-of-experts block (EP 1: every expert on the rank; plain PyTorch).

Router: ``Linear(hidden, experts)`` without bias, softmax over the experts in fp32 (slime's
``--moe-router-dtype fp32``, ``--moe-router-score-function softmax``), the top-k probabilities renormalised to
sum to one (Hugging Face ``norm_topk_prob`` of Qwen3-MoE / Qwen3-Next; Mixtral the same), no token dropping.
Experts: SwiGLU MLPs of ``moe.expert_ffn``, each run on the tokens routed to it. Shared expert (Qwen3-Next,
Qwen3.5-MoE): a SwiGLU MLP of ``moe.shared_ffn`` on every token, scaled by sigmoid(Linear(hidden, 1)). The
parameter count equals ``ModelSpec`` 's (router + experts + shared expert + gate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attune.spec.model import ModelSpec


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden: int, ffn: int, device=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False, device=device)
        self.up_proj = nn.Linear(hidden, ffn, bias=False, device=device)
        self.down_proj = nn.Linear(ffn, hidden, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    """Top-k routed experts plus the optional gated shared expert, in place of a layer's MLP."""

    def __init__(self, spec: ModelSpec, device=None):
        super().__init__()
        moe = spec.moe
        if moe is None:
            raise ValueError(f"{spec.name} is dense: it has no MoE block")
        h = spec.hidden
        self.top_k = moe.top_k
        self.gate = nn.Linear(h, moe.experts, bias=False, device=device)  # the router (HF name: gate)
        self.experts = nn.ModuleList(SwiGLU(h, moe.expert_ffn, device) for _ in range(moe.experts))
        self.shared_expert = SwiGLU(h, moe.shared_ffn, device) if moe.shared_ffn else None
        self.shared_expert_gate = nn.Linear(h, 1, bias=False, device=device) if moe.shared_gate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights summing to one, top-k expert ids) per token; x is [tokens, hidden]."""
        logits = F.linear(x.float(), self.gate.weight.float())
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.route(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            if tok.numel():
                y = expert(flat[tok]) * weights[tok, slot].unsqueeze(-1).to(flat.dtype)
                out = out.index_add(0, tok, y)
        if self.shared_expert is not None:
            s = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                s = s * torch.sigmoid(self.shared_expert_gate(flat))
            out = out + s
        return out.reshape(shape)
