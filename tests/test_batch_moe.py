"""The array engine covers MoE models (attune.estimator.batch_moe, issue 18): every term equals the frozen reference
the scalar composition wrote before its deletion (``tests/fixtures/estimate_reference_moe_lowp.json.gz``, rewritten
for a deliberate physics change by ``python tests/test_batch_moe.py --write``), and a row's terms in a batch equal its
batch of one (``estimate()``).

Random layouts of the bundled MoE models from the ``moe`` search space (EP, ETP, dispatcher, a2a overlap, optimizer
offload, full recompute), with MoE fields the space fixes flipped at random (VPP 2, grouped GEMM and permute fusion
off, shared-expert overlap, force balance, capacity factor, selective recompute of the MoE modules, activation
offload of the routed tensors, no precision-aware / distributed optimizer), on several clusters and engines (CUDA
graphs scoped and full included): every per-stage time part (``ep_comm``,
``moe_host``), memory term (expert weights, grads, optimizer states, activations), named overhead (DeepEP buffers,
the expert communicators' NCCL buffers) and step figure equals the reference within 1e-9 relative. The same with
low-precision GEMMs (fp8 on Hopper, mxfp8 / nvfp4 on Blackwell, Megatron-Bridge's fused grouped MLP) and multi-token
prediction (MoE-kind MTP layers: DeepSeek-V3, GLM), alone and together.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from attune.estimator import estimate, estimate_batch
from attune.estimator.batch_tables import merged_order
from attune.estimator.coefficients import Coefficients
from attune.search.space import SearchSpace, load_space
from attune.spec.columns import LayoutColumns
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.identity import layout_from_dict
from attune.spec.layout import Workload
from attune.spec.model import load_model
from attune.spec.precision import fields_for
from tests import test_batch_engine as dense
from tests.test_batch_engine import mismatches, scalar_terms

REFERENCE = Path(__file__).parent / "fixtures" / "estimate_reference_moe_lowp.json.gz"

MODULES = ("core_attn", "mlp", "moe", "moe_act", "shared_experts", "mla_up_proj")
OFFLOAD = ("qkv_linear", "core_attn", "attn_proj", "expert_fc1", "moe_act")
FLIPS = {"vpp": 2, "moe_ep_overlap": True, "moe_grouped_gemm": False, "moe_permute_fusion": False,
         "moe_shared_expert_overlap": True, "moe_force_balance": True, "moe_capacity_factor": 1.0,
         "precision_aware_optimizer": False, "distributed_optimizer": False, "overlap_grad_reduce": True,
         "micro_batch_size": 2}


def _subset(rng, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n in names if rng.random() < 0.4) or (names[int(rng.integers(len(names)))],)


def _moe_flips(rng) -> dict:
    flips = {k: v for k, v in FLIPS.items() if rng.random() < 0.15}
    if flips.get("vpp"):
        flips.update(first=None, last=None, pipeline_layout=None)
    if rng.random() < 0.3:
        flips.update(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None,
                     recompute_modules=_subset(rng, MODULES))
    if rng.random() < 0.2:
        flips["offload_modules"] = _subset(rng, OFFLOAD)
    return flips


def draw_moe(model, cluster, engine, wl, n: int, seed: int) -> list:
    """n random layouts of the moe space (with flips) that the estimator accepts."""
    base = load_space("moe")
    space = SearchSpace(name="batch-moe", path="", knobs=dict(base.knobs), fixed=dict(base.fixed))
    return dense.draw_from(space, model, cluster, engine, wl, n, seed, _moe_flips, 80)


def with_recipes(lays: list, recipes: tuple[str, ...], mtp: int, seed: int) -> list:
    """The layouts in turn in each of ``recipes`` (fp8 ones with --fp8-param-gather at random) and, with ``mtp``,
    with that many MTP layers on about half of them (uniform full recompute then recomputes 1 layer per group)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, lay in enumerate(lays):
        recipe = recipes[i % len(recipes)]
        kw = fields_for(recipe, param_gather=recipe.startswith("fp8") and bool(rng.integers(2)))
        if mtp and (i < 3 or rng.integers(2)):
            kw["mtp_layers"] = mtp
            if lay.recompute_method == "uniform":
                kw["recompute_num_layers"] = 1
        out.append(dataclasses.replace(lay, **kw))
    return out


