"""attune run: one real measured run on 2 CPU workers, JSON output, and bad input."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from attune.cli import main  # noqa: E402


@pytest.mark.slow
def test_run_tiny_llama_dp2(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["run", "--model", "tiny-llama", "--gpus", "2xcpu", "--steps", "12", "--out", str(out), "--json",
               "--", "--pipeline-model-parallel-size", "1", "--use-distributed-optimizer"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["status"] == "ok" and d["measured"] is True
    assert d["tokens_per_s_per_gpu"] > 0 and d["step_time_s"] > 0
    assert len(d["losses"]) == 12 and len(d["peak_memory_gib"]) == 1
    saved = json.loads((out / "run.json").read_text())
    assert saved["layout"]["dp"] == 2 and saved["result"]["status"] == "ok"


@pytest.mark.parametrize("flags,word", [
    (["--pipeline-model-parallel-size", "two"], "expected an integer"),
    (["--pipeline-model-parallel-size", "3"], "does not divide the 2 GPUs"),
    (["--no-such-flag", "1"], "--no-such-flag"),
])
def test_bad_flag_exit_2_one_line(tmp_path, capsys, flags, word):
    rc = main(["run", "--model", "tiny-llama", "--gpus", "2xcpu", "--out", str(tmp_path), "--"] + flags)
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and word in err


def test_text_output_units(monkeypatch, capsys, tmp_path):
    from attune.cli.render import format_run_result
    from attune.runners.base import TrialResult
    from attune.runners.torch_runner import TorchRunner
    from attune.spec.layout import Layout, Workload

    res = TrialResult(status="oom", measured=True, reason="out of memory on pipeline stage 1", peak_memory_gib=[1.5, 2.25])
    assert "stage 1 2.25 GiB" in format_run_result(res, Layout(dp=2), Workload(), "test")

    monkeypatch.setattr(TorchRunner, "run", lambda self, spec: res)
    rc = main(["run", "--model", "tiny-llama", "--gpus", "2xcpu", "--out", str(tmp_path)])
    assert rc == 1
    cap = capsys.readouterr()
    assert cap.err.strip() == "attune run: oom: out of memory on pipeline stage 1"
    assert "GiB" in cap.out
