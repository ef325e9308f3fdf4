"""No command injection: every command a shell or Ray runs is built by attune.runners.shell and survives
hostile values. Each test RUNS the built entrypoint with /bin/sh (as Ray's job supervisor does, shell=True) and
checks that no canary file appears and that the program got the hostile text back literally."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from attune.recipe import load_recipe
from attune.runners.ray import torch_job
from attune.runners.ray.cluster import ClusterConfig, ClusterFileError, SlimePaths, parse_cluster_config
from attune.runners.shell import ShellValueError, check_ray_literal, command, ray_env_vars, ray_expands, word
from attune.runners.slime.launch import command_for_recipe
from attune.runners.slime.preflight import preflight_job

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "tests" / "fixtures" / "seed_recipe.yaml"


def hostile(canary: Path) -> list[str]:
    """Values that would run `touch canary` if a shell read them unquoted (or double-quoted)."""
    c = str(canary)
    return [f"$(touch {c})", f"`touch {c}`", f"x; touch {c}; true", f"x' ; touch {c}; '", f'x" ; touch {c}; "',
            f"x\ntouch {c}", f"x && touch {c}", f"x | touch {c}", "$HOME/x", "${HOME}", f"x > {c}",
            f"x\"$(touch {c})\"", f"x'$(touch {c})'", "--flag=-x", "*", "~"]


@pytest.fixture()
def dump(tmp_path):
    """A program that writes its argv (JSON) to a file: stands in for python on the 'cluster'."""
    out = tmp_path / "argv.jsonl"
    prog = tmp_path / "dump-argv"
    prog.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(out)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR)
    return prog, out


def run_sh(entry: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/sh", "-c", entry], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HOME": "/expanded-home"})


def paths(value: str) -> SlimePaths:
    return SlimePaths(slime=value, megatron=value, hf_checkpoint=value, torch_dist=value, sft_data=value,
                      output=value)


def cfg(python: str, value: str, env: dict | None = None) -> ClusterConfig:
    return ClusterConfig(source="cluster.yaml", address="http://127.0.0.1:8265", nodes=1, gpus_per_node=8,
                         gpu_type="H200", paths=paths(value), python=python, env=env or {}, nvlink=0)


def test_command_round_trips_every_hostile_word(tmp_path, dump):
    prog, out = dump
    canary = tmp_path / "canary"
    words = hostile(canary)
    r = run_sh(command([prog, *words]), tmp_path)
    assert r.returncode == 0, r.stderr
    assert not canary.exists()
    assert json.loads(out.read_text()) == words  # $HOME and ${HOME} stay literal too


def test_preflight_entrypoint_hostile_paths_and_python(tmp_path, dump):
    prog, out = dump
    canary = tmp_path / "canary"
    for value in hostile(canary):
        entry, env = preflight_job(cfg(str(prog), value))
        r = run_sh(entry, tmp_path)
        assert r.returncode == 0, (value, r.stderr)
        assert not canary.exists(), value
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == len(hostile(canary))
    for value, argv in zip(hostile(canary), rows):
        assert argv[:2] == ["-m", "attune.runners.slime.preflight_probe"]
        spec = json.loads(argv[2])
        assert set(spec["paths"].values()) == {value}  # literal, $HOME not expanded
    # a hostile interpreter name is one (missing) program, never a command list
    for py in (f"python3; touch {canary}; true", f"$(touch {canary})", f"`touch {canary}`", f"python3\ntouch {canary}"):
        entry, _ = preflight_job(cfg(py, "/data"))
        run_sh(entry, tmp_path)
        assert not canary.exists(), py


def test_torch_job_entrypoint_hostile_python(tmp_path):
    canary = tmp_path / "canary"
    for py in hostile(canary):
        run_sh(torch_job.entrypoint({"x": 1}, py), tmp_path)
        assert not canary.exists(), py


def test_slime_launch_script_hostile_paths(tmp_path, dump):
    """The whole slime launch (bash -c '<script>'), run for real with the dump program as python: the hostile
    slime folder exists, so the script gets as far as the training command."""
    prog, out = dump
    recipe = load_recipe(SEED)
    values = [v for v in hostile(Path("canary")) if "/" not in v and not ray_expands(v) and "\n" not in v]
    assert any("$(" in v for v in values) and any("`" in v for v in values)
    for i, value in enumerate(values):
        d = tmp_path / f"d{i}" / value
        d.mkdir(parents=True)
        c = replace(cfg(str(prog), str(d)), env={"NCCL_DEBUG": value})
        cmd = command_for_recipe(recipe, c)
        r = run_sh(cmd.ray_entrypoint(), tmp_path)
        assert not list(tmp_path.rglob("canary")), (value, r.stderr)
        assert r.returncode == 0, (value, r.stderr[-2000:])
        argvs = [json.loads(x) for x in out.read_text().splitlines()]
        train = [a for a in argvs if a and a[0].endswith(".py")][-1]
        assert train[train.index("--hf-checkpoint") + 1] == str(d)
        assert cmd.runtime_env()["env_vars"]["NCCL_DEBUG"] == value
        out.unlink()


def test_ray_env_values_that_ray_would_expand_are_refused():
    for v in ("$HOME/x", "${HOME}", "a$PATH", "${X:-y}"):
        with pytest.raises(ShellValueError, match="Ray's runtime_env would expand"):
            check_ray_literal(v, "paths.slime")
    assert check_ray_literal("/data/$", "x") == "/data/$"  # a bare $ is not expanded by os.path.expandvars
    assert ray_env_vars({"A": "/x"}, {"PYTHONPATH": "/a:${PYTHONPATH}"}) == {"A": "/x", "PYTHONPATH": "/a:${PYTHONPATH}"}
    with pytest.raises(ShellValueError):
        word("a\x00b")


def test_cluster_file_refuses_expanding_paths_and_env(tmp_path):
    base = {"ray": {"address": "http://127.0.0.1:8265"}, "nodes": 1, "gpus_per_node": 8, "gpu_type": "H200",
            "paths": {k: "/data" for k in ("slime", "megatron", "hf_checkpoint", "torch_dist", "sft_data", "output")}}
    for key, val in (("slime", "$HOME/slime"), ("megatron", "/a/$PATH"), ("output", "${HOME}")):
        bad = json.loads(json.dumps(base))
        bad["paths"][key] = val
        with pytest.raises(ClusterFileError, match=f"paths.{key}"):
            parse_cluster_config(bad, "c.yaml")
    with pytest.raises(ClusterFileError, match="env.X"):
        parse_cluster_config({**base, "env": {"X": "$HOME/x"}}, "c.yaml")
    # backticks and ; are fine in a literal path: the launch quotes them (test above)
    assert parse_cluster_config({**base, "python": "python3; touch x"}, "c.yaml").python == "python3; touch x"
