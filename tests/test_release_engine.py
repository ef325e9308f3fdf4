"""Issue 18 items 4 and 5: the NeMo / Megatron-Bridge launch defaults per release (attune.spec.engine
MEGATRON_BRIDGE_RELEASES) and the memory edge they decide: Llama 3.1 8B at TP 1, PP 1, DP 128 on 128 H100 (80 GB),
seq 8192, global batch 128 (the Megatron-Bridge Llama 3 8B recipe's), built by hand, not a corpus row."""

import pytest

from attune.calibrate.corpus import read_row
from attune.calibrate.report import predict_row
from attune.estimator import estimate
from attune.spec.engine import container_release, for_release, get_engine

GEOM = dict(name="Llama 3.1 8B", layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, mlp="swiglu")


def _row(version: str, tp: int = 1) -> dict:
    return dict(id="r", series="s", model=dict(GEOM), engine="Megatron-Bridge (NeMo, Megatron-Core)",
                engine_version=version, gpu="H100-SXM5-80GB", num_gpus=128, precision="bf16", precision_class="bf16",
                low_precision=False, seq_len=8192, global_batch=128, micro_batch=1, tp=tp, pp=1, vpp=None, cp=1,
                dp=128 // tp, recompute=None, measured=dict(metric="tokens_per_s_per_gpu", value=8000.0),
                derived=dict(tokens_per_s_per_gpu=8000.0), source=dict(url="hand-made"))


def test_container_release_parsing():
    assert container_release("NeMo 25.02.01 container") == (25, 2)
    assert container_release("NeMo 26.08 container") == (26, 8)
    assert container_release("Bridge 600d069b / MCore 24bad8e6") is None
    assert container_release("not stated") is None


def test_release_defaults_accumulate_in_order():
    base = get_engine("megatron-bridge")
    assert for_release(base, "NeMo 24.12 container") is base  # NeMo 2 launches: the engine as it stands
    mid = for_release(base, "NeMo 25.11 container")
    assert mid.logits_bytes_per_element == 2.0 and not mid.expandable_segments  # TE cross entropy in place
    late = for_release(base, "NeMo 26.06.01 container")
    assert late.expandable_segments and late.logits_bytes_per_element == 2.0
    assert for_release(base, "NeMo 26.08 container").logits_bytes_per_element == 6.0
    # only the megatron-bridge engine has releases
    assert for_release(get_engine("megatron"), "NeMo 25.11 container") is get_engine("megatron")


@pytest.mark.parametrize("version", ["NeMo 25.09 container", "NeMo 25.11 container", "NeMo 26.04 container",
                                     "NeMo 26.06 container", "NeMo 26.08 container"])
def test_llama8b_tp1_dp128_fits_on_80gb_with_megatron_bridge_defaults(version):
    p = predict_row(read_row(_row(version), "dense.yaml"))
    assert p.failure is None
    assert p.peak_gib < p.capacity_gib, (version, p.peak_gib)
    assert p.peak_gib > 0.85 * p.capacity_gib  # at the edge, not far below it


def test_recipe_at_tp1_keeps_tp_overlap_off_when_swept_to_tp2():
    r = read_row(_row("NeMo 25.11 container", tp=2), "dense.yaml")
    assert r.engine.name == "megatron-bridge" and not r.engine.recipe_tp_comm_overlap
    assert any("tp_comm_overlap: off" in a for a in r.assumptions)
    mem = estimate(r.model, r.cluster, r.layout, r.workload, r.engine).memory
    assert "tp_overlap_buffers" not in mem.stages[0].overheads
    on = estimate(r.model, r.cluster, r.layout, r.workload, get_engine("megatron-bridge")).memory
    assert on.stages[0].overheads["tp_overlap_buffers"] > 0  # what the generic engine would have assumed
