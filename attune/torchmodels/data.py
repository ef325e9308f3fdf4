"""Packed fixed-length training rows with a loss mask, identical for every trial of a study.

Rows come from a parquet file (columns `tokens` list<int> and `loss_mask` list<int>, one sample per
record; samples are packed whole, in file order, into rows of `seq_length` tokens, padded with
token 0 / mask 0; a sample longer than a row is cut into row-sized pieces), or are generated from a
seed: a small synthetic language of repeated random n-gram patterns, so the loss really falls.

Step s of a study reads rows s * global_batch ... (s + 1) * global_batch - 1 (modulo the number of
rows), whatever the layout; a DP rank takes its contiguous share of those, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Synthetic language: PATTERNS random n-grams of NGRAM tokens each, concatenated in random order.
# Sizes chosen so a few-million-parameter model learns them in tens of steps (this project's choice).
PATTERNS = 64
NGRAM = 8
# Leading tokens of each synthetic row with loss mask 0 (a stand-in "prompt", as in SFT data).
PROMPT_TOKENS = 8


class DataError(ValueError):
    """A data file that cannot be read as packed rows."""


@dataclass(frozen=True)
class PackedRows:
    tokens: np.ndarray  # [rows, seq_length] int64
    loss_mask: np.ndarray  # [rows, seq_length] int64, 1 = supervised token

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_length(self) -> int:
        return int(self.tokens.shape[1])

    def take(self, indices) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64) % len(self)
        return self.tokens[idx], self.loss_mask[idx]


def synthetic_rows(n_rows: int, seq_length: int, vocab: int, seed: int) -> PackedRows:
    """Rows of randomly chosen patterns from a seeded pattern bank; row i depends only on (seed, i)."""
    bank = np.random.default_rng([seed, 0]).integers(0, vocab, size=(PATTERNS, NGRAM), dtype=np.int64)
    per_row = -(-seq_length // NGRAM)
    tokens = np.empty((n_rows, seq_length), dtype=np.int64)
    for i in range(n_rows):
        pick = np.random.default_rng([seed, 1, i]).integers(0, PATTERNS, size=per_row)
        tokens[i] = bank[pick].reshape(-1)[:seq_length]
    mask = np.ones_like(tokens)
    mask[:, :min(PROMPT_TOKENS, seq_length)] = 0
    return PackedRows(tokens, mask)


def pack_samples(samples: list[tuple[list[int], list[int]]], seq_length: int) -> PackedRows:
    """Greedy in-order packing of (tokens, loss_mask) samples into rows of seq_length tokens."""
    rows_t: list[np.ndarray] = []
    rows_m: list[np.ndarray] = []
    cur_t: list[int] = []
    cur_m: list[int] = []

    def flush():
        if cur_t:
            pad = seq_length - len(cur_t)
            rows_t.append(np.array(cur_t + [0] * pad, dtype=np.int64))
            rows_m.append(np.array(cur_m + [0] * pad, dtype=np.int64))
            cur_t.clear()
            cur_m.clear()

    for toks, mask in samples:
        if len(toks) != len(mask):
            raise DataError(f"a sample has {len(toks)} tokens but {len(mask)} loss-mask entries")
        for lo in range(0, len(toks), seq_length):
            piece_t, piece_m = list(toks[lo: lo + seq_length]), list(mask[lo: lo + seq_length])
            if len(cur_t) + len(piece_t) > seq_length:
                flush()
            cur_t.extend(piece_t)
            cur_m.extend(piece_m)
    flush()
    if not rows_t:
        raise DataError("no tokens to pack")
    return PackedRows(np.stack(rows_t), np.stack(rows_m))


def parquet_rows(path: str, seq_length: int) -> PackedRows:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # optional dependency (attune[data])
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
    table = pq.read_table(path, columns=["tokens", "loss_mask"])
    toks = table.column("tokens").to_pylist()
    masks = table.column("loss_mask").to_pylist()
    return pack_samples(list(zip(toks, masks)), seq_length)


def load_rows(data_path: str | None, n_rows: int, seq_length: int, vocab: int, seed: int) -> PackedRows:
    """The study's rows: the parquet file if given, else `n_rows` synthetic rows from `seed`."""
    if data_path:
        rows = parquet_rows(data_path, seq_length)
        if int(rows.tokens.max()) >= vocab:
            raise DataError(f"{data_path}: token id {int(rows.tokens.max())} >= the model's vocabulary of {vocab}")
        return rows
    return synthetic_rows(n_rows, seq_length, vocab, seed)


def step_row_indices(step: int, global_batch: int, dp: int, dp_rank: int) -> list[int]:
    """Rows of one DP rank at one step (global_batch divisible by dp)."""
    per = global_batch // dp
    base = step * global_batch + dp_rank * per
    return list(range(base, base + per))


def shift_labels(tokens: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Next-token labels and their mask; the last position of a row predicts nothing."""
    labels = np.zeros_like(tokens)
    lmask = np.zeros_like(mask)
    labels[:, :-1] = tokens[:, 1:]
    lmask[:, :-1] = mask[:, 1:]
    return labels, lmask
