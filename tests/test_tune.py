import csv
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from attune.cli import main
from dataclasses import replace

from attune.spec.layout import Workload
from attune.spec.placement import stage_layer_counts
from attune.recipe import lint, load_recipe, schema_errors
from attune.search.space import SearchSpaceError, load_space
from attune.search.study import ORPHAN_AGE_S

REPO = Path(__file__).resolve().parents[1]
SPACE = REPO / "search_spaces" / "dense.yaml"


def _tune(out, *extra):
    return main(["tune", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--out", str(out), "--no-copy",
                 "--candidates", "8", *extra])


def _study(out):
    s = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    return s


def test_space_domains_fixed_and_baseline_round_trip(qwen, h200x8, slime, seed_cases):
    sp = load_space(SPACE)
    d1, d2 = sp.distributions(), sp.distributions()
    assert d1 == d2 and {"first_offset", "last_offset", "recompute_layers", "tp", "pp"} <= set(d1)
    for name in ("rb12", "slime"):
        lay = seed_cases[name]
        params = sp.params_for(lay, qwen, Workload())
        assert params is not None
        back = sp.to_layout(params, qwen, 8, Workload(), slime)
        assert back == replace(lay, first=back.first, last=back.last)
        assert stage_layer_counts(back, 64) == stage_layer_counts(lay, 64)


@pytest.mark.parametrize("text,needle", [
    ("knobs: [1, 2", "malformed YAML"),
    ("knobs:\n  warp: [1]\n", "knobs.warp: unknown knob"),
    ("knobs:\n  tp: [1, 2]\nfixed:\n  tp: 1\n", "contradictory"),
    ("knobs:\n  first_offset: {low: 3, high: 1}\n", "low 3 > high 1"),
    ("knobs:\n  recompute: [full, most]\n", "'most' not allowed"),
    ("knobs:\n  tp: [0, 2]\n", "positive integer"),
    ("fixed:\n  optimizer_cpu_offload: true\n  precision_aware_optimizer: false\n", "precision_aware_optimizer"),
])
def test_bad_search_spaces(tmp_path, text, needle):
    p = tmp_path / "space.yaml"
    p.write_text(text)
    with pytest.raises(SearchSpaceError, match=needle) as e:
        load_space(p)
    assert str(p) in str(e.value)


def test_tune_sim_end_to_end_and_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert _tune(out, "--trials", "4") == 0
    s = _study(out)
    measured = [t for t in s.trials if t.user_attrs.get("role")]
    assert measured[0].user_attrs["role"] == "baseline"
    assert measured[0].user_attrs["label"].startswith("TP4 SP PP2 34/30")
    assert len([t for t in measured if t.state == optuna.trial.TrialState.COMPLETE]) == 4
    # predicted OOMs never reach the runner: they are infeasible pruned trials with the overflowing stage
    ooms = [t for t in s.trials if t.user_attrs.get("kind") == "oom-predicted"]
    assert ooms and all(t.state == optuna.trial.TrialState.PRUNED and max(t.constraints.values()) > 0 for t in ooms)
    assert all("stage" in t.user_attrs["reason"] for t in ooms)
    assert all(not t.user_attrs.get("role") for t in ooms)
    # outputs
    r = load_recipe(out / "recipe.yaml")
    assert schema_errors(r) == [] and not [f for f in lint(r) if f.severity == "error"]
    assert r["status"] == "predicted" and r["result"]["tokens_per_s_per_gpu"] > 948
    assert "train_async.py" in r["run"] and "Gain over the baseline" in r["notes"]
    for png in ("best_so_far.png", "memory_by_stage.png", "candidates.png", "winner_vs_baseline.png"):
        assert (out / png).stat().st_size > 1000
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert len(rows) == len(s.trials)
    assert {"number", "state", "runner", "predicted_peak_gib", "measured_peak_gib", "predicted_tokens_per_s_per_gpu",
            "measured_tokens_per_s_per_gpu", "reason"} <= set(rows[0])
    report = (out / "report.md").read_text()
    assert "predicted out of memory" in report and "Gain" in report
    # rerunning resumes up to the new target instead of starting over
    n_before = len(s.trials)
    assert _tune(out, "--trials", "6") == 0
    s = _study(out)
    assert len([t for t in s.trials if t.user_attrs.get("role") and t.state == optuna.trial.TrialState.COMPLETE]) == 6
    assert len([t for t in s.trials if t.user_attrs.get("role") == "baseline"]) == 1
    n_after = len(s.trials)
    assert n_after > n_before
    assert _tune(out, "--trials", "6") == 0
    assert len(_study(out).trials) == n_after  # target reached: nothing new


def test_study_survives_kill(tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "attune.cli", "tune", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--out", str(out),
           "--no-copy", "--candidates", "8", "--trials", "40"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    deadline = time.time() + 60
    while time.time() < deadline:
        time.sleep(0.5)
        db = out / "study.db"
        if db.exists():
            # read-only polling: opening an Optuna storage here could race the tuner's schema creation
            try:
                con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
                n = con.execute("select count(*) from trial_user_attributes where key = 'role'").fetchone()[0]
                con.close()
            except sqlite3.Error:
                n = 0
            if n >= 3:
                break
    p.send_signal(signal.SIGKILL)
    p.wait()
    time.sleep(ORPHAN_AGE_S + 0.5)  # a trial asked but not yet tagged when the tuner died is judged by its age
    before = _study(out)
    done_before = [t for t in before.trials if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs.get("role")]
    assert len(done_before) >= 2
    assert _tune(out, "--trials", str(len(done_before) + 2)) == 0
    after = _study(out)
    assert not [t for t in after.trials if t.state == optuna.trial.TrialState.RUNNING]
    done_after = [t for t in after.trials if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs.get("role")]
    assert len(done_after) == len(done_before) + 2
    assert {t.number for t in done_before} <= {t.number for t in done_after}  # nothing finished was lost


def test_journal_storage_and_study_mismatch(tmp_path, capsys):
    out = tmp_path / "j"
    journal = tmp_path / "shared.journal"
    assert _tune(out, "--trials", "2", "--storage", str(journal), "--study-name", "shared") == 0
    assert journal.stat().st_size > 0
    # the same study name for another model is refused, naming what differs
    rc = main(["tune", "--model", "Llama-3.1-8B", "--gpus", "8xH200", "--out", str(out), "--no-copy",
               "--trials", "2", "--storage", str(journal), "--study-name", "shared"])
    assert rc == 2 and "created for model='Qwen3.6-27B'" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--model", "Qwen3.6-27B", "--gpus", "8xH200", "--search-space", "/nonexistent/space.yaml"], "no such search space"),
    (["--model", "Qwen3.6-27B", "--gpus", "8xZ900"], "unknown GPU type"),
    (["--model", "Qwen3.6-27B", "--gpus", "8xH200", "--out", "/proc/attune-cannot-write"], "not writable"),
])
def test_tune_bad_input(argv, needle, capsys):
    assert main(["tune", "--no-copy", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_no_layout_fits(tmp_path, capsys):
    rc = main(["tune", "--model", "Llama-3.1-70B", "--gpus", "1xA100", "--out", str(tmp_path / "x"), "--no-copy",
               "--candidates", "8", "--trials", "3"])
    err = capsys.readouterr().err
    assert rc == 1 and "no layout fits 1xA100" in err and "smallest shortfall" in err
