"""Issue 18: the knobs cut from the default space to keep the main command fast are searched again, now that the
space is scored as arrays; each expands only where its registry rule (`attune.spec.knob_registry`, ``applies``)
says it can change the layout."""

from __future__ import annotations

import numpy as np
import pytest

from attune.api.target import batch_for_cluster
from attune.estimator import estimate, estimate_batch
from attune.estimator.coefficients import coefficients_for
from attune.search.enumeration import enumerate_columns
from attune.search.space import load_space
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import load_model
from attune.spec.placement import stage_layer_counts
from attune.spec.rules import check


@pytest.fixture(scope="module")
def qwen_cols():
    """The default space of the main command's target (Qwen3.6-27B on 8 x H200, slime) as columns."""
    model, cluster = load_model("Qwen3.6-27B"), parse_cluster("8xH200")
    wl, _ = batch_for_cluster(Workload(), cluster.world_size)
    return enumerate_columns(load_space(None), model, cluster.world_size, wl, get_engine("slime")).cols


def test_comm_overlap_searched_where_there_is_communication(qwen_cols):
    assert tuple(load_space(None).domain("comm_overlap")) == (False, True)
    c = qwen_cols
    rule = (c["dp"] * c["cp"] > 1) | ((c["tp"] > 1) & c["sp"])
    on = c["overlap_grad_reduce"]
    assert np.array_equal(on, c["overlap_param_gather"])
    assert on.any() and not on[~rule].any()  # never expanded where there is nothing to overlap
    assert on[rule].sum() == (~on[rule]).sum()  # both values of every layout where it can matter
    assert np.array_equal(c["tp_comm_overlap"], on & c["sp"] & (c["tp"] > 1))


def test_partial_optimizer_offload_searched_under_recompute(qwen_cols):
    c = qwen_cols
    off, rec = c["optimizer_cpu_offload"], c["recompute_granularity"]
    partial = c["offload_fraction"] < 1.0
    assert not partial[~off].any()  # only with optimizer offload
    for r in ("none", "selective", "full"):  # both fractions under every recompute
        here = off & (rec == r)
        assert partial[here].sum() == (~partial[here]).sum() > 0, r


def test_activation_offload_searched_under_selective_recompute(qwen_cols):
    c = qwen_cols
    rec = c["recompute_granularity"]
    on = np.array([bool(m) for m in c["offload_modules"]])
    assert not on[rec == "full"].any()  # full recompute keeps no activations to offload
    for r in ("none", "selective"):
        here = rec == r
        assert on[here].sum() == (~on[here]).sum() > 0, r


def test_layout_strings_at_vpp_above_one():
    """Llama-3.1-8B (32 layers) on 8 x H100: the 'string' stage layout is searched at VPP 2 too, each stage's layers
    over its virtual stages (so a stage whose layers VPP does not divide is reachable); the array engine prices
    those rows as the scalar path does, and each row's layout reads back as its own parameter set."""
    model, cluster, engine = load_model("Llama-3.1-8B"), parse_cluster("8xH100"), get_engine("slime")
    wl, _ = batch_for_cluster(Workload(), cluster.world_size)
    space = load_space(None)
    es = enumerate_columns(space, model, cluster.world_size, wl, engine)
    c = es.cols
    rows = np.flatnonzero((c["pipeline_layout"] != None) & (c["vpp"] > 1))  # noqa: E711
    assert rows.size
    assert (c["pp"][c["pipeline_layout"] != None] > 2).all()  # noqa: E711  (only where there are middle stages)
    uneven = [i for i in rows if any(n % 2 for n in stage_layer_counts(es.cols.layout(int(i)), 32))]
    assert uneven  # a split VPP 2 cannot make
    sample = np.random.default_rng(0).choice(rows, size=min(40, rows.size), replace=False)
    coef = coefficients_for(cluster.gpu)
    b = estimate_batch(model, cluster, c.take(sample), wl, engine, coef)
    for j, i in enumerate(sample):
        lay = c.layout(int(i))
        assert not check(lay, model, cluster.world_size, wl, engine)
        assert space.params_for(lay, model, wl) == es.params(int(i))
        e = estimate(model, cluster, lay, wl, engine, coef)
        assert b.tokens_per_s_per_gpu[j] == pytest.approx(e.perf.tokens_per_s_per_gpu, rel=1e-9)
        assert b.peak_gib[j] == pytest.approx(e.memory.peak_gib, rel=1e-9)
