"""Trials as Ray jobs (attune.runners.ray.jobs, attune.runners.ray.runner).

The tests marked `ray` start a real local Ray head (127.0.0.1, 2 CPUs, one `attune_trial_slot`) inside the
test module and stop it at the end; they submit a real torch-trainer trial (tiny-llama, 2 CPU workers, PP 2)
through the `ray-torch` runner, the same submission / tail / log / result code the slime trials use. The
others drive RayJobs with a stand-in client and start no Ray head (they need the ray package for JobStatus).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

from attune.errors import MissingDependency
from attune.runners.base import OK, TIMEOUT, TrialResult, TrialSpec
from attune.runners.ray import jobs as jobs_mod
from attune.runners.ray.jobs import RayJobs, submission_id
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import load_model

ROOT = Path(__file__).resolve().parents[1]
HAVE_RAY = importlib.util.find_spec("ray") is not None
# Seconds allowed for the local head's dashboard (Jobs API) to come up on a 2-core machine.
HEAD_START_S = 120
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed: pip install 'attune[ray]'")


# ---------------------------------------------------------------------------- stand-in client (no Ray)
class FakeClient:
    """The slice of JobSubmissionClient that RayJobs uses; jobs follow scripted status sequences."""

    def __init__(self):
        self.jobs: dict[str, dict] = {}
        self.stopped: list[str] = []
        self.submitted: list[dict] = []

    def add(self, sid, statuses, log=""):
        self.jobs[sid] = {"statuses": list(statuses), "log": log, "start": time.time() * 1000}

    def _job(self, sid):
        if sid not in self.jobs:
            raise RuntimeError(f"Request failed with status code 404: Job {sid} does not exist.")
        return self.jobs[sid]

    def get_job_status(self, sid):
        j = self._job(sid)
        return j["statuses"][0] if len(j["statuses"]) == 1 else j["statuses"].pop(0)

    def get_job_info(self, sid):
        j = self._job(sid)
        return type("Info", (), {"start_time": j["start"], "end_time": None, "message": "scripted"})()

    def get_job_logs(self, sid):
        return self._job(sid)["log"]

    async def tail_job_logs(self, sid):
        """As Ray's: the log so far, then nothing until the job ends (peeks at the status, never pops it)."""
        j = self._job(sid)
        if j["log"]:
            yield j["log"]
        while j["statuses"][0] in ("PENDING", "RUNNING"):
            await asyncio.sleep(0.005)

    def submit_job(self, **kw):
        self.submitted.append(kw)
        self.add(kw["submission_id"], ["PENDING", "RUNNING", "SUCCEEDED"], "ok\n")
        return kw["submission_id"]

    def stop_job(self, sid):
        self.stopped.append(sid)
        self._job(sid)["statuses"] = ["STOPPED"]
        return True


def test_submission_id_is_deterministic_and_safe():
    assert submission_id("s", None, "tp1") == "attune-s-run-tp1"
    a = submission_id("my study/1", 7, "tp1-pp4-split16-rb12")
    assert a == submission_id("my study/1", 7, "tp1-pp4-split16-rb12") == "attune-my-study-1-t0007-tp1-pp4-split16-rb12"
    assert submission_id("s", 8, "tp1-pp4") != a
    with pytest.raises(ValueError, match="trial number"):
        submission_id("s", -1, "x")


@needs_ray
def test_submit_uses_entrypoint_resources_not_gpus():
    c = FakeClient()
    sid, attached = RayJobs("http://x:8265", client=c).submit("echo", {"env_vars": {}}, "attune-s-t0001",
                                                              resources={"attune_trial_slot": 1})
    assert (sid, attached) == ("attune-s-t0001", False)
    kw = c.submitted[0]
    assert kw["entrypoint_resources"] == {"attune_trial_slot": 1} and "entrypoint_num_gpus" not in kw


