"""attune.slime_rollout.pretokenized_sft_rollout on CPU, against a parquet written by attune.datasets.build."""

from __future__ import annotations

import enum
import importlib
import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pq = pytest.importorskip("pyarrow.parquet")

from attune.datasets.build import ENDOFTEXT, IM_END, IM_START, build_rows, write_parquet  # noqa: E402
from attune.slime_rollout import pretokenized_sft_rollout as ro  # noqa: E402

ROW = 16  # tokens per row
WORDS = "red green blue cyan magenta yellow black white orange purple brown pink".split()


def _tokenizer(path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(WORDS), "user assistant"] * 10, trainer)
    out = str(path / "tokenizer.json")
    tok.save(out)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("rows")
    rng = np.random.default_rng(3)
    convs = [{"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS, 3))},
                           {"role": "assistant", "content": " ".join(rng.choice(WORDS, 5 + i % 4))}]}
             for i in range(30)]
    res = build_rows(convs, _tokenizer(d), ROW, seed=5)
    path = str(d / "rows.parquet")
    write_parquet(res, path, row_group_rows=4)  # small row groups: a rollout spans several
    assert pq.ParquetFile(path).metadata.num_row_groups > 1
    return res, path


def _args(path, batch, **kw):
    return SimpleNamespace(prompt_data=path, rollout_batch_size=batch, n_samples_per_prompt=1, **kw)


def test_rollout_shapes_and_fields(built, monkeypatch):
    monkeypatch.setitem(sys.modules, "slime", None)  # no slime: local Sample
    res, path = built
    out = ro.generate_rollout(_args(path, 4), 0, data_source=None)
    assert isinstance(out, list) and len(out) == 4
    for i, group in enumerate(out):
        assert len(group) == 1
        s = group[0]
        assert isinstance(s, ro.LocalSample)
        assert s.tokens == res.tokens[i].tolist()
        assert s.loss_mask == res.loss_mask[i].tolist()[1:]  # token 0 is the one-token prompt
        assert s.response_length == ROW - 1 == len(s.loss_mask)  # slime asserts the equality (rollout.py:677)
        assert s.reward == 0.0
        assert s.status == ro.LocalSample.Status.COMPLETED
        assert s.index == i and s.metadata == {"row": i}


def _slime_scored_tokens(sample) -> list[int]:
    """Token positions slime's SFT loss scores for one sample (CP = 1), by slime's own slice rule.

    slime/backends/megatron_utils/loss.py:500-505 (reference slime-runtime-and-moe.md section 2): the sample's
    log-probs are ``log_prob_full[start-1:end-1]`` with ``start = total_length - response_length`` and
    ``end = total_length``; the log-prob at position p scores token p + 1. The slice is zipped with the
    sample's loss_mask (one entry per response token); a masked-in entry is a scored token.
    """
    total = len(sample.tokens)
    start, end = total - sample.response_length, total
    positions = list(range(total))[start - 1:end - 1]  # Python (and torch) slicing, negative start included
    assert len(positions) == sample.response_length == len(sample.loss_mask), \
        f"slice of {len(positions)} log-probs for a response of {sample.response_length} tokens"
    return [p + 1 for p, m in zip(positions, sample.loss_mask) if m]


def test_every_supervised_token_is_scored_once_by_slimes_slice(built, monkeypatch):
    """Issue 13, bug 1: with the whole row as the response, slime's slice is empty and the loss fails at step 0."""
    monkeypatch.setitem(sys.modules, "slime", None)
    res, path = built
    out = ro.generate_rollout(_args(path, res.rows), 0, data_source=None)
    checked = 0
    for i, group in enumerate(out):
        s = group[0]
        mask = res.loss_mask[i].tolist()
        scored = _slime_scored_tokens(s)
        assert scored or not any(mask[1:]), f"row {i}: supervised tokens but none scored"
        assert len(scored) == len(set(scored)), f"row {i}: a token scored twice"
        # every supervised target (token 0 has no preceding position, so it is never a target)
        assert scored == [t for t in range(1, len(mask)) if mask[t]], f"row {i}"
        checked += len(scored)
    assert checked > 0 and checked == sum(int(m.sum()) - int(m[0]) for m in res.loss_mask)


