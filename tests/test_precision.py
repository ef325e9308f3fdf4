"""Low precision as a numerics knob (issue 22): the layout fields and their flags, the rules, the memory and time
terms, the corpus rows and the low-precision fit stage (tested on series it was not fitted to)."""

from dataclasses import replace

import pytest

from attune.calibrate.corpus import default_corpus_dir, load_corpus, read_row
from attune.calibrate.fit import current
from attune.calibrate.precision_fit import fit_precision, precision_params
from attune.calibrate.report import predict_row, scores
from attune.errors import FlagError, LayoutError
from attune.estimator import estimate
from attune.spec.engine import get_engine
from attune.spec.flags import flag_table, from_flags, to_flags
from attune.spec.hardware import parse_cluster
from attune.spec.layout import FP8_FORMATS, FP8_RECIPES, Layout, Workload
from attune.spec.model import from_geometry, load_model
from attune.spec.precision import fields_for, hardware_refusal, precision_rules, recipe_of, slime_env

CORPUS = default_corpus_dir()
needs_corpus = pytest.mark.skipif(CORPUS is None, reason="shared/measurements is not beside this checkout")

# Nemotron-4 15B on 16 H100 as NeMo ran it (dense.yaml geometry), TP 4
NEMO = from_geometry(name="Nemotron-4 15B", layers=32, hidden=6144, ffn=24576, heads=48, kv_heads=8, vocab=256000,
                     mlp="squared_relu", seq_length=4096)
BASE = Layout(tp=4, sp=True, dp=4, micro_batch_size=4, distributed_optimizer=True)
WL = Workload(seq_length=4096, global_batch=64)


def _est(layout, gpus="16xH100", engine="megatron-bridge", model=NEMO, wl=WL):
    return estimate(model, parse_cluster(gpus), layout, wl, get_engine(engine))


# ---------------------------------------------------------------------- flags and rules
def test_flags_mirror_megatron_choices_and_round_trip():
    t = flag_table()
    # Megatron-LM 1dcf0daf transformer_config.py:434-441 Literal choices (custom: parsed, not modelled)
    assert t["--fp8-format"].choices == FP8_FORMATS == ("e4m3", "hybrid")
    assert set(t["--fp8-recipe"].choices) == set(FP8_RECIPES) | {"custom"} and t["--fp8-recipe"].default == "delayed"
    assert t["--fp4-format"].choices == ("e2m1",) and t["--fp8-param-gather"].arity == "switch"
    assert all(t[f].cls == "numerics" for f in ("--fp8-format", "--fp8-recipe", "--fp8-param-gather", "--fp4-format"))
    m = load_model("Qwen3.6-27B")
    lay = from_flags("--bf16 --use-distributed-optimizer --fp8-format e4m3 --fp8-recipe blockwise --fp8-param-gather",
                     m, 8).layout
    assert recipe_of(lay) == "fp8-blockwise" and lay.fp8_param_gather
    argv = to_flags(lay)
    assert argv[argv.index("--fp8-recipe") + 1] == "blockwise" and "--fp8-param-gather" in argv
    assert from_flags(argv, m, 8).layout == lay
    # the recipe without the format does nothing (Megatron reads fp8_recipe only with fp8): not written back
    bare = from_flags("--fp8-recipe mxfp8", m, 8).layout
    assert recipe_of(bare) == "bf16" and "--fp8-recipe" not in to_flags(bare)
    with pytest.raises(FlagError, match="expected one of e4m3, hybrid"):
        from_flags("--fp8-format e5m2", m, 8)
    with pytest.raises(LayoutError, match="not modelled"):
        from_flags("--fp8-format e4m3 --fp8-recipe custom", m, 8)


