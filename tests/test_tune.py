"""The study: search spaces as package data, the typed TrialRecord, trials.csv, the Tuner on the sim runner
(end to end, resume, kill), outputs under the working directory, and the CLI's errors."""

import csv
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from importlib import resources
from pathlib import Path

import optuna
import pytest

from attune.api.tune import default_out_dir, tune, tune_config
from attune.cli import main
from attune.recipe import lint, load_recipe, schema_errors
from attune.reporting import CSV_FIELDS, rerun_of, trials_frame, write_csv
from attune.search.records import INTERRUPTED, TrialRecord, records, study_counts
from attune.search.space import SearchSpaceError, bundled_spaces, load_space
from attune.search.tuner import Tuner
from attune.spec.layout import Workload
from attune.spec.placement import stage_layer_counts

# a small, fast sim study over a cut of the dense space (a few thousand layouts)
SMALL = str(Path(__file__).parent / "fixtures" / "spaces" / "dense_small.yaml")
FAST = dict(model="Qwen3.6-27B", gpus="8xH200", candidates=8, search_space=SMALL)


def _study(out):
    return optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")


def _measured_complete(study):
    return [r for r in records(study) if r.is_measured and r.completed]


# ------------------------------------------------------------------------------------------ search spaces
def test_space_domains_fixed_and_baseline_round_trip(qwen, h200x8, slime, seed_cases):
    sp = load_space(None)
    d1, d2 = sp.distributions(), sp.distributions()
    assert d1 == d2 and {"first_offset", "last_offset", "recompute_layers", "tp", "pp"} <= set(d1)
    for name in ("rb12", "slime"):
        lay = seed_cases[name]
        params = sp.params_for(lay, qwen, Workload())
        assert params is not None
        back = sp.to_layout(params, qwen, 8, Workload(), slime)
        assert back == replace(lay, first=back.first, last=back.last)
        assert stage_layer_counts(back, 64) == stage_layer_counts(lay, 64)


def test_spaces_are_package_data(tmp_path, monkeypatch):
    # found through importlib.resources, not the checkout: works from any directory and from a wheel
    monkeypatch.chdir(tmp_path)
    assert bundled_spaces() == ["dense", "moe", "small", "small-moe"]  # moe, small-moe: issue 14
    files = {f.name for f in resources.files("attune.search.spaces").iterdir()}
    assert {"dense.yaml", "small.yaml"} <= files
    assert load_space(None).name == "dense" and load_space("small").name == "small"
    assert load_space("small").fixed["tp"] == 1
    own = tmp_path / "mine.yaml"
    own.write_text("name: mine\nknobs:\n  pp: [1, 2]\n")
    assert load_space(own).name == "mine" and load_space(str(own)).knobs == {"pp": (1, 2)}
    with pytest.raises(SearchSpaceError, match="bundled spaces: dense, moe, small"):
        load_space("tiny")


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


# ------------------------------------------------------------------------------------------ TrialRecord
def _full_record() -> TrialRecord:
    return TrialRecord(
        role="candidate", runner="torch", host="h", pid=7, layout={"tp": 1, "pp": 2, "dp": 1, "first": 3, "last": 2},
        label="TP1 PP2 3/2 DP1", predicted_tokens_per_s_per_gpu=120.0, predicted_step_time_s=1.5, predicted_mfu=0.1,
        predicted_peak_gib=2.0, predicted_peak_stage=0, predicted_stage_gib=[2.0, 1.5], outcome="ok", measured=True,
        gpu_hours=0.01, reason="slow start", log_tail="...", measured_peak_gib=[1.6, 1.2], tokens_per_s_per_gpu=100.0,
        step_time_s=1.8, step_time_cv_percent=2.5, window=[5, 19], window_tokens=4096, losses={"0": 9.1, "1": 8.7},
        extra={"note": "x"}, oom_stage=None)


