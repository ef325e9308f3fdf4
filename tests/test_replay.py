"""The replay runner: a table of measured outcomes keyed by Megatron/slime flags, a recorded trials.csv replayed
as-is, and one-line errors for bad tables."""

import csv
from pathlib import Path

import pytest

from attune.api.tune import tune
from attune.cli import main
from attune.runners.base import FAILED, OK, OOM, TrialSpec
from attune.runners.replay import ReplayRunner, ReplayTableError
from attune.search.records import records
from attune.spec.flags import to_flags
from attune.spec.layout import Layout, Workload

SMALL = str(Path(__file__).parent / "fixtures" / "spaces" / "dense_small.yaml")
TARGET = dict(model="Qwen3.6-27B", gpus="8xH200", search_space=SMALL)
A = "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2"
B = "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --recompute-granularity full " \
    "--recompute-method uniform --recompute-num-layers 1"


def _write(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def test_flags_table_answers_and_misses(tmp_path, qwen, h200x8, slime):
    p = _write(tmp_path / "m.csv", ["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s", "peak_gib", "oom_stage"],
               [[A, "ok", "1234.5", "110.0", "70.1;71.2", ""], [B, "oom", "", "", "", "3"]])
    r = ReplayRunner(p, model=qwen, world_size=8)
    spec = lambda lay: TrialSpec(model=qwen, cluster=h200x8, layout=lay, workload=Workload(), engine=slime)  # noqa: E731
    res = r.run(spec(Layout(tp=2, sp=True, pp=2, dp=2)))
    assert res.status == OK and res.tokens_per_s_per_gpu == 1234.5 and res.peak_memory_gib == [70.1, 71.2]
    assert res.gpu_hours > 0 and res.measured
    uniform3 = Layout(tp=1, pp=4, dp=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3)
    res = r.run(spec(uniform3))  # uniform recompute in groups of 3 is the same layout as groups of 1
    assert res.status == OOM and res.oom_stage == 3
    res = r.run(spec(Layout(tp=4, dp=2)))
    assert res.status == FAILED and "not in the table" in res.reason


@pytest.mark.parametrize("header,rows,needle", [
    (["flags", "outcome", "tokens_per_s_per_gpu"], [[A, "ok", "1"]], "missing column(s) step_time_s"),
    (["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s"], [[A + " --warp-drive 3", "ok", "1", "1"]],
     "unknown flag --warp-drive"),
    (["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s"], [[A, "ok", "1", "1"], [A, "oom", "", ""]],
     "rows 2 and 3 are the same layout"),
    (["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s"], [[A, "fast", "1", "1"]], "outcome 'fast'"),
    (["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s"], [[A, "ok", "lots", "1"]], "is not a number"),
])
def test_bad_tables_are_one_line_errors(tmp_path, qwen, header, rows, needle):
    p = _write(tmp_path / "m.csv", header, rows)
    with pytest.raises(ReplayTableError) as e:
        ReplayRunner(p, model=qwen, world_size=8)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_cli_bad_table_exits_2(tmp_path, capsys):
    p = _write(tmp_path / "m.csv", ["flags", "outcome"], [[A, "ok"]])
    rc = main(["tune", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--runner", "replay", "--measurements", str(p),
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "missing column(s)" in err and len(err.splitlines()) == 1
    rc = main(["tune", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--runner", "replay", "--out", str(tmp_path / "o")])
    assert rc == 2 and "--measurements" in capsys.readouterr().err


def test_yaml_table(tmp_path, qwen):
    p = tmp_path / "m.yaml"
    p.write_text(f"rows:\n  - {{flags: '{A}', outcome: ok, tokens_per_s_per_gpu: 900, step_time_s: 140}}\n")
    assert ReplayRunner(p, model=qwen, world_size=8).rows[0].tokens_per_s_per_gpu == 900


def test_replaying_a_recorded_trials_csv(tmp_path):
    first = tune(**TARGET, out=tmp_path / "sim", trials=4)
    recorded = {r.label: r.value for r in records(first.outcome.study) if r.is_measured and r.value}
    # the recorded study, replayed offline: the same layouts answer with the recorded numbers
    again = tune(**TARGET, runner="replay", measurements=str(tmp_path / "sim" / "trials.csv"), out=tmp_path / "replay",
                 trials=4)
    meas = [r for r in records(again.outcome.study) if r.is_measured]
    assert meas[0].role == "baseline" and meas[0].value == pytest.approx(recorded[meas[0].label])
    assert again.outcome.best.value == pytest.approx(max(recorded.values()))
    for r in meas:
        assert (r.value is not None and r.value == pytest.approx(recorded[r.label])) or "not in the table" in r.reason
    assert again.verdict is None  # a replayed table cannot be verified
    # a flags table written from the same layouts reads the same way
    rows = [[" ".join(to_flags(r.to_layout(), Workload())), "ok", r.value, 100.0] for r in meas if r.value]
    p = _write(tmp_path / "flags.csv", ["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s"], rows)
    assert len(ReplayRunner(p, model=first.config.model, world_size=8).rows) == len(rows)