def test_rules_from_megatron_and_slime():
    assert precision_rules(Layout(**fields_for("fp8-blockwise", param_gather=True))) == []
    no_dist = Layout(distributed_optimizer=False, **fields_for("fp8-delayed", param_gather=True))
    assert any("distributed optimizer" in e for e in precision_rules(no_dist))
    cpu_adam = Layout(precision_aware_optimizer=True, optimizer_cpu_offload=True,
                      **fields_for("fp8-blockwise", param_gather=True))
    assert any("CPU Adam" in e for e in precision_rules(cpu_adam))
    both = Layout(fp8_format="e4m3", fp4_format="e2m1")
    assert any("cannot be used together" in e for e in precision_rules(both))
    moe_act = Layout(recompute_granularity="selective", recompute_modules=("moe_act",), **fields_for("fp8-delayed"))
    assert any("delayed fp8 scaling does not support moe_act" in e for e in precision_rules(moe_act))
    assert not precision_rules(replace(moe_act, fp8_recipe="tensorwise"))
    # hardware: mxfp8 and nvfp4 on Blackwell only, fp8 from Hopper; CPU workers emulate
    assert hardware_refusal(Layout(**fields_for("mxfp8")), "hopper") is not None
    assert hardware_refusal(Layout(**fields_for("mxfp8")), "blackwell") is None
    assert hardware_refusal(Layout(**fields_for("fp8-delayed")), "ampere") is not None
    assert hardware_refusal(Layout(**fields_for("nvfp4")), "", is_cpu=True) is None
    with pytest.raises(LayoutError, match="needs a Blackwell GPU"):
        _est(replace(BASE, **fields_for("mxfp8")))
    assert slime_env(Layout(**fields_for("fp8-blockwise"))) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    assert slime_env(Layout(**fields_for("fp8-tensorwise"))) == {}


# ---------------------------------------------------------------------- memory and time
def test_memory_terms_per_recipe():
    bf = _est(BASE).memory.stages[0]
    assert not any(k.startswith("low_precision") for k in bf.overheads)
    ts = _est(replace(BASE, **fields_for("fp8-tensorwise"))).memory.stages[0]
    dl = _est(replace(BASE, **fields_for("fp8-delayed", param_gather=True))).memory.stages[0]
    # the activations TE keeps in fp8: the GEMM-only inputs (ln_out, fc2 input) at 1 byte, an fp8 copy of the
    # FlashAttention output beside the bf16 one: fewer bytes overall
    assert ts.activations_gib < bf.activations_gib
    # Hopper tensor-scaled fp8: row-wise + transposed weight caches, 1 byte each, for the decoder linears only
    cache = ts.overheads["low_precision_weight_cache"]
    assert cache == pytest.approx(2 * (bf.params - NEMO.embedding_params / 4 - NEMO.hidden * NEMO.vocab / 4) / 2**30,
                                  rel=0.02)
    # --fp8-param-gather: the parameter is the row-wise copy (one cache fewer, the bf16 weight gone)
    assert dl.overheads["low_precision_weight_cache"] == pytest.approx(cache / 2, rel=1e-6)
    assert dl.overheads["low_precision_params"] == pytest.approx(-cache / 2, rel=1e-6)
    assert 0 < dl.overheads["low_precision_scaling"] < 0.01  # amax history 1: kilobytes
    assert dl.allocated_gib < ts.allocated_gib


def test_time_fp8_gemms_faster_attention_unchanged_quantize_priced():
    bf = _est(BASE).perf
    f8 = _est(replace(BASE, **fields_for("fp8-delayed"))).perf
    assert f8.tokens_per_s_per_gpu > 1.2 * bf.tokens_per_s_per_gpu
    b, f = bf.breakdown.compute_s, f8.breakdown.compute_s
    assert f["fwd_gemm"] < 0.8 * b["fwd_gemm"]
    assert f["fwd_attention"] == pytest.approx(b["fwd_attention"]) and f["fwd_memory"] > b["fwd_memory"]
    # tensorwise current scaling reads each input once more for its amax: more memory-bound time than delayed
    ts = _est(replace(BASE, **fields_for("fp8-tensorwise"))).perf
    assert ts.breakdown.compute_s["fwd_memory"] > f["fwd_memory"]
    # fp8 param gather: the DP all-gather moves one byte per parameter
    pg = _est(replace(BASE, dp=16, **fields_for("fp8-delayed", param_gather=True)), gpus="64xH100",
              wl=Workload(seq_length=4096, global_batch=256)).perf
    no = _est(replace(BASE, dp=16, **fields_for("fp8-delayed")), gpus="64xH100",
              wl=Workload(seq_length=4096, global_batch=256)).perf
    assert pg.dp_comm_s < no.dp_comm_s
    # TE userbuffers hide the TP collectives under the GEMMs: shorter fp8 GEMMs hide less of them
    ov = replace(BASE, tp_comm_overlap=True)
    assert (_est(replace(ov, **fields_for("fp8-delayed"))).perf.breakdown.exposed_comm_s["tp"]
            >= _est(ov).perf.breakdown.exposed_comm_s["tp"])
    # on CPU workers the casts are emulated around fp32 GEMMs: never faster
    tiny = load_model("tiny-llama")
    cpu = dict(gpus="2xcpu", engine="torch", model=tiny, wl=Workload(seq_length=256, global_batch=4))
    lay = Layout(dp=2)
    assert (_est(replace(lay, **fields_for("fp8-delayed")), **cpu).perf.tokens_per_s_per_gpu
            <= _est(lay, **cpu).perf.tokens_per_s_per_gpu)


