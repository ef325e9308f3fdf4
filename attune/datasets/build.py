"""Build fixed-length pretokenized SFT rows (the seed recipe's ``workload.dataset.build``).

Recipe text being implemented (seed attune-tp1-pp4-split16-rb12.yaml, ``dataset.build.packing``):
"source conversations in a seeded global permutation, concatenated with an EOS token between them and cut
into consecutive 8,192-token rows; rows without supervised targets are skipped".

Steps, in order:

1. Render every conversation with the chat template. ``qwen3_5`` here is plain Qwen ChatML:
   ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, nothing before or after (no default system
   prompt, no ``<think>`` block insertion, no generation prompt). Message contents are inserted verbatim, so a
   literal ``<|im_end|>`` inside a content string is read as the special token, as with Qwen's own template.
2. Tokenize the whole rendered string once with the ``tokenizers`` library (``add_special_tokens=False``).
3. Loss mask ``qwen3_5`` (our reading): a token is supervised (1) when its first character lies inside an
   assistant message's content or its closing ``<|im_end|>``; everything else is 0: the ``<|im_start|>``,
   the role name and its newline, the newline after ``<|im_end|>``, and every token of system/user/tool turns.
   A BPE token that starts before the assistant content (e.g. a merged run of newlines across the boundary)
   counts as not supervised.
4. Permute conversations with ``numpy.random.default_rng(seed).permutation(n)`` over all input conversations
   (conversations with no messages contribute nothing, not even an EOS).
5. Concatenate in that order with one EOS token (``<|endoftext|>`` or ``eos_id``) between neighbours; the
   EOS is not supervised. Cut consecutive rows of ``row_tokens`` tokens; the trailing partial row is dropped
   (so there are no padding tokens), and a row whose mask is all 0 is skipped (it still consumes its tokens).
   ``max_rows`` (optional) stops after that many kept rows.

``rows_sha256`` byte layout: SHA-256 over the kept rows in order, each row contributing its ``row_tokens``
token ids as little-endian int32 (4 x row_tokens bytes) immediately followed by its ``row_tokens`` mask values
as int8 (row_tokens bytes). No separators, no header.

Parquet layout (:func:`write_parquet`): columns ``tokens`` list<int32>, ``loss_mask`` list<int8> and
``metadata`` struct<row: int64, supervised_tokens: int32> (no ``messages``); zstd compression, fixed row
groups; schema key ``attune.build`` holds the build parameters as JSON. ``parquet_sha256`` is reproducible for
a given pyarrow version (the writer records its version in the file footer).

CLI: ``python -m attune.datasets.build --input conv.jsonl --tokenizer tokenizer.json --row-tokens 8192
--seed 42 [--max-rows 6400] --out rows.parquet`` prints the stats as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import numpy as np

__all__ = [
    "BuildResult",
    "BuildStats",
    "render_chatml",
    "build_rows",
    "rows_sha256",
    "write_parquet",
    "read_conversations",
    "main",
]

# Qwen ChatML special tokens (Qwen tokenizer_config.json added tokens).
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
# The only template / mask type implemented (the seed's `chat_template`/`loss_mask: qwen3_5`).
SUPPORTED_TEMPLATES = ("qwen3_5",)
SUPPORTED_MASKS = ("qwen3_5",)
# Conversations tokenized per encode_batch call (bounds memory; the result does not depend on it).
ENCODE_CHUNK = 512
# Rows per parquet row group (8,192-token rows: ~10 MB uncompressed per group); part of parquet_sha256.
ROW_GROUP_ROWS = 256
# Parquet compression codec; part of parquet_sha256.
PARQUET_COMPRESSION = "zstd"
# Schema metadata key with the build parameters.
SCHEMA_KEY = b"attune.build"
# Read size for hashing files.
HASH_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class BuildResult:
    """Kept rows and how they were made. ``tokens``/``loss_mask`` have shape (rows, row_tokens)."""

    tokens: np.ndarray  # int32
    loss_mask: np.ndarray  # int8, 1 = supervised
    row_tokens: int
    seed: int
    chat_template: str
    loss_mask_type: str
    eos_id: int
    conversations: int  # input conversations
    conversations_consumed: int  # conversations (in permutation order) read before stopping
    skipped_rows: int  # full rows dropped because no token was supervised
    dropped_tail_tokens: int  # tokens of the trailing partial row (0 when stopped by max_rows)
    tokenizer_sha256: str
    rows_sha256: str

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def padding_tokens(self) -> int:
        return 0  # rows are cut from one stream; the partial tail is dropped, never padded

    @property
    def supervised_token_ratio(self) -> float:
        total = self.tokens.size
        return float(self.loss_mask.sum(dtype=np.int64)) / total if total else 0.0


@dataclass(frozen=True)
class BuildStats:
    """What the recipe's ``dataset.build`` records (plus provenance extras)."""

    rows: int
    row_tokens: int
    padding_tokens: int
    supervised_token_ratio: float
    seed: int
    rows_sha256: str
    parquet_sha256: str
    parquet_bytes: int
    loss_mask: str
    chat_template: str
    eos_id: int
    tokenizer_sha256: str
    skipped_rows: int
    conversations: int
    conversations_consumed: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def render_chatml(messages: list[dict[str, Any]], where: str = "conversation") -> tuple[str, list[tuple[int, int]]]:
    """Render Qwen ChatML; return (text, supervised character spans [start, end) of assistant turns)."""
    text: list[str] = []
    pos = 0
    spans: list[tuple[int, int]] = []
    for j, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise ValueError(f"{where} message {j} has no 'role'")
        role, content = msg["role"], msg.get("content")
        if content is None:
            content = ""
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"{where} message {j}: role and content must be strings, got "
                             f"{type(role).__name__}/{type(content).__name__}")
        head = f"{IM_START}{role}\n"
        body = f"{content}{IM_END}"
        start = pos + len(head)
        text += [head, body, "\n"]
        pos = start + len(body) + 1
        if role == "assistant":
            spans.append((start, start + len(body)))
    return "".join(text), spans


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    if not offsets:
        return np.zeros(0, dtype=np.int8)
    starts = np.fromiter((o[0] for o in offsets), dtype=np.int64, count=len(offsets))
    if not spans:
        return np.zeros(len(offsets), dtype=np.int8)
    s0 = np.array([s for s, _ in spans], dtype=np.int64)
    s1 = np.array([e for _, e in spans], dtype=np.int64)
    k = np.searchsorted(s0, starts, side="right") - 1
    inside = (k >= 0) & (starts < s1[np.clip(k, 0, None)])
    return inside.astype(np.int8)


