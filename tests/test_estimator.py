"""The memory and performance models: the seed's verdicts, the physics of each term, the step breakdown."""

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from attune.cli import main
from attune.estimator import estimate
from attune.estimator.coefficients import DEFAULT, Coefficients, coefficients_for
from attune.estimator.costs import Shape, layer_costs
from attune.estimator.memory import communicators, optimizer_bytes
from attune.spec.engine import get_engine
from attune.spec.hardware import GiB, parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import FULL, LINEAR, from_geometry, load_model

ROOT = Path(__file__).resolve().parents[1]


def _memory(*args):
    """The memory records of ``estimate`` (no layout rule checked)."""
    return estimate(*args, check_layout=False).memory


def _perf(*args):
    """The performance records of ``estimate`` (no layout rule checked)."""
    return estimate(*args, check_layout=False).perf


def test_seed_memory_verdicts(qwen, h200x8, slime, seed_cases, seed_workload):
    est = {k: _memory(qwen, h200x8, v, seed_workload, slime) for k, v in seed_cases.items()}
    assert est["rb12"].fits and est["rb12"].peak_stage == 0
    assert est["rb12"].peak_gib > 0.9 * est["rb12"].capacity_gib  # near the limit
    assert not est["rb10"].fits and est["rb10"].stages[0].total_gib > est["rb10"].capacity_gib
    assert est["rb10"].stages[-1].total_gib < est["rb10"].capacity_gib  # stage 0 is the one that overflows
    assert not est["tp1pp2"].fits and est["tp1pp2"].peak_stage == 1
    assert est["tp1pp2"].stages[0].total_gib < est["tp1pp2"].capacity_gib
    assert est["tp1pp2"].stages[1].logits_gib > 15  # the FP32 logits of a 248,320-token vocabulary
    assert est["slime"].fits and est["slime"].host_needed_gib > 100  # optimizer on the host


def test_seed_throughputs_plausible(qwen, h200x8, slime, seed_cases, seed_workload):
    """Loose: the calibrated fit (attune calibrate) owns the 5% bound; the physics must land near it."""
    coef = coefficients_for(h200x8.gpu)  # the shipped Hopper set (the shared one has no per-generation values)
    tuned = _perf(qwen, h200x8, seed_cases["rb12"], seed_workload, slime, coef)
    base = _perf(qwen, h200x8, seed_cases["slime"], seed_workload, slime, coef)
    assert tuned.tokens_per_s_per_gpu == pytest.approx(2499.5, rel=0.10)
    assert base.tokens_per_s_per_gpu == pytest.approx(948.7, rel=0.10)