def test_slime_gdn_projections_stay_bf16():
    # slime's Qwen3.5 GDN mixer is plain nn.Linear: only the MLP linears of those layers are fp8
    m = load_model("Qwen3.6-27B")
    lay = Layout(pp=4, dp=2, distributed_optimizer=True, recompute_granularity="full", recompute_method="block",
                 recompute_num_layers=12, max_tokens_per_gpu=8192)
    wl = Workload()
    bf = _est(lay, gpus="8xH200", engine="slime", model=m, wl=wl)
    f8 = _est(replace(lay, **fields_for("fp8-blockwise")), gpus="8xH200", engine="slime", model=m, wl=wl)
    assert f8.perf.breakdown.compute_s["fwd_gdn"] == pytest.approx(bf.perf.breakdown.compute_s["fwd_gdn"])
    assert 1.0 < f8.perf.tokens_per_s_per_gpu / bf.perf.tokens_per_s_per_gpu < 1.6


# ---------------------------------------------------------------------- corpus rows and the fit stage
def test_corpus_recipe_per_source():
    row = dict(id="x", series="s", model=dict(name="Nemotron-4 15B", layers=32, hidden=6144, ffn=24576, heads=48,
                                             kv_heads=8, vocab=256000, mlp="squared_relu"),
               engine="NeMo (Megatron-Core)", gpu="H100-SXM-80GB (DGX-H100)", num_gpus=16, precision="fp8",
               precision_class="fp8", low_precision=True, seq_len=4096, global_batch=64, micro_batch=4, tp=4, pp=1,
               vpp=None, cp=1, dp=4, sp=None, recompute=None, dist_optimizer=None,
               measured=dict(metric="step_time_s", value=2.0), source=dict(url="hand-made"))
    r = read_row(row, "dense.yaml")
    assert r.expressed and recipe_of(r.layout) == "fp8-delayed" and r.layout.fp8_param_gather
    assert r.layout.fp8_format == "hybrid" and any("bf16_with_fp8_mixed" in a for a in r.assumptions)
    mb = read_row({**row, "engine": "Megatron-Bridge (NeMo, Megatron-Core)", "precision": "fp8-cs"}, "dense.yaml")
    assert recipe_of(mb.layout) == "fp8-tensorwise"
    sc = read_row({**row, "engine": "Megatron-Bridge (NeMo, Megatron-Core)", "precision": "FP8-SC"}, "dense.yaml")
    assert recipe_of(sc.layout) == "fp8-blockwise"
    mlm = read_row({**row, "engine": "Megatron-LM (Megatron-Core)"}, "dense.yaml")
    assert recipe_of(mlm.layout) == "fp8-delayed" and not mlm.layout.fp8_param_gather  # Megatron's default recipe
    mx = read_row({**row, "precision_class": "mxfp8", "gpu": "B200 (DGX-B200)", "num_gpus": 16}, "dense.yaml")
    assert recipe_of(mx.layout) == "mxfp8"
    on_hopper = read_row({**row, "precision_class": "mxfp8"}, "dense.yaml")
    assert not on_hopper.expressed and "Blackwell" in on_hopper.reason
    assert read_row({**row, "precision_class": "nvfp4"}, "dense.yaml").reason.startswith("not modelled: nvfp4")


