"""Expert parallelism for the torch runner's MoE block: the rank groups and the all-to-all token exchange.

Group layout (Megatron's, ``parallel_state.py`` expert RankGenerator, with TP = CP = ETP = 1): the expert
group folds into each pipeline stage's data-parallel group. Within a stage whose DP ranks are
``base + d`` (d = 0 .. DP - 1), the EP group of a rank is the ``EP`` adjacent ranks ``base + k*EP + j``
(j = 0 .. EP - 1) and its expert-data-parallel group is the ``DP / EP`` ranks holding the same experts,
``base + k*EP + ep_rank`` (k = 0 .. DP/EP - 1). Rank ``ep_rank`` of an EP group holds the experts
``[ep_rank * E/EP, (ep_rank + 1) * E/EP)``.

Token exchange (``dispatch``/``combine``): ``torch.distributed.all_to_all_single`` with uneven splits,
which gloo implements on CPU (checked: torch 2.x gloo ``alltoall_base``, empty splits included) and NCCL
on GPU. The per-expert token counts travel first (an even all-to-all of ``E`` integers), then the tokens;
the combine is the reverse all-to-all. :class:`AllToAll` is the autograd function: its backward is the
all-to-all with the splits swapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ExpertParallel", "AllToAll", "ep_group_ranks", "expert_dp_group_ranks", "exchange_counts"]


@dataclass(frozen=True, kw_only=True)
class ExpertParallel:
    """Where a rank sits in its expert-parallel group (EP 1: every expert local, no communication)."""

    size: int = 1
    """Ranks in the EP group (``--expert-model-parallel-size``)."""
    rank: int = 0
    """This rank's index in its EP group (0 .. size - 1)."""
    group: Any = None
    """The ``torch.distributed`` process group of the EP ranks (None with size 1)."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"EP size must be >= 1 (got {self.size})")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"EP rank {self.rank} outside its group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"EP {self.size} needs a process group")

    def local_experts(self, experts: int) -> range:
        """The global ids of the experts this rank holds."""
        if experts % self.size:
            raise ValueError(f"EP {self.size} must divide the {experts} experts")
        n = experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)


def ep_group_ranks(stage_base: int, dp: int, ep: int) -> list[list[int]]:
    """The EP groups of one pipeline stage whose DP ranks are ``stage_base .. stage_base + dp - 1``."""
    if dp % ep:
        raise ValueError(f"EP {ep} must divide DP {dp}")
    return [[stage_base + k * ep + j for j in range(ep)] for k in range(dp // ep)]


def expert_dp_group_ranks(stage_base: int, dp: int, ep: int) -> list[list[int]]:
    """The expert-data-parallel groups of one stage: ranks holding the same experts (one per EP rank)."""
    if dp % ep:
        raise ValueError(f"EP {ep} must divide DP {dp}")
    return [[stage_base + k * ep + j for k in range(dp // ep)] for j in range(ep)]


def exchange_counts(send_counts: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """Per-expert token counts: ``send_counts[e]`` tokens of this rank go to global expert e; returns
    [EP x local experts]: row s, column j = tokens source rank s sends to this rank's local expert j."""
    local = send_counts.numel() // ep.size
    if ep.size == 1:
        return send_counts.reshape(1, local).clone()
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=ep.group)
    return recv.reshape(ep.size, local)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``in_splits`` go to the group's ranks in order; ``out_splits`` rows come back from
    each. Backward: the gradient travels the reverse way (the same all-to-all with the splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], ep: ExpertParallel) -> torch.Tensor:
    """:class:`AllToAll` over ``ep``'s group; the identity with EP 1."""
    if ep.size == 1:
        return x
    return AllToAll.apply(x, out_splits, in_splits, ep.group)
