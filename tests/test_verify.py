"""attune verify: the pipeline on a scripted runner (fast), a real two-arm check of a small torch recipe with its
negative controls (slow), the configuration check and bad input. Every output goes under tmp_path."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace

import pytest

pytest.importorskip("torch")

from attune.api.verify import default_out_dir, verify  # noqa: E402
from attune.cli import main  # noqa: E402
from attune.correctness import prose  # noqa: E402
from attune.correctness.checks import optimizer_config  # noqa: E402
from attune.correctness.verify import VerifyError, resolve_target, verify_recipe  # noqa: E402
from attune.recipe import lint, load_recipe, validate_recipe, write_recipe  # noqa: E402
from attune.recipe.codec import to_recipe_block  # noqa: E402
from attune.runners.base import Capabilities, Runner, TrialResult  # noqa: E402
from attune.runners.registry import get_runner  # noqa: E402
from attune.runners.slime.launch import slime_command  # noqa: E402
from attune.runners.torch_runner import torch_rerun  # noqa: E402
from attune.spec.engine import get_engine  # noqa: E402
from attune.spec.hardware import parse_cluster  # noqa: E402
from attune.spec.layout import Layout, Workload  # noqa: E402
from attune.spec.model import load_model  # noqa: E402
from attune.spec.placement import batching  # noqa: E402

# The recipe under test: tiny-qwen3.5 on 2 CPU workers, PP 2 with an uneven 5/3 split and block
# recompute of 2 layers, the torch runner's default workload (256-token rows, batch 8, lr 3e-3).
WL = Workload(seq_length=256, global_batch=8, steps=20, window=(5, 19), lr=3e-3, min_lr=3e-4)
# The real (slow-lane) check trains the same recipe on 4 rows per step: half the training time of its 4 arms.
# Its controls still fail by a clear margin (2026-12-02, 20 steps, 4 rows: lr x10 correlation 0.73 and final loss
# difference 0.55, inverted mask correlation 0.44 and 1.02, against the pass bounds 0.95 and 0.05; with 8 rows
# 0.53 / 0.76 and 0.79 / 1.10).
REAL_WL = replace(WL, global_batch=4)
PP2 = Layout(pp=2, dp=1, first=5, last=3, max_tokens_per_gpu=256, recompute_granularity="full",
             recompute_method="block", recompute_num_layers=2, precision_aware_optimizer=True)


def make_recipe(layout: Layout = PP2, model_name: str = "tiny-qwen3.5", wl: Workload | None = None) -> dict:
    m, c, e = load_model(model_name), parse_cluster("2xcpu"), get_engine("torch")
    w = wl or WL
    cmd = slime_command(m, c, layout, w, steps=w.steps)
    return {
        "schema_version": 1, "model": m.name,
        "gpu": {"type": c.type_key, "count": c.world_size, "per_node": c.gpus_per_node, "instance": None},
        "author": {"name": "attune", "url": None}, "status": "measured",
        "stack": {"framework": "attune torch runner"},
        "workload": {"row_tokens": w.seq_length, "rows": "synthetic rows (seeded)", "global_batch": w.global_batch,
                     "precision": "bf16"},
        "layout": to_recipe_block(layout, m, batching(layout, w, e)),
        "result": {"tokens_per_s_per_gpu": 1000.0, "measured": "2026-11-29", "steps_per_run": 20, "window": [5, 19],
                   "window_tokens": 15 * w.global_batch * w.seq_length, "runs": 1},
        "correctness": {"result": "not_run", "summary": "not run yet: attune verify"},
        "env": {str(k): str(v) for k, v in cmd.env.items()}, "patches": [], "run": str(cmd.to_shell()),
        "notes": "- test recipe\n",
    }


# ------------------------------------------------------------------ a scripted runner: the pipeline in < 1 s
class ScriptedRunner(Runner):
    """Loss curves from a formula instead of training: the reference and candidate arms agree (or, with
    `candidate_shift`, the candidate drifts), the lr x10 arm and the inverted-mask arm diverge (unless `blind`)."""

    name = "scripted"
    capabilities = Capabilities(measured=True, engine="torch", max_tp=1, max_cp=1, default_workload=WL)

    def __init__(self, candidate_shift: float = 0.0, blind: bool = False):
        self.candidate_shift = candidate_shift
        self.blind = blind
        self.specs = []

    def check(self, spec):
        return [] if spec.layout.tp == 1 else [f"TP {spec.layout.tp} not supported by the scripted runner"]

    def rerun_command(self, spec):
        return torch_rerun(spec)  # its arms stand for the torch trainer's

    def _execute(self, spec, trial_dir):
        self.specs.append(spec)
        w = spec.workload
        broken = not self.blind and (w.lr != WL.lr or spec.data_path is not None)
        shift = self.candidate_shift if spec.label == "candidate" else 0.0
        losses = {s: (9.0 - 4.0 * (1 - math.exp(-s / 6)) if not broken else 9.0 + 0.3 * s) * (1 + shift)
                  + 0.01 * math.sin(s) for s in range(w.steps)}
        return TrialResult(status="ok", measured=True, tokens_per_s_per_gpu=1234.5, losses=losses)


def test_pipeline_on_scripted_runner_passes_with_failing_controls(tmp_path):
    runner = ScriptedRunner()
    seen: list[str] = []
    v = verify_recipe(validate_recipe(make_recipe()), runner, workdir=tmp_path / "w", steps=12, negative_control=True,
                      progress=seen.append)
    assert v.status == "verified" and v.passed and v.reasons == ()
    # the window rule is Workload.with_steps: 12 steps of the (5, 19) window -> (3, 11)
    assert {(s.workload.steps, s.workload.window) for s in runner.specs} == {(12, (3, 11))}
    assert [s.label for s in runner.specs] == ["reference", "candidate", "negative control lr x10",
                                               "negative control mask"]
    assert set(v.arms) == {"reference", "candidate", "negative_lr", "negative_mask"}
    assert (tmp_path / "w" / "neg-mask" / "result.json").is_file()  # the runner owned each arm's folder
    assert v.convergence.passed and v.convergence.correlation == pytest.approx(1.0)
    assert [c.observed for c in v.negative_controls] == ["fail", "fail", "fail"]
    assert v.component.config == "precision_aware" and v.component.passed
    corr = v.correctness_block()
    assert corr["result"] == "pass" and corr["configuration"] == "pass"
    assert corr["summary"].startswith("passed: configuration, convergence") and "3 of 3 negative controls" in corr["summary"]
    assert [t["test"].split(",")[0] for t in corr["component_tests"]] == ["precision_aware Adam against an FP64 reference"] * 2
    assert "reference arm" in corr["convergence"]["note"] and "scripted runner" in corr["convergence"]["note"]
    # progress lines are the prose, one per finished step, ending with the result
    assert seen == prose.report_lines(v)
    assert seen[0].startswith("configuration: pass (layout ") and seen[-1].startswith("result: pass: passed")
    assert sum(line.startswith("negative control:") for line in seen) == 3


def test_pipeline_reports_a_drifting_candidate_and_a_blind_check(tmp_path):
    drift = verify_recipe(validate_recipe(make_recipe()), ScriptedRunner(candidate_shift=0.2),
                          workdir=tmp_path / "a")
    assert drift.status == "failed" and not drift.convergence.passed
    assert any(r.startswith("convergence check failed (pointwise:") for r in drift.reasons)
    assert drift.correctness_block()["convergence"]["pointwise_failures"] == 20
    blind = verify_recipe(validate_recipe(make_recipe()), ScriptedRunner(blind=True), workdir=tmp_path / "b",
                          negative_control=True)
    assert blind.status == "failed"
    assert [c.observed for c in blind.negative_controls] == ["pass", "pass", "fail"]
    assert sum("negative control passed, so the check cannot detect it" in r for r in blind.reasons) == 2


def test_api_verify_writes_recipe_and_evidence_under_out_dir(tmp_path, monkeypatch):
    path = tmp_path / "recipe.yaml"
    write_recipe(make_recipe(), path)
    before = path.read_bytes()
    out = verify(path, runner=ScriptedRunner(), steps=12, out_dir=tmp_path / "out", negative_control=True)
    assert out.status == "verified" and out.exit_code == 0 and out.out_dir == tmp_path / "out"
    assert path.read_bytes() == before  # a file attune did not create is not rewritten without in_place
    assert out.recipe_path == tmp_path / "out" / "recipe.yaml"
    r = load_recipe(out.recipe_path)
    assert r["status"] == "verified" and r["correctness"] == out.verdict.correctness_block()
    assert len(r["correctness"]["negative_controls"]) == 3 and out.sidecar_path is None
    record = json.loads((out.out_dir / "verify.json").read_text())
    assert record["status"] == "verified" and record["reasons"] == []
    assert set(record["arms"]) == {"reference", "candidate", "negative_lr", "negative_mask"}
    assert record["arms"]["candidate"]["result"]["losses"]["11"] == pytest.approx(
        out.verdict.arms["candidate"].result.losses[11])
    # without out_dir: reports/verify/<recipe stem>-<UTC stamp>/ under the working directory
    monkeypatch.chdir(tmp_path)
    again = verify(path, runner=ScriptedRunner(candidate_shift=0.2), steps=12, in_place=True)
    assert again.out_dir.parent == tmp_path / "reports" / "verify" and again.out_dir.name.startswith("recipe-")
    # a measured failure with in_place rewrites the file (the arms trained and were compared)
    assert again.exit_code == 1 and load_recipe(path)["status"] == "failed" and not again.in_place_refused
    assert default_out_dir(path).parent == again.out_dir.parent


def test_recipe_fixture_is_valid(tmp_path):
    r = make_recipe()
    assert not [f for f in lint(r) if f.severity == "error"]
    path = tmp_path / "r.yaml"
    write_recipe(r, path)
    assert main(["recipe", "validate", str(path)]) == 0
    torch_runner = get_runner("torch")
    w = resolve_target(r, torch_runner, 12).workload
    assert (w.seq_length, w.global_batch, w.lr, w.min_lr, w.steps, w.window) == (256, 8, 3e-3, 3e-4, 12, (3, 11))
    # a window inside the run is kept (Workload.with_steps), the run block's lr is the arms' lr
    assert resolve_target(r, torch_runner, 40).workload.window == (5, 19)
    # without a workload block the arms use the torch runner's declared default workload
    bare = {k: v for k, v in r.items() if k not in ("workload", "run", "env")}
    assert resolve_target(bare, torch_runner, 20).workload == torch_runner.capabilities.default_workload
    assert optimizer_config(PP2) == "precision_aware"
    assert optimizer_config(Layout()) == "default"


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify")
    path = d / "recipe.yaml"
    write_recipe(make_recipe(wl=REAL_WL), path)
    lines: list[str] = []
    outcome = verify(path, steps=20, negative_control=True, out_dir=d / "out", progress=lines.append)
    return outcome, load_recipe(outcome.recipe_path), outcome.recipe_path, lines


@pytest.mark.slow
def test_real_verify_passes_and_records_numbers(verified):
    outcome, r, path, lines = verified
    assert outcome.exit_code == 0 and outcome.out_dir.is_dir()
    assert r["status"] == "verified"
    c = r["correctness"]
    assert c["result"] == "pass" and c["configuration"] == "pass"
    conv = c["convergence"]
    assert conv["result"] == "pass" and conv["steps"] == 20
    assert conv["correlation"] >= 0.95 and conv["final_loss_difference"] <= 0.05
    assert conv["pointwise_failures"] == 0 and conv["thresholds"]["correlation"] == 0.95
    assert "candidate arm" in conv["note"] and "reference arm" in conv["note"]
    assert len(c["component_tests"]) == 2
    for t in c["component_tests"]:
        assert t["result"] == "pass" and "precision_aware" in t["test"] and t["date"] and t["shape"]
    assert "--use-precision-aware-optimizer" in c["rules"]
    assert r["stack"]["pytorch"].startswith("2.") and "stack_probe" in r["stack"]["source"]
    assert main(["recipe", "validate", str(path)]) == 0
    record = json.loads((outcome.out_dir / "verify.json").read_text())
    assert record["status"] == "verified" and set(record["arms"]) >= {"reference", "candidate"}
    assert (outcome.out_dir / "candidate" / "result.json").is_file()
    assert lines[-1].startswith("result: pass")


@pytest.mark.slow
def test_negative_controls_fail_and_are_recorded(verified):
    _, r, _, _ = verified
    ctl = r["correctness"]["negative_controls"]
    assert len(ctl) == 3
    assert all(x["expected"] == "fail" and x["observed"] == "fail" for x in ctl)
    lr, mask, comp = ctl
    assert "lr x10" in lr["changed"] and lr["correlation"] < 0.95 and lr["final_loss_difference"] > 0.05
    assert "loss mask" in mask["changed"] and mask["final_loss_difference"] > 0.05
    assert "bias correction" in comp["changed"]


def test_layout_breaking_a_rule_fails_configuration(tmp_path, capsys, monkeypatch):
    r = make_recipe()
    r["layout"]["recompute"]["num_layers"] = 9  # block recompute of 9 layers on a 5-layer stage
    r["run"] = r["run"].replace("--recompute-num-layers 2", "--recompute-num-layers 9")
    runner = ScriptedRunner()
    v = verify_recipe(validate_recipe(copy.deepcopy(r)), runner, steps=20, workdir=tmp_path / "w")
    assert v.status == "failed" and v.correctness_block()["result"] == "fail"
    assert v.correctness_block()["configuration"] == "fail"
    assert "block recompute of 9 layers" in v.summary
    assert v.arms == {} and runner.specs == []  # nothing ran
    path = tmp_path / "bad.yaml"
    write_recipe(r, path)
    monkeypatch.chdir(tmp_path)  # the CLI's default work folder is ./reports/verify/<stem>-<stamp>/
    before = path.read_bytes()
    assert main(["verify", str(path)]) == 1
    assert "configuration check" in capsys.readouterr().err
    (work,) = (tmp_path / "reports" / "verify").iterdir()
    assert load_recipe(work / "recipe.yaml")["status"] == "failed"
    # not a measured failure: even --in-place leaves the file byte-identical
    assert main(["verify", str(path), "--in-place", "--out", str(tmp_path / "w2")]) == 1
    assert path.read_bytes() == before
    assert "not rewritten in place" in capsys.readouterr().err
    assert work.name.startswith("bad-") and json.loads((work / "verify.json").read_text())["status"] == "failed"


def test_run_block_disagreeing_with_layout_fails_configuration(tmp_path):
    r = make_recipe()
    r["run"] = r["run"].replace("--decoder-first-pipeline-num-layers 5", "--decoder-first-pipeline-num-layers 4")
    v = verify_recipe(validate_recipe(r), ScriptedRunner(), workdir=tmp_path / "w")
    assert v.configuration.result == "fail"
    assert any(e.startswith("lint") for e in v.configuration.errors)


def test_bad_input_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["verify", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such recipe file" in err
    with pytest.raises(VerifyError, match="at least 3 steps"):
        verify_recipe(validate_recipe(make_recipe()), ScriptedRunner(), steps=2, workdir=tmp_path / "w")
    tp2 = make_recipe(Layout(tp=2, dp=1, max_tokens_per_gpu=256), "tiny-llama")
    with pytest.raises(VerifyError, match="candidate arm: TP 2 not supported by the torch runner"):
        verify_recipe(validate_recipe(tp2), "torch", workdir=tmp_path / "w2")
    assert not (tmp_path / "reports").exists()  # bad input leaves nothing behind
