"""`attune slime preflight` (attune.runners.slime.preflight, preflight_probe), issue 13.

Without Ray: the node facts are judged against a cluster file and a model (missing paths reported by name, a
checkpoint config of the wrong model, GPUs), node_checks runs on this machine against folders written here,
and a study refuses to start when the runner's preflight fails. With Ray (marked `ray`): the real preflight job
runs on a local Ray head (the fixture of tests/test_ray_jobs.py), ships attune through the runtime_env and
reports a missing slime checkout by name, through the API and the CLI.
"""

from __future__ import annotations

import json
import shutil
import sys
from importlib import resources
from pathlib import Path

import pytest
import yaml

from attune.api.tune import tune_config
from attune.errors import RunnerError
from attune.runners.ray.cluster import parse_cluster_config
from attune.runners.ray.jobs import JobOutcome
from attune.runners.slime.preflight import PreflightFailed, judge, parse_preflight_log, preflight_job, run_preflight
from attune.runners.slime.preflight_probe import MARKER, node_checks
from attune.runners.slime.runner import SlimeRunner
from attune.search.tuner import Tuner
from attune.spec.model import load_model
from tests.test_ray_jobs import ray_head  # noqa: F401 - the module-scoped local Ray head fixture

ROOT = Path(__file__).resolve().parents[1]


def model_config(name: str) -> dict:
    return json.loads(resources.files("attune.spec").joinpath("model_configs", f"{name}.json").read_text())


def make_node(tmp_path: Path, model: str = "tiny-llama") -> dict:
    """Folders as a node should hold them: slime and Megatron-LM checkouts, both checkpoints, the rows."""
    paths = {k: tmp_path / k for k in ("slime", "megatron", "hf", "torch_dist")}
    for p in paths.values():
        p.mkdir()
    (paths["slime"] / "train_async.py").write_text("")
    (paths["hf"] / "config.json").write_text(json.dumps(model_config(model)))
    (paths["torch_dist"] / "latest_checkpointed_iteration.txt").write_text("release")
    (tmp_path / "rows.parquet").write_bytes(b"PAR1" + b"\0" * 60 + b"PAR1")
    return {"slime": str(paths["slime"]), "megatron": str(paths["megatron"]), "hf_checkpoint": str(paths["hf"]),
            "torch_dist": str(paths["torch_dist"]), "sft_data": str(tmp_path / "rows.parquet"),
            "output": str(tmp_path / "out")}


def cluster(paths: dict, address: str = "http://127.0.0.1:8265", **over):
    data = {"ray": {"address": address}, "nodes": 1, "gpus_per_node": 2, "gpu_type": "H100", "nvlink": "auto",
            "python": sys.executable, "paths": paths}
    data.update(over)
    return parse_cluster_config(data, "cluster.yaml")


GOOD_FACTS = {"host": "n0", "node_ip": "10.0.0.1", "slime_dir": True, "megatron_dir": True, "slime_entrypoint": True,
              "imports": {"slime": None, "megatron.core": None}, "hf_dir": True, "hf_config": None,
              "torch_dist_dir": True, "torch_dist_tracker": True, "data_head": b"PAR1".hex(), "data_bytes": 68,
              "attune": "/tmp/ray/attune", "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559.0}] * 2,
              "nvidia_smi": None, "nvlink_count": 12}


def facts(**over) -> dict:
    d = dict(GOOD_FACTS, hf_config=model_config("tiny-llama"))
    d.update(over)
    return d


# ---------------------------------------------------------------------------------------------- judging
def test_a_complete_node_passes(tmp_path):
    report = judge([facts()], cluster(make_node(tmp_path)), load_model("tiny-llama"))
    assert report.ok and report.reason() == "" and report.nodes == 1
    assert {c.check for c in report.checks} == {"paths.slime", "paths.megatron", "paths.hf_checkpoint",
                                                 "paths.torch_dist", "paths.sft_data", "attune", "gpus", "nvlink"}


