"""Issue 15: knobs beyond the seed (pipeline layout strings, module recompute, activation offload, overlap)."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import pytest
import yaml

from attune.errors import LayoutError
from attune.recipe import lint, parse_run
from attune.recipe.codec import from_recipe_blocks, to_recipe_block
from attune.recipe.models import schema_errors
from attune.runners.slime.launch import LaunchError, command_for_recipe, slime_command
from attune.spec.engine import get_engine
from attune.spec.flags import from_flags, to_flags
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import load_model
from attune.spec.pipeline_layout import (
    accounted_stage_counts,
    check_layout_string,
    expand,
    layout_string,
    pattern_counts,
)
from attune.spec.placement import batching, chunk_ranges, stage_layer_counts
from attune.spec.rules import check

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "tests" / "fixtures" / "seed_recipe.yaml"
SLIME = get_engine("slime")
MEGATRON = get_engine("megatron")
WL = Workload(seq_length=4096, global_batch=16)


# ------------------------------------------------------------------ the layout string
def test_expand_repeats_and_groups():
    assert expand("Et*2|(t*3|)*2tL") == ("Ett", "ttt", "ttt", "tL")
    assert layout_string([15, 16, 16, 16, 16, 16, 16, 15]) == "Et*15|(t*16|)*6t*15L"
    assert expand(layout_string([3, 1, 0, 2])) == ("Ettt", "t", "", "ttL")


@pytest.mark.parametrize("text, needle", [
    ("Et*3|x|tL", "symbol 'x'"),
    ("Et*|tL", "needs a repeat count"),
    ("E(t*3|tL", "unmatched '('"),
    ("Et*3)|tL", "unmatched ')'"),
])
def test_bad_syntax_is_one_line(text, needle):
    msg = check_layout_string(text, 2, 1, 4)
    assert len(msg) == 1 and needle in msg[0] and "\n" not in msg[0]


@pytest.mark.parametrize("text, pp, vpp, needle", [
    ("Et*3|t*4|t*4|t*5L", 2, 1, "has 4 stage(s); PP 2 x VPP 1 needs 2"),
    ("Et*3|t*5L", 2, 1, "places 8 transformer layers; the model has 16"),
    ("t*8|Et*8L", 2, 1, "exactly one E, at the start of the first stage"),
    ("Et*8L|t*8", 2, 1, "exactly one L, at the end of the last stage"),
])
def test_megatron_layout_rules(text, pp, vpp, needle):
    assert any(needle in m for m in check_layout_string(text, pp, vpp, 16))


def test_vpp_chunks_follow_megatron_order():
    L = Layout(pp=2, vpp=2, pipeline_layout="Et*3|t*4|t*4|t*5L")
    assert chunk_ranges(L, 16) == [[(0, 3), (7, 11)], [(3, 7), (11, 16)]]
    assert stage_layer_counts(L, 16) == [7, 9]


def test_accounting_for_embedding_and_loss():
    assert accounted_stage_counts(126, 8, 1, True, True) == [15, 16, 16, 16, 16, 16, 16, 15]
    assert accounted_stage_counts(63, 4, 1, False, True) == [16, 16, 16, 15]
    with pytest.raises(LayoutError, match="must divide evenly over PP x VPP = 4"):
        accounted_stage_counts(64, 4, 1, True, False)


def test_pattern_counts_move_layers_to_the_middle():
    assert pattern_counts(64, 4, 2, 3) == [14, 19, 18, 13]
    assert sum(pattern_counts(126, 8, 1, 2)) == 126
    assert pattern_counts(64, 2, 1, 1) is None


# ------------------------------------------------------------------ 405B on PP 8
def test_llama_405b_on_pp8_is_accepted_the_way_megatron_runs_it():
    m = load_model("Llama-3.1-405B")
    assert m.num_layers == 126 and 400e9 < m.total_params < 410e9
    # the even split refuses 126 / 8 ...
    assert check(Layout(pp=8, dp=1), m, 8, WL, MEGATRON)
    # ... the embedding / loss accounting and an explicit layout string run it
    for L in (Layout(pp=8, dp=1, account_for_embedding=True, account_for_loss=True),
              Layout(pp=8, dp=1, pipeline_layout="Et*15|(t*16|)*6t*15L"),
              Layout(pp=8, dp=1, vpp=2, pipeline_layout=layout_string([7] + [8] * 14 + [7]))):
        assert check(L, m, 8, WL, MEGATRON) == [], L
        assert sum(stage_layer_counts(L, m.num_layers)) == 126


def test_rule_messages_are_one_line_and_name_the_conflict():
    m = load_model("Llama-3.1-8B")
    L = Layout(pp=2, dp=4, first=15, pipeline_layout="Et*15|t*17L")
    msgs = check(L, m, 8, WL, MEGATRON)
    assert any("cannot be combined with --decoder-first/last-pipeline-num-layers" in x for x in msgs)
    msgs = check(Layout(pp=2, dp=4, first=15, account_for_loss=True), m, 8, WL, MEGATRON)
    assert any("--account-for-embedding/loss-in-pipeline-split cannot be combined" in x for x in msgs)
    q = load_model("Qwen3.6-27B")
    msgs = check(Layout(pp=4, dp=2, pipeline_layout="Et*16|t*17|t*17|t*14L"), q, 8, WL, SLIME)
    assert any("slime's Qwen3.5 spec asserts" in x for x in msgs)
    assert check(Layout(pp=4, dp=2, pipeline_layout="Et*16|t*17|t*17|t*14L"), q, 8, WL, MEGATRON) == []
    msgs = check(Layout(pp=2, dp=4, recompute_granularity="full", recompute_method="block", recompute_num_layers=2,
                        recompute_modules=("mlp",)), m, 8, WL, MEGATRON)
    assert any("--recompute-modules needs --recompute-granularity selective" in x for x in msgs)
    msgs = check(Layout(pp=2, dp=4, recompute_granularity="selective", recompute_modules=("mlp", "attn")), m, 8, WL,
                 MEGATRON)
    assert any("recompute module(s) attn; allowed: core_attn" in x for x in msgs)
    msgs = check(Layout(pp=2, dp=4, recompute_granularity="selective", recompute_modules=("moe_act",)), m, 8, WL,
                 MEGATRON)
    assert any("need a mixture-of-experts model" in x for x in msgs)
    msgs = check(Layout(pp=2, dp=4, offload_modules=("mlp",)), m, 8, WL, MEGATRON)
    assert any("offload module(s) mlp; allowed: attn_norm" in x for x in msgs)
    msgs = check(Layout(pp=2, dp=4, offload_modules=("attn_proj",)), m, 8, WL, MEGATRON)
    assert any("offload module attn_proj needs core_attn too" in x for x in msgs)
    assert all("\n" not in x for x in msgs)


# ------------------------------------------------------------------ round trips
KNOBBED = Layout(pp=4, dp=2, pipeline_layout="Et*19|t*21|t*21|t*19L", recompute_granularity="selective",
                 recompute_modules=("core_attn", "mlp"), distributed_optimizer=True)


def test_flags_round_trip_custom_layout_and_module_recompute():
    m = load_model("Llama-3.1-70B")
    words = to_flags(KNOBBED, WL)
    assert words[words.index("--pipeline-model-parallel-layout") + 1] == "Et*19|t*21|t*21|t*19L"
    i = words.index("--recompute-modules")
    assert words[i + 1:i + 3] == ["core_attn", "mlp"]
    assert "--num-virtual-stages-per-pipeline-rank" not in words
    assert from_flags(words, m, 8).layout == KNOBBED
    # VPP comes from the stage count
    vpp = Layout(pp=2, dp=4, pipeline_layout=layout_string([10, 10, 10, 10, 10, 10, 10, 10]))
    got = from_flags(to_flags(vpp, WL), m, 8).layout
    assert got.vpp == 4 and got == Layout(pp=2, dp=4, vpp=4, pipeline_layout=vpp.pipeline_layout)
    with pytest.raises(LayoutError, match="has 8 stages but PP 2"):
        from_flags(to_flags(got, WL) + ["--num-virtual-stages-per-pipeline-rank", "2"], m, 8)
    # offload modules only with the switch
    off = Layout(pp=1, dp=8, offload_modules=("core_attn", "attn_proj"))
    w = to_flags(off, WL)
    assert "--fine-grained-activation-offloading" in w and from_flags(w, m, 8).layout == off
    w.remove("--fine-grained-activation-offloading")
    assert from_flags(w, m, 8).layout.offload_modules == ()
    acc = Layout(pp=8, dp=1, account_for_embedding=True, account_for_loss=True)
    assert from_flags(to_flags(acc, WL), load_model("Llama-3.1-405B"), 8).layout == acc


def test_recipe_and_slime_launch_round_trip(tmp_path):
    m = load_model("Llama-3.1-70B")
    cluster = parse_cluster("8xH200")
    block = to_recipe_block(KNOBBED, m, batching(KNOBBED, WL, SLIME))
    assert block["pipeline_layout"] == KNOBBED.pipeline_layout and block["layer_split"] is None
    assert block["recompute"]["modules"] == ["core_attn", "mlp"]
    layout, _ = from_recipe_blocks(yaml.safe_load(yaml.safe_dump(block)))
    assert layout == KNOBBED
    cmd = slime_command(m, cluster, KNOBBED, WL)
    script = cmd.to_shell()
    assert shlex.quote(KNOBBED.pipeline_layout) in script
    assert from_flags(cmd.flags, m, 8).layout == KNOBBED
    # a whole recipe: schema-valid, and its slime command is the same launch
    seed = yaml.safe_load(SEED.read_text())
    recipe = copy.deepcopy(seed)
    recipe.update(model=m.name, run=script, env={k: str(v) for k, v in cmd.env.items()}, layout=block)
    recipe["workload"] = dict(recipe["workload"], row_tokens=WL.seq_length, global_batch=WL.global_batch)
    assert not schema_errors(recipe)
    again = command_for_recipe(recipe)
    assert from_flags(again.flags, m, 8).layout == KNOBBED
    errors = [str(f) for f in lint(recipe) if str(f).startswith("error") and (f.path == "run" or f.path.startswith("layout"))]
    assert not errors, errors
    assert parse_run(script).flag_dict()["--pipeline-model-parallel-layout"] == KNOBBED.pipeline_layout


def test_slime_refuses_a_layout_string_for_qwen35():
    q = load_model("Qwen3.6-27B")
    with pytest.raises(LaunchError, match="slime's Qwen3.5 spec asserts"):
        slime_command(q, parse_cluster("8xH200"), Layout(pp=4, dp=2, pipeline_layout="Et*16|t*17|t*17|t*14L"),
                      Workload())


# ------------------------------------------------------------------ memory and time
def _est(model, gpus, layout, engine=SLIME, wl=None):
    from attune.estimator import estimate
    return estimate(load_model(model), parse_cluster(gpus), layout, wl or Workload(), engine)


def test_module_recompute_and_offload_free_memory_and_cost_time():
    base = Layout(pp=4, dp=2, first=16, last=14, max_tokens_per_gpu=8192, precision_aware_optimizer=True)
    sel = Layout(pp=4, dp=2, first=16, last=14, max_tokens_per_gpu=8192, precision_aware_optimizer=True,
                 recompute_granularity="selective")
    mlp = Layout(pp=4, dp=2, first=16, last=14, max_tokens_per_gpu=8192, precision_aware_optimizer=True,
                 recompute_granularity="selective", recompute_modules=("core_attn", "mlp"))
    off = Layout(pp=4, dp=2, first=16, last=14, max_tokens_per_gpu=8192, precision_aware_optimizer=True,
                 offload_modules=("qkv_linear", "core_attn", "attn_proj"))
    e0, es, em, eo = (_est("Qwen3.6-27B", "8xH200", L) for L in (base, sel, mlp, off))
    a0, asel, amlp, aoff = (e.memory.stages[0].activations_gib for e in (e0, es, em, eo))
    # FlashAttention: core_attn recompute frees nothing; mlp recompute frees the MLP's inner tensors of 16 layers
    assert asel == pytest.approx(a0)
    assert amlp < 0.8 * a0
    assert em.perf.step_time_s > es.perf.step_time_s  # the MLP GEMMs run twice
    # activation offload frees the attention inputs of the 4 softmax-attention layers of stage 0 only (slime's GDN
    # layers are not Megatron attention): a drop, but a small one
    assert 0.8 * a0 < aoff < a0
    # the PCIe traffic is priced: exposed only beyond the microbatch's compute (H200: PCIe Gen5 x16, 55 GB/s)
    assert "act_offload" in eo.perf.breakdown.exposed_comm_s and eo.perf.breakdown.exposed_comm_s["act_offload"] >= 0.0


def test_offload_modules_act_in_every_layer_where_the_mixer_is_megatrons():
    L0 = Layout(pp=2, dp=4, micro_batch_size=1)
    L1 = Layout(pp=2, dp=4, micro_batch_size=1, offload_modules=("core_attn",))
    wl = Workload(seq_length=8192, global_batch=32)
    a0 = _est("Llama-3.1-8B", "8xH100", L0, MEGATRON, wl).memory.stages[0].activations_gib
    a1 = _est("Llama-3.1-8B", "8xH100", L1, MEGATRON, wl).memory.stages[0].activations_gib
    assert a1 < 0.95 * a0


def test_layout_string_changes_the_stage_memory():
    # Llama-3.1-8B, 32 layers on PP 4: 8/8/8/8 vs a string that puts 6 on the first stage
    even = Layout(pp=4, dp=2)
    s = Layout(pp=4, dp=2, pipeline_layout="Et*6|t*9|t*9|t*8L")
    wl = Workload(seq_length=8192, global_batch=32)
    m0 = _est("Llama-3.1-8B", "8xH100", even, MEGATRON, wl).memory.stages
    m1 = _est("Llama-3.1-8B", "8xH100", s, MEGATRON, wl).memory.stages
    assert m1[0].activations_gib < m0[0].activations_gib and m1[1].activations_gib > m0[1].activations_gib
    assert m1[0].layers == 6 and m1[1].layers == 9


# ------------------------------------------------------------------ search space and ablation
SMALL_SPACE = """
name: knobs_small
knobs:
  tp: [1, 2]
  sequence_parallel: [true]
  pp: [1, 4]
  first_offset: {low: -1, high: 1}
  last_offset: {low: -1, high: 1}
  recompute: [none, selective, full]
  recompute_method: [block]
  recompute_layers: {low: 1, high: 4}
  optimizer_cpu_offload: [false, true]
  recompute_modules: [core_attn, core_attn+mlp]
  offload_fraction: [1.0, 0.5]
  activation_offload: [none, qkv_linear+core_attn+attn_proj]
  comm_overlap: [false, true]
  stage_layout: [split, string]