@needs_ray
@pytest.mark.parametrize("status", ["PENDING", "RUNNING", "SUCCEEDED"])
def test_existing_live_or_finished_job_is_attached(status):
    c = FakeClient()
    c.add("attune-s-t0001", [status])
    assert RayJobs("http://x:8265", client=c).submit("echo", {}, "attune-s-t0001") == ("attune-s-t0001", True)
    assert c.submitted == []


@needs_ray
@pytest.mark.parametrize("status", ["FAILED", "STOPPED"])
def test_failed_or_stopped_job_is_resubmitted_with_retry_suffix(status):
    c = FakeClient()
    c.add("attune-s-t0001", [status])
    c.add("attune-s-t0001-retry1", ["FAILED"])
    assert RayJobs("http://x:8265", client=c).submit("echo", {}, "attune-s-t0001") == ("attune-s-t0001-retry2", False)
    c.add("attune-s-t0002", ["FAILED"])
    c.add("attune-s-t0002-retry1", ["RUNNING"])
    assert RayJobs("http://x:8265", client=c).submit("echo", {}, "attune-s-t0002") == ("attune-s-t0002-retry1", True)


@needs_ray
def test_wait_streams_logs_and_stops_on_timeout():
    c = FakeClient()
    c.add("j", ["RUNNING"], "line 1\n")
    chunks: list[str] = []
    out = RayJobs("http://x:8265", client=c).wait("j", timeout_s=0.05, poll_s=0.02, on_log=chunks.append,
                                                  stop_grace_s=1.0)
    assert out.status == "TIMEOUT" and out.timed_out and c.stopped == ["j"] and chunks == ["line 1\n"]


@needs_ray
def test_keyboard_interrupt_stops_the_job():
    c = FakeClient()
    c.add("j", ["RUNNING"], "x")

    def boom(_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        RayJobs("http://x:8265", client=c).wait("j", timeout_s=60, poll_s=0.01, on_log=boom, stop_grace_s=1.0)
    assert c.stopped == ["j"]


def test_missing_ray_is_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingDependency) as ei:
        jobs_mod.import_ray_jobs()
    assert str(ei.value) == "the slime runner needs the optional extra: pip install 'attune[ray]'"


