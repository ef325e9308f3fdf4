"""slime's TensorBoard scalars as the trial's metrics (attune.runners.slime.tbscalars), issue 13.

The event files are written here with torch's SummaryWriter in slime's scalar names and steps (reference
slime-and-qwen.md 2.1-2.2: the training rank writes perf/* at step = rollout id and train/* at step =
train/step; the RolloutManager writes its own perf/* into the same folder from another process), with the
numbers of the stdout fixture success_20steps.log (tests/fixtures/slime_logs/make_fixtures.py). Both paths must
give the same result.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install 'attune[slime]'")

from attune.errors import MissingDependency  # noqa: E402
from attune.recipe import load_recipe  # noqa: E402
from attune.recipe.target import recipe_target  # noqa: E402
from attune.runners.base import OK, OOM, TrialSpec  # noqa: E402
from attune.runners.ray.jobs import JobOutcome  # noqa: E402
from attune.runners.slime import tbscalars  # noqa: E402
from attune.runners.slime.logparse import parse_slime_log  # noqa: E402
from attune.runners.slime.runner import slime_result  # noqa: E402
from attune.runners.slime.tbscalars import (  # noqa: E402
    EventFileScalars,
    dump_line,
    read_tensorboard_dir,
    scalars_from_log,
    train_metrics,
)
from attune.spec.engine import get_engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "tests" / "fixtures" / "slime_logs"
_spec = importlib.util.spec_from_file_location("make_fixtures", LOGS / "make_fixtures.py")
FIX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(FIX)
# TensorBoard keeps a scalar as a 32-bit float: relative agreement with the stdout's 64-bit values.
FLOAT32_REL = 1e-6


def write_slime_events(tb_dir: Path, rollouts: int = 20) -> None:
    """Event files as slime writes them: the training rank's and the RolloutManager's, same folder."""
    from torch.utils.tensorboard import SummaryWriter

    train = SummaryWriter(log_dir=str(tb_dir), filename_suffix=".train")
    rollout = SummaryWriter(log_dir=str(tb_dir), filename_suffix=".rollout")
    for rid in range(rollouts):
        t = FIX.TRAIN_TIMES[rid]
        rollout.add_scalar("perf/rollout_time", 3.12 + 0.01 * rid, rid)
        rollout.add_scalar("rollout/response_len/mean", 5538.9, rid)
        grad = math.nan if rid == FIX.NAN_GRAD_STEP else 1.8 - 0.05 * rid
        for tag, v in (("train/loss", FIX.LOSSES[rid]), ("train/grad_norm", grad), ("train/lr-pg_0", 1e-5)):
            train.add_scalar(tag, v, rid)  # step: train/step (one optimizer step per rollout here)
        for tag, v in (("perf/train_wait_time", 0.61), ("perf/actor_train_time", t), ("perf/train_time", t + 0.02),
                       ("perf/actor_train_tok_per_s", FIX.TOKENS_PER_STEP / t), ("perf/step_time", t + 0.63)):
            train.add_scalar(tag, v, rid)  # step: rollout/step = the rollout id
    train.close()
    rollout.close()


@pytest.fixture(scope="module")
def tb_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tensorboard")
    write_slime_events(d)
    return d


@pytest.fixture(scope="module")
def stdout_log():
    return (LOGS / "success_20steps.log").read_text()


@pytest.fixture(scope="module")
def seed_spec():
    t = recipe_target(load_recipe(ROOT / "tests" / "fixtures" / "seed_recipe.yaml"), engine="slime")
    return TrialSpec(model=t.model, cluster=t.cluster, layout=t.layout, workload=t.workload, engine=get_engine("slime"))


def test_reads_both_writers_and_tells_the_training_rank(tb_dir):
    files = read_tensorboard_dir(tb_dir)
    assert len(files) == 2
    train = [f for f in files if f.is_training_rank]
    assert len(train) == 1 and sorted(train[0].scalars["perf/actor_train_time"]) == list(range(20))
    assert all(not t.startswith("rollout/") for f in files for t in f.scalars)  # only perf/* and train/* kept


def test_event_files_parse_to_the_same_run_as_the_stdout(tb_dir, stdout_log):
    from_stdout = parse_slime_log(stdout_log, gpus=8)
    from_tb = parse_slime_log(stdout_log, gpus=8, metrics=train_metrics(read_tensorboard_dir(tb_dir)))
    assert from_stdout.metrics_source == "stdout" and from_tb.metrics_source == "tensorboard"
    assert from_tb.complete and from_tb.window_missing == ()
    assert from_tb.tokens == from_stdout.tokens  # integer tokens per rollout, exactly
    assert from_tb.window_tokens == from_stdout.window_tokens == 15 * FIX.TOKENS_PER_STEP
    for name in ("tokens_per_s_per_gpu", "tokens_per_s_per_gpu_step_time", "window_time_s"):
        assert getattr(from_tb, name) == pytest.approx(getattr(from_stdout, name), rel=FLOAT32_REL), name
    # the CV is a difference of nearly equal times: float32 rounding moves it by ~5e-6 relative here
    assert from_tb.step_time_cv_percent == pytest.approx(from_stdout.step_time_cv_percent, rel=1e-4)
    assert from_tb.train_time_s == pytest.approx(from_stdout.train_time_s, rel=FLOAT32_REL)
    assert from_tb.step_time_s == pytest.approx(from_stdout.step_time_s, rel=FLOAT32_REL)
    assert from_tb.loss == pytest.approx(from_stdout.loss, rel=FLOAT32_REL)
    assert from_tb.grad_norm_nan_count == from_stdout.grad_norm_nan_count == 1
    # the two named throughputs differ: step_time also holds the wait between steps
    assert from_tb.tokens_per_s_per_gpu_step_time < from_tb.tokens_per_s_per_gpu
    expect = 15 * FIX.TOKENS_PER_STEP / sum(t + 0.63 for t in FIX.TRAIN_TIMES[5:20]) / 8
    assert from_tb.tokens_per_s_per_gpu_step_time == pytest.approx(expect, rel=FLOAT32_REL)


def test_scalars_travel_through_the_job_log(tb_dir):
    files = read_tensorboard_dir(tb_dir)
    log = "training output\n" + dump_line(files) + "\nJob 'x' succeeded\n"
    back = scalars_from_log(log)
    assert [f.name for f in back] == [f.name for f in files]
    grad = next(f for f in back if f.is_training_rank).scalars["train/grad_norm"]
    assert math.isnan(grad[FIX.NAN_GRAD_STEP]) and grad[0] == pytest.approx(1.8, rel=FLOAT32_REL)
    assert scalars_from_log("no marker here\n") is None
    assert scalars_from_log(tbscalars.MARKER + '{"files": [oops\n') is None  # a cut-off line: fall back


def test_trial_result_is_the_same_from_either_source(tb_dir, stdout_log, seed_spec):
    """slime_result takes the TensorBoard scalars the launch printed into the log; without them the stdout."""
    def result(log):
        return slime_result(JobOutcome(submission_id="s", status="SUCCEEDED", log=log, attached=False, wall_s=900.0),
                            seed_spec)

    plain = result(stdout_log)
    with_tb = result(stdout_log + dump_line(read_tensorboard_dir(tb_dir)) + "\n")
    assert plain.extra["slime"]["metrics_source"] == "stdout"
    assert with_tb.extra["slime"]["metrics_source"] == "tensorboard"
    assert plain.status == with_tb.status == OK
    assert with_tb.window_tokens == plain.window_tokens and with_tb.window == plain.window
    assert with_tb.tokens_per_s_per_gpu == pytest.approx(plain.tokens_per_s_per_gpu, rel=FLOAT32_REL)
    assert with_tb.step_times_s == pytest.approx(plain.step_times_s, rel=FLOAT32_REL)
    assert with_tb.losses == pytest.approx(plain.losses, rel=FLOAT32_REL)
    tp = with_tb.extra["throughput"]
    assert tp["basis"] == "actor_train_time" and tp["tokens_per_s_per_gpu_actor_train_time"] == with_tb.tokens_per_s_per_gpu
    assert tp["tokens_per_s_per_gpu_step_time"] == pytest.approx(
        plain.extra["throughput"]["tokens_per_s_per_gpu_step_time"], rel=FLOAT32_REL)


def test_oom_still_comes_from_the_stdout(tmp_path, seed_spec):
    """The scalars of the rollouts before an OOM do not hide it: OOM and crash detection read the log lines."""
    write_slime_events(tmp_path, rollouts=2)
    log = (LOGS / "oom_step2_last_stage.log").read_text() + dump_line(read_tensorboard_dir(tmp_path)) + "\n"
    r = slime_result(JobOutcome(submission_id="s", status="FAILED", log=log, attached=False, wall_s=300.0), seed_spec)
    assert r.status == OOM and r.oom_stage == 3
    assert r.extra["slime"]["metrics_source"] == "tensorboard" and r.step_times_s == pytest.approx(FIX.TRAIN_TIMES[:2])


def test_entry_point_prints_one_marker_line(tb_dir, capsys):
    assert tbscalars.main([str(tb_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(tbscalars.MARKER) and len(scalars_from_log(out[0])) == 2
    assert read_tensorboard_dir(tb_dir / "missing") == []


def test_no_training_scalars_means_no_metrics():
    assert train_metrics([EventFileScalars(name="r", scalars={"perf/rollout_time": {0: 3.1}})]) is None


def test_missing_tensorboard_is_one_line(monkeypatch, tb_dir):
    import builtins

    real = builtins.__import__

    def no_tensorboard(name, *a, **k):
        if name.startswith("tensorboard"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(MissingDependency, match=r"attune\[slime\]"):
        read_tensorboard_dir(tb_dir)
