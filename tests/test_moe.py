"""Mixture-of-experts models and expert parallelism (issue 14): parameter counts, EP rules, memory and time
terms, flags, slime launch arguments, the MoE search space."""

from __future__ import annotations

import re
import shlex

import pytest

from attune.api.estimate import estimate_target
from attune.api.tune import tune, tune_config
from attune.errors import LayoutError, ModelError, RecipeError
from attune.estimator import estimate
from attune.estimator.coefficients import coefficients_for
from attune.estimator.memory import communicators, deepep_buffer_bytes, fixed_overheads
from attune.recipe.target import recipe_target
from attune.runners.slime.launch import model_args
from attune.search.space import load_space
from attune.spec import moe as moe_mod
from attune.spec.baselines import baseline_layout
from attune.spec.engine import get_engine
from attune.spec.flags import from_flags, to_flags
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import from_hf_config, load_model
from attune.spec.moe import expert_data_parallel
from attune.spec.placement import stage_params
from attune.spec.rules import check

SLIME = get_engine("slime")
H200 = parse_cluster("8xH200")


def test_published_parameter_counts():
    nxt = load_model("Qwen3-Next-80B-A3B")
    assert nxt.total_params == 79_674_391_296  # published (slime-runtime-and-moe.md section 4)
    assert nxt.activated_params == 3_874_929_408
    # published rounded figures of the others: model cards' "30.5B / 3.3B", "235B / 22B", Mixtral "46.7B / 12.9B"
    for name, total, active in (("Qwen3-30B-A3B", 30.5e9, 3.3e9), ("Qwen3-235B-A22B", 235e9, 22e9),
                                ("Mixtral-8x7B", 46.7e9, 12.9e9), ("Qwen3.5-35B-A3B", 35e9, 3.0e9)):
        m = load_model(name)
        assert abs(m.total_params - total) / total < 0.02, name
        assert abs(m.activated_params - active) / active < 0.16, name
        # MFU convention: matmuls a token passes through, no input embedding, no vectors
        assert m.active_params < m.activated_params < m.total_params
    assert load_model("Mixtral-8x7B").total_params == 46_702_792_704


def test_moe_families_and_tiny_models():
    assert load_model("Qwen3-30B-A3B").moe.family == "qwen3_moe"
    assert load_model("Qwen3-Next-80B-A3B").moe.family == "qwen3_next"
    assert load_model("Qwen3.5-35B-A3B").moe.family == "qwen3_5_moe"
    assert load_model("Mixtral-8x7B").moe.family == "mixtral"
    q = load_model("Qwen3.5-35B-A3B")
    assert q.moe.shared_gate and q.moe.shared_ffn == 512 and q.count_types(0, 40) == (10, 30)
    for tiny in ("tiny-qwen3-moe", "tiny-qwen3.5-moe"):
        m = load_model(tiny)
        assert m.moe is not None and m.total_params < 5e6
    with pytest.raises(ModelError, match="num_experts_per_tok"):
        from_hf_config({"model_type": "deepseek_v3", "n_routed_experts": 256})
    with pytest.raises(ModelError, match="not modelled"):
        from_hf_config({"model_type": "olmoe", "num_experts": 8, "num_experts_per_tok": 2})
    with pytest.raises(ModelError, match="dense MLP width"):
        from_hf_config({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 8, "mlp_only_layers": [0], "hidden_size": 16,
                        "num_attention_heads": 2, "num_hidden_layers": 2, "vocab_size": 10})


def test_stage_params_count_every_expert():
    m = load_model("Qwen3-30B-A3B")
    lay = Layout(pp=4, dp=2, ep=2)
    assert sum(stage_params(m, lay, r) for r in range(4)) == m.total_params


