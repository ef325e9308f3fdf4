"""The array engine (attune.estimator.batch, issue 18): every term of a frozen reference, and a row's terms do not
depend on the batch it is estimated in.

The frozen reference (``tests/fixtures/estimate_reference.json.gz``) holds random layouts of several bundled dense and
GDN-hybrid models on several clusters and engines (the default space's knobs plus communication overlap, with a few
Layout fields the space does not search flipped at random) and every term the scalar composition of bb2a96d (before
``estimate()`` became a batch of one) gave them with the coefficients' source values (``Coefficients()``, which a
refit does not move): every per-stage time part and memory term, every named overhead and the step figures must
equal it within 1e-9 relative. A deliberate physics change rewrites it: ``python tests/test_batch_engine.py --write``.
Whole batches equal batches of one (``estimate()``) term by term. Low-precision rows (every recipe on the GPUs that
run it, with and without --fp8-param-gather, FP8 attention) and multi-token prediction go through the arrays too; MoE
models: tests/test_batch_moe.py.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attune.errors import AttuneError, LayoutError
from attune.estimator import estimate, estimate_batch
from attune.estimator.batch_place import place_batch
from attune.estimator.coefficients import DEFAULT, Coefficients
from attune.estimator.terms import estimate_terms
from attune.search.space import SearchSpace, load_space
from attune.spec import pipeline_layout
from attune.spec.columns import LayoutColumns
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.identity import layout_from_dict
from attune.spec.layout import Layout, Workload
from attune.spec.model import load_model
from attune.spec.placement import place
from attune.spec.precision import fields_for

RTOL = 1e-9
REFERENCE = Path(__file__).parent / "fixtures" / "estimate_reference.json.gz"
# fields the space does not search, flipped at random (rows an invalid flip breaks are dropped by the scalar path)
FLIPS = {"precision": "fp16", "distributed_optimizer": False, "precision_aware_optimizer": False,
         "overlap_cpu_optimizer": False, "overlap_grad_reduce": True, "overlap_param_gather": True,
         "tp_comm_overlap": True, "micro_batch_size": 2, "account_for_embedding": True, "account_for_loss": True}


def scalar_terms(e) -> dict[str, float]:
    return estimate_terms(e.memory, e.perf)


def batch_terms(b, i: int) -> dict[str, float]:
    return b.terms(i)


def mismatches(a: dict, b: dict) -> list[str]:
    assert len(a) > 40 and len(b) > 40  # every stage's parts, memory terms and overheads, and the step's
    bad = [f"{k}: missing in the batch" for k in a if k not in b]
    for k, v in a.items():
        w = b.get(k, 0.0 if k.startswith("overhead.") else None)
        if w is None or v == w or (math.isnan(v) and math.isnan(w)):
            continue
        if abs(v - w) > RTOL * max(abs(v), abs(w)):
            bad.append(f"{k}: expected {v!r} got {w!r}")
    return bad + [f"{k}: not in the expected terms" for k in b if k not in a and not k.startswith("overhead.")
                  and b[k] != 0.0]


def draw_from(space: SearchSpace, model, cluster, engine, wl, n: int, seed: int, flips_of, tries_per: int) -> list:
    """n random layouts of ``space`` that the estimator accepts, each changed by ``flips_of(rng)`` (a dict of
    Layout fields), within ``tries_per * n`` tries."""
    rng = np.random.default_rng(seed)
    out, tries = [], 0
    while len(out) < n and tries < tries_per * n:
        tries += 1
        params = {k: (lambda d: d[int(rng.integers(len(d)))])(space.domain(k)) for k in space.knobs}
        try:
            lay = space.to_layout(params, model, cluster.world_size, wl, engine)
            lay = dataclasses.replace(lay, **flips_of(rng))
            estimate(model, cluster, lay, wl, engine, check_layout=False)
        except (AttuneError, ZeroDivisionError):
            continue
        out.append(lay)
    return out


def _dense_flips(rng) -> dict:
    flips = {k: v for k, v in FLIPS.items() if rng.random() < 0.12}
    if flips.get("account_for_embedding") or flips.get("account_for_loss"):
        flips.update(first=None, last=None, pipeline_layout=None)
    return flips


def draw(model, cluster, engine, wl, n: int, seed: int, extra: dict | None = None) -> list:
    """n random layouts the estimator accepts: the default space's knobs with communication overlap."""
    base = load_space(None)
    space = SearchSpace(name="batch", path="", knobs=dict(base.knobs, comm_overlap=(False, True), **(extra or {})),
                        fixed=dict(base.fixed))
    return draw_from(space, model, cluster, engine, wl, n, seed, _dense_flips, 60)