def rows_sha256(tokens: np.ndarray, loss_mask: np.ndarray) -> str:
    """SHA-256 over rows in order: row tokens as little-endian int32, then row mask as int8 (module doc)."""
    if tokens.shape != loss_mask.shape or tokens.ndim != 2:
        raise ValueError(f"tokens {tokens.shape} and loss_mask {loss_mask.shape} must be equal 2-D shapes")
    h = hashlib.sha256()
    t = np.ascontiguousarray(tokens, dtype="<i4")
    m = np.ascontiguousarray(loss_mask, dtype="i1")
    for r in range(t.shape[0]):
        h.update(t[r].tobytes())
        h.update(m[r].tobytes())
    return h.hexdigest()


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(HASH_CHUNK_BYTES), b""):
            h.update(chunk)
    return h.hexdigest()


def build_rows(
    conversations: Iterable[dict[str, Any]],
    tokenizer_path: str,
    row_tokens: int,
    seed: int,
    chat_template: str = "qwen3_5",
    loss_mask: str = "qwen3_5",
    eos_id: int | None = None,
    max_rows: int | None = None,
) -> BuildResult:
    """Render, tokenize, mask, permute, pack and cut conversations into fixed rows (module doc)."""
    _check_build_args(chat_template, loss_mask, row_tokens, max_rows)
    tok, eos_id = _load_tokenizer(tokenizer_path, eos_id)
    convs = _message_lists(conversations)
    order = np.random.default_rng(seed).permutation(len(convs))
    packed = _cut_rows(_encoded_chunks(convs, order, tok, eos_id), row_tokens, max_rows)
    if not packed.tokens:
        raise ValueError(f"no full {row_tokens}-token row with a supervised token from {len(convs)} conversations")
    tokens = np.stack(packed.tokens).astype(np.int32, copy=False)
    mask = np.stack(packed.mask).astype(np.int8, copy=False)
    return BuildResult(
        tokens=tokens,
        loss_mask=mask,
        row_tokens=row_tokens,
        seed=seed,
        chat_template=chat_template,
        loss_mask_type=loss_mask,
        eos_id=int(eos_id),
        conversations=len(convs),
        conversations_consumed=packed.consumed,
        skipped_rows=packed.skipped,
        dropped_tail_tokens=packed.tail_tokens,
        tokenizer_sha256=_file_sha256(tokenizer_path),
        rows_sha256=rows_sha256(tokens, mask),
    )


def _check_build_args(chat_template: str, loss_mask: str, row_tokens: int, max_rows: int | None) -> None:
    if chat_template not in SUPPORTED_TEMPLATES:
        raise ValueError(f"unknown chat_template {chat_template!r}; supported: {', '.join(SUPPORTED_TEMPLATES)}")
    if loss_mask not in SUPPORTED_MASKS:
        raise ValueError(f"unknown loss_mask {loss_mask!r}; supported: {', '.join(SUPPORTED_MASKS)}")
    if row_tokens <= 0:
        raise ValueError(f"row_tokens must be positive, got {row_tokens}")
    if max_rows is not None and max_rows <= 0:
        raise ValueError(f"max_rows must be positive, got {max_rows}")