def test_ep_rules():
    m = load_model("Qwen3-30B-A3B")
    wl = Workload()
    ok = Layout(tp=2, sp=True, dp=4, ep=8, moe_dispatcher="alltoall")  # slime runs alltoall and flex only
    assert check(ok, m, 8, wl, SLIME) == []
    assert expert_data_parallel(ok) == 1
    assert expert_data_parallel(Layout(dp=8, ep=2)) == 4
    errs = " ".join(check(Layout(dp=8, ep=3), m, 8, wl, SLIME))
    assert "EP 3 must divide the 128 experts" in errs
    errs = " ".join(check(Layout(tp=2, sp=True, dp=4, ep=8, etp=2), m, 8, wl, SLIME))
    assert "must divide TP x CP x DP = 8" in errs
    assert "sequence parallelism" in " ".join(check(Layout(tp=2, dp=4, ep=2), m, 8, wl, SLIME))
    assert "ETP 5" in " ".join(check(Layout(dp=5, etp=5), m, 5, wl, SLIME))
    dense = load_model("Qwen3.6-27B")
    assert "needs a mixture-of-experts model" in " ".join(check(Layout(dp=8, ep=2), dense, 8, wl, SLIME))


def test_ep_layouts_round_trip_through_flags():
    m = load_model("Qwen3.5-35B-A3B")
    lay = Layout(tp=2, sp=True, dp=4, ep=4, etp=2, moe_dispatcher="alltoall", moe_grouped_gemm=True,
                 moe_permute_fusion=True, moe_shared_expert_overlap=True)
    argv = to_flags(lay)
    assert "--expert-model-parallel-size" in argv and argv[argv.index("--expert-tensor-parallel-size") + 1] == "2"
    assert from_flags(argv, m, 8).layout == lay
    # an absent --expert-tensor-parallel-size is the TP size (Megatron validate_args)
    assert from_flags("--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4", m, 8).layout.etp == 2
    with pytest.raises(LayoutError, match="dispatcher"):
        Layout(moe_dispatcher="bogus")


def _est(model: str, flags: str):
    m = load_model(model)
    p = from_flags(flags, m, 8)
    return estimate(m, H200, p.layout, p.workload, SLIME)


BASE = ("--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --use-dynamic-batch-size "
        "--max-tokens-per-gpu 8192 --moe-token-dispatcher-type alltoall --moe-grouped-gemm --expert-tensor-parallel-size 1")


def test_memory_breakdown_has_expert_and_dense_parts():
    e1 = _est("Qwen3.5-35B-A3B", BASE + " --expert-model-parallel-size 1")
    e8 = _est("Qwen3.5-35B-A3B", BASE + " --expert-model-parallel-size 8")
    s1, s8 = e1.memory.stages[0], e8.memory.stages[0]
    m = e1.model
    # EP 8 holds an eighth of the experts; the dense part does not change
    assert s1.expert_params == pytest.approx(8 * s8.expert_params)
    assert s8.expert_params == pytest.approx(m.num_layers * m.moe.routed_params(m.hidden) / 8)
    assert s1.weights_gib == pytest.approx(s8.weights_gib) and s8.expert_weights_gib > 0
    # expert optimizer states shard over expert DP: EP 1 -> expert DP 4, EP 8 -> 1
    assert s1.expert_optimizer_gib / s1.expert_weights_gib < s8.expert_optimizer_gib / s8.expert_weights_gib
    assert 0 < s8.expert_activations_gib < s8.activations_gib
    d = e8.to_dict()["stages"][0]
    assert d["experts"]["params"] == int(s8.expert_params)
    assert s8.total_gib == pytest.approx(s8.weights_gib + s8.grads_gib + s8.optimizer_gib + s8.expert_state_gib
                                         + s8.activations_gib + s8.logits_gib + s8.overhead_gib)
    # a dense model has no expert part
    assert "experts" not in _est("Qwen3.6-27B", "--tensor-model-parallel-size 4 --sequence-parallel --use-distributed-optimizer").to_dict()["stages"][0]


