"""The runner contract (attune.runners.base), the registry, process trees and the Ray submission ids.

Fast: nothing here launches torchrun or a Ray head (the real runs are in test_torch_runner.py and
test_ray_jobs.py, marked slow / ray).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

from attune.errors import UserInputError
from attune.runners import base
from attune.runners.base import (
    OK,
    OOM,
    Capabilities,
    Runner,
    TrialResult,
    TrialSpec,
    UnsupportedLayout,
    step_time_stats,
)
from attune.runners.procs import kill_tree, run_logged
from attune.runners.ray.jobs import JobOutcome
from attune.runners.registry import get_runner, runner_capabilities, runner_class, runner_names
from attune.runners.torch_runner import TORCH_WORKLOAD
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import load_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_CLUSTER = ROOT / "examples" / "cluster.yaml"


def spec(layout: Layout | None = None, trial_dir: Path | None = None, cluster: str = "2xcpu",
         model: str = "tiny-llama", engine: str = "torch", **kw) -> TrialSpec:
    return TrialSpec(model=load_model(model), cluster=parse_cluster(cluster), layout=layout or Layout(pp=2, dp=1),
                     workload=Workload(seq_length=64, global_batch=4, steps=4, window=(1, 3)),
                     engine=get_engine(engine), trial_dir=trial_dir, **kw)


# ------------------------------------------------------------------------------------------- registry
def test_registry_names_and_unknown_name():
    assert runner_names() == ("sim", "torch", "slime", "ray-torch", "replay")
    with pytest.raises(UserInputError) as ei:
        get_runner("x")
    assert str(ei.value) == "unknown runner 'x'; allowed: sim, torch, slime, ray-torch, replay"
    assert ei.value.exit_code == 2
    assert not hasattr(base, "get_runner")  # base knows no concrete runner
    for name in runner_names():
        assert runner_class(name).name == name


def test_capabilities_of_each_runner():
    sim, torch, slime, ray_torch, replay = (runner_capabilities(n) for n in runner_names())
    assert replay.measured and replay.needs_measurements and not replay.verifiable and sim.verifiable
    assert not sim.measured and sim.engine is None and sim.max_tp is None and not sim.needs_cluster_file
    assert torch.measured and torch.engine == "torch" and (torch.max_tp, torch.max_cp, torch.max_vpp) == (1, 1, 1)
    assert torch.default_workload == TORCH_WORKLOAD and torch.default_search_space == "small"
    assert not torch.needs_cluster_file and not torch.passes_unknown_flags
    assert slime.measured and slime.engine is None and slime.max_tp is None
    assert slime.needs_cluster_file and slime.passes_unknown_flags and slime.default_workload is None
    # the torch trainer on Ray: the trainer's limits and workload, Ray's need for a cluster file
    assert ray_torch.needs_cluster_file and ray_torch.max_tp == 1 and ray_torch.default_workload == TORCH_WORKLOAD
    assert (ray_torch.default_trials, torch.default_trials, slime.default_trials, sim.default_trials) == (3, 3, 12, 20)
    assert torch.baseline_limits() == {"max_tp": 1, "max_cp": 1}
    assert sim.baseline_limits() == {"max_tp": None, "max_cp": None}
    # instances report what their class does
    assert get_runner("sim").capabilities == sim and get_runner("sim").measured is False


def test_runner_is_abstract():
    class Half(Runner):
        name = "half"
        capabilities = Capabilities(measured=False)

        def check(self, spec):
            return []

    with pytest.raises(TypeError):
        Half()


def test_trial_spec_is_keyword_only_and_checked():
    s = spec()
    with pytest.raises(TypeError):
        TrialSpec(s.model, s.cluster, s.layout, s.workload, s.engine)  # noqa
    with pytest.raises(UserInputError, match="trial_number"):
        spec(trial_number=-1)
    with pytest.raises(UserInputError, match="timeout_s"):
        spec(timeout_s=0)
    with pytest.raises(ValueError, match="status"):
        TrialResult(status="fine", measured=True)


# ------------------------------------------------------------------------------------------- check
def test_torch_check_refuses_tp2_in_one_line():
    pytest.importorskip("torch")
    r = get_runner("torch")
    reasons = r.check(spec(Layout(tp=2, dp=1)))
    assert len(reasons) == 1 and "\n" not in reasons[0]
    assert reasons[0].startswith("TP 2 not supported by the torch runner") and "TP <= 1" in reasons[0]
    assert r.check(spec(Layout(pp=2, dp=1))) == []
    bad = r.check(spec(Layout(pp=1, dp=4)))  # 4 ranks on a 2-worker cluster: a layout rule
    assert len(bad) == 1 and "is invalid" in bad[0]


def test_ray_torch_check_names_its_runner(tmp_path):
    r = get_runner("ray-torch", address="http://127.0.0.1:8265")
    reasons = r.check(spec(Layout(cp=2, dp=1)))
    assert len(reasons) == 1 and reasons[0].startswith("CP 2 not supported by the ray-torch runner")


def test_run_refuses_what_check_refuses_before_touching_the_folder(tmp_path):
    pytest.importorskip("torch")
    with pytest.raises(UnsupportedLayout, match="TP 2") as ei:
        get_runner("torch").run(spec(Layout(tp=2, dp=1), tmp_path / "t"))
    assert ei.value.exit_code == 2 and not (tmp_path / "t").exists()


# ------------------------------------------------------------------------------------------- statistics
def test_step_time_stats_uses_the_sample_stdev():
    st = step_time_stats([1.0, 2.0, 3.0], tokens=600, gpus=2)
    assert st.mean_s == 2.0 and st.total_s == 6.0 and st.steps == 3
    assert st.cv_percent == pytest.approx(50.0)  # sample stdev 1.0 (population would give 40.8 %)
    assert st.tokens_per_s_per_gpu == pytest.approx(50.0)
    one = step_time_stats([2.0])
    assert one.cv_percent is None and one.tokens_per_s_per_gpu is None
    with pytest.raises(ValueError):
        step_time_stats([])


# ------------------------------------------------------------------------------------------- idempotency
class CountingSim(runner_class("sim")):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def _execute(self, spec, trial_dir):
        self.calls += 1
        return super()._execute(spec, trial_dir)


def test_rerun_of_a_finished_trial_number_returns_its_result(tmp_path):
    r = CountingSim()
    s = spec(Layout(pp=1, dp=2), tmp_path, engine="slime", trial_number=7)
    first = r.run(s)
    assert first.status in (OK, OOM) and first.trial_number == 7 and r.calls == 1
    assert json.loads((tmp_path / "result.json").read_text())["trial_number"] == 7
    again = r.run(s)
    assert r.calls == 1 and again.to_dict() == first.to_dict()
    # another trial number in the same folder, or none, runs again
    r.run(spec(Layout(pp=1, dp=2), tmp_path, engine="slime", trial_number=8))
    r.run(spec(Layout(pp=1, dp=2), tmp_path, engine="slime"))
    assert r.calls == 3


def test_torch_runner_reuses_a_finished_result_without_launching(tmp_path):
    pytest.importorskip("torch")
    done = TrialResult(status=OK, measured=True, tokens_per_s_per_gpu=123.0, trial_number=4)
    done.save(tmp_path / "result.json")
    res = get_runner("torch").run(spec(trial_dir=tmp_path, trial_number=4))
    assert res.tokens_per_s_per_gpu == 123.0 and not (tmp_path / "log.txt").exists()


# ------------------------------------------------------------------------------------------- Ray submission ids
class FakeJobs:
    """Stands in for RayJobs: every job succeeds at once with an empty log."""

    address = "http://fake:8265"

    def __init__(self):
        self.submitted: list[str] = []

    def submit(self, entrypoint, runtime_env, sid, resources=None, metadata=None):
        self.submitted.append(sid)
        return sid, False

    def wait(self, sid, timeout_s=None, poll_s=10.0, on_log=None, stop_grace_s=60.0, attached=False):
        return JobOutcome(submission_id=sid, status="SUCCEEDED", log="", attached=attached, wall_s=1.0)


def test_submission_id_comes_from_the_trial_number_not_the_label(tmp_path):
    r = get_runner("ray-torch", jobs=FakeJobs(), study="my study")
    label = "TP1 PP4 16/14 DP2 Rb12 mt8192"
    s = spec(trial_dir=tmp_path / "a", trial_number=5, label=label)
    sid = r.submission_id_for(s)
    assert sid.startswith("attune-my-study-t0005-tp1-pp2-") and "8192" not in sid
    assert r.submission_id_for(spec(trial_dir=tmp_path / "b", trial_number=5, label=label)) == sid  # same trial
    assert r.submission_id_for(spec(trial_number=6, label=label)) != sid
    assert "-run-" in r.submission_id_for(spec(label=label))  # outside a study
    res = r.run(s)  # no result line: a failed trial, not an exception
    assert res.status == "failed" and res.extra["submission_id"] == sid and r.jobs.submitted == [sid]
    assert r.run(s).extra["submission_id"] == sid and r.jobs.submitted == [sid]  # idempotent: not resubmitted


# ------------------------------------------------------------------------------------------- process trees
def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_timeout_kills_the_whole_tree_including_new_sessions(tmp_path):
    log = tmp_path / "log.txt"
    # a child in the same group and one in a session of its own (as torchrun starts its workers)
    cmd = ["bash", "-c", "sleep 60 & echo $!; setsid sleep 60 & echo $!; wait"]
    t0 = time.monotonic()
    out = run_logged(cmd, log_path=log, timeout_s=1.0, grace_s=1.0)
    assert out.timed_out and time.monotonic() - t0 < 10 and out.wall_s >= 1.0
    pids = [int(x) for x in log.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def test_kill_tree_of_a_finished_process_is_a_no_op():
    assert kill_tree(2**22 + 12345) == []  # above the kernel's pid_max: never a live process