fixed:
  vpp: 1
  cp: 1
  tokens_per_microbatch_rows: 1
  precision_aware_optimizer: true
  distributed_optimizer: true
  overlap_cpu_optimizer: true
"""


def test_space_enumerates_the_new_knobs_and_maps_back(tmp_path):
    from attune.search.space import load_space
    p = tmp_path / "space.yaml"
    p.write_text(SMALL_SPACE)
    sp = load_space(str(p))
    m = load_model("Llama-3.1-8B")
    wl = Workload(seq_length=4096, global_batch=16)
    pairs = sp.enumerate(m, 8, wl, MEGATRON)
    lays = [L for _, L in pairs]
    assert any(L.pipeline_layout for L in lays) and any(L.recompute_modules == ("core_attn", "mlp") for L in lays)
    assert any(L.offload_modules for L in lays) and any(L.optimizer_cpu_offload and L.offload_fraction == 0.5 for L in lays)
    assert any(L.overlap_grad_reduce for L in lays)
    for params, L in pairs[::7]:
        assert sp.to_layout(params, m, 8, wl, MEGATRON) == L
    # params_for maps every generated layout string back (older limits of params_for, not tested here: SP off at
    # TP 1 with an SP domain of [true], a last stage the split repair moved outside the offset domain)
    strings = [L for _, L in pairs if L.pipeline_layout and L.tp > 1]
    assert strings
    for L in strings:
        assert sp.to_layout(sp.params_for(L, m, wl), m, 8, wl, MEGATRON) == L
    knobbed = [L for _, L in pairs if L.tp > 1 and (L.recompute_modules or L.offload_modules or L.overlap_grad_reduce)]
    back = [L for L in knobbed if sp.params_for(L, m, wl) is not None]
    assert len(back) > 0.5 * len(knobbed)
    assert all(sp.to_layout(sp.params_for(L, m, wl), m, 8, wl, MEGATRON) == L for L in back)
    # slime refuses layout strings for Qwen3.5: the space does not even generate them
    q = load_model("Qwen3.6-27B")
    assert not any(L.pipeline_layout for _, L in sp.enumerate(q, 8, Workload(), SLIME))


@pytest.mark.parametrize("bad, needle", [("recompute_modules: [core_attn+attn]", "'+'-joined names of core_attn"),
                                         ("offload_fraction: [1.5]", "must be a fraction in (0, 1]"),
                                         ("stage_layout: [split, zigzag]", "not allowed")])
def test_space_rejects_bad_knob_values(tmp_path, bad, needle):
    from attune.errors import SearchSpaceError
    from attune.search.space import load_space
    p = tmp_path / "space.yaml"
    p.write_text(f"name: x\nknobs:\n  tp: [1]\n  {bad}\nfixed: {{}}\n")
    with pytest.raises(SearchSpaceError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        load_space(str(p))


def test_sim_tune_report_has_the_ablation_table(tmp_path):
    from attune.api.tune import tune
    p = tmp_path / "space.yaml"
    p.write_text(SMALL_SPACE)
    res = tune(model="Llama-3.1-8B", gpus="8xH100", engine="megatron", search_space=str(p), trials=2, seq=4096,
               global_batch=16, out=tmp_path / "out", verify=False)
    text = (tmp_path / "out" / "report.md").read_text()
    assert "## What each knob beyond the seed buys (ablation, predicted)" in text
    table = text.split("## What each knob beyond the seed buys")[1].split("\n## ")[0]
    for knob in ("pipeline layout string", "module recompute", "partial optimizer offload", "activation offload",
                 "communication overlap"):
        assert f"| {knob}" in table
    assert res.outcome.best is not None


def test_ablation_rows_follow_the_scored_table(tmp_path):
    from attune.estimator.coefficients import coefficients_for
    from attune.search.ablation import ablation
    from attune.search.space import load_space
    p = tmp_path / "space.yaml"
    p.write_text(SMALL_SPACE)
    cluster = parse_cluster("8xH100")
    a = ablation(load_space(str(p)), load_model("Llama-3.1-8B"), cluster, Workload(seq_length=4096, global_batch=16),
                 MEGATRON, coefficients_for(cluster.gpu))
    assert a.best_tokens and len(a.rows) == 5
    for r in a.rows:
        # pinning a knob off never beats the best with every knob
        assert r.without_tokens is None or r.without_tokens <= a.best_tokens + 1e-6
        assert r.limit and "\n" not in r.limit


# ------------------------------------------------------------------ the torch runner
def _torch_spec(layout, tmp):
    from attune.runners.base import TrialSpec
    wl = Workload(seq_length=128, global_batch=4, steps=8, window=(2, 7), lr=1e-3, min_lr=1e-4)
    return TrialSpec(model=load_model("tiny-qwen3.5"), cluster=parse_cluster("2xcpu"), layout=layout, workload=wl,
                     engine=get_engine("torch"), trial_dir=tmp, timeout_s=120)


def test_torch_runner_refuses_what_it_does_not_implement(tmp_path):
    from attune.runners.torch_runner import TorchRunner
    r = TorchRunner()
    base = dict(pp=2, dp=1, max_tokens_per_gpu=128, distributed_optimizer=False)
    mlp = Layout(**base, recompute_granularity="selective", recompute_modules=("core_attn", "mlp"))
    off = Layout(**base, offload_modules=("core_attn",))
    (m1,), (m2,) = r.check(_torch_spec(mlp, tmp_path)), r.check(_torch_spec(off, tmp_path))
    assert "recompute module(s) mlp are not implemented by the torch trainer" in m1
    assert "fine-grained activation offloading is not implemented" in m2
    # a per-stage layout string and core-attention recompute run for real
    ok = Layout(**base, pipeline_layout="Et*5|t*3L", recompute_granularity="selective", recompute_modules=("core_attn",))
    assert r.check(_torch_spec(ok, tmp_path)) == []


@pytest.mark.slow
def test_torch_runner_trains_a_layout_string(tmp_path):
    from attune.runners.base import OK
    from attune.runners.torch_runner import TorchRunner
    lay = Layout(pp=2, dp=1, max_tokens_per_gpu=128, distributed_optimizer=False, pipeline_layout="Et*2|t*6L")
    res = TorchRunner().run(_torch_spec(lay, tmp_path / "t"))
    assert res.status == OK, res.reason + res.log_tail
    ranks = sorted(res.extra["ranks"], key=lambda r: r["rank"])
    assert [r["layers"] for r in ranks] == [[0, 2], [2, 8]]


def test_offload_pcie_is_hidden_under_compute_until_it_is_not():
    from attune.estimator.offload import offload_exposed_seconds
    # 5.5 GB over a 55 GB/s link: 0.1 s each way
    assert offload_exposed_seconds(5.5e9, fwd_s=0.2, bwd_s=0.4, pcie_gbps=55.0) == 0.0
    assert offload_exposed_seconds(5.5e9, fwd_s=0.05, bwd_s=0.4, pcie_gbps=55.0) == pytest.approx(0.05)
    assert offload_exposed_seconds(0.0, fwd_s=0.0, bwd_s=0.0, pcie_gbps=55.0) == 0.0
