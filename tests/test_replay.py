"""The replay runner: a table of measured outcomes keyed by Megatron/slime flags, a recorded trials.csv replayed
as-is, and one-line errors for bad tables."""

import csv
import dataclasses
import tempfile
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
# slime always runs the distributed optimizer (it changes memory, so it is part of a layout's identity)
A = "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --use-distributed-optimizer"
B = "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --recompute-granularity full " \
    "--recompute-method uniform --recompute-num-layers 1 --use-distributed-optimizer"


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
    uniform1 = Layout(tp=1, pp=4, dp=2, recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    res = r.run(spec(uniform1))
    assert res.status == OOM and res.oom_stage == 3
    # uniform recompute in groups of 3 keeps a third of the group inputs and rebuilds 3 layers at once: another layout
    res = r.run(spec(dataclasses.replace(uniform1, recompute_num_layers=3)))
    assert res.status == FAILED and "not in the table" in res.reason
    res = r.run(spec(Layout(tp=2, sp=True, pp=2, dp=2, overlap_grad_reduce=True)))  # overlap on: not row A
    assert res.status == FAILED
    res = r.run(spec(Layout(tp=4, dp=2)))
    assert res.status == FAILED and "not in the table" in res.reason


@pytest.mark.parametrize("header,rows,needle", [
    (["flags", "outcome", "tokens_per_s_per_gpu"], [[A, "ok", "1"]], "missing column(s) step_time_s"),
    (["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s"], [[A + " --warp-drive 3", "ok", "1", "1"]],
     "unknown flag --warp-drive"),
    (["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s"], [[A, "ok", "1", "1"], [A, "oom", "", ""]],
     "rows 2 and 3 are the same layout"),
    (["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s"], [[A, "fast", "1", "1"]],
     "outcome: 'fast' not allowed; allowed: 'ok', 'oom' or 'failed'"),
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


UNIFORM = "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --use-distributed-optimizer " \
          "--recompute-granularity full --recompute-method uniform --recompute-num-layers {n}"


def test_one_row_per_uniform_group_size_each_answers_its_own(tmp_path, qwen, h200x8, slime):
    """Issue 19: a complete table with one row per uniform group size is accepted, and each row answers its own
    layout (groups of N keep 64/N inputs and rebuild N layers at once: different memory and speed)."""
    sizes = (1, 2, 3, 4, 8)
    p = _write(tmp_path / "m.csv", ["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s"],
               [[UNIFORM.format(n=n), "ok", str(1000 + n), "100"] for n in sizes])
    r = ReplayRunner(p, model=qwen, world_size=8)
    for n in sizes:
        lay = Layout(tp=1, pp=1, dp=8, recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=n)
        res = r.run(TrialSpec(model=qwen, cluster=h200x8, layout=lay, workload=Workload(), engine=slime))
        assert res.status == OK and res.tokens_per_s_per_gpu == 1000 + n


@pytest.mark.parametrize("a,b", [
    (UNIFORM.format(n=2), UNIFORM.format(n=2)),
    # the overlap flags are part of the layout: the same flags twice, with overlap on, are one layout
    (A + " --overlap-grad-reduce --overlap-param-gather", "--overlap-param-gather --overlap-grad-reduce " + A),
    # a group size past the model's layers is one group, like a group of all of them
    (UNIFORM.format(n=64), UNIFORM.format(n=99)),
])
def test_two_rows_of_one_layout_are_refused_in_one_line(tmp_path, qwen, a, b):
    p = _write(tmp_path / "m.csv", ["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s"],
               [[a, "ok", "1", "1"], [b, "ok", "2", "1"]])
    with pytest.raises(ReplayTableError) as e:
        ReplayRunner(p, model=qwen, world_size=8)
    assert "rows 2 and 3 are the same layout" in str(e.value) and "\n" not in str(e.value)


def test_overlap_flags_are_another_layout(tmp_path, qwen, h200x8, slime):
    """Overlap on and overlap off are two rows of a table, and neither answers the other's trial."""
    on = A + " --overlap-grad-reduce --overlap-param-gather"
    p = _write(tmp_path / "m.csv", ["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s"],
               [[on, "ok", "2000", "1"]])
    r = ReplayRunner(p, model=qwen, world_size=8)
    spec = lambda lay: TrialSpec(model=qwen, cluster=h200x8, layout=lay, workload=Workload(), engine=slime)  # noqa: E731
    base = Layout(tp=2, sp=True, pp=2, dp=2)
    assert r.run(spec(dataclasses.replace(base, overlap_grad_reduce=True, overlap_param_gather=True))).status == OK
    assert r.run(spec(base)).status == FAILED


def test_one_layout_key_accounts_for_every_layout_field(qwen):
    """Every Layout field changes the key (where it can change a run) or is carried as the stage layers."""
    from attune.spec.identity import KEY_DERIVED_FIELDS, layout_key
    L = qwen.num_layers
    base = Layout(tp=2, sp=True, pp=4, dp=1, first=15, last=15, recompute_granularity="full",
                  recompute_method="uniform", recompute_num_layers=2, optimizer_cpu_offload=True,
                  precision_aware_optimizer=True)
    k0 = layout_key(base, L)
    changes = dict(tp=4, pp=1, dp=2, cp=2, ep=2, etp=2, moe_dispatcher="alltoall", moe_grouped_gemm=True,
                   moe_permute_fusion=True, moe_shared_expert_overlap=True, moe_capacity_factor=1.0,
                   moe_force_balance=True, sp=False, vpp=2, micro_batch_size=2, max_tokens_per_gpu=8192,
                   recompute_granularity="selective", recompute_method="block", recompute_num_layers=3, mtp_layers=1,
                   distributed_optimizer=False, precision_aware_optimizer=False, optimizer_cpu_offload=False,
                   offload_fraction=0.5, overlap_cpu_optimizer=True, precision="fp16", overlap_grad_reduce=True,
                   overlap_param_gather=True, tp_comm_overlap=True, account_for_embedding=True,
                   account_for_loss=True, recompute_modules=("mlp",), offload_modules=("core_attn",),
                   moe_ep_overlap=True, fp8_format="e4m3", fp8_recipe="blockwise", fp8_param_gather=True,
                   fp4_format="e2m1")
    fields = {f.name for f in dataclasses.fields(Layout)}
    assert set(changes) | set(KEY_DERIVED_FIELDS) == fields
    for f, v in changes.items():
        lay = dataclasses.replace(base, **{f: v})
        if f == "recompute_modules":
            lay = dataclasses.replace(lay, recompute_granularity="selective")
            assert layout_key(lay, L) != layout_key(dataclasses.replace(base, recompute_granularity="selective"), L)
            continue
        if f.startswith("account_for_"):  # 64 layers + the embedding (or the loss) over 5 stages of 13
            split = dataclasses.replace(base, pp=5, first=12 if f == "account_for_embedding" else 13,
                                        last=13 if f == "account_for_embedding" else 12)
            lay = dataclasses.replace(split, first=None, last=None, **{f: True})
            assert layout_key(lay, L) != layout_key(split, L)
            continue
        if f == "fp8_recipe":  # the recipe is part of the identity where a format is set
            fp8 = dataclasses.replace(base, fp8_format="e4m3")
            assert layout_key(dataclasses.replace(fp8, fp8_recipe=v), L) != layout_key(fp8, L)
            continue
        if f == "offload_modules":
            lay = dataclasses.replace(lay, recompute_granularity="none")
            assert layout_key(lay, L) != layout_key(dataclasses.replace(base, recompute_granularity="none"), L)
            continue
        assert layout_key(lay, L) != k0, f
    # the split as first/last and as a layout string with the same stage layers: one layout
    assert layout_key(dataclasses.replace(base, first=None, last=None, pipeline_layout="E" + "t" * 15 + "|" + "t" * 17
                                          + "|" + "t" * 17 + "|" + "t" * 15 + "L"), L) == k0


def test_a_trial_without_a_folder_leaves_no_folder_behind(tmp_path, monkeypatch, qwen, h200x8, slime):
    """A spec without ``trial_dir`` runs in a scratch folder that ``Runner.run`` removes (3,615 result folders of
    benchmark studies were once left in /tmp)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    p = _write(tmp_path / "m.csv", ["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s"], [[A, "ok", "900", "9"]])
    r = ReplayRunner(p, model=qwen, world_size=8)
    spec = TrialSpec(model=qwen, cluster=h200x8, layout=Layout(tp=2, sp=True, pp=2, dp=2), workload=Workload(),
                     engine=slime)
    assert r.run(spec).tokens_per_s_per_gpu == 900
    assert r.run(dataclasses.replace(spec, layout=Layout(tp=4, dp=2))).status == FAILED
    assert not list(scratch.iterdir())
    kept = tmp_path / "kept"
    r.run(dataclasses.replace(spec, trial_dir=kept))
    assert (kept / "result.json").exists()  # a folder the caller names is the caller's