def check(name: str, gpus: str, engine, n: int, seed: int, recipes: tuple[str, ...] = (), mtp: int = 0) -> None:
    model, cluster, wl = load_model(name), parse_cluster(gpus), Workload()
    lays = draw_moe(model, cluster, engine, wl, n, seed)
    assert len(lays) >= n * 2 // 3
    if recipes or mtp:
        lays = with_recipes(lays, recipes or ("bf16",), mtp, seed)
    cols = LayoutColumns.from_layouts(lays)
    b = estimate_batch(model, cluster, cols, wl, engine)
    for i, lay in enumerate(lays):
        bad = mismatches(scalar_terms(estimate(model, cluster, lay, wl, engine, check_layout=False)), b.terms(i))
        assert not bad, f"{name} {lay.label()}: {bad[:5]}"


CASES = [("Qwen3-30B-A3B", "8xH200", "slime"), ("Qwen3.5-35B-A3B", "8xH200", "slime"),
         ("DeepSeek-V3", "256xH200", "slime"), ("GPT-OSS-120B", "16xH100", "megatron-bridge"),
         ("GPT-OSS-20B", "8xB200", "megatron"), ("GLM-5.2-744B-A40B", "64xH200", "slime"),
         ("Kimi-K2", "128xH100", "megatron"), ("Qwen3-Next-80B-A3B", "16xH200", "slime"),
         ("Mixtral-8x7B", "16xGB200", "megatron-bridge"), ("Moonlight-16B-A3B", "16xH100", "megatron"),
         ("tiny-qwen3-moe", "4xcpu", "torch"), ("tiny-qwen3.5-moe", "2xcpu", "torch")]


@pytest.mark.parametrize("name,gpus,eng", CASES)
def test_moe_batch_equals_batches_of_one(name, gpus, eng):
    check(name, gpus, get_engine(eng), 24, seed=len(name) * 7 + len(gpus))


@pytest.mark.parametrize("graphs", ["scoped", "full"])
def test_moe_batch_with_cuda_graphs(graphs):
    """The host launch time a routing sync exposes (moe.host_exposed_s) under scoped and full CUDA graphs."""
    check("Qwen3-235B-A22B", "32xH100", dataclasses.replace(get_engine("megatron-bridge"), cuda_graphs=graphs), 16,
          seed=11)


FP8 = ("fp8-delayed", "fp8-tensorwise", "fp8-blockwise")
# MoE x low precision and MoE x MTP (issue 18): every recipe on the GPUs that run it, bf16 rows among them;
# Megatron-Bridge's MXFP8 recipes with TE's fused grouped MLP and FP8 attention; the MoE-kind MTP layers of
# DeepSeek-V3 and GLM (their last layer is an MoE layer), with and without low precision
LOW_CASES = [("Qwen3-30B-A3B", "8xH200", "slime", ("bf16",) + FP8, 0, {}),
             ("GPT-OSS-120B", "16xH100", "megatron", FP8, 0, {}),
             ("Qwen3.5-35B-A3B", "16xB200", "megatron-bridge", ("mxfp8", "nvfp4", "fp8-blockwise"), 0,
              {"fused_grouped_mlp": True, "fp8_attention": True}),
             ("Mixtral-8x7B", "16xGB200", "megatron-bridge", ("mxfp8", "nvfp4", "bf16"), 0, {"fused_grouped_mlp": True}),
             ("DeepSeek-V3", "256xH200", "slime", ("bf16",), 1, {}),
             ("DeepSeek-V3", "256xH200", "slime", FP8, 1, {}),
             ("GLM-5.2-744B-A40B", "64xH200", "megatron", ("bf16", "fp8-blockwise"), 1, {}),
             ("GLM-4.7-30B-A3B", "16xB200", "megatron-bridge", ("mxfp8", "nvfp4", "bf16"), 1,
              {"fused_grouped_mlp": True}),
             ("DeepSeek-V3-5layer", "4xcpu", "torch", ("fp8-delayed", "mxfp8", "nvfp4"), 1, {})]


