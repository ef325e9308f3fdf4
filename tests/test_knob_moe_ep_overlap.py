"""A searched knob added through the knob registry alone (issue 19): --overlap-moe-expert-parallel-comm
(`moe_ep_overlap`). One registry entry and its line in the MoE space; the enumeration, the layout, the read-back,
the space-file validation, the knob-distance features and the layout key follow from the declaration."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attune.errors import SearchSpaceError
from attune.estimator import estimate
from attune.search.space import FEATURES, KNOBS, layout_features, layout_key, load_space
from attune.spec.engine import get_engine
from attune.spec.flags import from_flags, to_flags
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import load_model

SLIME = get_engine("slime")
WL = Workload(seq_length=4096, global_batch=64)
SPACE = """
name: ep-overlap
knobs:
  ep: [1, 8]
  dispatcher: [alltoall, allgather]
  recompute: [none, full]
  moe_ep_overlap: [false, true]
fixed: {tp: 1, pp: 1, vpp: 1, cp: 1, recompute_method: uniform, recompute_layers: 1, tokens_per_microbatch_rows: 1}
"""


@pytest.fixture(scope="module")
def moe_space(tmp_path_factory):
    p = tmp_path_factory.mktemp("space") / "ep-overlap.yaml"
    p.write_text(SPACE)
    return load_space(p)


def test_it_is_a_searched_knob_of_the_moe_space():
    assert "moe_ep_overlap" in KNOBS and "moe_ep_overlap" in FEATURES
    assert load_space("moe").knobs["moe_ep_overlap"] == (False, True)


def test_expanded_only_at_ep_above_1_and_kept_only_where_megatron_runs_it(moe_space):
    m = load_model("Qwen3-30B-A3B")
    lays = [lay for _, lay in moe_space.enumerate(m, 8, WL, SLIME)]
    on = [lay for lay in lays if lay.moe_ep_overlap]
    assert on and all(lay.ep > 1 and lay.moe_dispatcher == "alltoall" and lay.recompute_granularity != "full"
                      for lay in on)
    # every overlap layout has its overlap-off twin, and the two are two layouts (two keys, two feature points)
    for lay in on:
        off = dataclasses.replace(lay, moe_ep_overlap=False)
        assert off in lays and layout_key(off, m.num_layers) != layout_key(lay, m.num_layers)
        assert np.abs(layout_features(lay, m.num_layers) - layout_features(off, m.num_layers)).sum() == 1.0
    # the parameters of a layout read back to it
    for params, lay in moe_space.enumerate(m, 8, WL, SLIME):
        assert moe_space.params_for(lay, m, WL) == params


def test_the_estimator_prices_it():
    m, h200 = load_model("Qwen3-30B-A3B"), parse_cluster("8xH200")
    lay = from_flags("--expert-model-parallel-size 8 --moe-token-dispatcher-type alltoall --use-distributed-optimizer "
                     "--overlap-moe-expert-parallel-comm", m, 8).layout
    assert lay.moe_ep_overlap and "--overlap-moe-expert-parallel-comm" in to_flags(lay)
    on = estimate(m, h200, lay, WL, SLIME)
    off = estimate(m, h200, dataclasses.replace(lay, moe_ep_overlap=False), WL, SLIME)
    assert on.perf.step_time_s != off.perf.step_time_s


def test_a_dense_model_is_not_expanded(moe_space):
    q = load_model("Qwen3.6-27B")
    lays = [lay for _, lay in moe_space.enumerate(q, 8, WL, SLIME)]
    assert lays and not any(lay.moe_ep_overlap for lay in lays)


def test_the_space_file_refuses_a_non_switch(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("knobs:\n  moe_ep_overlap: [1, 0]\n")
    with pytest.raises(SearchSpaceError, match="moe_ep_overlap"):
        load_space(p)
