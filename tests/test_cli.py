"""The CLI as a user runs it: every sub-command once, and bad input as one line with the right exit code."""

import json
from pathlib import Path

import pytest

from attune.cli import main

from .conftest import SEED

FIXTURES = Path(__file__).parent / "fixtures"
TUNED = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
         "--decoder-first-pipeline-num-layers", "16", "--decoder-last-pipeline-num-layers", "14",
         "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "12",
         "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192", "--use-precision-aware-optimizer"]


def _data_build_argv(tmp_path):
    from .test_data_build import make_conversations, make_tokenizer

    conv = tmp_path / "conv.jsonl"
    conv.write_text("\n".join(json.dumps(c) for c in make_conversations()))
    tok = make_tokenizer(tmp_path)
    return ["data", "build", "--input", str(conv), "--tokenizer", tok, "--row-tokens", "64", "--out",
            str(tmp_path / "rows.parquet")]


# every sub-command, once, as a user types it: (argv, exit code, text expected on stdout)
SMOKE = {
    "models": (["models"], 0, "Qwen3.6-27B"),
    "gpus": (["gpus"], 0, "H200"),
    "estimate": (["estimate", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--", *TUNED], 0, "tokens/s/GPU"),
    "estimate-megatron": (["estimate", "--model", "Llama-3.1-8B", "--gpus", "8xH100", "--engine", "megatron"], 0,
                          "GiB"),
    "estimate-recipe-only": (["estimate", "--recipe", SEED], 0, "Qwen3.6-27B on 8xH200"),
    "recipe-validate": (["recipe", "validate", str(Path(__file__).parents[1] / "reports" / "example" / "recipe.yaml")],
                        0, "0 error(s)"),
    "recipe-show": (["recipe", "show", SEED], 0, "TP"),
    "slime-command": (["slime", "command", "--recipe", SEED], 0, "train"),
    "slime-parse-log": (["slime", "parse-log", str(FIXTURES / "slime_logs" / "success_20steps.log"), "--gpus", "8"], 0,
                        "tokens/s/GPU"),
    "run-sim": (["run", "--runner", "sim", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--", *TUNED], 0,
                "predicted"),
    "tune-sim": (["tune", "--model", "tiny-llama", "--gpus", "2xH100", "--trials", "2", "--no-verify"], 0, "recipe"),
    "data-build": (None, 0, "rows"),
}


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_every_subcommand(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # default outputs land under the working directory's reports/
    argv, code, text = SMOKE[name]
    if argv is None:
        argv = _data_build_argv(tmp_path)
    assert main(argv) == code, capsys.readouterr().err
    assert text in capsys.readouterr().out


def test_estimate_json_keys(capsys):
    assert main(["estimate", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--json", "--"] + TUNED) == 0
    d = json.loads(capsys.readouterr().out)
    for k in ("fits", "capacity_gib", "peak_gib", "stages", "step_time_s", "tokens_per_s_per_gpu", "mfu",
              "usd_per_million_tokens", "model"):
        assert k in d
    assert d["model"]["active_params"] == 25_623_920_640
    s0 = d["stages"][0]
    assert {"stage", "layers", "total_gib", "breakdown"} <= set(s0)
    assert set(s0["breakdown"]) == {"weights_gib", "grads_gib", "optimizer_gib", "activations_gib", "logits_gib",
                                    "overhead_gib"}
    assert d["fits"] is True and [s["layers"] for s in d["stages"]] == [16, 17, 17, 14]


def test_estimate_recipe_names_its_model_and_gpus(capsys):
    assert main(["estimate", "--recipe", SEED, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["model"]["name"] == "Qwen3.6-27B" and d["gpus"] == "8xH200" and d["layout"]["pp"] == 4


ESTIMATE = ["estimate", "--model", "Qwen3.6-27B", "--gpus", "8xH200"]


@pytest.mark.parametrize("argv,needle", [
    (["estimate", "--model", "Nope", "--gpus", "8xH200"], "unknown model 'Nope'"),
    (["estimate", "--model", "Qwen3.6-27B", "--gpus", "8xV100"], "unknown GPU type 'V100'"),
    (ESTIMATE + ["--", "--tensor-model-parallel-size", "3"], "does not divide"),
    (ESTIMATE + ["--", "--tensor-model-parallel-size", "8"], "query groups"),
    (ESTIMATE + ["--recipe", "/nonexistent.yaml"], "nonexistent"),
    (["estimate", "--model", "Qwen3.6-27B", "--gpus", "0xH100"], "at least 1"),
    (ESTIMATE + ["--global-batch", "-4"], "--global-batch"),
    (ESTIMATE + ["--seq", "0"], "--seq"),
    (ESTIMATE + ["--price", "0"], "--price"),
    (ESTIMATE + ["--gpus-per-node", "0"], "--gpus-per-node"),
    (["estimate", "--model", "Qwen3.6-27B"], "--gpus"),
    (["tune", "--model", "tiny-llama", "--gpus", "2xH100", "--memory-headroom", "1.5"], "--memory-headroom"),
    (["tune", "--model", "tiny-llama", "--gpus", "2xH100", "--trials", "0"], "--trials"),
    (["run", "--model", "tiny-llama", "--gpus", "2xcpu", "--steps", "0"], "--steps"),
    (["slime", "parse-log", "/nonexistent.log", "--gpus", "8"], "no such log file"),
    (["recipe", "show", "/nonexistent.yaml"], "nonexistent"),
    (["nosuchcommand"], "invalid choice"),
])
def test_bad_input_one_line_exit_2(argv, needle, capsys):
    with _exit_code() as rc:
        rc.value = main(argv)
    assert rc.value == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


class _exit_code:
    """argparse exits through SystemExit; the rest returns a code: accept either."""

    def __enter__(self):
        self.value = None
        return self

    def __exit__(self, et, ev, tb):
        if et is SystemExit:
            self.value = ev.code
            return True
        return False


def test_no_layout_fits_is_a_runtime_failure_exit_1(tmp_path, capsys):
    rc = main(["tune", "--model", "Llama-3.1-70B", "--gpus", "1xA100", "--out", str(tmp_path / "x"), "--trials", "3",
               "--no-verify"])
    err = capsys.readouterr().err
    assert rc == 1 and "no layout fits 1xA100" in err and len(err.strip().splitlines()) == 1


def test_debug_shows_the_traceback(monkeypatch):
    from attune.errors import ModelError

    monkeypatch.setenv("ATTUNE_DEBUG", "1")
    with pytest.raises(ModelError):
        main(["estimate", "--model", "Nope", "--gpus", "8xH200"])


def test_internal_bug_is_not_reported_as_bad_input(monkeypatch):
    """Only AttuneError is caught: a bug elsewhere keeps its traceback instead of looking like user error."""
    import attune.api

    def boom(*a, **k):
        raise KeyError("a bug")

    monkeypatch.setattr(attune.api, "estimate_target", boom)
    with pytest.raises(KeyError):
        main(["estimate", "--model", "Qwen3.6-27B", "--gpus", "8xH200"])


def test_models_and_gpus_json(capsys):
    assert main(["models", "--json"]) == 0
    names = [m["name"] for m in json.loads(capsys.readouterr().out)]
    assert "Qwen3.6-27B" in names
    assert main(["gpus", "--json"]) == 0
    assert {g["type"] for g in json.loads(capsys.readouterr().out)["gpus"]} == {"H100", "H200", "H800", "A100", "B200", "GB200", "B300", "GB300"}
