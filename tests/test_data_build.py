"""attune.datasets.build with a tiny byte-level BPE tokenizer trained inside the test (no hub access)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from attune.datasets.build import (  # noqa: E402
    ENDOFTEXT,
    IM_END,
    IM_START,
    build_rows,
    read_conversations,
    render_chatml,
    rows_sha256,
    write_parquet,
)

ROW = 32  # tokens per row in these tests
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def make_tokenizer(path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [" ".join(WORDS), "system user assistant tool", "You are a helpful assistant."] * 20
    tok.train_from_iterator(corpus, trainer)
    out = str(path / "tokenizer.json")
    tok.save(out)
    return out


def words(rng, n):
    return " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), n))


def make_conversations():
    rng = np.random.default_rng(7)
    convs = []
    for i in range(14):
        msgs = []
        if i % 3 == 0:
            msgs.append({"role": "system", "content": "You are a helpful assistant."})
        for _ in range(1 + i % 2):
            msgs.append({"role": "user", "content": words(rng, 3 + i % 5)})
            msgs.append({"role": "assistant", "content": words(rng, 4 + i % 7)})
        convs.append({"messages": msgs})
    # A long user-only conversation: more than two rows of unsupervised tokens, so some full row is all 0.
    convs.append({"messages": [{"role": "user", "content": words(rng, 90)}]})
    convs.append({"messages": []})  # contributes nothing, not even an EOS
    return convs


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def convs():
    return make_conversations()


def reference_rows(convs, tok_path, row, seed):
    """Independent re-derivation: tokenize message pieces separately (equal to whole-string tokenization for
    these texts, whose piece boundaries are pre-tokenizer boundaries) and pack with plain Python lists."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    start, end, eos = tok.token_to_id(IM_START), tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)
    stream_t, stream_m = [], []
    first = True
    for i in np.random.default_rng(seed).permutation(len(convs)):
        msgs = convs[int(i)]["messages"]
        if not msgs:
            continue
        if not first:
            stream_t.append(eos)
            stream_m.append(0)
        first = False
        for m in msgs:
            sup = 1 if m["role"] == "assistant" else 0
            head = [start] + enc(m["role"]) + enc("\n")
            body = enc(m["content"]) + [end]
            nl = enc("\n")
            stream_t += head + body + nl
            stream_m += [0] * len(head) + [sup] * len(body) + [0] * len(nl)
    rows_t, rows_m, skipped = [], [], 0
    for r in range(len(stream_t) // row):
        t, m = stream_t[r * row:(r + 1) * row], stream_m[r * row:(r + 1) * row]
        if any(m):
            rows_t.append(t)
            rows_m.append(m)
        else:
            skipped += 1
    return np.array(rows_t, dtype=np.int32), np.array(rows_m, dtype=np.int8), skipped, len(stream_t) % row


def test_render_chatml_spans():
    text, spans = render_chatml([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert [text[a:b] for a, b in spans] == ["yo<|im_end|>"]


def test_rows_match_independent_packing(convs, tok_path):
    res = build_rows(convs, tok_path, ROW, seed=42)
    ref_t, ref_m, skipped, tail = reference_rows(convs, tok_path, ROW, 42)
    assert res.rows == len(ref_t) > 3
    assert res.tokens.shape == (res.rows, ROW) and res.tokens.dtype == np.int32
    np.testing.assert_array_equal(res.tokens, ref_t)
    np.testing.assert_array_equal(res.loss_mask, ref_m)
    assert res.skipped_rows == skipped >= 1
    assert res.dropped_tail_tokens == tail
    assert res.padding_tokens == 0
    assert res.conversations == len(convs)
    assert res.supervised_token_ratio == pytest.approx(ref_m.sum() / ref_m.size)


def test_mask_only_on_assistant_tokens(convs, tok_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    res = build_rows(convs, tok_path, ROW, seed=42)
    start, end, eos = tok.token_to_id(IM_START), tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)
    sup = res.tokens[res.loss_mask == 1]
    assert start not in sup and eos not in sup
    assert end in sup
    # Decode each supervised run: it is assistant text ending (unless cut by a row edge) in <|im_end|>.
    assistant_text = " ".join(m["content"] for c in convs for m in c["messages"] if m["role"] == "assistant")
    for r in range(res.rows):
        t, m = res.tokens[r], res.loss_mask[r]
        runs = np.split(np.arange(ROW), np.flatnonzero(np.diff(m)) + 1)
        for run in runs:
            if m[run[0]] != 1:
                continue
            ids = [int(x) for x in t[run] if x != end]
            text = tok.decode(ids).strip()
            assert text == "" or text in assistant_text
            assert "system" not in text and "user" not in text and "assistant" not in text
    # Every <|im_end|> of a user/system turn is unsupervised: count masked <|im_end|> tokens.
    assert ((res.tokens == end) & (res.loss_mask == 0)).any()


def test_eos_between_conversations(convs, tok_path):
    res = build_rows(convs, tok_path, ROW, seed=42)
    eos = res.eos_id
    assert (res.tokens == eos).sum() >= 1
    assert (res.loss_mask[res.tokens == eos] == 0).all()
    # An EOS is always followed by <|im_start|> (the next conversation's first token) inside a row.
    from tokenizers import Tokenizer

    start = Tokenizer.from_file(tok_path).token_to_id(IM_START)
    flat = res.tokens.reshape(-1)
    pos = np.flatnonzero(flat[:-1] == eos)
    assert (flat[pos + 1] == start).all()


def test_given_eos_id(convs, tok_path):
    res = build_rows(convs, tok_path, ROW, seed=42, eos_id=3)
    assert res.eos_id == 3


def test_determinism(convs, tok_path):
    a = build_rows(convs, tok_path, ROW, seed=42)
    b = build_rows(convs, tok_path, ROW, seed=42)
    c = build_rows(convs, tok_path, ROW, seed=43)
    assert a.rows_sha256 == b.rows_sha256
    assert a.rows_sha256 != c.rows_sha256


def test_rows_sha256_byte_layout(convs, tok_path):
    res = build_rows(convs, tok_path, ROW, seed=42)
    h = hashlib.sha256()
    for r in range(res.rows):
        h.update(b"".join(int(x).to_bytes(4, "little", signed=True) for x in res.tokens[r]))
        h.update(bytes(int(x) & 0xFF for x in res.loss_mask[r]))
    assert res.rows_sha256 == h.hexdigest() == rows_sha256(res.tokens, res.loss_mask)


def test_all_masked_rows_skipped(tok_path):
    rng = np.random.default_rng(1)
    convs = [{"messages": [{"role": "user", "content": words(rng, 200)}]},
             {"messages": [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": words(rng, 40)}]}]
    res = build_rows(convs, tok_path, ROW, seed=0)
    assert res.skipped_rows >= 3
    assert all(res.loss_mask[r].any() for r in range(res.rows))
    with pytest.raises(ValueError, match="no full"):
        build_rows(convs[:1], tok_path, ROW, seed=0)


def test_max_rows(convs, tok_path):
    full = build_rows(convs, tok_path, ROW, seed=42)
    two = build_rows(convs, tok_path, ROW, seed=42, max_rows=2)
    assert two.rows == 2
    np.testing.assert_array_equal(two.tokens, full.tokens[:2])


def test_parquet_round_trip(convs, tok_path, tmp_path):
    res = build_rows(convs, tok_path, ROW, seed=42)
    path = tmp_path / "rows.parquet"
    stats = write_parquet(res, str(path))
    t = pq.read_table(path)
    assert t.schema.field("tokens").type == pa.list_(pa.int32())
    assert t.schema.field("loss_mask").type == pa.list_(pa.int8())
    assert "messages" not in t.schema.names
    np.testing.assert_array_equal(np.array(t.column("tokens").to_pylist(), dtype=np.int32), res.tokens)
    np.testing.assert_array_equal(np.array(t.column("loss_mask").to_pylist(), dtype=np.int8), res.loss_mask)
    meta = t.column("metadata").to_pylist()
    assert [m["row"] for m in meta] == list(range(res.rows))
    assert [m["supervised_tokens"] for m in meta] == [int(x) for x in res.loss_mask.sum(axis=1)]
    build = json.loads(t.schema.metadata[b"attune.build"])
    assert build["row_tokens"] == ROW and build["rows_sha256"] == res.rows_sha256
    assert stats.rows == res.rows and stats.row_tokens == ROW and stats.padding_tokens == 0 and stats.seed == 42
    assert stats.parquet_bytes == path.stat().st_size
    assert stats.parquet_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    again = write_parquet(res, str(tmp_path / "again.parquet"))
    assert again.parquet_sha256 == stats.parquet_sha256
    d = stats.to_dict()
    for key in ("rows", "row_tokens", "padding_tokens", "supervised_token_ratio", "seed", "rows_sha256",
                "parquet_sha256", "parquet_bytes"):
        assert key in d


def test_read_conversations(convs, tmp_path):
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps({"id": i, **c}) for i, c in enumerate(convs)) + "\n\n")
    assert read_conversations(str(jl)) == convs
    pqp = tmp_path / "c.parquet"
    nonempty = [c for c in convs if c["messages"]]
    pq.write_table(pa.Table.from_pylist([{"id": i, **c} for i, c in enumerate(nonempty)]), pqp)
    assert read_conversations(str(pqp)) == nonempty
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="messages"):
        read_conversations(str(bad))


def test_cli(convs, tok_path, tmp_path, capsys):
    from attune.datasets.build import main

    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps(c) for c in convs))
    out = tmp_path / "o.parquet"
    assert main(["--input", str(jl), "--tokenizer", tok_path, "--row-tokens", str(ROW), "--seed", "42",
                 "--out", str(out)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["rows_sha256"] == build_rows(convs, tok_path, ROW, seed=42).rows_sha256


def test_errors(tok_path, tmp_path):
    with pytest.raises(ValueError, match="conversation 1 has no 'messages'"):
        build_rows([{"messages": []}, {"text": "x"}], tok_path, ROW, seed=0)
    with pytest.raises(ValueError, match="chat_template"):
        build_rows([], tok_path, ROW, seed=0, chat_template="llama3")
    with pytest.raises(ValueError, match="role and content"):
        build_rows([{"messages": [{"role": "user", "content": ["x"]}]}], tok_path, ROW, seed=0)
    from tokenizers import Tokenizer, models

    plain = tmp_path / "plain.json"
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(plain))
    with pytest.raises(ValueError, match="im_start"):
        build_rows([{"messages": []}], str(plain), ROW, seed=0)
