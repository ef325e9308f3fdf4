"""The knob registry (issue 19): each knob declared once, everything else generated from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from attune.recipe.codec import from_recipe_blocks, to_recipe_block
from attune.recipe.models import LayoutBlock
from attune.recipe.target import recipe_target
from attune.search import space as S
from attune.search.enumeration import enumerate_columns
from attune.search.spacefile import Fixed, Knobs
from attune.spec.engine import get_engine
from attune.spec.flags import flag_table
from attune.spec.identity import KEY_DERIVED_FIELDS, layout_key
from attune.spec.knob_registry import GENERIC, IDENTITY, KNOBS, IntSpan, flags_of, recipe_paths
from attune.spec.layout import Layout, Workload
from attune.spec.model import load_model

LAYOUT_FIELDS = [f.name for f in dataclasses.fields(Layout)]
SEED = Path(__file__).parent / "fixtures" / "seed_recipe.yaml"


def test_every_layout_field_is_one_item_of_the_identity():
    covered = [f for item in IDENTITY for f in item.covers]
    assert sorted(covered) == sorted(LAYOUT_FIELDS)  # each exactly once
    assert KEY_DERIVED_FIELDS == ("first", "last", "pipeline_layout")
    assert [k for k, _ in layout_key(Layout(), 64)] == [i.name for i in IDENTITY]


def test_every_knob_sets_layout_fields_that_have_flags():
    for k in KNOBS:
        assert k.fields and set(k.fields) <= set(LAYOUT_FIELDS), k.name
        flags = [f for fld in k.fields for f in flags_of(fld)]
        assert flags and all(f in flag_table() for f in flags), k.name
    assert flags_of("moe_ep_overlap") == ("--overlap-moe-expert-parallel-comm",)
    assert flags_of("sp") == ("--sequence-parallel",)


def test_recipe_paths_name_recipe_keys():
    """Every identity item says where a recipe carries it: a layout-block key of the recipe model, the workload
    block's precision, or the run flags (whose fields have flags in the table)."""
    for item in IDENTITY:
        if not recipe_paths(item):
            assert item.name == "virtual_stage_layers"  # derived from vpp and the split, both carried
            continue
        for path in recipe_paths(item):
            block, _, key = path.partition(".")
            if block == "layout":
                assert key.split(".")[0] in LayoutBlock.model_fields, path
            elif block == "workload":
                assert key == "precision"
            else:
                assert path == "run.flags" and all(flags_of(f) for f in item.covers), item.name


def test_the_space_tables_are_generated():
    assert list(S.KNOBS) == [k.name for k in KNOBS if k.searched]
    assert S.FIXED_ONLY == {k.name for k in KNOBS if not k.searched}
    assert set(S.DEFAULTS) == {k.name for k in KNOBS}
    assert all(S.KNOBS[k.name] == ("int" if isinstance(k.domain, IntSpan) else "choice") for k in KNOBS if k.searched)
    assert list(Knobs.model_fields) == list(S.KNOBS) and list(Fixed.model_fields) == [k.name for k in KNOBS]
    assert len(S.FEATURES) == len(set(S.FEATURES)) == len(S.layout_features(Layout(), 64))
    # the generic knobs carry their own rules: where they apply, the fields they set, how a layout reads back
    assert all(k.to_fields is not None for k in GENERIC)


@pytest.mark.parametrize("space", ["dense", "small", "moe"])
def test_enumerated_parameters_read_back(space):
    """Every enumerated layout's generic knobs come back from `params_for` (the read-back each declares), on a
    small model (the core knobs' split offsets are repaired on the way in, so not every offset reads back). The
    space is enumerated as columns, the search's own enumeration (tests/test_enumeration.py: the same layouts and
    parameter sets, in the same order, as the scalar `SearchSpace.enumerate`, which costs ~10x more)."""
    sp = S.load_space(space)
    m = load_model("Qwen3-30B-A3B" if space == "moe" else "Qwen3-0.6B")
    wl = Workload(seq_length=4096, global_batch=16)
    es = enumerate_columns(sp, m, 8, wl, get_engine("slime"))
    assert len(es)
    for i in range(0, len(es), max(1, len(es) // 400)):
        params, lay = es.params(i), es.cols.layout(i)
        back = sp.params_for(lay, m, wl)
        if back is None:  # a split repaired past the offsets' domain (PP > 2: the last stage takes the remainder)
            assert lay.pp > 2
            continue
        assert all(back[k.name] == params[k.name] for k in GENERIC if k.name in sp.knobs)


# a value other than the default for each field a recipe's layout block carries, on a layout where it shows
_SHOWN = dict(tp=2, sp=True, pp=2, dp=2, cp=2, vpp=2, ep=2, etp=2, moe_dispatcher="alltoall", max_tokens_per_gpu=4096,
              distributed_optimizer=False, precision_aware_optimizer=True, account_for_embedding=True,
              account_for_loss=True, offload_modules=("core_attn",), recompute_granularity="selective",
              recompute_modules=("mlp",), optimizer_cpu_offload=True, offload_fraction=0.5, overlap_cpu_optimizer=True,
              micro_batch_size=2, recompute_method="uniform", recompute_num_layers=3)


def test_recipe_paths_are_where_the_codec_writes_and_reads():
    """Each identity item whose recipe path is a key of the layout block: the codec writes the field there and
    reads it back (the registry's recipe path and the codec say the same)."""
    m = load_model("Qwen3-0.6B")
    base = Layout(tp=1, pp=1, dp=8)
    tried = []
    for item in IDENTITY:
        paths = recipe_paths(item)
        if len(paths) != 1 or not paths[0].startswith("layout.") or item.covers[0] not in _SHOWN:
            continue
        f = item.covers[0]
        extra = {"recompute_granularity": "selective"} if f == "recompute_modules" else {
            "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1} if f in (
            "recompute_method", "recompute_num_layers") else (
            {"optimizer_cpu_offload": True, "precision_aware_optimizer": True} if f in (
                "offload_fraction", "overlap_cpu_optimizer") else {})
        lay = dataclasses.replace(base, **{**extra, f: _SHOWN[f]})
        block = to_recipe_block(lay, m)
        node = block
        for part in paths[0].removeprefix("layout.").split("."):
            assert part in node, (f, paths[0])
            node = node[part]
        back, _ = from_recipe_blocks(block, None)
        assert getattr(back, f) == getattr(lay, f), f
        tried.append(f)
    assert sorted(tried) == sorted(_SHOWN)
    assert recipe_paths(next(i for i in IDENTITY if i.name == "stage_layers")) == (
        "layout.layer_split.first", "layout.layer_split.last", "layout.pipeline_layout")


def test_fields_carried_in_the_run_flags_read_back_from_a_recipe():
    """Every field whose registry recipe path is run.flags comes back from a recipe's run flags (the overlap flags
    were dropped before the registry said where they travel)."""
    r = yaml.safe_load(SEED.read_text())
    run_fields = {f for item in IDENTITY if recipe_paths(item) == ("run.flags",) for f in item.covers}
    assert {"overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "moe_ep_overlap"} <= run_fields
    r["run"] = r["run"].replace("--use-distributed-optimizer",
                                "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather")
    lay = recipe_target(r).layout
    assert lay.overlap_grad_reduce and lay.overlap_param_gather
    assert not recipe_target(yaml.safe_load(SEED.read_text())).layout.overlap_grad_reduce