def test_one_token_row_is_refused():
    with pytest.raises(ValueError, match="1 tokens"):
        ro._make_sample(ro.LocalSample, [5], [1], 0, 7)


def test_rollout_row_order_and_wrap(built):
    res, path = built
    n = res.rows
    batch = 5
    rid = 3
    out = ro.generate_rollout(_args(path, batch), rid, data_source=None)
    expected = [(rid * batch + i) % n for i in range(batch)]
    assert [g[0].metadata["row"] for g in out] == expected
    assert [g[0].tokens for g in out] == [res.tokens[j].tolist() for j in expected]
    # Far past the end: wraps.
    far = n * 7 + 2
    out = ro.generate_rollout(_args(path, 3), far, data_source=None)
    assert [g[0].metadata["row"] for g in out] == [(far * 3 + i) % n for i in range(3)]
    assert ro.row_indices(2, 4, 10) == [8, 9, 0, 1]


def test_evaluation_is_empty(built):
    _, path = built
    assert ro.generate_rollout(_args(path, 4), 0, None, evaluation=True) == {}


def test_errors(built, tmp_path):
    _, path = built
    with pytest.raises(ValueError, match="n-samples-per-prompt"):
        ro.generate_rollout(SimpleNamespace(prompt_data=path, rollout_batch_size=2, n_samples_per_prompt=4), 0, None)
    with pytest.raises(ValueError, match="prompt_data"):
        ro.generate_rollout(SimpleNamespace(prompt_data=None, rollout_batch_size=2), 0, None)
    with pytest.raises(FileNotFoundError, match="not found"):
        ro.generate_rollout(_args(str(tmp_path / "missing.parquet"), 2), 0, None)
    with pytest.raises(ValueError, match="positive"):
        ro.row_indices(0, 0, 10)


def test_import_without_slime(monkeypatch):
    monkeypatch.setitem(sys.modules, "slime", None)
    mod = importlib.reload(ro)
    assert mod.sample_class() is mod.LocalSample


def test_uses_slime_types_when_present(built, monkeypatch):
    """With a stand-in slime package on sys.modules, slime's Sample and RolloutFn*Output are used."""

    @dataclass
    class Sample:
        class Status(enum.Enum):
            COMPLETED = "completed"

        tokens: list = field(default_factory=list)
        response_length: int = 0
        reward: float | None = None
        loss_mask: list | None = None
        status: object = None
        index: int | None = None
        metadata: dict = field(default_factory=dict)

    @dataclass
    class RolloutFnTrainOutput:
        samples: list
        metrics: dict | None = None

    @dataclass
    class RolloutFnEvalOutput:
        data: dict
        metrics: dict | None = None

    mods = {name: types.ModuleType(name) for name in
            ("slime", "slime.utils", "slime.utils.types", "slime.rollout", "slime.rollout.base_types")}
    mods["slime.utils.types"].Sample = Sample
    mods["slime.rollout.base_types"].RolloutFnTrainOutput = RolloutFnTrainOutput
    mods["slime.rollout.base_types"].RolloutFnEvalOutput = RolloutFnEvalOutput
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    res, path = built
    out = ro.generate_rollout(_args(path, 2), 1, None)
    assert isinstance(out, RolloutFnTrainOutput)
    s = out.samples[1][0]
    assert isinstance(s, Sample) and s.status is Sample.Status.COMPLETED
    assert s.tokens == res.tokens[3].tolist() and s.index == 3 and s.metadata == {"row": 3}
    ev = ro.generate_rollout(_args(path, 2), 1, None, evaluation=True)
    assert isinstance(ev, RolloutFnEvalOutput) and ev.data == {}
