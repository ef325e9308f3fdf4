"""The torch runner's MoE block (issue 14): exact parameter counts, routing, a real MoE training run (EP 1)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attune.runners.base import TrialSpec  # noqa: E402
from attune.runners.registry import get_runner  # noqa: E402
from attune.runners.torch_spec import decode_spec, encode_spec  # noqa: E402
from attune.spec.engine import get_engine  # noqa: E402
from attune.spec.hardware import parse_cluster  # noqa: E402
from attune.spec.layout import Layout, Workload  # noqa: E402
from attune.spec.model import load_model  # noqa: E402
from attune.spec.placement import stage_params  # noqa: E402
from attune.torchmodels import build_model  # noqa: E402
from attune.torchmodels.moe_block import MoEBlock  # noqa: E402


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen3.5-moe"])
def test_torch_moe_parameter_counts_equal_the_spec(name):
    m = load_model(name)
    assert sum(p.numel() for p in build_model(m).parameters()) == m.total_params
    lay = Layout(pp=2, dp=1)
    half = m.num_layers // 2
    first = build_model(m, 0, half, first=True, last=False)
    assert sum(p.numel() for p in first.parameters()) == stage_params(m, lay, 0)


def test_router_picks_top_k_and_every_token_gets_its_experts():
    m = load_model("tiny-qwen3.5-moe")
    torch.manual_seed(0)
    block = MoEBlock(m)
    x = torch.randn(32, m.hidden)
    w, ids = block.route(x)
    assert ids.shape == (32, m.moe.top_k) and torch.allclose(w.sum(-1), torch.ones(32))
    # the block equals the explicit per-token sum of its experts plus the gated shared expert
    y = block(x)
    ref = torch.stack([
        sum(w[i, j] * block.experts[int(ids[i, j])](x[i:i + 1])[0] for j in range(m.moe.top_k))
        + torch.sigmoid(block.shared_expert_gate(x[i:i + 1]))[0] * block.shared_expert(x[i:i + 1])[0]
        for i in range(32)])
    assert torch.allclose(y, ref, atol=1e-5)
    y.sum().backward()
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0


def test_moe_spec_crosses_to_the_worker():
    m = load_model("tiny-qwen3-moe")
    back, _, _ = decode_spec(encode_spec(m, Layout(dp=2), Workload(), "torch", "/tmp/x", "cpu", None, None, None))
    assert back == m and back.moe == m.moe


@pytest.mark.slow
def test_torch_runner_trains_a_moe_model(tmp_path):
    wl = Workload(seq_length=128, global_batch=4, steps=12, window=(3, 11), lr=1e-3, min_lr=1e-4, seed=42)
    spec = TrialSpec(model=load_model("tiny-qwen3.5-moe"), cluster=parse_cluster("2xcpu"),
                     layout=Layout(pp=2, dp=1, max_tokens_per_gpu=128, distributed_optimizer=False), workload=wl,
                     engine=get_engine("torch"), trial_dir=tmp_path, timeout_s=180)
    r = get_runner("torch").run(spec)
    assert r.status == "ok", r
    assert r.tokens_per_s_per_gpu > 0 and r.losses[11] < r.losses[0]