@pytest.mark.parametrize("name,gpus,eng,recipes,mtp,knobs", LOW_CASES)
def test_moe_low_precision_and_mtp_equal_batches_of_one(name, gpus, eng, recipes, mtp, knobs):
    """The routed experts under a low-precision recipe (precision.moe_times on their grouped GEMMs, the quantized
    saved tensors, the expert parameters in the weight cache / fp8 params, the expert shard in the weight cast) and
    MoE-kind MTP layers (their routed experts' time, parameters, expert-DP and optimizer terms, activations) through
    the arrays: every term of a batch equal to the batch of one's (the values: the frozen reference)."""
    check(name, gpus, dataclasses.replace(get_engine(eng), **knobs), 18, seed=len(name) * 5 + len(recipes) + mtp,
          recipes=recipes, mtp=mtp)


def test_dense_and_moe_group_keys():
    """A dense model's kind tables are keyed by the shape alone; an MoE model's by the routed experts' fields too,
    so rows that differ only in, e.g., the dispatcher get their own routed-expert times."""
    model, cluster, engine, wl = load_model("Qwen3-30B-A3B"), parse_cluster("8xH200"), get_engine("slime"), Workload()
    lays = draw_moe(model, cluster, engine, wl, 3, seed=2)
    lay = dataclasses.replace(lays[0], ep=8, etp=1, moe_dispatcher="alltoall")
    rows = [lay, dataclasses.replace(lay, moe_dispatcher="flex"), dataclasses.replace(lay, moe_ep_overlap=True)]
    b = estimate_batch(model, cluster, LayoutColumns.from_layouts(rows), wl, engine)
    ep = b.time.ep_comm[:, 0]
    assert ep[0] > 0 and len(set(ep.tolist())) == 3
    for i, r in enumerate(rows):
        assert not mismatches(scalar_terms(estimate(model, cluster, r, wl, engine, check_layout=False)), b.terms(i))


def test_overhead_names_keep_every_rows_order():
    """The fixed overheads of rows with and without DeepEP's buffers and TP overlap's are merged in an order that
    keeps each row's own (memory._fixed_overheads adds deepep_buffers before tp_overlap_buffers), whichever row comes
    first; orders that contradict each other are refused."""
    rows = [["cuda_context", "nccl_buffers", "deepep_buffers"], ["cuda_context", "nccl_buffers", "tp_overlap_buffers"],
            ["cuda_context", "nccl_buffers", "deepep_buffers", "tp_overlap_buffers"]]
    for order in (rows, rows[::-1], [rows[1], rows[0], rows[2]]):
        got = merged_order(order)
        assert got == ["cuda_context", "nccl_buffers", "deepep_buffers", "tp_overlap_buffers"]
    with pytest.raises(AssertionError, match="no merge"):
        merged_order([["a", "b"], ["b", "a"]])


def reference_cases() -> list[tuple]:
    """(model, gpus, engine, engine knobs, model MTP layers, layouts) of the frozen MoE / low-precision / MTP reference:
    a few layouts of every case above and of test_batch_engine's low-precision cases, drawn as those tests draw."""
    out = []
    for name, gpus, eng in CASES:
        model, cluster = load_model(name), parse_cluster(gpus)
        lays = draw_moe(model, cluster, get_engine(eng), Workload(), 4, seed=len(name) * 7 + len(gpus))
        out.append((name, gpus, eng, {}, None, lays))
    for graphs in ("scoped", "full"):
        knobs = {"cuda_graphs": graphs}
        engine = dataclasses.replace(get_engine("megatron-bridge"), **knobs)
        lays = draw_moe(load_model("Qwen3-235B-A22B"), parse_cluster("32xH100"), engine, Workload(), 3, seed=11)
        out.append(("Qwen3-235B-A22B", "32xH100", "megatron-bridge", knobs, None, lays))
    for name, gpus, eng, recipes, mtp, knobs in LOW_CASES:
        model, cluster = load_model(name), parse_cluster(gpus)
        seed = len(name) * 5 + len(recipes) + mtp
        engine = dataclasses.replace(get_engine(eng), **knobs)
        lays = with_recipes(draw_moe(model, cluster, engine, Workload(), 6, seed), recipes, mtp, seed)
        out.append((name, gpus, eng, knobs, None, lays))
    for name, gpus, eng, recipes, knobs, mtp in dense.LOW_CASES:
        model, cluster = load_model(name), parse_cluster(gpus)
        model_mtp = max(mtp, model.mtp_layers)
        model = dataclasses.replace(model, mtp_layers=model_mtp)
        engine = dataclasses.replace(get_engine(eng), **knobs)
        lays = dense.draw(model, cluster, engine, Workload(), 8, seed=len(name) + 11)
        rng = np.random.default_rng(len(name) * 7 + len(gpus))
        lays = [dataclasses.replace(lay, mtp_layers=mtp * int(rng.integers(2) or i < 4),
                                    **(dict(recompute_num_layers=1) if mtp and lay.recompute_method == "uniform"
                                       else {}),
                                    **fields_for(recipes[i % len(recipes)],
                                                 param_gather=recipes[i % len(recipes)].startswith("fp8")
                                                 and bool(rng.integers(2))))
                for i, lay in enumerate(lays)]
        out.append((name, gpus, eng, knobs, model_mtp, lays))
    return out