CASES = [("Qwen3.6-27B", "8xH200", "slime"), ("Qwen3.6-27B", "16xH100", "megatron"),
         ("Llama-3.1-8B", "64xH100", "megatron-bridge"), ("Qwen3.5-4B", "8xH200", "slime"),
         ("gpt2", "16xH100", "megatron-legacy"), ("Nemotron-4-15B", "16xH100", "megatron"),
         ("GLM-4-9B", "8xH200", "megatron"), ("Qwen2.5-7B", "64xH100", "slime"),
         # an NVLink domain beyond the node (GB200 NVL72), a Blackwell Ultra peak ratio, Ampere's coefficients
         ("Llama-3.1-8B", "16xGB200", "megatron-bridge"), ("Qwen3.6-27B", "16xB300", "slime"),
         ("Qwen3-8B", "32xA100", "megatron"),
         # CPU workers (fp32 activations, the shared host memory, CPU GEMM saturation) and attune's fp32 trainer
         ("tiny-qwen3.5", "4xcpu", "torch"), ("tiny-llama", "2xcpu", "torch"), ("Qwen3-1.7B", "8xH100", "torch")]


def _reference() -> list[dict]:
    with gzip.open(REFERENCE, "rt") as f:
        return json.load(f)


def write_reference(path: Path = REFERENCE, per_case: int = 4) -> int:
    """Rewrite the frozen reference from this tree (a deliberate physics change): ``per_case`` drawn layouts of every
    case of CASES with every term ``estimate()`` gives them at the coefficients' source values, 13 digits."""
    out = []
    for name, gpus, eng in CASES:
        model, cluster, engine, wl = load_model(name), parse_cluster(gpus), get_engine(eng), Workload()
        for lay in draw(model, cluster, engine, wl, per_case, seed=len(name) + len(gpus)):
            e = estimate(model, cluster, lay, wl, engine, Coefficients(), check_layout=False)
            out.append({"model": name, "gpus": gpus, "engine": eng, "layout": lay.to_dict(),
                        "terms": {k: float(f"{v:.13g}") for k, v in scalar_terms(e).items()}})
    with gzip.open(path, "wt", compresslevel=9) as f:
        json.dump(out, f, separators=(",", ":"))
    return len(out)


def test_every_term_equals_the_frozen_reference():
    ref = _reference()
    assert len(ref) >= 50 and {(r["model"], r["gpus"], r["engine"]) for r in ref} == set(CASES)
    groups: dict[tuple, list[dict]] = {}
    for r in ref:
        groups.setdefault((r["model"], r["gpus"], r["engine"]), []).append(r)
    for (name, gpus, eng), rows in groups.items():
        model, cluster, engine, wl = load_model(name), parse_cluster(gpus), get_engine(eng), Workload()
        lays = [layout_from_dict(r["layout"]) for r in rows]
        b = estimate_batch(model, cluster, LayoutColumns.from_layouts(lays), wl, engine, Coefficients())
        for i, (lay, r) in enumerate(zip(lays, rows)):
            got = {k: float(f"{v:.13g}") for k, v in batch_terms(b, i).items()}
            bad = mismatches(r["terms"], got)
            assert not bad, f"{name} {gpus} {eng} {lay.label()}: {bad[:5]}"


@pytest.mark.parametrize("name,gpus,eng", CASES)
def test_batch_equals_batches_of_one(name, gpus, eng):
    """A row's terms in a batch of 40 mixed layouts (other PP, VPP, recompute groups, shapes) equal its terms alone
    (``estimate()``: a batch of one, read through the typed records)."""
    model, cluster, engine, wl = load_model(name), parse_cluster(gpus), get_engine(eng), Workload()
    lays = draw(model, cluster, engine, wl, 40, seed=len(name) + len(gpus))
    assert len(lays) >= 30
    b = estimate_batch(model, cluster, LayoutColumns.from_layouts(lays), wl, engine)
    for i, lay in enumerate(lays):
        bad = mismatches(scalar_terms(estimate(model, cluster, lay, wl, engine, check_layout=False)), batch_terms(b, i))
        assert not bad, f"{lay.label()}: {bad[:5]}"