def test_trial_record_round_trip():
    study = optuna.create_study(direction="maximize")
    rec = _full_record()
    t = study.ask()
    rec.save(t)
    study.tell(t, 100.0)
    back = TrialRecord.from_trial(study.trials[0])
    assert replace(back, number=None, state=None, value=None) == rec
    assert (back.number, back.state, back.value) == (0, "COMPLETE", 100.0)
    # the attribute names are the ones older studies hold (resume reads them)
    assert set(rec.to_user_attrs()) == set(study.trials[0].user_attrs)
    assert {"role", "layout", "predicted_peak_gib", "measured_peak_gib", "outcome", "losses"} <= set(rec.to_user_attrs())
    # derived numbers: predicted against measured
    assert back.measured_peak_max_gib == 1.6 and back.measured_throughput == 100.0
    assert back.memory_error_percent == 25.0 and back.throughput_error_percent == 20.0
    assert back.to_layout().pp == 2


def test_trial_record_defaults_and_checks():
    study = optuna.create_study()
    t = study.ask()
    study.tell(t, state=optuna.trial.TrialState.FAIL)
    r = TrialRecord.from_trial(study.trials[0])
    assert r.reason == INTERRUPTED and not r.is_measured and r.layout is None
    with pytest.raises(KeyError):
        r.to_layout()
    with pytest.raises(ValueError, match="allowed baseline, candidate"):
        TrialRecord(role="winner")
    assert TrialRecord(measured=False, measured_peak_gib=[3.0]).measured_peak_max_gib is None  # sim: not measured


def test_trials_csv_from_trials_dataframe(tmp_path):
    study = optuna.create_study(direction="maximize")
    t = study.ask()
    _full_record().save(t)
    study.tell(t, 100.0)
    t = study.ask()
    TrialRecord(kind="invalid", reason="TP 3 does not divide 8 GPUs").save(t)
    study.tell(t, state=optuna.trial.TrialState.PRUNED)
    assert list(trials_frame(study).columns) == CSV_FIELDS
    rows = list(csv.DictReader(write_csv(study, tmp_path / "trials.csv").open()))
    assert [r["number"] for r in rows] == ["0", "1"] and [r["state"] for r in rows] == ["COMPLETE", "PRUNED"]
    assert rows[0]["measured_peak_gib"] == "1.6" and rows[0]["measured_tokens_per_s_per_gpu"] == "100.0"
    assert rows[0]["memory_error_percent"] == "25.0" and rows[0]["first"] == "3" and rows[0]["tp"] == "1"
    assert rows[1]["kind"] == "invalid" and rows[1]["label"] == "" and rows[1]["reason"].startswith("TP 3")
    # written from the records directly: the same bytes as the DataFrame's CSV (no integer column has an empty cell
    # here; where one has, pandas writes 1.0 and the csv module 1)
    trials_frame(study).to_csv(tmp_path / "frame.csv", index=False, na_rep="", lineterminator="\r\n")
    assert (tmp_path / "trials.csv").read_bytes() == (tmp_path / "frame.csv").read_bytes()


