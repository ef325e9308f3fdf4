import json

import pytest

from attune.cli import main

from .conftest import SEED

TUNED = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
         "--decoder-first-pipeline-num-layers", "16", "--decoder-last-pipeline-num-layers", "14",
         "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "12",
         "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192", "--use-precision-aware-optimizer"]


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


def test_estimate_recipe_and_table(capsys):
    assert main(["estimate", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--recipe", SEED]) == 0
    out = capsys.readouterr().out
    assert "tokens/s/GPU" in out and "GiB" in out


@pytest.mark.parametrize("argv,needle", [
    (["estimate", "--model", "Nope", "--gpus", "8xH200"], "unknown model 'Nope'"),
    (["estimate", "--model", "Qwen3.6-27B", "--gpus", "8xV100"], "unknown GPU type 'V100'"),
    (["estimate", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--", "--tensor-model-parallel-size", "3"], "does not divide"),
    (["estimate", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--", "--tensor-model-parallel-size", "8"], "query groups"),
    (["estimate", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--recipe", "/nonexistent.yaml"], "nonexistent"),
])
def test_bad_input_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_models_and_gpus(capsys):
    assert main(["models", "--json"]) == 0
    names = [m["name"] for m in json.loads(capsys.readouterr().out)]
    assert "Qwen3.6-27B" in names
    assert main(["gpus", "--json"]) == 0
    assert {g["type"] for g in json.loads(capsys.readouterr().out)["gpus"]} == {"H100", "H200", "A100", "B200"}