@needs_corpus
def test_fit_stage_moves_only_precision_coefficients_and_predicts_held_out_series():
    corpus = load_corpus(CORPUS, include_seed=False)
    low = [r for r in corpus.expressed if r.low_precision]
    assert {r.precision for r in low} == {"fp8", "mxfp8"}
    held = "dgxc-v24.11.1-gpt3-175b-fp8-h100-weak"
    start = current()
    params = precision_params(corpus, start)
    assert {p.name for p in params} <= {"fp8_gemm_efficiency", "fp8_blockwise_gemm_ratio", "mxfp8_gemm_efficiency",
                                        "fp8_attention_speedup"}
    dense_low = [r for r in low if r.model.moe is None]
    res = fit_precision(corpus, start, [r for r in dense_low if r.series != held])
    assert held not in res.series
    # a bf16 coefficient did not move
    assert res.coefficients.for_row(dense_low[0]).gemm_efficiency == start.for_row(dense_low[0]).gemm_efficiency
    preds = [predict_row(r, res.coefficients.for_row(r)) for r in dense_low if r.series == held]
    mape = sum(abs(p.error) for p in preds) / len(preds)
    assert mape < 0.10, f"held-out fp8 series {held}: {100 * mape:.1f}%"
    fp8 = next(s for s in scores([predict_row(r, res.coefficients.for_row(r)) for r in dense_low]) if s.series == "fp8")
    assert fp8.mape < 0.10


@needs_corpus
def test_bf16_vs_fp8_pairs_of_the_same_layout():
    # the same NeMo release, model, GPUs and layout in bf16 and fp8: the predicted speed-up is the precision
    # model alone (everything else cancels)
    corpus = load_corpus(CORPUS, include_seed=False)
    by_id = {r.id: r for r in corpus.expressed}
    for size in ("16g", "2048g"):
        f8 = by_id[f"dgxc-v24.11.1-nemotron4-15b-fp8-h100-{size}"]
        bf = by_id[f"dgxc-v24.11.1-nemotron4-15b-bf16-h100-{size}"]
        assert replace(f8.layout, **fields_for("bf16")) == bf.layout
        measured = f8.tokens_per_s_per_gpu / bf.tokens_per_s_per_gpu
        predicted = predict_row(f8).tokens_per_s_per_gpu / predict_row(bf).tokens_per_s_per_gpu
        assert predicted == pytest.approx(measured, rel=0.08)


# ---------------------------------------------------------------------- search
def test_allow_numerics_values():
    from attune.errors import UserInputError
    from attune.search.precision_search import allowed_recipes
    assert allowed_recipes(["fp8"]) == ("fp8-delayed", "fp8-tensorwise", "fp8-blockwise", "mxfp8")
    assert allowed_recipes(["mxfp8,fp8-blockwise"]) == ("fp8-blockwise", "mxfp8")
    assert allowed_recipes([]) == ()
    with pytest.raises(UserInputError, match="--allow-numerics 'fp9': allowed fp8"):
        allowed_recipes(["fp9"])


def test_tune_reports_best_bf16_and_best_low_precision(tmp_path):
    from attune.api.tune import tune
    res = tune(model="tiny-llama", gpus="8xH100", search_space="small", out=tmp_path, allow_numerics=["fp8"])
    low = res.low_precision
    assert low is not None and low.low is not None and "mxfp8" not in low.recipes  # Hopper: no MXFP8
    assert any("mxfp8" in r for r in low.refused)
    assert recipe_of(low.low.layout) != "bf16" and recipe_of(low.bf16.layout) == "bf16"
    # tiny-llama's 128-wide GEMMs gain little at the fp8 peak and its quantize passes (both orientations on Hopper)
    # cost about as much: the best fp8 layout is within 2% of the same layout in bf16 (the step is mostly overhead)
    assert low.low.memory.fits
    assert low.low.perf.tokens_per_s_per_gpu == pytest.approx(low.same_layout_bf16.perf.tokens_per_s_per_gpu, rel=0.02)
    text = res.report_path.read_text()
    assert "## Low precision" in text and "best low precision" in text and "--fp8-format e4m3" in text
    assert any(line.startswith("best low precision:") for line in res.summary_lines())
    # without the option the study is bf16 only and the report has no such section
    plain = tune(model="tiny-llama", gpus="8xH100", search_space="small", out=tmp_path / "plain")
    assert plain.low_precision is None and "## Low precision" not in plain.report_path.read_text()
    assert recipe_of(plain.outcome.best.to_layout()) == "bf16"