FP8 = ("fp8-delayed", "fp8-tensorwise", "fp8-blockwise")
# every recipe on the GPUs that run it (precision.hardware_refusal: fp8 from Hopper, mxfp8 / nvfp4 on Blackwell; CPU
# workers emulate all), engines with and without slime's replicated GDN projections, FP8 attention (Megatron-Bridge's
# MXFP8 recipes), and multi-token prediction: MiMo-7B's own MTP module, and the MTP knob on a GDN hybrid
LOW_CASES = [("Qwen3.6-27B", "8xH200", "slime", FP8, {}, 0), ("Qwen3.6-27B", "16xH100", "megatron", FP8, {}, 1),
             ("Llama-3.1-8B", "16xB200", "megatron-bridge", FP8 + ("mxfp8", "nvfp4"), {"fp8_attention": True}, 0),
             ("Qwen3.5-4B", "16xGB200", "megatron", ("mxfp8", "nvfp4"), {}, 0),
             ("Qwen2.5-7B", "64xH100", "slime", FP8, {}, 0), ("MiMo-7B", "8xH200", "slime", ("bf16",) + FP8, {}, 1),
             ("MiMo-7B", "16xB200", "megatron-bridge", ("mxfp8", "nvfp4"), {"fp8_attention": True}, 1),
             ("tiny-qwen3.5", "4xcpu", "torch", FP8 + ("mxfp8", "nvfp4"), {}, 1)]


@pytest.mark.parametrize("name,gpus,eng,recipes,knobs,mtp", LOW_CASES)
def test_low_precision_and_mtp_through_the_arrays(name, gpus, eng, recipes, knobs, mtp):
    """fp8 / mxfp8 / nvfp4 rows (GEMM speed, quantize passes, quantized saved inputs, the weight cache, fp8 params,
    scaling state, the cast and the fp8 all-gather) and MTP rows (the last stage's extra layer: time, memory, the
    loss's logits) in a batch of 36 equal their batches of one (``estimate()``) term by term; their values against the
    scalar composition: tests/test_batch_moe.py's frozen reference."""
    model, cluster, wl = load_model(name), parse_cluster(gpus), Workload()
    model = dataclasses.replace(model, mtp_layers=max(mtp, model.mtp_layers))
    engine = dataclasses.replace(get_engine(eng), **knobs)
    rng = np.random.default_rng(len(name) * 7 + len(gpus))
    lays = []
    for i, lay in enumerate(draw(model, cluster, engine, wl, 36, seed=len(name) + 11)):
        recipe = recipes[i % len(recipes)]
        gather = recipe.startswith("fp8") and bool(rng.integers(2))
        rec = dict(recompute_num_layers=1) if (mtp and lay.recompute_method == "uniform") else {}
        lays.append(dataclasses.replace(lay, mtp_layers=mtp * int(rng.integers(2) or i < 4), **rec,
                                        **fields_for(recipe, param_gather=gather)))
    b = estimate_batch(model, cluster, LayoutColumns.from_layouts(lays), wl, engine)
    for i, lay in enumerate(lays):
        bad = mismatches(scalar_terms(estimate(model, cluster, lay, wl, engine, check_layout=False)), batch_terms(b, i))
        assert not bad, f"{lay.label()}: {bad[:5]}"
    assert {lay.mtp_layers for lay in lays} == ({0, mtp} if mtp else {0})


def test_coefficients_as_estimate_chooses_them():
    """Without coef, the cluster's generation's fitted set (as estimate()); a given set is used as given."""
    model, cluster, engine, wl = load_model("Llama-3.1-8B"), parse_cluster("8xH200"), get_engine("megatron"), Workload()
    lays = draw(model, cluster, engine, wl, 5, seed=5)
    cols = LayoutColumns.from_layouts(lays)
    dflt = estimate_batch(model, cluster, cols, wl, engine)
    given = estimate_batch(model, cluster, cols, wl, engine, coef=DEFAULT)
    for i, lay in enumerate(lays):
        plain = estimate(model, cluster, lay, wl, engine, check_layout=False)
        assert dflt.step.step_time_s[i] == plain.perf.step_time_s
        ref = estimate(model, cluster, lay, wl, engine, coef=DEFAULT, check_layout=False)
        assert given.step.step_time_s[i] == ref.perf.step_time_s


def test_bubble_is_one_number():
    """The step is the critical stage's m microbatches + the one bubble + DP + optimizer + overhead."""
    model, cluster, engine, wl = load_model("Qwen3.6-27B"), parse_cluster("8xH200"), get_engine("slime"), Workload()
    b = estimate_batch(model, cluster, LayoutColumns.from_layouts(draw(model, cluster, engine, wl, 30, seed=6)),
                       wl, engine)
    rows = np.arange(len(b))
    crit = (b.time.forward_s + b.time.backward_s)[rows, b.step.critical_stage]
    s = b.step
    total = s.microbatches * crit + s.bubble_s + s.dp_comm_s + s.optimizer_s + s.overhead_s
    assert np.allclose(total, s.step_time_s, rtol=1e-12, atol=0)