@pytest.mark.parametrize("over, check, words", [
    ({"slime_dir": False}, "paths.slime", "/x/slime: no such directory"),
    ({"slime_entrypoint": False}, "paths.slime", "no train_async.py"),
    ({"imports": {"slime": None, "megatron.core": "ModuleNotFoundError: No module named 'megatron'"}},
     "paths.megatron", "import megatron.core fails"),
    ({"hf_config": None, "hf_config_error": "FileNotFoundError: config.json"}, "paths.hf_checkpoint", "no readable config.json"),
    ({"hf_config": model_config("tiny-qwen3.5")}, "paths.hf_checkpoint", "does not match tiny-llama"),
    ({"torch_dist_tracker": False}, "paths.torch_dist", "latest_checkpointed_iteration.txt"),
    ({"data_head": None, "data_error": "PermissionError: denied"}, "paths.sft_data", "not readable"),
    ({"data_head": b"{\"a\"".hex()}, "paths.sft_data", "not a parquet file"),
    ({"attune": None, "attune_error": "ModuleNotFoundError: No module named 'attune'"}, "attune", "not importable"),
    ({"gpus": []}, "gpus", "no GPUs"),
    ({"gpus": [{"name": "NVIDIA A100-SXM4-80GB", "memory_mib": 81920.0}] * 8}, "gpus", "wants 1 node(s) x 2 x H100"),
])
def test_what_is_missing_is_named(over, check, words):
    paths = {"slime": "/x/slime", "megatron": "/x/Megatron-LM", "hf_checkpoint": "/x/hf", "torch_dist": "/x/td",
             "sft_data": "/x/rows.parquet", "output": "/x/out"}
    report = judge([facts(**over)], cluster(paths), load_model("tiny-llama"))
    failed = report.failures
    assert [c.check for c in failed] == [check] and words in failed[0].detail, report.checks
    assert report.reason().startswith("slime preflight failed (1 of 8 checks on 1 node(s)): " + check)


def test_checkpoint_mismatch_names_the_fields():
    paths = {"slime": "/s", "megatron": "/m", "hf_checkpoint": "/h", "torch_dist": "/t", "sft_data": "/d", "output": "/o"}
    cfg = dict(model_config("tiny-llama"), num_hidden_layers=3)
    row = next(c for c in judge([facts(hf_config=cfg)], cluster(paths), load_model("tiny-llama")).checks
               if c.check == "paths.hf_checkpoint")
    assert not row.ok and "num_layers 3 (model " in row.detail


def test_a_cpu_head_is_fine_when_the_gpu_nodes_are_enough():
    paths = {"slime": "/s", "megatron": "/m", "hf_checkpoint": "/h", "torch_dist": "/t", "sft_data": "/d", "output": "/o"}
    head = facts(host="head", node_ip="10.0.0.9", gpus=[], nvlink_count=None)
    report = judge([head, facts()], cluster(paths), load_model("tiny-llama"))
    assert report.ok, report.failures
    report = judge([head, facts()], cluster(paths, nvlink=12), load_model("tiny-llama"))
    assert [(c.node, c.check) for c in report.failures] == [("10.0.0.9", "nvlink")]


def test_a_node_the_task_could_not_reach_fails():
    paths = {"slime": "/s", "megatron": "/m", "hf_checkpoint": "/h", "torch_dist": "/t", "sft_data": "/d", "output": "/o"}
    report = judge([{"node_ip": "10.0.0.3", "error": "NodeDiedError: gone"}], cluster(paths))
    assert not report.ok and "NodeDiedError" in report.reason()
    assert not judge([], cluster(paths)).ok


# ---------------------------------------------------------------------------------------------- the node side
def test_node_checks_on_this_machine(tmp_path):
    """The node task itself, here: the folders written above, an interpreter that cannot import slime (a stand-in
    answering the import check as Python does here; the `ray` test runs the real imports)."""
    paths = make_node(tmp_path)
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 'IMPORTS {\"slime\": \"ModuleNotFoundError: No module named slime\", "
                    "\"megatron.core\": null}'\n")
    fake.chmod(0o755)
    f = node_checks(paths, str(fake))
    assert f["slime_dir"] and f["slime_entrypoint"] and f["torch_dist_tracker"] and f["data_head"] == b"PAR1".hex()
    assert f["hf_config"]["num_hidden_layers"] == model_config("tiny-llama")["num_hidden_layers"]
    assert f["imports"]["slime"].startswith("ModuleNotFoundError") and f["attune"]
    report = judge([f], cluster(paths, gpu_type="cpu"), load_model("tiny-llama"))
    assert [c.check for c in report.failures if c.check.startswith("paths")] == ["paths.slime"]
    shutil.rmtree(paths["slime"])
    f = node_checks(paths, "/nonexistent/python3")
    assert "did not run" in f["imports"]["slime"] and not f["slime_dir"]


def test_job_spec_and_log_round_trip(tmp_path):
    cfg = cluster(make_node(tmp_path), env={"NCCL_DEBUG": "INFO"})
    entry, env = preflight_job(cfg)
    assert entry.startswith(f"{sys.executable} -m attune.runners.slime.preflight_probe ")
    assert env["py_modules"] and Path(env["py_modules"][0]).name == "attune" and env["env_vars"] == {"NCCL_DEBUG": "INFO"}
    log = "noise\n" + MARKER + json.dumps({"nodes": [facts()]}) + "\n"
    assert parse_preflight_log(log)[0]["host"] == "n0" and parse_preflight_log("no report\n") is None


