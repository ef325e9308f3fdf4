import csv

import optuna
import pytest

from attune.cli import main
from attune.recipe import lint, load_recipe


@pytest.mark.slow
def test_tune_with_real_torch_trials(tmp_path):
    """The whole loop for real: propose, estimate, run with torchrun, measure, learn, write."""
    out = tmp_path / "torch"
    rc = main(["tune", "--model", "tiny-llama", "--gpus", "2xcpu", "--runner", "torch", "--trials", "2",
               "--steps", "8", "--candidates", "8", "--out", str(out), "--no-copy", "--no-verify"])
    assert rc == 0
    r = load_recipe(out / "recipe.yaml")
    assert r["status"] == "measured" and r["result"]["measured"]
    assert r["result"]["tokens_per_s_per_gpu"] > 0 and r["result"]["gpu_hours"] > 0
    assert not [f for f in lint(r) if f.severity == "error"]
    rows = [x for x in csv.DictReader((out / "trials.csv").open()) if x["role"]]
    assert len(rows) >= 2
    for x in rows:
        if x["state"] == "COMPLETE":
            # predicted against measured, both present, with the model's error
            assert float(x["measured_tokens_per_s_per_gpu"]) > 0 and float(x["predicted_tokens_per_s_per_gpu"]) > 0
            assert float(x["measured_peak_gib"]) > 0.1 and float(x["predicted_peak_gib"]) > 0.1
            assert x["memory_error_percent"] != "" and x["throughput_error_percent"] != ""
    report = (out / "report.md").read_text()
    assert "Model error on measured trials" in report
    s = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    assert all((t.user_attrs.get("gpu_hours") or 0) > 0 for t in s.trials if t.user_attrs.get("role"))