# ---------------------------------------------------------------------- slime launch
def test_slime_launch_writes_the_low_precision_flags_and_environment():
    from attune.runners.slime.launch import LaunchError, slime_command
    m, c = load_model("Qwen3.6-27B"), parse_cluster("8xH200")
    lay = Layout(pp=4, dp=2, first=16, last=14, recompute_granularity="full", recompute_method="block",
                 recompute_num_layers=12, max_tokens_per_gpu=8192, **fields_for("fp8-blockwise", param_gather=True))
    cmd = slime_command(m, c, lay, Workload())
    argv = [str(a) for a in cmd.argv]
    # slime docs/en/advanced/low-precision.md:65-70: --fp8-format e4m3 --fp8-recipe blockwise, fp32 block scales
    assert argv[argv.index("--fp8-format") + 1] == "e4m3" and argv[argv.index("--fp8-recipe") + 1] == "blockwise"
    assert "--fp8-param-gather" in argv and cmd.env["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == "1"
    # the flags read back to the same layout through the one flag codec
    back = from_flags(argv[2:], m, 8).layout
    assert recipe_of(back) == "fp8-blockwise" and back.fp8_param_gather
    ts = slime_command(m, c, replace(lay, **fields_for("fp8-tensorwise")), Workload())
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES" not in ts.env and "--fp8-param-gather" not in ts.argv
    with pytest.raises(LaunchError, match="needs a Blackwell GPU"):
        slime_command(m, c, replace(lay, **fields_for("mxfp8")), Workload())
    cpu_adam = replace(lay, precision_aware_optimizer=True, optimizer_cpu_offload=True)
    with pytest.raises(LaunchError, match="not compatible with CPU Adam"):
        slime_command(m, c, cpu_adam, Workload())


@needs_corpus
def test_pairs_of_the_same_release_and_layout_in_the_report():
    from attune.calibrate.precision_fit import pairs, pairs_markdown
    from attune.calibrate.report import predict
    corpus = load_corpus(CORPUS, include_seed=False)
    preds = predict(corpus)
    ps = pairs(preds)
    dense = [q for q in ps if q.low.row.model.moe is None]
    assert len(dense) >= 40 and all(q.low.row.cluster.spec == q.bf16.row.cluster.spec for q in ps)
    err = sum(abs(q.predicted / q.measured - 1) for q in dense) / len(dense)
    assert err < 0.06  # the precision model alone: everything else cancels within a pair
    assert "## bf16 vs low precision" in pairs_markdown(preds)


def test_low_precision_best_is_written_as_a_recipe(tmp_path):
    from attune.api.tune import tune
    from attune.recipe import lint, load_recipe
    from attune.recipe.target import recipe_target
    res = tune(model="tiny-llama", gpus="8xH100", search_space="small", out=tmp_path, allow_numerics=["fp8-blockwise"])
    path = res.low_precision_recipe_path
    assert path is not None and path.name == "recipe-fp8-blockwise.yaml"
    r = load_recipe(path)
    assert r["status"] == "predicted" and r["correctness"]["result"] == "not_run"
    assert not [f for f in lint(r) if f.severity == "error"]
    assert "--fp8-recipe blockwise" in r["run"] and r["env"].get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES") == "1"
    back = recipe_target(r).layout
    assert recipe_of(back) == "fp8-blockwise" and back == res.low_precision.low.layout
    assert r["result"]["tokens_per_s_per_gpu"] == pytest.approx(res.low_precision.low.perf.tokens_per_s_per_gpu, rel=1e-3)
