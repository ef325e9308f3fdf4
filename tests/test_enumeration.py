"""The space as columns (issue 18): `enumerate_columns` gives the same layouts, in the same order, with the same
parameter sets, layout keys and knob-distance features as the reference `SearchSpace.enumerate`."""

from __future__ import annotations

import dataclasses
from importlib import resources

import numpy as np
import pytest
import yaml

from attune.api.target import batch_for_cluster
from attune.errors import SearchSpaceError
from attune.estimator import estimate
from attune.estimator.coefficients import coefficients_for
from attune.search.enumeration import enumerate_columns
from attune.search.scoring import score_space
from attune.search.space import layout_features, layout_key, load_space, params_key
from attune.spec.columns import FIELDS, LayoutColumns
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import load_model
from attune.spec.rules import index_sharing_rule


def _same(model_name: str, gpus: str, space, engine: str = "slime") -> int:
    model, cluster, eng = load_model(model_name), parse_cluster(gpus), get_engine(engine)
    wl, _ = batch_for_cluster(Workload(), cluster.world_size)
    ref = space.enumerate(model, cluster.world_size, wl, eng)
    es = enumerate_columns(space, model, cluster.world_size, wl, eng)
    L = model.num_layers
    assert len(es) == len(ref)
    want = LayoutColumns.from_layouts(lay for _, lay in ref)
    for name in FIELDS:  # every layout, field by field
        assert np.array_equal(es.cols[name], want[name], equal_nan=want[name].dtype.kind == "f"), name
    assert [es.params(i) for i in range(len(es))] == [p for p, _ in ref]
    # keys, the key index and the features on a sample (each costs a scalar derivation per layout)
    for i in np.random.default_rng(0).choice(len(ref), size=min(len(ref), 1500), replace=False):
        lay = ref[i][1]
        key = layout_key(lay, L)
        assert es.cols.layout(i) == lay, i
        assert es.key(i) == key, i
        assert es.row_of_key(key) == i, i
        np.testing.assert_allclose(es.features[i], layout_features(lay, L), rtol=0, atol=1e-12)
    return len(ref)



def _same_strata(model_name: str, gpus: str, space, strata: list[tuple[int, int, int]], engine: str = "slime") -> int:
    """`_same` on whole (TP, PP, CP) strata of a space: the columns of the WHOLE space, restricted to the rows of one
    stratum, equal the reference enumeration of that stratum (the space with TP, PP and CP fixed to its values),
    layout by layout and field by field, with the same parameter sets and (on a sample) keys and features.

    Why a stratum stands for itself exactly: TP, PP and CP are the reference's outer loop and enter every layout's
    identity (`layout_key`), so no layout of one stratum deduplicates against another's, and within a stratum both
    enumerations expand every other knob over its whole domain (every split offset, VPP, layout string, recompute
    method and count, offload, overlap, rows per microbatch). Returns the number of layouts compared."""
    model, cluster, eng = load_model(model_name), parse_cluster(gpus), get_engine(engine)
    wl, _ = batch_for_cluster(Workload(), cluster.world_size)
    es = enumerate_columns(space, model, cluster.world_size, wl, eng)
    L = model.num_layers
    seen = {(int(t), int(p), int(c)) for t, p, c in zip(es.cols["tp"], es.cols["pp"], es.cols["cp"])}
    compared = 0
    for tp, pp, cp in strata:
        assert (tp, pp, cp) in seen, (tp, pp, cp)  # the whole space has this stratum
        sub = dataclasses.replace(space, knobs={**space.knobs, "tp": (tp,), "pp": (pp,), "cp": (cp,)})
        ref = sub.enumerate(model, cluster.world_size, wl, eng)
        rows = np.flatnonzero((es.cols["tp"] == tp) & (es.cols["pp"] == pp) & (es.cols["cp"] == cp))
        assert len(rows) == len(ref) > 0, (tp, pp, cp)
        want = LayoutColumns.from_layouts(lay for _, lay in ref)
        for name in FIELDS:  # every layout of the stratum, field by field
            assert np.array_equal(es.cols[name][rows], want[name], equal_nan=want[name].dtype.kind == "f"), name
        assert [es.params(int(i)) for i in rows] == [p for p, _ in ref]
        for j in np.random.default_rng(0).choice(len(ref), size=min(len(ref), 500), replace=False):
            i, lay = int(rows[j]), ref[j][1]
            key = layout_key(lay, L)
            assert es.cols.layout(i) == lay and es.key(i) == key and es.row_of_key(key) == i, i
            np.testing.assert_allclose(es.features[i], layout_features(lay, L), rtol=0, atol=1e-12)
        compared += len(ref)
    return compared