# ---------------------------------------------------------------------------- a real local Ray head
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    pytest.importorskip("ray", reason="ray is not installed: pip install 'attune[ray]'")
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    tmp = tempfile.mkdtemp(prefix="rayt", dir="/tmp")  # short: Ray puts unix sockets under it
    dash = _free_port()
    cmd = [ray_bin, "start", "--head", "--block", "--port=0", "--node-ip-address=127.0.0.1",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
           f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
           f"--metrics-export-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
           f"--ray-client-server-port={_free_port()}", "--num-cpus=2", "--num-gpus=0",
           '--resources={"attune_trial_slot": 1}', "--disable-usage-stats", f"--temp-dir={tmp}"]
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    log = open(Path(tmp) / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    from ray.job_submission import JobSubmissionClient

    t0 = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited with {proc.returncode}: {(Path(tmp) / 'ray-start.log').read_text()[-2000:]}")
            try:
                JobSubmissionClient(address).list_jobs()
                break
            except Exception:  # noqa: BLE001 - dashboard not up yet
                if time.monotonic() - t0 > HEAD_START_S:
                    pytest.fail(f"Ray dashboard at {address} not up after {HEAD_START_S} s")
                time.sleep(1.0)
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group id is its pid
            proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def marker():
    return f"attune-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory, ray_head, marker):
    p = tmp_path_factory.mktemp("cluster") / "cluster.yaml"
    p.write_text(yaml.safe_dump({
        "ray": {"address": ray_head}, "nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu", "nvlink": 0,
        "python": sys.executable,
        "paths": {"slime": "/nonexistent/slime", "megatron": "/nonexistent/Megatron-LM", "hf_checkpoint": "/x",
                  "torch_dist": "/x", "sft_data": "/x", "output": "/tmp", "attune": str(ROOT)},
        "env": {"ATTUNE_TEST_MARK": marker},
        "timeouts": {"trial_s": 300, "poll_s": 0.5, "stop_grace_s": 30},
    }))
    return p


def tiny_spec(trial_dir: Path, steps: int, number: int, timeout_s: float | None = 120.0) -> TrialSpec:
    return TrialSpec(model=load_model("tiny-llama"), cluster=parse_cluster("2xcpu"), layout=Layout(pp=2, dp=1),
                     workload=Workload(seq_length=64, global_batch=4, steps=steps, window=(1, min(3, steps - 1))),
                     engine=get_engine("torch"), trial_dir=trial_dir, timeout_s=timeout_s, label=f"trial {number}",
                     trial_number=number)


def _runner(cluster_file, study):
    from attune.runners.registry import get_runner

    return get_runner("ray-torch", cluster_file=cluster_file, study=study)


@pytest.fixture(scope="module")
def first_run(cluster_file, tmp_path_factory):
    runner = _runner(cluster_file, f"e2e{uuid.uuid4().hex[:6]}")
    spec = tiny_spec(tmp_path_factory.mktemp("trial1"), steps=4, number=1)
    t0 = time.monotonic()
    result = runner.run(spec)
    return runner, spec, result, time.monotonic() - t0


@pytest.mark.ray
@pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed: pip install 'attune[ray]'")
def test_torch_trial_end_to_end_through_ray(first_run):
    runner, spec, res, took = first_run
    assert res.status == OK, res.reason + res.log_tail[-2000:]
    assert res.measured and res.tokens_per_s_per_gpu > 0 and len(res.step_times_s) == 4 and len(res.losses) == 4
    assert res.extra["job_status"] == "SUCCEEDED" and res.extra["attached"] is False
    assert res.extra["submission_id"] == runner.submission_id_for(spec)
    assert res.extra["submission_id"].startswith(f"attune-{runner.study}-t0001-tp1-pp2-")
    assert res.trial_number == 1 and res.extra["trial_kind"] == "torch"
    assert res.wall_s > 0 and res.gpu_hours == pytest.approx(2 * res.wall_s / 3600)
    log = (spec.trial_dir / "log.txt").read_text()
    assert "ATTUNE_TRIAL_RESULT" in log and "step 3" in log
    saved = TrialResult.from_dict(json.loads((spec.trial_dir / "result.json").read_text()))
    assert saved.tokens_per_s_per_gpu == pytest.approx(res.tokens_per_s_per_gpu)
    print(f"\nRay torch trial: {res.tokens_per_s_per_gpu:.1f} tokens/s/GPU (2 CPU workers), job wall "
          f"{res.wall_s:.1f} s, runner call {took:.1f} s, pending {res.extra['pending_s']:.1f} s")


@pytest.mark.ray
@pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed: pip install 'attune[ray]'")
def test_resubmission_attaches_to_the_existing_job(first_run, tmp_path):
    runner, spec, res, _ = first_run
    again_spec = tiny_spec(tmp_path, steps=4, number=1)  # another folder: Ray, not result.json, dedupes
    t0 = time.monotonic()
    again = runner.run(again_spec)
    assert time.monotonic() - t0 < 30
    assert again.extra["attached"] is True and again.extra["submission_id"] == res.extra["submission_id"]
    assert again.status == OK and again.tokens_per_s_per_gpu == pytest.approx(res.tokens_per_s_per_gpu)
    assert "ATTUNE_TRIAL_RESULT" in (tmp_path / "log.txt").read_text()


@pytest.mark.ray
@pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed: pip install 'attune[ray]'")
def test_failed_job_is_resubmitted_as_retry(ray_head):
    jobs = RayJobs(ray_head)
    sid = f"attune-failtest-{uuid.uuid4().hex[:6]}"
    got, attached = jobs.submit("echo failing; exit 3", {}, sid, resources={"attune_trial_slot": 1})
    out = jobs.wait(got, timeout_s=60, poll_s=0.5)
    assert (got, attached, out.status) == (sid, False, "FAILED") and "failing" in out.log
    got2, attached2 = jobs.submit("echo fine", {}, sid, resources={"attune_trial_slot": 1})
    assert (got2, attached2) == (f"{sid}-retry1", False)
    assert jobs.wait(got2, timeout_s=60, poll_s=0.5).status == "SUCCEEDED"
    assert jobs.submit("echo fine", {}, sid) == (f"{sid}-retry1", True)  # succeeded: attach, don't rerun


def _processes_with_env(marker: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"ATTUNE_TEST_MARK={marker}".encode() in (d / "environ").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


@pytest.mark.ray
@pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed: pip install 'attune[ray]'")
def test_job_past_its_timeout_is_stopped(cluster_file, marker, tmp_path, first_run):
    runner = _runner(cluster_file, f"to{uuid.uuid4().hex[:6]}")
    spec = tiny_spec(tmp_path, steps=2000, number=2, timeout_s=6.0)
    res = runner.run(spec)
    assert res.status == TIMEOUT and "timeout" in res.reason
    assert res.extra["job_status"] == "TIMEOUT"
    assert runner.jobs.status(res.extra["submission_id"]) == "STOPPED"
    deadline = time.monotonic() + 15
    while _processes_with_env(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_with_env(marker) == []  # torchrun and its workers are gone too
    assert (tmp_path / "log.txt").exists() and (tmp_path / "result.json").exists()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed: pip install 'attune[ray]'")
def test_tune_study_through_local_ray_head(cluster_file, tmp_path):
    """The whole study with the slime runner's Ray Jobs path, each trial the torch runner's run as a Ray job."""
    import optuna

    from attune.cli import main
    from attune.recipe import lint, load_recipe

    out = tmp_path / "ray-study"
    rc = main(["tune", "--model", "tiny-llama", "--gpus", "2xcpu", "--runner", "slime", "--trial-kind", "torch",
               "--cluster", str(cluster_file), "--trials", "2", "--steps", "6", "--candidates", "8",
               "--out", str(out), "--no-verify"])
    assert rc == 0
    s = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    measured = [t for t in s.trials if t.user_attrs.get("role")]
    assert len([t for t in measured if t.state == optuna.trial.TrialState.COMPLETE]) == 2
    assert all(t.user_attrs["runner"] == "ray-torch" for t in measured)  # slime's Ray path, torch trainer
    r = load_recipe(out / "recipe.yaml")
    assert r["status"] == "measured" and r["result"]["tokens_per_s_per_gpu"] > 0
    assert not [f for f in lint(r) if f.severity == "error"]
    # each trial left its Ray job's log behind
    assert any(p.name == "log.txt" and p.stat().st_size > 0 for p in (out / "trials").rglob("log.txt"))


@needs_ray
def test_submission_keeps_the_drivers_gpus_visible():
    # entrypoint_resources: Ray sets no NOSET switch for the driver (job_manager.py); the job's env_vars must
    c = FakeClient()
    env = {"env_vars": {"A": "1"}, "py_modules": ["x"]}
    RayJobs("http://x:8265", client=c).submit("echo", env, "attune-s-t0002", resources={"attune_trial_slot": 1})
    sent = c.submitted[0]["runtime_env"]
    assert sent["env_vars"] == {"A": "1", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert sent["py_modules"] == ["x"] and env == {"env_vars": {"A": "1"}, "py_modules": ["x"]}  # caller's copy kept
    # a value the user set is kept; without entrypoint resources Ray sets the switch itself: nothing added
    assert jobs_mod.driver_sees_gpus({"env_vars": {jobs_mod.NOSET_CUDA_ENV: "0"}})["env_vars"] == {jobs_mod.NOSET_CUDA_ENV: "0"}
    RayJobs("http://x:8265", client=c).submit("echo", {"env_vars": {}}, "attune-s-t0003")
    assert c.submitted[1]["runtime_env"] == {"env_vars": {}}
