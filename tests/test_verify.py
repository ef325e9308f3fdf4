"""attune verify: a real two-arm check of a small torch recipe, its negative controls, and the configuration check."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("torch")

from attune.cli import main  # noqa: E402
from attune.spec.engine import get_engine  # noqa: E402
from attune.spec.hardware import parse_cluster  # noqa: E402
from attune.spec.layout import Layout, Workload
from attune.spec.placement import batching
from attune.recipe.codec import to_recipe_block  # noqa: E402
from attune.spec.model import load_model  # noqa: E402
from attune.recipe import lint, load_recipe, write_recipe  # noqa: E402
from attune.runners.slime.launch import slime_command  # noqa: E402
from attune.verify import VerifyError, optimizer_config, verify_recipe, workload_of  # noqa: E402

# The recipe under test: tiny-qwen3.5 on 2 CPU workers, PP 2 with an uneven 5/3 split and block
# recompute of 2 layers, the torch tune workload (256-token rows, batch 8, lr 3e-3).
WL = Workload(seq_length=256, global_batch=8, steps=20, window=(5, 19), lr=3e-3, min_lr=3e-4)
PP2 = Layout(pp=2, dp=1, first=5, last=3, max_tokens_per_gpu=256, recompute_granularity="full",
             recompute_method="block", recompute_num_layers=2, precision_aware_optimizer=True)


def make_recipe(layout: Layout = PP2, model_name: str = "tiny-qwen3.5") -> dict:
    m, c, e = load_model(model_name), parse_cluster("2xcpu"), get_engine("torch")
    cmd = slime_command(m, c, layout, WL, steps=WL.steps)
    return {
        "schema_version": 1, "model": m.name,
        "gpu": {"type": c.type_key, "count": c.world_size, "per_node": c.gpus_per_node, "instance": None},
        "author": {"name": "attune", "url": None}, "status": "measured",
        "stack": {"framework": "attune torch runner"},
        "workload": {"row_tokens": WL.seq_length, "rows": "synthetic rows (seeded)", "global_batch": WL.global_batch,
                     "precision": "bf16"},
        "layout": to_recipe_block(layout, m, batching(layout, WL, e)),
        "result": {"tokens_per_s_per_gpu": 1000.0, "measured": "2026-11-29", "steps_per_run": 20, "window": [5, 19],
                   "window_tokens": 15 * WL.global_batch * WL.seq_length, "runs": 1},
        "correctness": {"result": "not_run", "summary": "not run yet: attune verify"},
        "env": {str(k): str(v) for k, v in cmd.env.items()}, "patches": [], "run": str(cmd.to_shell()),
        "notes": "- test recipe\n",
    }


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify")
    path = d / "recipe.yaml"
    write_recipe(make_recipe(), path)
    rc = main(["verify", str(path), "--steps", "20", "--negative-control"])
    return rc, load_recipe(path), path


def test_recipe_fixture_is_valid(tmp_path):
    r = make_recipe()
    assert not [f for f in lint(r) if f.severity == "error"]
    path = tmp_path / "r.yaml"
    write_recipe(r, path)
    assert main(["recipe", "validate", str(path)]) == 0
    w = workload_of(r, "torch", 12)
    assert (w.seq_length, w.global_batch, w.lr, w.min_lr, w.steps, w.window) == (256, 8, 3e-3, 3e-4, 12, (3, 11))
    assert optimizer_config(PP2) == "precision_aware"


@pytest.mark.slow
def test_real_verify_passes_and_records_numbers(verified):
    rc, r, path = verified
    assert rc == 0
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


@pytest.mark.slow
def test_negative_controls_fail_and_are_recorded(verified):
    _, r, _ = verified
    ctl = r["correctness"]["negative_controls"]
    assert len(ctl) == 3
    assert all(x["expected"] == "fail" and x["observed"] == "fail" for x in ctl)
    lr, mask, comp = ctl
    assert "lr x10" in lr["changed"] and lr["correlation"] < 0.95 and lr["final_loss_difference"] > 0.05
    assert "loss mask" in mask["changed"] and mask["final_loss_difference"] > 0.05
    assert "bias correction" in comp["changed"]


def test_layout_breaking_a_rule_fails_configuration(tmp_path, capsys):
    r = make_recipe()
    r["layout"]["recompute"]["num_layers"] = 9  # block recompute of 9 layers on a 5-layer stage
    r["run"] = r["run"].replace("--recompute-num-layers 2", "--recompute-num-layers 9")
    res = verify_recipe(copy.deepcopy(r), "torch", steps=20, workdir=tmp_path / "w")
    assert res["status"] == "failed" and res["correctness"]["result"] == "fail"
    assert res["correctness"]["configuration"] == "fail"
    assert "block recompute of 9 layers" in res["correctness"]["summary"]
    assert res["arms"] == {}  # nothing ran
    path = tmp_path / "bad.yaml"
    write_recipe(r, path)
    assert main(["verify", str(path)]) == 1
    assert load_recipe(path)["status"] == "failed"
    assert "configuration check" in capsys.readouterr().err


def test_run_block_disagreeing_with_layout_fails_configuration(tmp_path):
    r = make_recipe()
    r["run"] = r["run"].replace("--decoder-first-pipeline-num-layers 5", "--decoder-first-pipeline-num-layers 4")
    res = verify_recipe(r, "torch", workdir=tmp_path / "w")
    assert res["correctness"]["configuration"] == "fail"
    assert any("lint" in e for e in res["configuration"]["errors"])


def test_bad_input_exit_2(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such recipe file" in err
    with pytest.raises(VerifyError):
        verify_recipe(make_recipe(), "torch", steps=2, workdir=tmp_path / "w")
    tp2 = make_recipe(Layout(tp=2, dp=1, max_tokens_per_gpu=256), "tiny-llama")
    with pytest.raises(VerifyError, match="not supported by the torch runner"):
        verify_recipe(tp2, "torch", workdir=tmp_path / "w2")