def test_invalid_split_is_one_line():
    model, cluster, engine, wl = load_model("Qwen3.6-27B"), parse_cluster("8xH200"), get_engine("slime"), Workload()
    cols = LayoutColumns({"pp": np.array([4, 4]), "dp": np.array([2, 2]), "first": np.array([16, 17]),
                          "last": np.array([14, 14])})
    with pytest.raises(LayoutError, match="layer split"):
        estimate_batch(model, cluster, cols, wl, engine)


@given(st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_placement_arrays_equal_place(data):
    """Stage and chunk ranges, layer kinds, batching and in-flight microbatches of the array placement equal
    attune.spec.placement.place row by row (uneven first/last splits, VPP, layout strings, embedding/loss accounting,
    dynamic and static batching)."""
    model = load_model(data.draw(st.sampled_from(["Qwen3.6-27B", "Llama-3.1-8B", "Qwen3.5-4B"])))
    engine = get_engine(data.draw(st.sampled_from(["slime", "megatron"])))
    wl = Workload(global_batch=data.draw(st.sampled_from([64, 128, 96])))
    lays = []
    for _ in range(data.draw(st.integers(1, 6))):
        pp = data.draw(st.sampled_from([1, 2, 3, 4, 8]))
        vpp = data.draw(st.sampled_from([1, 2])) if pp > 1 else 1
        L = model.num_layers
        kw = dict(pp=pp, vpp=vpp, dp=data.draw(st.sampled_from([1, 2, 4])), cp=data.draw(st.sampled_from([1, 2])),
                  micro_batch_size=data.draw(st.sampled_from([1, 2])),
                  max_tokens_per_gpu=data.draw(st.sampled_from([None, 4096, 8192, 16384])))
        how = data.draw(st.sampled_from(["even", "split", "string", "account"]))
        if how == "split" and pp > 2:
            first = data.draw(st.integers(1, L // pp + 4))
            rest = L - first - (L // pp)
            ok = rest > 0 and rest % (pp - 2) == 0 and (rest // (pp - 2)) % vpp == 0
            if ok and first % vpp == 0 and (L // pp) % vpp == 0:
                kw.update(first=first, last=L // pp)
        elif how == "string":
            counts = [L // (pp * vpp)] * (pp * vpp)
            counts[-1] += L - sum(counts)
            kw["pipeline_layout"] = pipeline_layout.layout_string(counts)
        elif how == "account" and (L + 2) % (pp * vpp) == 0:
            kw.update(account_for_embedding=True, account_for_loss=True)
        lays.append(Layout(**kw))
    places = []
    for lay in list(lays):
        try:
            places.append(place(model, lay, wl, engine))
        except LayoutError:  # a split the model's layers do not allow: the scalar rule refuses it
            lays.remove(lay)
    if not lays:
        return
    pl = place_batch(model, LayoutColumns.from_layouts(lays), wl, engine)
    for i, (lay, ref) in enumerate(zip(lays, places)):
        assert pl.microbatches[i] == ref.batch.microbatches and pl.tokens_per_gpu[i] == ref.batch.tokens_per_gpu
        assert pl.rows_per_microbatch[i] == ref.batch.rows_per_microbatch
        for r, stg in enumerate(ref.stages):
            assert pl.inflight[i, r] == stg.inflight
            for c, ch in enumerate(stg.chunks):
                assert (pl.start[i, r, c], pl.stop[i, r, c]) == (ch.start, ch.stop)
                assert dict(zip(model.kinds, pl.kinds[i, r, c].tolist())) == {k: dict(ch.kinds).get(k, 0)
                                                                             for k in model.kinds}
        assert pl.stage[i].sum() == lay.pp and pl.chunk[i].sum() == lay.pp * lay.vpp


def test_stage_values_alone_equal_the_records():
    model, cluster, engine, wl = load_model("Qwen3.6-27B"), parse_cluster("8xH200"), get_engine("slime"), Workload()
    lays = draw(model, cluster, engine, wl, 20, seed=7)
    cols = LayoutColumns.from_layouts(lays)
    alone = estimate_batch(model, cluster, cols, wl, engine)
    got = {k: alone.stage_values(k) for k in ("total_gib", "recompute", "nccl_buffers")}
    b = estimate_batch(model, cluster, cols, wl, engine)
    assert np.array_equal(got["total_gib"], b.memory.total_gib)
    assert np.array_equal(got["recompute"], b.time.recompute)
    assert np.array_equal(got["nccl_buffers"], b.memory.overheads["nccl_buffers"])
    assert np.array_equal(b.stage_values("total_gib"), b.memory.total_gib)  # after the records are built
    assert set(np.unique(b.stage.sum(axis=1))) == {lay.pp for lay in lays} and b.stage.shape[1] == max(
        lay.pp for lay in lays)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    print(f"{write_reference()} layouts written to {REFERENCE}")
