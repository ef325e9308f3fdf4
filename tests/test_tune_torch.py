"""The whole loop for real, once: propose, estimate, run with torchrun, measure, learn, write. One tuning session
(a module fixture, through the CLI) that every assertion below reads."""

import csv
import json

import optuna
import pytest

from attune.cli import main
from attune.recipe import lint, load_recipe
from attune.search.records import records

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def torch_study(tmp_path_factory):
    """`attune tune` on the torch runner: tiny-llama on 2 CPU workers, 2 measured trials of 8 steps."""
    out = tmp_path_factory.mktemp("tune-torch") / "out"
    rc = main(["tune", "--model", "tiny-llama", "--gpus", "2xcpu", "--runner", "torch", "--trials", "2",
               "--steps", "8", "--candidates", "8", "--out", str(out), "--no-verify"])
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    return rc, out, study


def test_exit_code_and_measured_recipe(torch_study):
    rc, out, _ = torch_study
    assert rc == 0
    r = load_recipe(out / "recipe.yaml")
    assert r["status"] == "measured" and r["result"]["measured"]
    assert r["result"]["tokens_per_s_per_gpu"] > 0 and r["result"]["gpu_hours"] > 0
    assert not [f for f in lint(r) if f.severity == "error"]


def test_run_block_is_the_torch_runners_command(torch_study):
    _, out, _ = torch_study
    r = load_recipe(out / "recipe.yaml")
    assert r["run"].startswith("attune run --runner torch --model tiny-llama --gpus 2xcpu --steps 8 --")
    assert "train_async.py" not in r["run"] and r["env"] == {}


def test_trials_csv_predicted_against_measured(torch_study):
    _, out, _ = torch_study
    rows = [x for x in csv.DictReader((out / "trials.csv").open()) if x["role"]]
    assert len(rows) >= 2
    for x in rows:
        if x["state"] == "COMPLETE":
            # predicted against measured, both present, with the model's error
            assert float(x["measured_tokens_per_s_per_gpu"]) > 0 and float(x["predicted_tokens_per_s_per_gpu"]) > 0
            assert float(x["measured_peak_gib"]) > 0.1 and float(x["predicted_peak_gib"]) > 0.1
            assert x["memory_error_percent"] != "" and x["throughput_error_percent"] != ""
    assert "Model error on measured trials" in (out / "report.md").read_text()


def test_measured_trials_record_their_cost_and_folder(torch_study):
    _, out, study = torch_study
    measured = [r for r in records(study) if r.is_measured]
    assert measured and all((r.gpu_hours or 0) > 0 and r.runner == "torch" and r.measured for r in measured)
    for r in measured:
        # the runner owns its trial folder, named by the Optuna trial number; its result carries that number
        (folder,) = (out / "trials").glob(f"{r.number:05d}-*")
        assert json.loads((folder / "result.json").read_text())["trial_number"] == r.number
