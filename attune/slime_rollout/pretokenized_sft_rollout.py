"""slime rollout function that replays pretokenized fixed-length SFT rows.

Use with slime:  ``--rollout-function-path attune.slime_rollout.pretokenized_sft_rollout.generate_rollout
--prompt-data rows.parquet --rollout-batch-size 128 --debug-train-only --loss-type sft_loss ...``
(reference: /work/shared/reference/slime-and-qwen.md §1.4: with ``--debug-train-only`` the rollout function is
still called every rollout, through ``call_rollout_fn(self.generate_rollout, ...)``).

Input: the parquet written by :func:`attune.datasets.build.write_parquet` (columns ``tokens`` list<int32>,
``loss_mask`` list<int8>), path from ``args.prompt_data``.

Rows for rollout ``rollout_id``: ``(rollout_id * args.rollout_batch_size + i) % rows`` for
``i in range(args.rollout_batch_size)``, i.e. consecutive rows in file order, wrapping at the end. The
``data_source`` slime passes is not used (rows come from the parquet, not from slime's prompt dataset).

Each sample: ``tokens`` = the row, ``response_length`` = ``len(tokens) - 1`` and ``loss_mask`` = the row's mask
without its first entry (``mask[1:]``): a one-token prompt. slime scores sample log-probs as
``log_prob_full[start-1:end-1]`` with ``start = total_length - response_length``
(slime/backends/megatron_utils/loss.py:500-505; reference slime-runtime-and-moe.md section 2), and the log-prob at
position t-1 scores token t, so the response must leave at least one prompt token: with the whole row as the
response the slice is empty and the SFT loss fails at step 0. Every target but token 0 stays supervised, and
``len(loss_mask) == response_length`` as slime asserts (slime/ray/rollout.py:677-679). ``reward`` = 0.0,
``status`` = ``Sample.Status.COMPLETED``; ``index``/``group_index`` = the row's position in this rollout's
sequence (``rollout_id * batch + i``, unwrapped) and ``metadata = {"row": <row index>}`` when the Sample
class has those fields.

Return shape (the contract of §1.4: ``generate_rollout(args, rollout_id, data_source, evaluation=False) ->
RolloutFnTrainOutput | RolloutFnEvalOutput``; samples are groups of ``n_samples_per_prompt`` per prompt):

* training: ``rollout_batch_size`` groups of exactly one sample, ``list[list[Sample]]`` (the same shape as
  slime's in-tree ``slime.rollout.sft_rollout.generate_rollout``). When slime is importable and provides
  ``slime.rollout.base_types.RolloutFnTrainOutput``, that list is returned wrapped as
  ``RolloutFnTrainOutput(samples=groups)``; otherwise the bare list (which slime's ``call_rollout_fn`` wraps).
* evaluation: nothing to evaluate: ``RolloutFnEvalOutput(data={})`` when available, else ``{}``.

``Sample`` is ``slime.utils.types.Sample``, imported inside the call; without slime (CPU tests) a local
dataclass with the same fields is used. This module never imports slime at import time, and never uses
PyPI's unrelated ``slime`` package (a failing ``slime.utils.types`` import falls back to the local class).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LocalSample", "generate_rollout", "row_indices", "read_rows", "sample_class"]


@dataclass
class LocalSample:
    """Stand-in for ``slime.utils.types.Sample`` with the fields this rollout sets (tests without slime)."""

    class Status(enum.Enum):
        # Values as in slime.utils.types.Sample.Status.
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    status: "LocalSample.Status" = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)


def sample_class() -> type:
    """slime's Sample when slime is installed, else :class:`LocalSample`."""
    try:
        from slime.utils.types import Sample  # noqa: PLC0415 - lazy on purpose (GPU images only)

        return Sample
    except Exception:
        return LocalSample