def test_no_global_activation_multiplier():
    word = "activation" + "_factor"
    assert not hasattr(DEFAULT, word)
    # code, package data and docs (benchmarks/RESULTS.md is a dated record of past runs)
    out = subprocess.run(["grep", "-rl", "--include=*.py", "--include=*.yaml", "--include=*.md", word, "attune",
                          "tests", "benchmarks", "README.md", "docs", "--exclude=RESULTS.md"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.stdout.strip() == "", out.stdout


def test_coefficients_carry_units_sources_and_few_bounds():
    fields = dataclasses.fields(Coefficients)
    assert all(f.metadata.get("unit") and f.metadata.get("source") for f in fields)
    fitted = [f for f in fields if "bounds" in f.metadata and not f.metadata.get("moe")
              and not f.metadata.get("precision")]
    assert 1 <= len(fitted) <= 10  # few: efficiencies, overlap and overhead terms (issue 10)
    moe = [f for f in fields if "bounds" in f.metadata and f.metadata.get("moe")]
    # MoE kernels (issue 14), their host launch time, and Blackwell Ultra's sustained peak (the corpus's only
    # Blackwell Ultra rows are MoE rows: issues 21/22)
    assert 1 <= len(moe) <= 7 and all("moe" in f.name or "ultra" in f.name for f in moe)
    low = [f for f in fields if "bounds" in f.metadata and f.metadata.get("precision")]
    assert 1 <= len(low) <= 3 and all("fp8" in f.name for f in low)  # low-precision GEMMs only (issue 22)
    for f in fitted + moe + low:
        lo, hi = f.metadata["bounds"]
        assert lo < getattr(DEFAULT, f.name) < hi or lo <= f.default <= hi
    per_gen = {f.name for f in fields if f.metadata.get("per_generation")}
    assert per_gen <= {"gemm_efficiency", "attention_efficiency", "nvlink_efficiency", "network_efficiency",
                       "moe_grouped_gemm_efficiency", "fp8_gemm_efficiency"}


def test_saved_tensors_named_and_mlp_kinds():
    """Each layer's activation is the sum of named tensors; an ungated MLP saves f + f, SwiGLU 2f + f."""
    s = Shape(1, False, 1, 4096, 4096)
    geo = dict(name="x", layers=2, hidden=1024, ffn=4096, heads=8, vocab=0)
    by = {mlp: layer_costs(from_geometry(mlp=mlp, **geo), get_engine("megatron"), s)[FULL] for mlp in
          ("swiglu", "gelu", "squared_relu")}
    for c in by.values():
        assert all(t.name and t.bytes >= 0 for t in c.saved)
        assert c.act_bytes == pytest.approx(sum(t.bytes for t in c.saved))
    # fc1 output + activation output: SwiGLU keeps one more ffn-wide bf16 tensor
    assert by["swiglu"].act_bytes - by["gelu"].act_bytes == pytest.approx(4096 * 2 * 4096, rel=0.01)
    assert by["gelu"].act_bytes == pytest.approx(by["squared_relu"].act_bytes)


def test_gdn_saved_tensors_follow_the_engine(qwen):
    """slime's replicated HF GDN keeps fp32 norm copies on the full sequence; megatron-core's is TP-sharded."""
    s = Shape(4, True, 1, 8192, 8192)
    sl = layer_costs(qwen, get_engine("slime"), s)[LINEAR]
    mc = layer_costs(qwen, get_engine("megatron"), s)[LINEAR]
    assert any("fp32" in t.name for t in sl.saved)
    assert sl.act_bytes > 2.5 * mc.act_bytes


def test_overheads_add_up_and_reserved_above_allocated(qwen, h200x8, slime, seed_cases, seed_workload):
    for lay in seed_cases.values():
        for eng in (slime, get_engine("megatron"), get_engine("megatron-bridge")):
            if eng.forces_distributed_optimizer or lay.distributed_optimizer:
                m = _memory(qwen, h200x8, lay, seed_workload, eng)
                for s in m.stages:
                    assert s.overhead_gib == pytest.approx(sum(s.overheads.values()))
                    assert {"cuda_context", "gemm_workspaces", "nccl_buffers", "fragmentation"} <= set(s.overheads)
                    assert s.total_gib >= s.reserved_gib > s.allocated_gib > 0
                    parts = s.weights_gib + s.grads_gib + s.optimizer_gib + s.activations_gib + s.logits_gib
                    assert s.total_gib == pytest.approx(parts + s.overhead_gib)
                assert m.peak_reserved_gib <= m.peak_gib


def test_nccl_buffers_follow_the_communicators(qwen, h200x8, seed_workload):
    lay = Layout(tp=2, sp=True, pp=2, dp=2, recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1)
    groups = {g[0] for g in communicators(lay, 0, h200x8)}
    assert {"tp", "pp", "dp_cp", "model_parallel", "world", "embedding"} <= groups and "cp" not in groups
    nvls = _memory(qwen, h200x8, lay, seed_workload, get_engine("megatron")).stages[0].overheads
    plain = _memory(qwen, h200x8, lay, seed_workload, get_engine("megatron-bridge")).stages[0].overheads
    assert nvls["nccl_buffers"] > plain["nccl_buffers"]  # NVLS buffers only where NCCL_NVLS_ENABLE is left on
    one = _memory(qwen, parse_cluster("1xH200"), Layout(), seed_workload, get_engine("megatron"))
    assert one.stages[0].overheads["nccl_buffers"] == 0  # a single GPU creates no communicator


def test_fragmentation_lower_with_expandable_segments(qwen, h200x8, seed_cases, seed_workload):
    lay = seed_cases["rb12"]
    coef = Coefficients()  # the sourced field defaults (the fitted set may move `fragmentation`)
    sl = _memory(qwen, h200x8, lay, seed_workload, get_engine("slime"), coef).stages[0]
    mg = _memory(qwen, h200x8, lay, seed_workload, get_engine("megatron"), coef).stages[0]
    assert sl.overheads["fragmentation"] / sl.allocated_gib < mg.overheads["fragmentation"] / mg.allocated_gib


@pytest.mark.parametrize("kw,want", [
    (dict(), (2, 4, 12 / 8)),  # bf16: 6 + 12/d (dist_optimizer.md)
    (dict(precision_aware_optimizer=True), (2, 4, 10 / 8)),  # 16-bit master remainder
    (dict(precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"), (2, 4, 6 / 8)),
    (dict(grad_reduce_in_bf16=True), (2, 2, 16 / 8)),  # bf16 grads, fp32 grad copy in the optimizer
    (dict(precision="fp16"), (2, 2, 16 / 8)),  # fp16: 4 + 16/d
])
def test_optimizer_bytes_per_engine_rules(kw, want):
    opts = {k: kw.pop(k) for k in ("grad_reduce_in_bf16", "exp_avg_dtype", "exp_avg_sq_dtype") if k in kw}
    w, g, o, h = optimizer_bytes(Layout(dp=8, **kw), **opts)
    assert (w, g, o, h) == pytest.approx((*want, 0.0))


def _explain_cases():
    wl = Workload(seq_length=4096, global_batch=256)
    nemo = load_model("Nemotron-4-15B")
    yield nemo, parse_cluster("64xH100"), Layout(tp=2, sp=True, dp=32, micro_batch_size=2), wl, "megatron-bridge"
    yield nemo, parse_cluster("64xH100"), Layout(tp=2, sp=True, dp=32, micro_batch_size=2), wl, "megatron"
    gpt = load_model("GPT-3-175B")
    yield (gpt, parse_cluster("128xH100"), Layout(tp=4, sp=True, pp=8, vpp=12, dp=4),
           Workload(seq_length=2048, global_batch=256), "megatron-bridge")
    big = load_model("Nemotron-4-340B")
    yield big, parse_cluster("128xGB200"), Layout(tp=8, sp=True, pp=4, vpp=12, dp=4), Workload(
        seq_length=4096, global_batch=32), "megatron-bridge"


@pytest.mark.parametrize("case", list(_explain_cases()), ids=lambda c: f"{c[0].name}-{c[4]}")
def test_explain_sums_to_the_step(case):
    model, cluster, lay, wl, eng = case
    e = estimate(model, cluster, lay, wl, get_engine(eng))
    br = e.perf.breakdown
    assert br.total_s == pytest.approx(e.perf.step_time_s, rel=1e-3)
    for s in e.perf.stages:
        assert sum(s.parts.values()) == pytest.approx(s.forward_s + s.backward_s, rel=1e-9)
    assert br.bubble_s >= 0 and all(v >= 0 for v in br.exposed_comm_s.values())


def test_overlap_hides_communication():
    """DP overlap hides the reduce under the backward; TE userbuffers hide TP collectives under GEMMs."""
    m, c = load_model("Nemotron-4-15B"), parse_cluster("64xH100")
    wl = Workload(seq_length=4096, global_batch=256)
    lay = Layout(tp=2, sp=True, dp=32, micro_batch_size=2)
    plain = estimate(m, c, lay, wl, get_engine("megatron")).perf
    over = estimate(m, c, Layout(tp=2, sp=True, dp=32, micro_batch_size=2, overlap_grad_reduce=True,
                                 overlap_param_gather=True, tp_comm_overlap=True), wl, get_engine("megatron")).perf
    bridge = estimate(m, c, lay, wl, get_engine("megatron-bridge")).perf
    assert over.dp_comm_s < 0.5 * plain.dp_comm_s
    assert over.breakdown.exposed_comm_s["tp"] < plain.breakdown.exposed_comm_s["tp"]
    # the recipes' overlap is on by default: the same pipeline; and NeMo reduces grads in bf16, so less DP traffic
    assert bridge.pipeline_s == pytest.approx(over.pipeline_s)
    assert bridge.dp_comm_s <= over.dp_comm_s and bridge.step_time_s <= over.step_time_s


def test_cli_explain_and_json(capsys):
    argv = ["estimate", "--model", "Nemotron-4-15B", "--gpus", "16xH100", "--engine", "megatron-bridge", "--seq",
            "4096", "--global-batch", "64", "--", "--tensor-model-parallel-size", "4", "--sequence-parallel",
            "--micro-batch-size", "4", "--use-distributed-optimizer"]
    assert main(argv[:1] + ["--explain"] + argv[1:]) == 0
    text = capsys.readouterr().out
    assert "pipeline bubble" in text and "total = step time" in text and "nccl buffers" in text
    assert main(argv[:1] + ["--json"] + argv[1:]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["performance"]["step"]["total_s"] == pytest.approx(d["step_time_s"], rel=1e-3)
    assert d["peak_reserved_gib"] <= d["peak_gib"] and d["peak_allocated_gib"] < d["peak_reserved_gib"]
    assert "overheads_gib" in d["stages"][0]


def test_physics_monotone(qwen, h200x8, slime, seed_workload):
    """More recompute: less memory, more time. More microbatch tokens: more activation memory."""
    base = dict(tp=1, pp=4, dp=2, first=16, last=14, recompute_granularity="full", recompute_method="block",
                max_tokens_per_gpu=8192, precision_aware_optimizer=True)
    prev_mem, prev_t = 1e9, 0
    for n in (4, 8, 12, 16):
        lay = Layout(recompute_num_layers=n, **base)
        m = _memory(qwen, h200x8, lay, seed_workload, slime).peak_gib
        t = _perf(qwen, h200x8, lay, seed_workload, slime).step_time_s
        assert m < prev_mem and t > prev_t
        prev_mem, prev_t = m, t


def test_megatron_engine_shards_gdn(qwen, h200x8, seed_workload):
    lay = Layout(tp=4, sp=True, pp=2, dp=1, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    s = _memory(qwen, h200x8, lay, seed_workload, get_engine("slime")).stages[0].params
    m = _memory(qwen, h200x8, lay, seed_workload, get_engine("megatron")).stages[0].params
    assert s > 1.5 * m  # slime replicates the GDN mixer on every TP rank


def test_other_models_plausible():
    """Published regime: dense Llama training on H100 in bf16 reaches roughly 35-55% MFU."""
    m = load_model("Llama-3.1-70B")
    c = parse_cluster("64xH100")
    lay = Layout(tp=8, sp=True, pp=4, dp=2, recompute_granularity="none", max_tokens_per_gpu=8192)
    e = estimate(m, c, lay, Workload(seq_length=8192, global_batch=256), get_engine("megatron"))
    assert 0.30 < e.perf.mfu < 0.60


def test_layers_only_model_and_legacy_attention():
    """A row counting the transformer layers only (vocab 0) estimates without an output layer; the 2022 engine
    keeps the unfused attention scores, which selective recompute drops (Korthikanti et al. 2022)."""
    m = from_geometry(name="gpt3-175B", layers=96, hidden=12288, ffn=49152, heads=96, kv_heads=96, vocab=0,
                      mlp="gelu", seq_length=2048)
    c, wl = parse_cluster("64xA100"), Workload(seq_length=2048, global_batch=64)
    lay = Layout(tp=8, pp=8, vpp=3, dp=1, distributed_optimizer=False, precision="fp16")
    legacy, flash = get_engine("megatron-legacy"), get_engine("megatron")
    est = estimate(m, c, lay, wl, legacy, check_layout=False)
    assert est.perf.tokens_per_s_per_gpu > 0 and est.memory.stages[-1].logits_gib == 0
    a_legacy = est.memory.stages[0].activations_gib
    a_flash = estimate(m, c, lay, wl, flash, check_layout=False).memory.stages[0].activations_gib
    sel = estimate(m, c, Layout(tp=8, pp=8, vpp=3, dp=1, sp=True, recompute_granularity="selective",
                                distributed_optimizer=False, precision="fp16"), wl, legacy, check_layout=False)
    assert a_legacy > 1.5 * a_flash  # 5 bytes per attention score per head
    assert sel.memory.stages[0].activations_gib < 0.3 * a_legacy


def test_fp16_grad_copy_only_at_the_optimizer_step():
    """fp16: 2 + 2 + 12 bytes per parameter during forward/backward; the fp32 grad copy (4) only in the step."""
    m, c = load_model("Nemotron-4-15B"), parse_cluster("8xH100")
    wl = Workload(seq_length=4096, global_batch=8)
    st = estimate(m, c, Layout(tp=8, sp=True, precision="fp16", distributed_optimizer=False), wl,
                  get_engine("megatron")).memory.stages[0]
    per_param = (st.weights_gib + st.grads_gib + st.optimizer_gib) * GiB / st.params
    assert per_param == pytest.approx(16.0)


def test_legacy_fp16_accumulates_grads_in_fp32_18_bytes():
    """2022 Megatron (the Korthikanti et al. runs): fp16 params, fp32 main grads, fp32 master, m, v = 18 bytes."""
    m, c = load_model("Nemotron-4-15B"), parse_cluster("8xH100")
    wl = Workload(seq_length=4096, global_batch=8)
    st = estimate(m, c, Layout(tp=8, sp=True, precision="fp16", distributed_optimizer=False), wl,
                  get_engine("megatron-legacy")).memory.stages[0]
    assert (st.weights_gib + st.grads_gib + st.optimizer_gib) * GiB / st.params == pytest.approx(18.0)


def test_megatron_bridge_reduces_grads_in_bf16():
    m, c = load_model("Nemotron-4-15B"), parse_cluster("64xH100")
    wl, lay = Workload(seq_length=4096, global_batch=256), Layout(tp=2, sp=True, dp=32, micro_batch_size=2)
    mg = estimate(m, c, lay, wl, get_engine("megatron")).memory.stages[0]
    nb = estimate(m, c, lay, wl, get_engine("megatron-bridge")).memory.stages[0]
    assert mg.grads_gib == pytest.approx(2 * nb.grads_gib)