# ------------------------------------------------------------------------------------------ the tuner, end to end
def test_tune_sim_end_to_end_and_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may land outside --out (recipes/ included)
    out = tmp_path / "run"
    res = tune(**FAST, trials=1, out=out)
    s = _study(out)
    measured = [r for r in records(s) if r.is_measured]
    assert measured[0].role == "baseline" and measured[0].label.startswith("TP4 SP PP2 34/30")
    assert len(s.trials) == len(measured) == 1  # trials are measured runs only
    assert res.outcome.stop_kind == "trials"
    # rerunning resumes: the sampler's first pick is the model's optimum; the sim runner is exact, so the stop
    # rule ends the study right after it
    res = tune(**FAST, trials=5, out=out)
    s = _study(out)
    assert len(_measured_complete(s)) == 2 and len([r for r in records(s) if r.role == "baseline"]) == 1
    assert res.outcome.stop_kind == "rule" and res.outcome.best.number == 1
    assert res.outcome.best.value > measured[0].value
    best = records(s)[1]
    assert best.predicted_tokens_per_s_per_gpu == pytest.approx(best.value, rel=1e-3)  # the prediction stays
    # outputs
    r = load_recipe(out / "recipe.yaml")
    assert schema_errors(r) == [] and not [f for f in lint(r) if f.severity == "error"] and not res.lint_errors
    assert r["status"] == "predicted" and r["result"]["tokens_per_s_per_gpu"] > measured[0].value
    assert "train_async.py" in r["run"] and "Gain over the baseline" in r["notes"]
    for png in ("best_so_far.png", "memory_by_stage.png", "candidates.png", "winner_vs_baseline.png"):
        assert (out / png).stat().st_size > 1000
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert len(rows) == len(s.trials) and list(rows[0]) == CSV_FIELDS
    report = (out / "report.md").read_text()
    assert "Stopped by rule" in report and "Gain" in report and "Top 10 predicted layouts" in report
    assert res.saved_recipe is None and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert any(line.startswith(f"winner: {best.label}") for line in res.summary_lines())
    n_after = len(s.trials)
    tune(**FAST, trials=5, out=out, save_recipe=True, recipes_root=tmp_path / "checkout")
    assert len(_study(out).trials) == n_after  # the stop rule still holds: nothing new
    assert list((tmp_path / "checkout" / "recipes" / "qwen3.6-27b" / "h200").glob("attune-*.yaml"))
    assert study_counts(_study(out)).measured_ok == 2


def test_tpe_sampler_still_available(tmp_path):
    res = tune(**{**FAST, "candidates": 16}, trials=3, out=tmp_path / "tpe", sampler="tpe")
    s = res.outcome.study
    assert len(_measured_complete(s)) == 3 and res.outcome.stop_kind == "trials"
    # TPE learns from its rejected proposals: they stay PRUNED trials with the reason
    assert all(r.kind is not None for r in records(s) if not r.is_measured)


def test_default_out_dir_is_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tune_config(**FAST)
    assert cfg.out_dir == default_out_dir("Qwen3.6-27B", "8xH200") and cfg.out_dir.parent == tmp_path / "reports"
    assert cfg.storage == f"sqlite:///{cfg.out_dir / 'study.db'}"


def test_recipe_run_block_is_the_measuring_runners(tmp_path):
    slime_cfg = tune_config(**FAST, out=tmp_path / "s")
    torch_cfg = tune_config(model="tiny-llama", gpus="2xcpu", runner="torch", out=tmp_path / "t")
    assert torch_cfg.engine.name == "torch" and torch_cfg.space.name == "small" and torch_cfg.trials == 3
    rerun = rerun_of(slime_cfg, slime_cfg.baseline)
    assert "train_async.py" in rerun.command and rerun.env
    assert rerun.stack["slime"].startswith("624b824a ") and "pytorch" not in rerun.stack
    rerun = rerun_of(torch_cfg, torch_cfg.baseline)
    assert rerun.command.startswith("attune run --runner torch --model tiny-llama --gpus 2xcpu") and rerun.env == {}
    assert "--pipeline-model-parallel-size" in rerun.command and "slime" not in rerun.stack


def test_stale_trials_failed_by_heartbeat(tmp_path):
    cfg = tune_config(**FAST, trials=1, out=tmp_path, heartbeat_interval_s=1, grace_period_s=2)
    tuner = Tuner(cfg)
    study = tuner.open_study()
    measured = tuner._ask()  # a measured trial whose tuner died: one heartbeat, then silence
    TrialRecord(role="candidate").save(measured)
    tuner._rdb.record_heartbeat(tuner._rdb.get_trial_id_from_study_id_trial_number(
        tuner._rdb.get_study_id_from_name(cfg.study_name), measured.number))
    tuner._ask()  # a proposal asked but never told: no role, no heartbeat
    assert tuner.fail_stale_trials() == 0  # both too young to judge
    time.sleep(3.2)  # > grace period (SQLite keeps heartbeat times to the second)
    assert tuner.fail_stale_trials() == 2
    failed = records(study, (optuna.trial.TrialState.FAIL,))
    assert len(failed) == 2 and all(r.reason == INTERRUPTED for r in failed)


