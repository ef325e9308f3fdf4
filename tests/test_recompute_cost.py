"""Issue 18 item 2: full against selective recompute on the published Megatron-LM runs of Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models"), built by hand from the paper's Table 3 (not
corpus rows): GPT-style models, sequence 2048, micro batch 1, TP 8, DP 1, on A100 with 2022's Megatron-LM
(unfused attention with dropout). The paper's Table 5 measured SP + selective recompute 1.29-1.32x faster than
full recompute; its Table 4 measured one 22B layer's selective recompute at 1.3 ms of backward against 7.7 ms of
forward (the softmax and dropout passes over the a x s x s scores, not only the two attention GEMMs)."""

import pytest

from attune.estimator import estimate
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import from_geometry

# Table 3: layers, hidden, heads, PP, global batch (TP 8, GPUs = 8 x PP)
PAPER = {"175B": (96, 12288, 96, 8, 64), "530B": (105, 20480, 128, 35, 280), "1T": (128, 25600, 160, 64, 512)}
LEGACY = get_engine("megatron-legacy")


def _step(name: str, **kw) -> float:
    layers, h, heads, pp, gb = PAPER[name]
    model = from_geometry(name=name, layers=layers, hidden=h, ffn=4 * h, heads=heads, vocab=51200, mlp="gelu",
                          seq_length=2048)
    lay = Layout(tp=8, pp=pp, dp=1, distributed_optimizer=False, precision="fp16", **kw)
    return estimate(model, parse_cluster(f"{8 * pp}xA100"), lay, Workload(seq_length=2048, global_batch=gb), LEGACY,
                    check_layout=False).perf.step_time_s


@pytest.mark.parametrize("name", sorted(PAPER))
def test_full_over_selective_recompute_ratio_is_the_papers(name):
    full = _step(name, sp=False, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    sel = _step(name, sp=True, recompute_granularity="selective")
    # measured 1.29-1.32x (Table 5); a band around it, not the figure
    assert 1.25 <= full / sel <= 1.36, full / sel


def test_unfused_selective_recompute_reruns_the_softmax_passes():
    model = from_geometry(name="22B", layers=48, hidden=6144, ffn=4 * 6144, heads=64, vocab=0, mlp="gelu",
                          seq_length=2048)
    wl, cl = Workload(seq_length=2048, global_batch=4), parse_cluster("8xA100")

    def stage(engine, **kw):
        lay = Layout(tp=8, dp=1, micro_batch_size=4, sp=True, distributed_optimizer=False, precision="fp16", **kw)
        return estimate(model, cl, lay, wl, engine, check_layout=False).perf.stages[0]

    sel = stage(LEGACY, recompute_granularity="selective")
    rec, attn = sel.parts["recompute"], sel.parts["fwd_attention"]
    assert rec > 2 * attn  # the scores' HBM passes run again, not only QK^T and PV
    assert 0.08 < rec / sel.forward_s < 0.25  # Table 4: 1.3 ms of 7.7 ms
    # FlashAttention frees nothing under core_attn recompute and re-runs only its kernel
    flash = stage(get_engine("megatron"), recompute_granularity="selective")
    assert flash.parts["recompute"] == pytest.approx(flash.parts["fwd_attention"])


def test_one_22b_layer_against_table_4():
    """Table 4, one 22B layer (TP 8, micro batch 4): forward 7.7 ms, backward 11.9 ms without recompute; full
    recompute adds one forward to the backward (19.5 ms); selective + SP 7.2 / 13.1 ms. Ratios, not the figures:
    the backward's TP all-reduces run under the weight-gradient GEMMs (megatron-core tensor_parallel/layers.py)."""
    model = from_geometry(name="22B", layers=48, hidden=6144, ffn=4 * 6144, heads=64, vocab=0, mlp="gelu",
                          seq_length=2048)
    wl, cl = Workload(seq_length=2048, global_batch=4), parse_cluster("8xA100")

    def stage(**kw):
        lay = Layout(tp=8, dp=1, micro_batch_size=4, distributed_optimizer=False, precision="fp16", **kw)
        return estimate(model, cl, lay, wl, LEGACY, check_layout=False).perf.stages[0]

    none = stage(sp=False)
    assert 1.45 < none.backward_s / none.forward_s < 1.65  # 11.9 / 7.7 = 1.55
    full = stage(sp=False, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert full.forward_s == pytest.approx(none.forward_s)
    assert (full.backward_s - none.backward_s) / none.forward_s == pytest.approx(1.0, abs=0.1)  # (19.5 - 11.9) / 7.7
    sel_sp = stage(sp=True, recompute_granularity="selective")
    total = lambda s: s.forward_s + s.backward_s  # noqa: E731
    assert 1.0 < total(sel_sp) / total(none) < 1.07  # 20.3 / 19.6 = 1.036
    assert 1.3 < total(full) / total(sel_sp) < 1.4  # 27.2 / 20.3 = 1.34
