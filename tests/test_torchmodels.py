"""PyTorch modules of the torch runner: exact parameter counts, GDN forms, stage composition, data, training."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attune.runners.torch_worker import lr_at  # noqa: E402
from attune.spec.layout import Layout, Workload  # noqa: E402
from attune.spec.model import load_model  # noqa: E402
from attune.spec.placement import stage_layer_counts, stage_params  # noqa: E402
from attune.torchmodels import build_model, gated_delta_rule_chunked, gated_delta_rule_recurrent, token_loss_sum  # noqa: E402
from attune.torchmodels.data import (  # noqa: E402
    NGRAM,
    PROMPT_TOKENS,
    DataError,
    load_rows,
    pack_samples,
    shift_labels,
    step_row_indices,
    synthetic_rows,
)
from attune.torchmodels.modules import GatedDeltaNet  # noqa: E402

TINY = ["tiny-qwen3.5", "tiny-llama", "tiny-gpt2"]


def n_params(m) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_param_count_exact(name):
    spec = load_model(name)
    assert n_params(build_model(spec)) == spec.total_params


@pytest.mark.parametrize("name", ["Qwen3.6-27B", "Llama-3.1-8B"])
def test_large_models_param_count_exact_on_meta(name):
    spec = load_model(name)
    m = build_model(spec, device="meta")
    assert all(p.device.type == "meta" for p in m.parameters())
    assert n_params(m) == spec.total_params


@pytest.mark.parametrize("name", TINY)
def test_stage_param_counts_match_spec(name):
    spec = load_model(name)
    counts = stage_layer_counts(Layout(pp=3, first=2, last=2), spec.num_layers)
    start = 0
    for s, c in enumerate(counts):
        first, last = s == 0, s == len(counts) - 1
        m = build_model(spec, start, start + c, first, last, device="meta")
        assert n_params(m) == stage_params(spec, Layout(pp=3, first=2, last=2), s), (name, s)
        start += c


def _gdn_inputs(b=2, t=150, h=4, dk=16, dv=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=g), dim=-1)
    v = torch.randn(b, t, h, dv, generator=g)
    logdecay = -torch.rand(b, t, h, generator=g) * 0.5
    beta = torch.rand(b, t, h, generator=g)
    return [x.double().requires_grad_(True) for x in (q, k, v, logdecay, beta)]


def test_gdn_chunked_equals_recurrent_forward_and_backward():
    # t = 150 is not a multiple of the chunk: exercises the padding
    a_in = _gdn_inputs()
    b_in = [x.detach().clone().requires_grad_(True) for x in a_in]
    ref = gated_delta_rule_recurrent(*a_in, scale=0.25)
    out = gated_delta_rule_chunked(*b_in, scale=0.25, chunk=32)
    assert ref.shape == out.shape == (2, 150, 4, 24)
    assert torch.allclose(ref, out, atol=1e-5, rtol=1e-5)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (ref.float() * w).sum().backward()
    (out.float() * w).sum().backward()
    for x, y in zip(a_in, b_in):
        assert torch.allclose(x.grad, y.grad, atol=1e-4, rtol=1e-4)


def test_gdn_recurrence_matches_hand_computed_two_steps():
    # one head, dk = dv = 1: S1 = beta1 k1 v1; S2 = e^{g2} S1 + k2 beta2 (v2 - e^{g2} S1 k2); o_t = S_t q_t scale
    q = torch.tensor([1.0, 1.0]).view(1, 2, 1, 1)
    k = torch.tensor([1.0, 1.0]).view(1, 2, 1, 1)
    v = torch.tensor([2.0, 3.0]).view(1, 2, 1, 1)
    g = torch.tensor([0.0, math.log(0.5)]).view(1, 2, 1)
    beta = torch.tensor([0.5, 1.0]).view(1, 2, 1)
    s1 = 0.5 * 2.0
    s2 = 0.5 * s1 + 1.0 * (3.0 - 0.5 * s1)
    expect = torch.tensor([s1, s2]) * 2.0
    for rule in (gated_delta_rule_recurrent, gated_delta_rule_chunked):
        assert torch.allclose(rule(q, k, v, g, beta, scale=2.0).reshape(-1), expect), rule.__name__


def test_gdn_module_forms_agree():
    spec = load_model("tiny-qwen3.5")
    torch.manual_seed(0)
    m = GatedDeltaNet(spec)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 70, spec.hidden)
    m.chunked = True
    a = m(x)
    m.chunked = False
    b = m(x)
    assert a.abs().max() > 1e-3
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", TINY)
def test_model_is_causal(name):
    spec = load_model(name)
    m = build_model(spec, seed=3)
    ids = torch.randint(0, spec.vocab, (1, 40), generator=torch.Generator().manual_seed(0))
    ids2 = ids.clone()
    ids2[0, 30:] = (ids2[0, 30:] + 7) % spec.vocab
    with torch.no_grad():
        a, b = m(ids), m(ids2)
    assert torch.allclose(a[:, :30], b[:, :30], atol=1e-5)
    assert not torch.allclose(a[:, 30:], b[:, 30:], atol=1e-5)


@pytest.mark.parametrize("name", TINY)
def test_pipeline_stages_compose_to_the_whole_model(name):
    # same seed -> a layer gets the same weights whichever stage holds it, so stages compose exactly
    spec = load_model(name)
    whole = build_model(spec, seed=7)
    s0 = build_model(spec, 0, 5, first=True, last=False, seed=7)
    s1 = build_model(spec, 5, spec.num_layers, first=False, last=True, seed=7)
    ids = torch.randint(0, spec.vocab, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(whole(ids), s1(s0(ids)), atol=1e-5)
    other = build_model(spec, seed=8)
    with torch.no_grad():
        assert not torch.allclose(whole(ids), other(ids), atol=1e-3)


@pytest.mark.parametrize("gran,method,n", [("full", "block", 2), ("full", "uniform", 3), ("selective", None, None)])
def test_recompute_does_not_change_gradients(gran, method, n):
    spec = load_model("tiny-qwen3.5")
    ids = torch.randint(0, spec.vocab, (2, 32), generator=torch.Generator().manual_seed(2))
    labels = torch.roll(ids, -1, 1)
    mask = torch.ones_like(ids)
    grads = []
    for rec in (("none", None, None), (gran, method, n)):
        m = build_model(spec, seed=1)
        m.set_recompute(*rec)
        token_loss_sum(m(ids), labels, mask).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_synthetic_rows_deterministic_and_independent_of_count():
    a = synthetic_rows(10, 64, 4096, seed=5)
    b = synthetic_rows(20, 64, 4096, seed=5)
    c = synthetic_rows(10, 64, 4096, seed=6)
    assert np.array_equal(a.tokens, b.tokens[:10])
    assert not np.array_equal(a.tokens, c.tokens)
    assert a.loss_mask[:, :PROMPT_TOKENS].sum() == 0 and a.loss_mask[:, PROMPT_TOKENS:].all()
    assert a.tokens.max() < 4096
    # built from n-grams: each row is a concatenation of NGRAM-long patterns from one bank
    bank = {tuple(r[i:i + NGRAM]) for r in b.tokens for i in range(0, 64, NGRAM)}
    assert len(bank) <= 64


def test_pack_samples_and_parquet(tmp_path):
    rows = pack_samples([([1, 2, 3], [0, 1, 1]), ([4, 5], [1, 1]), ([6, 7, 8, 9, 10, 11], [1] * 6)], seq_length=5)
    assert rows.tokens.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 0, 0, 0, 0]]
    assert rows.loss_mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    with pytest.raises(DataError):
        pack_samples([([1, 2], [1])], 4)
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"tokens": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [1, 1]]}), path)
    got = load_rows(str(path), n_rows=99, seq_length=5, vocab=16, seed=0)
    assert got.tokens.tolist() == [[1, 2, 3, 4, 5]]
    with pytest.raises(DataError, match="vocabulary"):
        load_rows(str(path), n_rows=1, seq_length=5, vocab=4, seed=0)


def test_labels_and_row_split():
    t = np.array([[1, 2, 3, 4]])
    m = np.array([[0, 1, 1, 1]])
    lab, lm = shift_labels(t, m)
    assert lab.tolist() == [[2, 3, 4, 0]] and lm.tolist() == [[1, 1, 1, 0]]
    assert step_row_indices(2, 8, 2, 1) == [20, 21, 22, 23]
    assert step_row_indices(2, 8, 1, 0) == list(range(16, 24))


def test_lr_schedule_warmup_then_cosine_to_min():
    w = Workload(steps=20, lr=1e-3, min_lr=1e-4, warmup_fraction=0.1)
    lrs = [lr_at(s, w) for s in range(20)]
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    assert lrs[-1] > 1e-4 and lr_at(20, w) == pytest.approx(1e-4)


def test_tiny_qwen35_trains_single_process():
    spec = load_model("tiny-qwen3.5")
    torch.manual_seed(0)
    m = build_model(spec, seed=11)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    rows = synthetic_rows(30 * 4, 128, spec.vocab, seed=11)
    losses = []
    for step in range(30):
        t, mk = rows.take(range(step * 4, step * 4 + 4))
        lab, lm = shift_labels(t, mk)
        loss = token_loss_sum(m(torch.from_numpy(t)), torch.from_numpy(lab), torch.from_numpy(lm)) / float(lm.sum())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(spec.vocab)) < 0.3  # starts near uniform
    assert np.mean(losses[-5:]) < losses[0] - 2.0, losses