# plain TPE (no stop rule on the exact sim runner) over the small space, up to 16 proposals per measured trial
_KILLABLE = ("from attune.api.tune import tune; "
             "tune(model='Qwen3.6-27B', gpus='8xH200', candidates=16, trials={trials}, out={out!r}, "
             "sampler='tpe', search_space=" + repr(SMALL) + ", heartbeat_interval_s=1, grace_period_s=2)")


def test_study_survives_kill(tmp_path):
    out = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "-c", _KILLABLE.format(trials=40, out=str(out))],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
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
            if n >= 2:  # the baseline finished, a candidate started
                break
    p.send_signal(signal.SIGKILL)
    p.wait()
    time.sleep(3.2)  # past the grace period of 2 s: the killed tuner's trials are stale
    before = _study(out)
    done_before = _measured_complete(before)
    assert len(done_before) >= 1
    subprocess.run([sys.executable, "-c", _KILLABLE.format(trials=len(done_before) + 1, out=str(out))],
                   check=True, cwd=tmp_path, capture_output=True)
    after = _study(out)
    assert not [t for t in after.trials if t.state == optuna.trial.TrialState.RUNNING]
    done_after = _measured_complete(after)
    assert len(done_after) == len(done_before) + 1
    assert {r.number for r in done_before} <= {r.number for r in done_after}  # nothing finished was lost


# ------------------------------------------------------------------------------------------ the CLI
def test_journal_storage_and_study_mismatch(tmp_path, capsys):
    out = tmp_path / "j"
    journal = tmp_path / "shared.journal"
    assert main(["tune", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--out", str(out), "--candidates", "8",
                 "--trials", "2", "--storage", str(journal), "--study-name", "shared", "--search-space", SMALL]) == 0
    assert journal.stat().st_size > 0
    # the same study name for another model is refused, naming what differs
    rc = main(["tune", "--model", "Llama-3.1-8B", "--gpus", "8xH200", "--out", str(tmp_path / "j2"),
               "--trials", "2", "--storage", str(journal), "--study-name", "shared", "--search-space", SMALL])
    assert rc == 2 and "created for model='Qwen3.6-27B'" in capsys.readouterr().err
    # and its --out folder, holding the other study's files, is refused before any work
    rc = main(["tune", "--model", "Llama-3.1-8B", "--gpus", "8xH200", "--out", str(out),
               "--trials", "2", "--storage", str(journal), "--study-name", "shared", "--search-space", SMALL])
    assert rc == 2 and "holds the files of study 'shared' (Qwen3.6-27B" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--model", "Qwen3.6-27B", "--gpus", "8xH200", "--search-space", "/nonexistent/space.yaml"], "no such search space"),
    (["--model", "Qwen3.6-27B", "--gpus", "8xZ900"], "unknown GPU type"),
    (["--model", "Qwen3.6-27B", "--gpus", "8xH200", "--out", "/proc/attune-cannot-write"], "cannot write there"),
])
def test_tune_bad_input(argv, needle, capsys):
    assert main(["tune", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_no_layout_fits(tmp_path, capsys):
    rc = main(["tune", "--model", "Llama-3.1-70B", "--gpus", "1xA100", "--out", str(tmp_path / "x"),
               "--candidates", "8", "--trials", "3"])
    err = capsys.readouterr().err
    assert rc == 1 and "no layout fits 1xA100" in err and "smallest shortfall" in err
    assert (tmp_path / "x" / "trials.csv").exists()