def row_indices(rollout_id: int, batch: int, rows: int) -> list[int]:
    """Row indices of one rollout: ``(rollout_id * batch + i) % rows`` for i < batch."""
    if batch <= 0:
        raise ValueError(f"rollout_batch_size must be positive, got {batch}")
    if rows <= 0:
        raise ValueError("the pretokenized parquet has no rows")
    if rollout_id < 0:
        raise ValueError(f"rollout_id must be non-negative, got {rollout_id}")
    return [(rollout_id * batch + i) % rows for i in range(batch)]


def read_rows(path: str, indices: list[int]) -> list[tuple[list[int], list[int]]]:
    """(tokens, loss_mask) of the given rows, reading only the row groups that hold them."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"pretokenized parquet not found: {path}") from None
    names = pf.schema_arrow.names
    for col in ("tokens", "loss_mask"):
        if col not in names:
            raise ValueError(f"{path} has no '{col}' column (columns: {', '.join(names)})")
    md = pf.metadata
    starts, acc = [], 0
    for g in range(md.num_row_groups):
        starts.append(acc)
        acc += md.row_group(g).num_rows
    groups: dict[int, Any] = {}
    out = []
    for idx in indices:
        if not 0 <= idx < acc:
            raise IndexError(f"row {idx} is outside {path} ({acc} rows)")
        g = max(i for i, s in enumerate(starts) if s <= idx)
        if g not in groups:
            groups[g] = pf.read_row_group(g, columns=["tokens", "loss_mask"])
        t = groups[g]
        tokens = t.column("tokens")[idx - starts[g]].as_py()
        mask = t.column("loss_mask")[idx - starts[g]].as_py()
        if tokens is None or mask is None or len(tokens) != len(mask):
            raise ValueError(f"row {idx} of {path}: tokens and loss_mask lengths differ or are null")
        out.append((tokens, mask))
    return out


def _num_rows(path: str) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except FileNotFoundError:
        raise FileNotFoundError(f"pretokenized parquet not found: {path}") from None


def _make_sample(cls: type, tokens: list[int], mask: list[int], position: int, row: int) -> Any:
    s = cls()
    if len(tokens) < 2:
        raise ValueError(f"row {row} has {len(tokens)} tokens; a sample needs a prompt token and a response token")
    s.tokens = list(tokens)
    s.response_length = len(tokens) - 1  # token 0 is the prompt: slime's slice [start-1:end-1] needs start >= 1
    s.loss_mask = list(mask[1:])  # aligned with the response tokens 1..len-1
    s.reward = 0.0
    s.status = cls.Status.COMPLETED
    for name, value in (("index", position), ("group_index", position)):
        if hasattr(s, name):
            setattr(s, name, value)
    if isinstance(getattr(s, "metadata", None), dict):
        s.metadata = {**s.metadata, "row": row}
    return s


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime rollout function (module doc: rows, sample fields, return shape)."""
    if evaluation:
        try:
            from slime.rollout.base_types import RolloutFnEvalOutput  # noqa: PLC0415

            return RolloutFnEvalOutput(data={})
        except Exception:
            return {}
    path = getattr(args, "prompt_data", None)
    if not path:
        raise ValueError("args.prompt_data (the pretokenized parquet path) is not set")
    batch = getattr(args, "rollout_batch_size", None)
    if batch is None:
        raise ValueError("args.rollout_batch_size is not set")
    n_samples = getattr(args, "n_samples_per_prompt", 1) or 1
    if n_samples != 1:
        raise ValueError(f"pretokenized SFT rows need --n-samples-per-prompt 1, got {n_samples}")
    indices = row_indices(int(rollout_id), int(batch), _num_rows(path))
    rows = read_rows(path, indices)
    cls = sample_class()
    base = int(rollout_id) * int(batch)
    groups = [[_make_sample(cls, tokens, mask, base + i, idx)]
              for i, (idx, (tokens, mask)) in enumerate(zip(indices, rows))]
    if cls is LocalSample:
        return groups
    try:
        from slime.rollout.base_types import RolloutFnTrainOutput  # noqa: PLC0415

        return RolloutFnTrainOutput(samples=groups)
    except Exception:
        return groups