def _load_tokenizer(tokenizer_path: str, eos_id: int | None):
    """The ``tokenizers`` tokenizer with the ChatML special tokens, and the EOS id (default ``<|endoftext|>``)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError("attune.datasets.build needs the 'tokenizers' package (pip install tokenizers)") from None
    if not os.path.isfile(tokenizer_path):
        raise FileNotFoundError(f"tokenizer file not found: {tokenizer_path}")
    try:
        tok = Tokenizer.from_file(tokenizer_path)
    except Exception as e:  # the tokenizers library raises its own Exception type for a malformed file
        msg = " ".join(str(e).split())[:200] or type(e).__name__
        raise ValueError(f"tokenizer {tokenizer_path} is not a tokenizers JSON file ({msg})") from None
    for special in (IM_START, IM_END):
        if tok.token_to_id(special) is None:
            raise ValueError(f"tokenizer {tokenizer_path} has no {special} token (needed by the ChatML template)")
    if eos_id is None:
        eos_id = tok.token_to_id(ENDOFTEXT)
        if eos_id is None:
            raise ValueError(f"tokenizer {tokenizer_path} has no {ENDOFTEXT} token; pass eos_id")
    if not 0 <= eos_id < 2**31:
        raise ValueError(f"eos_id {eos_id} is outside int32")
    return tok, eos_id


def _message_lists(conversations: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each conversation's ``messages`` list; at least one conversation."""
    convs: list[list[dict[str, Any]]] = []
    for i, conv in enumerate(conversations):
        msgs = conv.get("messages") if isinstance(conv, dict) else None
        if not isinstance(msgs, (list, tuple)):
            raise ValueError(f"conversation {i} has no 'messages' list")
        convs.append(list(msgs))
    if not convs:
        raise ValueError("no conversations given")
    return convs


def _encoded_chunks(convs: list[list[dict[str, Any]]], order: np.ndarray, tok, eos_id: int):
    """The token stream in permutation order, ``ENCODE_CHUNK`` conversations at a time: per chunk, the number of
    conversations read and the (tokens, mask) pieces, one EOS (not supervised) between non-empty neighbours."""
    first = True
    eos_t = np.array([eos_id], dtype=np.int32)
    eos_m = np.zeros(1, dtype=np.int8)
    for c0 in range(0, len(order), ENCODE_CHUNK):
        idx = order[c0:c0 + ENCODE_CHUNK]
        rendered = [render_chatml(convs[int(i)], where=f"conversation {int(i)}") for i in idx]
        encs = tok.encode_batch([t for t, _ in rendered], add_special_tokens=False)
        pieces_t: list[np.ndarray] = []
        pieces_m: list[np.ndarray] = []
        for (text, spans), enc in zip(rendered, encs):
            if not text:
                continue
            ids = np.asarray(enc.ids, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= 2**31):
                raise ValueError("token id outside int32 range")
            if not first:
                pieces_t.append(eos_t)
                pieces_m.append(eos_m)
            first = False
            pieces_t.append(ids.astype(np.int32))
            pieces_m.append(_mask_from_offsets(enc.offsets, spans))
        yield len(idx), pieces_t, pieces_m


@dataclass
class _Packed:
    """The kept rows (each ``row_tokens`` long) and what cutting them consumed and dropped."""

    tokens: list[np.ndarray]
    mask: list[np.ndarray]
    skipped: int = 0
    consumed: int = 0
    tail_tokens: int = 0


def _cut_rows(chunks, row_tokens: int, max_rows: int | None) -> _Packed:
    """Cut the stream of ``_encoded_chunks`` into consecutive rows; skip rows without a supervised token; stop
    after ``max_rows`` kept rows (the rest unused by design) or keep the trailing partial row's size."""
    out = _Packed(tokens=[], mask=[])
    pend_tok = np.zeros(0, dtype=np.int32)
    pend_mask = np.zeros(0, dtype=np.int8)
    for count, pieces_t, pieces_m in chunks:
        out.consumed += count
        stream_t = np.concatenate([pend_tok, *pieces_t])
        stream_m = np.concatenate([pend_mask, *pieces_m])
        n_full = stream_t.size // row_tokens
        cut = n_full * row_tokens
        rows_t = stream_t[:cut].reshape(n_full, row_tokens)
        rows_m = stream_m[:cut].reshape(n_full, row_tokens)
        for r in range(n_full):
            if not rows_m[r].any():
                out.skipped += 1
                continue
            out.tokens.append(rows_t[r])
            out.mask.append(rows_m[r])
            if max_rows is not None and len(out.tokens) >= max_rows:
                return out  # tokens after the last kept row are unused by design: the build stops at max_rows
        pend_tok, pend_mask = stream_t[cut:].copy(), stream_m[cut:].copy()
    out.tail_tokens = int(pend_tok.size)
    return out