def test_main_command_space_equal():
    """Qwen3.6-27B on 8 x H200, the dense space (181,314 layouts in 15 (TP, PP, CP) strata; Qwen3.5 refuses layout
    strings on slime): every layout as columns against the reference on the strata of the main command's winner (TP1
    PP8), the seed's (TP1 PP4 DP2) and slime's baseline (TP4 PP2), with every TP, PP, CP and DP 8, 4, 2, 1 (about
    72,000 layouts; `_same_strata`)."""
    strata = [(1, 1, 1), (1, 2, 2), (1, 4, 1), (1, 8, 1), (2, 1, 2), (2, 2, 2), (4, 2, 1)]
    assert _same_strata("Qwen3.6-27B", "8xH200", load_space(None), strata) > 60_000


def test_moe_space_equal():
    """A MoE model with its default space (EP, ETP, the dispatcher, the EP overlap)."""
    assert _same("Qwen3-30B-A3B", "8xH200", load_space("moe")) > 10_000


def test_llama_64_gpus_equal(tmp_path):
    """Llama-3.1-70B on 64 x H100 (layout strings, DP up to 64, the grown global batch), the dense space with
    narrower offsets and recompute counts, every layout of it as columns against the reference on whole strata
    (`_same_strata`) other than the slow lane's whole-space ones: every TP, PP, CP and DP 64, 8, 2, 1."""
    data = yaml.safe_load((resources.files("attune.search.spaces") / "dense.yaml").read_text())
    data["knobs"]["first_offset"] = {"low": -3, "high": 3}
    data["knobs"]["last_offset"] = {"low": -3, "high": 3}
    data["knobs"]["recompute_layers"] = {"low": 1, "high": 6}
    p = tmp_path / "narrow.yaml"
    p.write_text(yaml.safe_dump(data))
    assert _same_strata("Llama-3.1-70B", "64xH100", load_space(p), [(1, 1, 1), (2, 8, 2), (4, 2, 1), (8, 4, 2)]) > 10_000


@pytest.mark.slow
def test_megatron_engine_equal():
    """Llama-3.1-8B on Megatron-LM (no dynamic batching: rows are the microbatch size): the whole dense space as
    columns (166,416 layouts in 16 strata) against the reference on whole (TP, PP, CP) strata holding every TP, PP,
    CP and DP 8, 4, 2, 1 (about 51,000 layouts; `_same_strata`)."""
    strata = [(1, 1, 1), (1, 4, 1), (1, 8, 1), (2, 1, 1), (2, 2, 2), (4, 1, 2), (8, 1, 1)]
    assert _same_strata("Llama-3.1-8B", "8xH100", load_space(None), strata, engine="megatron") > 10_000


def test_small_space_and_no_layout():
    assert _same("tiny-qwen3.5", "2xcpu", load_space("small"), engine="torch") > 0
    model, eng = load_model("Qwen3.6-27B"), get_engine("slime")
    with pytest.raises(SearchSpaceError):
        enumerate_columns(load_space("small"), model, 3, Workload(), eng)


# Strata of Llama-3.1-70B 64 x H100's whole dense space (1,152,648 layouts in 31 (TP, PP, CP) strata) that hold every
# value of TP (1, 2, 4, 8; SP forced off at TP 1, both SP values above), PP (1, 2, 4, 8: no split, the split with its
# first offset, both offsets with layout strings at PP > 2, with and without VPP 2), CP (1, 2) and DP (64, 8, 4, 1:
# overlap and offload with and without data parallelism), about 108,000 layouts: the reference enumerates a layout
# about 10x slower than the columns, so the whole space cost minutes of the slow lane.
WHOLE_SPACE_STRATA = [(1, 1, 1), (1, 4, 2), (2, 1, 1), (4, 2, 2), (8, 8, 1)]


