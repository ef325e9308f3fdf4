"""Each engine's MoE token dispatchers (issue 21): read from the flag table, enforced by the layout rules,
and the MoE search space proposes only the ones the engine runs.

slime 624b824a slime/backends/megatron_utils/arguments.py lines 83-88: after Megatron's validate_args, slime
rewrites --moe-token-dispatcher-type allgather to alltoall (allgather does not support variable sequence
lengths), so a slime layout with allgather is one slime never runs.
"""

from __future__ import annotations

import pytest

from attune.api.tune import tune
from attune.search.space import load_space
from attune.spec.engine import get_engine
from attune.spec.flag_data import engine_choices
from attune.spec.flags import flag_table
from attune.spec.layout import Layout, Workload
from attune.spec.model import load_model
from attune.spec.rules import check

SLIME, MEGATRON = get_engine("slime"), get_engine("megatron")
FLAG = "--moe-token-dispatcher-type"


def test_engine_dispatchers_come_from_the_flag_table():
    assert engine_choices(FLAG, "slime") == ("alltoall", "flex")
    assert set(engine_choices(FLAG, "megatron")) == set(flag_table()[FLAG].choices) == {"allgather", "alltoall", "flex"}
    assert engine_choices("--num-layers", "slime") is None


@pytest.mark.parametrize("dispatcher,ok_slime", [("alltoall", True), ("flex", True), ("allgather", False), (None, False)])
def test_slime_refuses_the_dispatchers_it_rewrites(dispatcher, ok_slime):
    m = load_model("Qwen3-30B-A3B")
    lay = Layout(tp=1, dp=8, ep=8, moe_dispatcher=dispatcher)
    errs = check(lay, m, 8, Workload(), SLIME)
    assert (not errs) == ok_slime, errs
    if not ok_slime:
        assert "allowed on slime: alltoall, flex" in errs[-1] and FLAG in errs[-1]
    assert not check(lay, m, 8, Workload(), MEGATRON)  # Megatron-LM runs all three (absent: allgather)


def test_dense_models_have_no_dispatcher_rule():
    assert not check(Layout(tp=1, dp=8), load_model("tiny-llama"), 8, Workload(), SLIME)


def test_moe_space_proposes_only_dispatchers_the_engine_runs():
    space = load_space("moe")
    m, wl = load_model("tiny-qwen3-moe"), Workload(seq_length=1024, global_batch=16)
    assert "allgather" in space.domain("dispatcher")  # the space names it: the rules decide per engine
    on_slime = {lay.moe_dispatcher for _, lay in space.enumerate(m, 8, wl, SLIME)}
    on_megatron = {lay.moe_dispatcher for _, lay in space.enumerate(m, 8, wl, MEGATRON)}
    assert on_slime == {"alltoall", "flex"} and on_megatron == {"alltoall", "allgather", "flex"}


@pytest.mark.slow
def test_qwen35_moe_winner_uses_a_dispatcher_slime_runs(tmp_path):
    res = tune(model="Qwen3.5-35B-A3B", gpus="8xH200", out=tmp_path / "out")
    assert res.recipe.layout.dispatcher in engine_choices(FLAG, "slime")