def test_expert_parallel_time_terms():
    e1 = _est("Qwen3-30B-A3B", BASE + " --expert-model-parallel-size 1")
    e8 = _est("Qwen3-30B-A3B", BASE + " --expert-model-parallel-size 8")
    assert e1.perf.breakdown.exposed_comm_s["ep"] == 0.0 < e8.perf.breakdown.exposed_comm_s["ep"]
    no_grouped = _est("Qwen3-30B-A3B", BASE.replace(" --moe-grouped-gemm", "") + " --expert-model-parallel-size 8")
    assert no_grouped.perf.step_time_s > e8.perf.step_time_s
    # MFU counts the active parameters only: a 30B-total model runs at a few percent to tens of percent MFU
    assert 0.01 < e8.perf.mfu < 0.6


REFERENCE = {  # slime-runtime-and-moe.md section 4, MODEL_ARGS
    "Qwen3.5-35B-A3B": {"--num-layers": "40", "--hidden-size": "2048", "--num-attention-heads": "16",
                        "--num-query-groups": "2", "--kv-channels": "256", "--ffn-hidden-size": "512",
                        "--vocab-size": "248320", "--rotary-percent": "0.25", "--rotary-base": "10000000",
                        "--num-experts": "256", "--moe-router-topk": "8", "--moe-ffn-hidden-size": "512",
                        "--moe-shared-expert-intermediate-size": "512", "--spec": "slime_plugins.models.qwen3_5",
                        "switches": ("--moe-shared-expert-gate", "--attention-output-gate", "--apply-layernorm-1p",
                                     "--untie-embeddings-and-output-weights")},
    "Qwen3-30B-A3B": {"--num-layers": "48", "--hidden-size": "2048", "--num-attention-heads": "32",
                      "--num-query-groups": "4", "--kv-channels": "128", "--vocab-size": "151936",
                      "--rotary-base": "1000000", "--num-experts": "128", "--moe-router-topk": "8",
                      "--moe-ffn-hidden-size": "768", "switches": ()},
    "Qwen3-Next-80B-A3B": {"--num-layers": "48", "--hidden-size": "2048", "--num-attention-heads": "16",
                           "--num-query-groups": "2", "--kv-channels": "256", "--vocab-size": "151936",
                           "--rotary-percent": "0.25", "--rotary-base": "10000000", "--num-experts": "512",
                           "--moe-router-topk": "10", "--moe-ffn-hidden-size": "512",
                           "--moe-shared-expert-intermediate-size": "512", "--spec": "slime_plugins.models.qwen3_next",
                           "switches": ("--moe-shared-expert-gate", "--attention-output-gate")},
    "Qwen3-235B-A22B": {"--num-layers": "94", "--hidden-size": "4096", "--num-attention-heads": "64",
                        "--num-query-groups": "4", "--kv-channels": "128", "--vocab-size": "151936",
                        "--num-experts": "128", "--moe-router-topk": "8", "--moe-ffn-hidden-size": "1536",
                        "switches": ()},
}
COMMON = {"--moe-router-score-function": "softmax", "--moe-token-drop-policy": "probs", "--moe-router-dtype": "fp32",
          "--moe-aux-loss-coeff": "0"}


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_slime_launch_moe_args_match_the_reference(name):
    m = load_model(name)
    a = model_args(m)
    want = dict(REFERENCE[name])
    switches = want.pop("switches")
    for flag, value in {**want, **COMMON}.items():
        assert a.count(flag) == 1 and a[a.index(flag) + 1] == value, (flag, a)
    for s in switches:
        assert s in a
    if "--moe-shared-expert-intermediate-size" not in want:
        assert "--moe-shared-expert-intermediate-size" not in a and "--moe-shared-expert-gate" not in a
    freq = a[a.index("--moe-layer-freq") + 1]
    # slime's scripts join with IFS=', ' (first character ','): no spaces, which Megatron's _eval_pattern refuses
    assert freq == "[" + ",".join(["1"] * m.num_layers) + "]"
    # the layout's MoE flags (dispatcher, grouped GEMM, permute fusion) come from the layout, once
    lay = baseline_layout(m, parse_cluster("8xH200"), Workload(), SLIME)[0]
    flags = to_flags(lay)
    for f in ("--moe-token-dispatcher-type", "--moe-grouped-gemm", "--moe-permute-fusion"):
        assert f in flags and f not in a
    assert shlex.split(shlex.join(a)) == a