class _Jobs:
    """RayJobs stand-in: the preflight job 'ran' and printed ``log``."""

    def __init__(self, log: str, status: str = "SUCCEEDED"):
        self.log, self.status, self.submitted = log, status, []
        self.address = "http://127.0.0.1:8265"

    def submit(self, entrypoint, runtime_env, sid, resources=None, metadata=None):
        self.submitted.append((entrypoint, runtime_env, sid))
        return sid, False

    def wait(self, sid, **kw):
        return JobOutcome(submission_id=sid, status=self.status, log=self.log, attached=False, wall_s=3.0)


def test_slime_runner_preflight_raises_with_the_missing_path(tmp_path):
    paths = make_node(tmp_path)
    cf = tmp_path / "cluster.yaml"
    cf.write_text(yaml.safe_dump({"ray": {"address": "http://127.0.0.1:8265"}, "nodes": 1, "gpus_per_node": 2,
                                  "gpu_type": "H100", "paths": dict(paths, slime="/nowhere/slime")}))
    bad = MARKER + json.dumps({"nodes": [facts(slime_dir=False)]})
    runner = SlimeRunner(cluster_file=cf, jobs=_Jobs(bad))
    with pytest.raises(PreflightFailed, match=r"paths\.slime on 10\.0\.0\.1: /nowhere/slime: no such directory"):
        runner.preflight(load_model("tiny-llama"), runner.cluster_cfg.cluster())
    SlimeRunner(cluster_file=cf, jobs=_Jobs(MARKER + json.dumps({"nodes": [facts()]}))).preflight(
        load_model("tiny-llama"), runner.cluster_cfg.cluster())
    with pytest.raises(RunnerError, match="without a report"):  # the job died before printing (no attune on the head)
        run_preflight(_Jobs("ModuleNotFoundError: No module named 'attune'", "FAILED"), runner.cluster_cfg)


def test_study_refuses_to_start_when_preflight_fails(tmp_path, monkeypatch):
    """The tuner calls the runner's preflight once before the first trial; a failure stops it with its reason
    and no trial runs."""
    cfg = tune_config(model="Qwen3.6-27B", gpus="8xH200", trials=1, candidates=4, out=tmp_path / "run",
                      sampler="tpe")  # TPE: the study opens at once (the model sampler scores the space first)
    calls = []

    def refuse(model, cluster):
        calls.append((model.name, cluster.spec))
        raise PreflightFailed("slime preflight failed (1 of 8 checks on 1 node(s)): paths.slime on n0: /s: no such directory")

    monkeypatch.setattr(cfg.runner, "preflight", refuse)
    tuner = Tuner(cfg)
    with pytest.raises(PreflightFailed, match="paths.slime"):
        tuner.run()
    assert calls == [("Qwen3.6-27B", "8xH200")] and tuner.measured() == []


# ---------------------------------------------------------------------------------------------- a real Ray head
@pytest.mark.ray
def test_preflight_job_on_a_local_ray_head(ray_head, tmp_path, capsys):  # noqa: F811 - the imported fixture
    from attune.api.slime import preflight
    from attune.cli import main

    paths = dict(make_node(tmp_path), slime="/nonexistent/slime")
    cf = tmp_path / "cluster.yaml"
    cf.write_text(yaml.safe_dump({"ray": {"address": ray_head}, "nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu",
                                  "nvlink": 0, "python": sys.executable, "paths": paths}))
    report = preflight(cf, model="tiny-llama", timeout_s=300)
    by_check = {c.check: c for c in report.checks}
    assert report.nodes == 1 and not report.ok
    assert not by_check["paths.slime"].ok and "/nonexistent/slime: no such directory" in by_check["paths.slime"].detail
    assert by_check["attune"].ok  # shipped through the job's runtime_env (py_modules)
    assert by_check["paths.hf_checkpoint"].ok and "matches tiny-llama" in by_check["paths.hf_checkpoint"].detail
    assert by_check["paths.torch_dist"].ok and by_check["paths.sft_data"].ok
    assert not by_check["gpus"].ok and "no GPUs" in by_check["gpus"].detail  # a CPU-only head
    assert "paths.slime" in report.reason() and "/nonexistent/slime" in report.reason()
    code = main(["slime", "preflight", "--cluster", str(cf), "--model", "tiny-llama"])
    captured = capsys.readouterr()
    assert code == 1 and "/nonexistent/slime" in captured.out and "MISSING" in captured.out
    assert "slime preflight failed" in captured.err
