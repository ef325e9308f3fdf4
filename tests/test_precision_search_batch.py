"""The low-precision comparison prices its candidates as one batch (``precision_search.price``): the same tokens/s/GPU,
memory verdicts and rule refusals as ``estimate()`` on each variant, one by one."""

from __future__ import annotations

import dataclasses

import numpy as np

from attune.errors import AttuneError
from attune.estimator import estimate
from attune.search.precision_search import price, rules_ok, variant_columns, variants
from attune.spec.columns import LayoutColumns
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import load_model
from attune.spec.precision import PRECISION_RULE_FIELDS, precision_rules

RECIPES = ("fp8-delayed", "fp8-tensorwise", "fp8-blockwise", "mxfp8", "nvfp4")


def _layouts() -> list[Layout]:
    """Valid bf16 layouts of Qwen3.6-27B on 8 GPUs, with the fields the precision rules read varied."""
    base = [Layout(pp=8, first=7, last=3, recompute_granularity="full", recompute_method="block",
                   recompute_num_layers=4, max_tokens_per_gpu=8192, precision_aware_optimizer=True),
            Layout(tp=2, sp=True, pp=4, dp=1, max_tokens_per_gpu=8192, recompute_granularity="selective",
                   recompute_modules=("core_attn", "layernorm")),
            Layout(tp=4, sp=True, pp=2, max_tokens_per_gpu=16384, optimizer_cpu_offload=True, offload_fraction=1.0,
                   precision_aware_optimizer=True, overlap_cpu_optimizer=True),
            Layout(tp=2, sp=True, pp=2, dp=2, max_tokens_per_gpu=8192, distributed_optimizer=False,
                   recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)]
    return base


def test_rule_fields_are_every_field_precision_rules_reads():
    read: set[str] = set()

    class Spy:
        def __init__(self, lay):
            self._lay = lay

        def __getattr__(self, name):
            read.add(name)
            return getattr(self._lay, name)

    for lay in _layouts():
        for v in variants(lay, RECIPES):
            precision_rules(Spy(v))
    indirect = {"effective_recompute_modules": {"recompute_granularity", "recompute_modules"}}
    fields = set().union(*(indirect.get(n, {n}) for n in read))
    assert fields <= set(PRECISION_RULE_FIELDS) and "fp8_param_gather" in fields


def test_rules_ok_equals_precision_rules_row_by_row():
    cols, V = variant_columns(LayoutColumns.from_layouts(_layouts()), RECIPES)
    assert V == 9
    got = rules_ok(cols)
    want = [not precision_rules(cols.layout(i)) for i in range(len(cols))]
    assert got.tolist() == want and not all(want) and any(want)


def test_price_equals_estimate_of_each_variant():
    model, wl, engine = load_model("Qwen3.6-27B"), Workload(), get_engine("megatron")
    for gpus, recipes in (("8xH200", RECIPES[:3]), ("8xB200", RECIPES)):
        cluster = parse_cluster(gpus)
        lays = _layouts()
        for lay in lays:  # the candidates are valid bf16 layouts (the scored table's)
            estimate(model, cluster, lay, wl, engine)
        usable = 0.98 * cluster.gpu.capacity_gib
        tok, priced, fits = price(model, cluster, wl, engine, None, LayoutColumns.from_layouts(lays), recipes, usable)
        for r, lay in enumerate(lays):
            for v, var in enumerate(variants(lay, recipes)):
                try:
                    e = estimate(model, cluster, var, wl, engine)
                except AttuneError:
                    assert not priced[r, v] and np.isnan(tok[r, v])
                    continue
                assert priced[r, v] and tok[r, v] == e.perf.tokens_per_s_per_gpu
                assert fits[r, v] == (e.memory.peak_gib <= usable and e.memory.host_fits)
        assert fits.any() and not priced.all()


def test_variant_columns_are_the_variants_in_order():
    lays = _layouts()[:2]
    cols, V = variant_columns(LayoutColumns.from_layouts(lays), RECIPES[:2])
    assert cols.layouts() == [v for lay in lays for v in variants(lay, RECIPES[:2])]
    assert dataclasses.replace(cols.layout(1), fp8_param_gather=False) == cols.layout(0)