def write_parquet(result: BuildResult, path: str, row_group_rows: int = ROW_GROUP_ROWS) -> BuildStats:
    """Write the rows (module doc: parquet layout) and return the recipe's build stats."""
    if row_group_rows <= 0:
        raise ValueError(f"row_group_rows must be positive, got {row_group_rows}")
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, width = result.tokens.shape
    if n * width >= 2**31:
        raise ValueError(f"{n} rows x {width} tokens exceed the int32 list offsets of one parquet file")
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * width, type=pa.int32())
    tokens = pa.ListArray.from_arrays(offsets, pa.array(result.tokens.reshape(-1), type=pa.int32()))
    mask = pa.ListArray.from_arrays(offsets, pa.array(result.loss_mask.reshape(-1), type=pa.int8()))
    meta = pa.StructArray.from_arrays(
        [pa.array(np.arange(n, dtype=np.int64)), pa.array(result.loss_mask.sum(axis=1, dtype=np.int64).astype(np.int32))],
        names=["row", "supervised_tokens"],
    )
    build_meta = {
        "row_tokens": result.row_tokens, "seed": result.seed, "chat_template": result.chat_template,
        "loss_mask": result.loss_mask_type, "eos_id": result.eos_id, "rows": n,
        "tokenizer_sha256": result.tokenizer_sha256, "rows_sha256": result.rows_sha256,
    }
    schema = pa.schema(
        [pa.field("tokens", pa.list_(pa.int32())), pa.field("loss_mask", pa.list_(pa.int8())),
         pa.field("metadata", meta.type)],
        metadata={SCHEMA_KEY: json.dumps(build_meta, sort_keys=True).encode()},
    )
    table = pa.Table.from_arrays([tokens, mask, meta], schema=schema)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    pq.write_table(table, path, compression=PARQUET_COMPRESSION, row_group_size=row_group_rows)
    return BuildStats(
        rows=n,
        row_tokens=result.row_tokens,
        padding_tokens=result.padding_tokens,
        supervised_token_ratio=result.supervised_token_ratio,
        seed=result.seed,
        rows_sha256=result.rows_sha256,
        parquet_sha256=_file_sha256(path),
        parquet_bytes=os.path.getsize(path),
        loss_mask=result.loss_mask_type,
        chat_template=result.chat_template,
        eos_id=result.eos_id,
        tokenizer_sha256=result.tokenizer_sha256,
        skipped_rows=result.skipped_rows,
        conversations=result.conversations,
        conversations_consumed=result.conversations_consumed,
    )


def read_conversations(path: str) -> list[dict[str, Any]]:
    """Read ``{"messages": [...]}`` records from JSONL (.jsonl/.json lines) or parquet (a ``messages`` column)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"conversation file not found: {path}")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        names = pq.ParquetFile(path).schema_arrow.names
        if "messages" not in names:
            raise ValueError(f"{path} has no 'messages' column (columns: {', '.join(names)})")
        return [{"messages": m} for m in pq.read_table(path, columns=["messages"]).column("messages").to_pylist()]
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                raise ValueError(f"{path}:{lineno} is not a JSON line") from None
            if not isinstance(rec, dict) or "messages" not in rec:
                raise ValueError(f"{path}:{lineno} has no 'messages' field")
            out.append({"messages": rec["messages"]})
    return out


def main(argv: list[str] | None = None) -> int:  # entry point: python3 -m attune.datasets.build
    ap = argparse.ArgumentParser(prog="python -m attune.datasets.build", description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help="conversations: .jsonl or .parquet with a 'messages' column")
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json for the tokenizers library")
    ap.add_argument("--row-tokens", type=int, required=True, help="tokens per row")
    ap.add_argument("--seed", type=int, required=True, help="permutation seed")
    ap.add_argument("--max-rows", type=int, default=None, help="stop after this many kept rows")
    ap.add_argument("--eos-id", type=int, default=None, help="EOS token id (default: <|endoftext|>)")
    ap.add_argument("--out", required=True, help="output parquet path")
    a = ap.parse_args(argv)
    result = build_rows(read_conversations(a.input), a.tokenizer, a.row_tokens, a.seed,
                        eos_id=a.eos_id, max_rows=a.max_rows)
    stats = write_parquet(result, a.out)
    print(json.dumps(stats.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