def test_baselines_are_slimes_layouts_adapted():
    lay, note = baseline_layout(load_model("Qwen3-30B-A3B"), H200, Workload(), SLIME)
    assert (lay.tp, lay.pp, lay.ep, lay.etp, lay.dp, lay.moe_dispatcher) == (4, 1, 8, 1, 2, "alltoall")
    lay, note = baseline_layout(load_model("Qwen3.5-35B-A3B"), H200, Workload(), SLIME)
    assert (lay.tp, lay.ep, lay.max_tokens_per_gpu) == (2, 8, 8192)
    # slime's TP4 PP4 CP2 EP16 needs 64 GPUs (Megatron: world divisible by ETP x EP x PP = 64); on 4 x 8 EP halves
    lay, note = baseline_layout(load_model("Qwen3-235B-A22B"), parse_cluster("8x8xH200"), Workload(), SLIME)
    assert (lay.tp, lay.pp, lay.cp, lay.ep, lay.dp) == (4, 4, 2, 16, 2) and lay.last == 22
    lay, note = baseline_layout(load_model("Qwen3-235B-A22B"), parse_cluster("4x8xH200"), Workload(), SLIME)
    assert (lay.tp, lay.pp, lay.cp, lay.ep) == (4, 4, 1, 8) and "CP 2 -> 1" in note and "EP 16 -> 8" in note


def test_moe_space_enumerates_ep_layouts():
    space = load_space("moe")
    m = load_model("tiny-qwen3-moe")
    cands = space.enumerate(m, 8, Workload(seq_length=1024, global_batch=16), SLIME)
    eps = {lay.ep for _, lay in cands}
    assert eps == {1, 2, 4, 8}
    for _params, lay in cands[:50]:
        assert space.params_for(lay, m, Workload(seq_length=1024, global_batch=16)) is not None
    # a dense model in the same space stays at EP 1
    dense = space.enumerate(load_model("tiny-llama"), 8, Workload(seq_length=1024, global_batch=16), SLIME)
    assert {lay.ep for _, lay in dense} == {1}


SMALL_MOE = """name: moe-test
knobs:
  tp: [1, 2]
  sequence_parallel: [true, false]
  ep: [1, 2, 4, 8]
  dispatcher: [alltoall]
fixed:
  pp: 1
  recompute: full
  recompute_method: uniform
  recompute_layers: 1
  moe_grouped_gemm: true
"""


def test_tune_on_a_moe_model_emits_a_recipe(tmp_path):
    space = tmp_path / "moe-test.yaml"
    space.write_text(SMALL_MOE)
    cfg = tune_config(model="Qwen3-30B-A3B", gpus="8xH200", search_space=str(space), out=tmp_path / "out")
    assert cfg.space.name == "moe-test"
    assert tune_config(model="Qwen3-30B-A3B", gpus="8xH200", out=tmp_path / "o2").space.name == "moe"
    res = tune(model="Qwen3-30B-A3B", gpus="8xH200", search_space=str(space), out=tmp_path / "out", candidates=8)
    lay = res.recipe.layout
    assert lay.etp in (1, 2) and lay.dispatcher == "alltoall" and lay.ep in (1, 2, 4, 8)
    assert res.recipe_path.exists() and "experts over EP" in lay.summary
    assert res.outcome.baseline is not None
    # the recipe reads back to the winner's layout (EP, ETP, dispatcher from the block; kernel switches from the run)
    back = recipe_target(res.recipe)
    assert back.layout == res.outcome.best.to_layout()
    assert estimate_target(back).perf.tokens_per_s_per_gpu == pytest.approx(res.outcome.best.value, rel=1e-3)
    # numerics-class MoE options have no layout-block key: the run flags carry them back
    def with_flags(extra: str):
        run = res.recipe.run
        assert "  --use-tensorboard \\\n" in run  # a line of the main (train) command
        changed = run.replace("  --use-tensorboard \\\n", f"  --use-tensorboard {extra} \\\n")
        return res.recipe.model_copy(update={"run": changed})

    lay2 = recipe_target(with_flags("--moe-expert-capacity-factor 1.5 --moe-router-force-load-balancing")).layout
    assert lay2.moe_capacity_factor == 1.5 and lay2.moe_force_balance and not back.layout.moe_force_balance
    with pytest.raises(RecipeError, match="--moe-expert-capacity-factor 'lots' is not a number"):
        recipe_target(with_flags("--moe-expert-capacity-factor lots"))