@pytest.mark.slow
def test_llama_64_gpus_whole_space_equal():
    """The whole space enumerated as columns (all 1,152,648 layouts) agrees with the reference on whole strata that
    cover every knob value (`_same_strata`)."""
    assert _same_strata("Llama-3.1-70B", "64xH100", load_space(None), WHOLE_SPACE_STRATA) > 100_000


def test_scored_space_reads_like_lists():
    """The scored table keeps columns; its layouts, parameter sets and stage peaks read like the lists they were,
    and a row is found by its layout key or its parameter set."""
    model, cluster, eng = load_model("Llama-3.1-8B"), parse_cluster("8xH100"), get_engine("slime")
    space, wl = load_space("small"), Workload()
    coef = coefficients_for(cluster.gpu)
    table = score_space(space, model, cluster, wl, eng, coef)
    ref = space.enumerate(model, cluster.world_size, wl, eng)
    assert len(table) == len(table.layouts) == len(table.params) == len(ref) > 10
    L = model.num_layers
    pos = table.position_gib()
    for i, (params, lay) in enumerate(ref):
        assert table.layouts[i] == lay and table.params[i] == params
        assert table.row(layout_key(lay, L)) == i and table.row(params_key(params)) == i
        mem = estimate(model, cluster, lay, wl, eng, coef, check_layout=False).memory
        st = table.stage_gib[i]
        assert st == tuple(s.total_gib for s in mem.stages) and len(st) == lay.pp
        assert pos[i, 0] == st[0] and pos[i, 2] == st[-1]
        assert pos[i, 1] == (max(st[1:-1]) if len(st) > 2 else -np.inf)
    assert table.layouts[-1] == ref[-1][1] and table.layouts[:2] == [lay for _, lay in ref[:2]]
    assert table.row(params_key({"tp": 99})) is None


def test_scored_table_survives_a_pickle(h200x8, slime):
    """The search benchmark keeps scored tables between runs as pickles (`--cache`): the lazy sequences are
    rebuilt on load and read the same rows."""
    import pickle

    from attune.estimator.coefficients import coefficients_for
    from attune.search.scoring import score_space
    from attune.search.space import load_space
    from attune.spec.layout import Workload
    from attune.spec.model import load_model

    t = score_space(load_space(None), load_model("tiny-llama"), h200x8, Workload(seq_length=1024, global_batch=16),
                    slime, coefficients_for(h200x8.gpu))
    t2 = pickle.loads(pickle.dumps(t))
    for i in (0, len(t) // 2, len(t) - 1):
        assert t2.layouts[i] == t.layouts[i] and t2.params[i] == t.params[i] and t2.stage_gib[i] == t.stage_gib[i]


@pytest.mark.slow
def test_index_sharing_split_rule_equal():
    """GLM-5.2 (DSA index sharing: every pipeline stage starts on a computing layer, a rule on the layer split) on
    32 x 8 x H200, the MoE space: the columns keep exactly the splits the reference's `check` keeps."""
    n = _same("GLM-5.2-744B-A40B", "32x8xH200", load_space("moe"))
    assert n > 1000


def test_index_sharing_splits_are_kept_and_refused_by_split():
    """The split rule of DSA index sharing is applied per split, not per (TP, PP, CP, DP, VPP): GLM-5.2 keeps PP 4
    with 18 / 20 layers on the first / last stage (stages start on layers 1, 19, 39, 59) while the even 19 / 19
    split of the same sizes is refused (its second stage would start on layer 20)."""
    model, cluster = load_model("GLM-5.2-744B-A40B"), parse_cluster("32x8xH200")
    wl, _ = batch_for_cluster(Workload(), cluster.world_size)
    es = enumerate_columns(load_space("moe"), model, cluster.world_size, wl, get_engine("slime"))
    pp, first, last = es.cols["pp"], es.cols["first"], es.cols["last"]
    splits = set(zip(pp.tolist(), first.tolist(), last.tolist()))
    assert (4, 18, 20) in splits and (4, 19, 19) not in splits
    assert all(not index_sharing_rule(es.cols.layout(int(i)), model)
               for i in np.random.default_rng(0).choice(len(es), size=200, replace=False))
