from pathlib import Path

from attune.cli import main
from attune.recipe import parse_run

FIX = Path(__file__).parent / "fixtures"


def test_slime_command_for_seed_recipe(capsys):
    assert main(["slime", "command", "--recipe", str(FIX / "seed_recipe.yaml")]) == 0
    out = capsys.readouterr().out
    rb = parse_run(out)
    flags = dict(rb.flags)
    assert rb.entrypoint[-1] == "train_async.py"
    assert flags["--decoder-first-pipeline-num-layers"] == "16" and flags["--recompute-num-layers"] == "12"
    assert flags["--hf-checkpoint"] == "$HF_CKPT"


def test_slime_command_without_cluster_file_ships_attune(capsys):
    """Issue 13: the printed launch keeps slime off --prompt-data (bug 2) and says how attune reaches the nodes:
    the Ray job's runtime_env py_modules, inherited by slime's actors (bug 3); the stack probe is non-fatal."""
    assert main(["slime", "command", "--recipe", str(FIX / "seed_recipe.yaml")]) == 0
    out = capsys.readouterr().out
    rb = parse_run(out)
    assert rb.has_flag("--disable-rollout-global-dataset")
    assert not rb.has_flag("--input-key") and not rb.has_flag("--metadata-key")
    assert "attune on the nodes" in out and "py_modules" in out and "--runtime-env-json" in out
    probe = next(line for line in out.splitlines() if "-m attune.runners.slime.stack_probe" in line)
    assert "||" in probe  # a missing attune does not stop the script under set -e


def test_slime_parse_log_exit_codes(capsys):
    logs = FIX / "slime_logs"
    assert main(["slime", "parse-log", str(logs / "success_20steps.log"), "--gpus", "8"]) == 0
    assert "tokens/s/GPU" in capsys.readouterr().out
    assert main(["slime", "parse-log", str(logs / "oom_step2_last_stage.log"), "--gpus", "8"]) == 1
    assert main(["slime", "parse-log", "/nonexistent.log", "--gpus", "8"]) == 2


def test_fp16_optimizer_bytes():
    from attune.estimator.memory import optimizer_bytes
    from attune.spec.layout import Layout

    # Megatron's table: bf16 6 + 12/d, fp16 4 + 16/d with the distributed optimizer
    w, g, o, h = optimizer_bytes(Layout(dp=4))
    assert (w + g, o) == (6, 3)
    w, g, o, h = optimizer_bytes(Layout(dp=4, precision="fp16"))
    assert (w + g, o) == (4, 4)
