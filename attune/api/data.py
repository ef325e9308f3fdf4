"""``attune data build``: packed fixed-length SFT rows from tokenized conversations."""

from __future__ import annotations

from attune.datasets.build import BuildStats, build_rows, read_conversations, write_parquet
from attune.errors import UserInputError


def build_data(*, input_path: str, tokenizer: str, row_tokens: int, seed: int, out: str,
               max_rows: int | None = None, eos_id: int | None = None) -> BuildStats:
    """Read conversations, pack them into rows of ``row_tokens`` tokens and write a parquet file."""
    try:
        result = build_rows(read_conversations(input_path), tokenizer, row_tokens, seed, eos_id=eos_id,
                            max_rows=max_rows)
        return write_parquet(result, out)
    except (OSError, ValueError) as e:  # the builder's own bad-input errors (a leaf module, no attune imports)
        raise UserInputError(f"data build: {' '.join(str(e).split())}") from None