def _target(name: str, model_mtp, eng: str, knobs: dict):
    model = load_model(name)
    if model_mtp is not None:
        model = dataclasses.replace(model, mtp_layers=model_mtp)
    return model, dataclasses.replace(get_engine(eng), **knobs)


def write_reference(path: Path = REFERENCE) -> int:
    """Rewrite the frozen reference from this tree (a deliberate physics change): every term ``estimate()`` gives
    the layouts of ``reference_cases`` at the coefficients' source values (``Coefficients()``), 13 digits."""
    out = []
    for name, gpus, eng, knobs, model_mtp, lays in reference_cases():
        model, engine = _target(name, model_mtp, eng, knobs)
        cluster = parse_cluster(gpus)
        for lay in lays:
            e = estimate(model, cluster, lay, Workload(), engine, Coefficients(), check_layout=False)
            out.append({"model": name, "gpus": gpus, "engine": eng, "knobs": knobs, "model_mtp": model_mtp,
                        "layout": lay.to_dict(),
                        "terms": {k: float(f"{v:.13g}") for k, v in scalar_terms(e).items()}})
    with gzip.open(path, "wt", compresslevel=9) as f:
        json.dump(out, f, separators=(",", ":"))
    return len(out)


def test_moe_low_precision_mtp_equal_the_frozen_reference():
    """MoE (EP, ETP, dispatchers, CUDA graphs), low-precision (fp8 / mxfp8 / nvfp4, fp8 param gather, FP8 attention,
    the fused grouped MLP) and MTP rows, estimated as one batch per target, equal every term the scalar composition
    of 4bd23b5 (before it was deleted; byte-equal to bb2a96d's) gave them at ``Coefficients()``."""
    with gzip.open(REFERENCE, "rt") as f:
        ref = json.load(f)
    assert len(ref) >= 150 and {r["model"] for r in ref} >= {"DeepSeek-V3", "GPT-OSS-120B", "MiMo-7B"}
    assert any(r["layout"]["mtp_layers"] for r in ref) and any(r["layout"]["ep"] > 1 for r in ref)
    groups: dict[str, list[dict]] = {}
    for r in ref:
        groups.setdefault(json.dumps([r["model"], r["gpus"], r["engine"], r["knobs"], r["model_mtp"]]), []).append(r)
    for key, rows in groups.items():
        name, gpus, eng, knobs, model_mtp = json.loads(key)
        model, engine = _target(name, model_mtp, eng, knobs)
        lays = [layout_from_dict(r["layout"]) for r in rows]
        b = estimate_batch(model, parse_cluster(gpus), LayoutColumns.from_layouts(lays), Workload(), engine,
                           Coefficients())
        for i, (lay, r) in enumerate(zip(lays, rows)):
            got = {k: float(f"{v:.13g}") for k, v in b.terms(i).items()}
            bad = mismatches(r["terms"], got)
            assert not bad, f"{name} {gpus} {eng} {lay.label()}: {bad[:5]}"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    print(f"{write_reference()} layouts written to {REFERENCE}")