def test_moe_act_recompute_needs_grouped_gemm():
    m = load_model("Qwen3-30B-A3B")
    wl = Workload(seq_length=4096, global_batch=64)
    base = dict(tp=1, pp=1, dp=8, ep=8, moe_dispatcher="alltoall", recompute_granularity="selective",
                recompute_modules=("moe_act",))
    assert not check(Layout(**base, moe_grouped_gemm=True), m, 8, wl, get_engine("megatron"))
    broken = check(Layout(**base, moe_grouped_gemm=False), m, 8, wl, get_engine("megatron"))
    assert broken and "moe_act needs --moe-grouped-gemm" in broken[0]


def test_expert_groups_and_deepep_buffers_in_the_fixed_overheads():
    m, c = load_model("Qwen3-30B-A3B"), parse_cluster("8xH200")
    wl, eng = Workload(seq_length=4096, global_batch=64), get_engine("megatron")
    a2a = Layout(tp=1, pp=1, dp=8, ep=4, moe_dispatcher="alltoall", moe_grouped_gemm=True)
    names = {g[0]: g[1] for g in communicators(a2a, 0, c)}
    assert names["ep"] == 4 and names["expert_dp"] == 2  # 8 GPUs / (EP 4 x ETP 1)
    assert "ep" not in {g[0] for g in communicators(Layout(tp=1, pp=1, dp=8), 0, c)}
    coef = coefficients_for(c.gpu)
    flex = Layout(tp=1, pp=1, dp=8, ep=4, moe_dispatcher="flex", moe_grouped_gemm=True)
    assert "deepep_buffers" not in fixed_overheads(a2a, wl, eng, c, 0, m, coef)
    got = fixed_overheads(flex, wl, eng, c, 0, m, coef)["deepep_buffers"]
    # 10 channels x 4 NVLink peers x 256 tokens x 2,048 x 2 bytes, no RDMA peers inside one node
    assert got * 2**30 == deepep_buffer_bytes(2048, 4, 8) == 10 * 4 * 256 * 4096
    assert deepep_buffer_bytes(7168, 32, 8) > deepep_buffer_bytes(7168, 8, 8)  # RDMA buffers across nodes


# Megatron-LM 1dcf0daf megatron/training/arguments.py lines 198-206: _eval_pattern refuses any character outside
# [,\d\[\]\(\)\+\*] (written out here, not imported, so a change to attune's own copy cannot hide a regression)
MEGATRON_FREQ_REFUSED = re.compile(r"[^,\d\[\]\(\)\+\*]")


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "Qwen3.5-35B-A3B", "Qwen3-235B-A22B", "DeepSeek-V3", "tiny-qwen3-moe"])
def test_moe_layer_freq_is_in_megatrons_accepted_form(name):
    m = load_model(name)
    a = model_args(m)
    freq = a[a.index("--moe-layer-freq") + 1]
    assert not MEGATRON_FREQ_REFUSED.search(freq), freq
    pat = m.moe.pattern or (1,) * m.num_layers
    assert list(eval(freq)) == list(pat)  # the same list Megatron evaluates


def test_a_spaced_moe_layer_freq_is_refused():
    # the form attune emitted before issue 21: Megatron's moe_freq_type exits 2 on it
    spaced = "[" + ", ".join(["1"] * 4) + "]"
    assert MEGATRON_FREQ_REFUSED.search(spaced)
    with pytest.raises(AssertionError, match="refuses"):
        moe_mod._checked_freq(spaced)
