"""The slime launch for a layout (attune.runners.slime.launch), the cluster file, and the slime runner's
result path on fixture logs (no Ray needed)."""

from __future__ import annotations

import copy
import dataclasses
import json
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from attune.cli import main
from attune.recipe import has_errors, lint, load_recipe, parse_run
from attune.recipe.codec import from_recipe_blocks, to_recipe_block
from attune.runners.base import FAILED, OK, OOM, TIMEOUT, TrialResult, TrialSpec
from attune.runners.ray.cluster import ClusterFileError, load_cluster, parse_cluster_config
from attune.runners.ray.jobs import JobOutcome
from attune.runners.slime.launch import (
    ATTUNE_PACKAGE_DIR,
    LaunchError,
    command_for_recipe,
    model_args,
    slime_command,
    stage_of_rank,
)
from attune.runners.slime.runner import SlimePayload, SlimeRunner, slime_result
from attune.spec.baselines import baseline_layout
from attune.spec.engine import get_engine
from attune.spec.flags import from_flags, known_flag
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import load_model
from attune.spec.placement import batching

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "tests" / "fixtures" / "seed_recipe.yaml"
LOGS = ROOT / "tests" / "fixtures" / "slime_logs"
EXAMPLE_CLUSTER = ROOT / "examples" / "cluster.yaml"

# slime scripts/models/qwen3.5-27B.sh MODEL_ARGS (reference slime-and-qwen.md 1.1), verbatim
QWEN27B_MODEL_ARGS = (
    "--spec slime_plugins.models.qwen3_5 get_qwen3_5_spec --disable-bias-linear --qk-layernorm "
    "--group-query-attention --num-attention-heads 24 --num-query-groups 4 --kv-channels 256 --num-layers 64 "
    "--hidden-size 5120 --ffn-hidden-size 17408 --use-gated-attention --normalization RMSNorm --apply-layernorm-1p "
    "--position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 0.25 --swiglu "
    "--untie-embeddings-and-output-weights --vocab-size 248320 --rotary-base 10000000 --attention-output-gate"
).split()


def groups(argv: list[str]) -> dict[str, tuple[str, ...]]:
    """flag -> its value words (flags must not repeat)."""
    out: dict[str, tuple[str, ...]] = {}
    cur = None
    for w in argv:
        if w.startswith("--"):
            assert w not in out, f"{w} given twice"
            out[w] = ()
            cur = w
        else:
            out[cur] = out[cur] + (w,)
    return out


@pytest.fixture(scope="module")
def seed():
    return load_recipe(SEED)


@pytest.fixture(scope="module")
def seed_cmd(seed):
    return command_for_recipe(seed)


@pytest.fixture(scope="module")
def seed_layout(seed):
    # the seed's layout block omits precision_aware_optimizer; its run block passes --use-precision-aware-optimizer
    return from_recipe_blocks(seed["layout"], seed["workload"], precision_aware_default=True)


def cluster_data(tmp_path: Path, **over) -> dict:
    d = {"ray": {"address": "http://127.0.0.1:8265"}, "nodes": 1, "gpus_per_node": 8, "gpu_type": "H200",
         "nvlink": 18, "python": "python3",
         "paths": {"slime": "/root/slime", "megatron": "/root/Megatron-LM", "hf_checkpoint": "/data/Qwen3.6-27B",
                   "torch_dist": "/data/Qwen3.6-27B_torch_dist", "sft_data": "/data/rows.parquet",
                   "output": "/data/out"},
         "env": {"NCCL_DEBUG": "WARN"}}
    d.update(over)
    return d


def cfg_from(tmp_path: Path, **over):
    return parse_cluster_config(cluster_data(tmp_path, **over), str(tmp_path / "cluster.yaml"))


# ---------------------------------------------------------------------------- model args
# flags slime's script passes that do nothing (the flag table's no_effect): the launch leaves them out
NO_OP_MODEL_ARGS = ("--use-gated-attention",)
OUR_QWEN27B_MODEL_ARGS = [w for w in QWEN27B_MODEL_ARGS if w not in NO_OP_MODEL_ARGS]


def test_model_args_qwen36_27b_are_slimes_model_args():
    """slime's MODEL_ARGS in slime's order, bar --use-gated-attention (registered by slime's Megatron patch,
    read by nothing); the gate itself, --attention-output-gate, stays."""
    a = model_args(load_model("Qwen3.6-27B"))
    assert a == OUR_QWEN27B_MODEL_ARGS
    assert "--attention-output-gate" in a and "--use-gated-attention" not in a


def test_model_args_tied_qwen35_omits_untie():
    a = model_args(load_model("Qwen3.5-4B"))
    assert "--untie-embeddings-and-output-weights" not in a
    g = groups(a)
    assert g["--num-attention-heads"] == ("16",) and g["--num-query-groups"] == ("4",) and g["--num-layers"] == ("32",)
    assert g["--hidden-size"] == ("2560",) and g["--ffn-hidden-size"] == ("9216",)


def test_model_args_llama_family():
    g = groups(model_args(load_model("Llama-3.1-8B")))
    for flag in ("--swiglu", "--group-query-attention", "--disable-bias-linear", "--untie-embeddings-and-output-weights"):
        assert flag in g
    assert g["--normalization"] == ("RMSNorm",) and g["--position-embedding-type"] == ("rope",)
    assert g["--num-query-groups"] == ("8",) and g["--rotary-base"] == ("500000",) and g["--norm-epsilon"] == ("1e-5",)
    assert g["--kv-channels"] == ("128",) and g["--vocab-size"] == ("128256",)
    assert "--qk-layernorm" not in g and "--spec" not in g


def test_model_args_gpt2_learned_layernorm_gelu_tied():
    g = groups(model_args(load_model("gpt2")))
    assert g["--position-embedding-type"] == ("learned_absolute",) and g["--normalization"] == ("LayerNorm",)
    assert g["--max-position-embeddings"] == ("1024",) and "--openai-gelu" in g
    for flag in ("--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear"):
        assert flag not in g


def test_learned_positions_name_the_row_length():
    # without --seq-length slime puts 4096 (slime/backends/megatron_utils/arguments.py lines 164-165), over GPT-2's
    # 1,024 positions: Megatron's validate_args fails (found by tools/check_launches.py)
    m, c = load_model("gpt2"), parse_cluster("8xH200")
    lay = baseline_layout(m, c, Workload(seq_length=1024), get_engine("slime"))[0]
    g = groups(slime_command(m, c, lay, Workload(seq_length=1024)).flags)
    assert g["--seq-length"] == ("1024",) and g["--max-position-embeddings"] == ("1024",)


# ---------------------------------------------------------------------------- the seed's launch
def test_entrypoint_is_train_async_without_colocate(seed_cmd):
    assert seed_cmd.argv[:2] == ["python3", "train_async.py"]
    assert "--colocate" not in seed_cmd.argv
    rb = parse_run(seed_cmd.to_shell())
    assert rb.entrypoint == ["python3", "train_async.py"] and rb.launcher == [] and rb.positionals == []


def test_train_py_when_not_async(seed):
    c = command_for_recipe(seed, async_=False)
    assert c.argv[:2] == ["python3", "train.py"] and "--colocate" not in c.argv


def test_seed_launch_flag_by_flag(seed_cmd):
    g = groups(seed_cmd.flags)
    # actor placement
    assert g["--actor-num-nodes"] == ("1",) and g["--actor-num-gpus-per-node"] == ("8",)
    # model args, in slime's order, right after the placement
    i = seed_cmd.flags.index("--spec")
    assert seed_cmd.flags[i:i + len(OUR_QWEN27B_MODEL_ARGS)] == OUR_QWEN27B_MODEL_ARGS
    # checkpoints (shell variables without a cluster file)
    assert g["--hf-checkpoint"] == ("$HF_CKPT",) and g["--ref-load"] == ("$TORCH_DIST",)
    # workload
    expect = {
        "--rollout-function-path": ("attune.slime_rollout.pretokenized_sft_rollout.generate_rollout",),
        "--prompt-data": ("$SFT_DATA",), "--disable-rollout-global-dataset": (),
        "--num-rollout": ("20",), "--rollout-batch-size": ("128",), "--global-batch-size": ("128",),
        "--loss-type": ("sft_loss",), "--calculate-per-token-loss": (),
        "--disable-compute-advantages-and-returns": (), "--debug-train-only": (),
    }
    # layout (the seed: TP1 PP4 16/.../14, block recompute of 12 layers, dynamic batching at 8,192 tokens)
    expect.update({
        "--tensor-model-parallel-size": ("1",), "--pipeline-model-parallel-size": ("4",),
        "--decoder-first-pipeline-num-layers": ("16",), "--decoder-last-pipeline-num-layers": ("14",),
        "--context-parallel-size": ("1",), "--expert-model-parallel-size": ("1",),
        "--expert-tensor-parallel-size": ("1",), "--recompute-granularity": ("full",),
        "--recompute-method": ("block",), "--recompute-num-layers": ("12",), "--use-dynamic-batch-size": (),
        "--max-tokens-per-gpu": ("8192",), "--use-distributed-optimizer": (), "--use-precision-aware-optimizer": (),
    })
    # optimizer, misc, logging
    expect.update({
        "--optimizer": ("adam",), "--lr": ("1e-5",), "--lr-decay-style": ("cosine",), "--min-lr": ("1e-6",),
        "--lr-warmup-fraction": ("0.1",), "--weight-decay": ("0.1",), "--adam-beta1": ("0.9",),
        "--adam-beta2": ("0.98",), "--attention-dropout": ("0.0",), "--hidden-dropout": ("0.0",),
        "--accumulate-allreduce-grads-in-fp32": (), "--attention-softmax-in-fp32": (),
        "--attention-backend": ("flash",), "--distributed-timeout-minutes": ("30",),
        "--use-tensorboard": (),
    })
    for flag, vals in expect.items():
        assert g.get(flag) == vals, f"{flag}: {g.get(flag)} != {vals}"
    # slime sets these itself; Megatron's --tensorboard-dir is not what slime's logger reads
    # no-op flags (the flag table's no_effect) are left out: TENSORBOARD_DIR names the TensorBoard folder
    for flag in ("--bf16", "--fp16", "--seq-length", "--micro-batch-size", "--colocate", "--tensorboard-dir",
                 "--tb-project-name", "--tb-experiment-name", "--loss-mask-type", "--use-gated-attention"):
        assert flag not in g
    assert seed_cmd.env["TENSORBOARD_DIR"] == "$PROFILE_DIR/attune-tp1-pp4-split16-rb12/tensorboard"
    # nvlink auto (no cluster file): the node's NVLS switch reaches the training actors
    assert g["--train-env-vars"] == ('{"NCCL_NVLS_ENABLE": "$NCCL_NVLS_ENABLE"}',)
    model_set = set(OUR_QWEN27B_MODEL_ARGS)
    assert set(g) - model_set == set(expect) | {"--actor-num-nodes", "--actor-num-gpus-per-node", "--hf-checkpoint",
                                                 "--ref-load", "--train-env-vars"}


def test_seed_launch_covers_every_flag_of_the_seed_run(seed, seed_cmd):
    """Every flag of the seed's measured run comes back with the same value (bar the rollout function's
    module path, which the seed abbreviates, --tensorboard-dir, which slime does not read, and --input-key /
    --metadata-key, which made slime's global data source open the rows itself: issue 13, bug 2)."""
    ours = parse_run(seed_cmd.to_shell()).flag_dict()
    theirs = parse_run(seed["run"]).flag_dict()
    for flag, value in theirs.items():
        if flag in ("--rollout-function-path", "--input-key", "--metadata-key") or known_flag(flag).no_effect:
            continue  # no-op flags (--tensorboard-dir, --loss-mask-type) are left out of the launch
        assert flag in ours, flag
        if value is not None and not value.startswith("$"):
            assert float(ours[flag]) == float(value) if _is_num(value) else ours[flag] == value, flag
    assert ours["--hf-checkpoint"] == theirs["--hf-checkpoint"] == "$HF_CKPT"


def _is_num(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def test_layout_flags_read_back_to_the_layout(seed_cmd, seed_layout, qwen):
    layout, workload = seed_layout
    parsed = from_flags(seed_cmd.flags, qwen, 8)
    assert parsed.layout == layout
    assert parsed.workload.global_batch == workload.global_batch and parsed.dynamic_batching


def test_env_and_runtime_env(seed, seed_cmd):
    env = seed_cmd.env
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["NCCL_NVLS_ENABLE"] == seed["env"]["NCCL_NVLS_ENABLE"]  # nvlink auto: the seed's shell test
    assert env["PYTHONPATH"].startswith("$MEGATRON_DIR:")
    assert env["TENSORBOARD_DIR"] == "$PROFILE_DIR/attune-tp1-pp4-split16-rb12/tensorboard"
    script = seed_cmd.to_shell()
    assert "nvidia-smi topo -m" in script
    rb = parse_run(script)
    for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_NVLS_ENABLE", "TENSORBOARD_DIR"):
        assert rb.env[k] == str(env[k])
    rt = seed_cmd.runtime_env()["env_vars"]
    assert "NCCL_NVLS_ENABLE" not in rt  # computed on the node; passed with --train-env-vars
    assert rt["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and rt["PYTHONPATH"] == "${MEGATRON_DIR}:${PYTHONPATH}"
    assert rt["TENSORBOARD_DIR"] == "${PROFILE_DIR}/attune-tp1-pp4-split16-rb12/tensorboard"


def test_nvlink_count_and_extras_from_the_cluster_file(tmp_path, seed):
    cfg = cfg_from(tmp_path)
    c = command_for_recipe(seed, cfg)
    assert c.env["NCCL_NVLS_ENABLE"] == "1" and c.env["NCCL_DEBUG"] == "WARN"
    assert c.env["PYTHONPATH"].startswith("/root/Megatron-LM:")
    assert "--train-env-vars" not in c.argv and "nvidia-smi" not in c.to_shell()
    rt = c.runtime_env()["env_vars"]
    assert rt["NCCL_NVLS_ENABLE"] == "1" and rt["NCCL_DEBUG"] == "WARN" and rt["TENSORBOARD_DIR"] == \
        "/data/out/attune-tp1-pp4-split16-rb12/tensorboard"
    g = groups(c.flags)
    assert g["--hf-checkpoint"] == ("/data/Qwen3.6-27B",) and g["--prompt-data"] == ("/data/rows.parquet",)
    assert command_for_recipe(seed, cfg_from(tmp_path, nvlink=0)).env["NCCL_NVLS_ENABLE"] == "0"


def test_without_cluster_file_paths_are_shell_variables(seed_cmd):
    rb = parse_run(seed_cmd.to_shell())
    f = rb.flag_dict()
    assert (f["--hf-checkpoint"], f["--ref-load"], f["--prompt-data"]) == ("$HF_CKPT", "$TORCH_DIST", "$SFT_DATA")
    assert 'cd "$SLIME_DIR"' in rb.other_commands
    assert rb.env["PYTHONPATH"].startswith("$MEGATRON_DIR") and rb.env["TENSORBOARD_DIR"].startswith("$PROFILE_DIR/")


def test_stack_probe_runs_first(seed_cmd):
    lines = seed_cmd.to_shell().splitlines()
    probe = next(i for i, l in enumerate(lines) if "-m attune.runners.slime.stack_probe" in l)
    main = next(i for i, l in enumerate(lines) if "train_async.py" in l)
    assert probe < main
    assert lines[0] == "#!/usr/bin/env bash" and "set -euo pipefail" in lines


def test_one_flag_per_line(seed_cmd):
    lines = seed_cmd.to_shell().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("python3 train_async.py"))
    end = next(i for i, l in enumerate(lines) if l.endswith("|| ATTUNE_TRAIN_RC=$?"))
    flag_lines = lines[start + 1:end + 1]
    assert len(flag_lines) == len(seed_cmd.flag_groups())
    for line in flag_lines:
        words = shlex.split(line.rstrip("\\").removesuffix("|| ATTUNE_TRAIN_RC=$?"))
        assert words[0].startswith("--") and all(not w.startswith("--") for w in words[1:])


def test_rendered_script_lints_clean(seed, seed_cmd):
    """A recipe whose run is this script (and env its exports) has no lint errors."""
    recipe = dict(seed)
    recipe["run"] = seed_cmd.to_shell()
    recipe["env"] = {k: str(v) for k, v in seed_cmd.env.items()}
    findings = lint(recipe)
    assert not has_errors(findings), [str(f) for f in findings if f.severity == "error"]
    # the seed's own run (python3 -m --async) is the bug this launch fixes
    assert has_errors(lint(seed))


@pytest.mark.parametrize("model, gpus", [("Qwen3.6-27B", "8xH200"), ("Qwen3.5-4B", "8xH100"),
                                         ("Llama-3.1-8B", "8xH100"), ("gpt2", "2xH100")])
def test_emitted_launch_lints_without_errors_or_no_op_flags(seed, model, gpus):
    """Every flag of the launch attune emits is in the flag table (an unknown flag is a lint error, since
    slime silently ignores it) and none is a no-op in this mode (no no_effect warning)."""
    m, cluster = load_model(model), parse_cluster(gpus)
    wl = Workload(seq_length=min(1024, m.max_positions or 1024), global_batch=16)
    layout, _ = baseline_layout(m, cluster, wl, get_engine("slime"))
    cmd = slime_command(m, cluster, layout, wl)
    recipe = copy.deepcopy(seed)
    recipe.update(model=m.name, run=cmd.to_shell(), env={k: str(v) for k, v in cmd.env.items()},
                  layout=to_recipe_block(layout, m, batching(layout, wl, get_engine("slime"))))
    recipe["gpu"] = {"type": cluster.type_key, "count": cluster.world_size, "per_node": cluster.gpus_per_node}
    recipe["workload"] = dict(recipe["workload"], row_tokens=wl.seq_length, global_batch=wl.global_batch)
    findings = lint(recipe)
    run_findings = [str(f) for f in findings if f.path == "run" or f.path.startswith("layout")]
    assert not [f for f in run_findings if f.startswith("error")], run_findings
    assert not [f for f in findings if "has no effect" in f.message or "unknown flag" in f.message]


def test_injection_stays_one_quoted_word(tmp_path, seed):
    evil = "/data/x; rm -rf /"
    data = cluster_data(tmp_path)
    data["paths"]["hf_checkpoint"] = evil
    data["env"] = {"NCCL_DEBUG": "$(touch /tmp/attune-pwned) `id`"}
    c = command_for_recipe(seed, parse_cluster_config(data, "c.yaml"))
    script = c.to_shell()
    assert shlex.quote(evil) in script
    rb = parse_run(script)
    assert rb.flag_dict()["--hf-checkpoint"] == evil
    assert not any("rm" in cmd.split() for cmd in rb.other_commands)
    assert rb.env["NCCL_DEBUG"] == "$(touch /tmp/attune-pwned) `id`"
    entry = shlex.split(c.ray_entrypoint())
    assert entry[:2] == ["bash", "-c"] and entry[2] == script and len(entry) == 3


def _fake_python(tmp_path: Path) -> Path:
    """A `python3` that prints its argv, cwd and a few env vars as JSON (for running the real script)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "python3"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "keys = ['CUDA_DEVICE_MAX_CONNECTIONS', 'NCCL_NVLS_ENABLE', 'NCCL_DEBUG', 'PYTHONPATH', "
                    "'TENSORBOARD_DIR', 'PYTORCH_CUDA_ALLOC_CONF']\n"
                    "print('FAKE ' + json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(), "
                    "'env': {k: os.environ.get(k) for k in keys}}))\n")
    fake.chmod(0o755)
    return fake


def test_script_runs_in_bash_with_hostile_values(tmp_path, seed):
    """Run the real script under bash with a stand-in python: the argv arrives word for word, nothing
    injected runs, and nvlink auto resolves to 0 on a machine without NVLink."""
    fake = _fake_python(tmp_path)
    slime_dir = tmp_path / "slime dir; touch pwned"
    slime_dir.mkdir()
    sentinel = tmp_path / "pwned"
    data = cluster_data(tmp_path, nvlink="auto", python=str(fake))
    data["paths"].update(slime=str(slime_dir), hf_checkpoint=f"/data/x; touch {sentinel}",
                         output=str(tmp_path / "out $(touch pwned)"))
    data["env"] = {"NCCL_DEBUG": f"$(touch {sentinel})"}
    c = command_for_recipe(seed, parse_cluster_config(data, "c.yaml"))
    (tmp_path / "launch.sh").write_text(c.to_shell())
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    p = subprocess.run(["bash", str(tmp_path / "launch.sh")], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    runs = [json.loads(l[5:]) for l in p.stdout.splitlines() if l.startswith("FAKE ")]
    assert len(runs) == 3  # the stack probe, training, then slime's TensorBoard scalars into the log
    probe, train, scalars = runs
    assert probe["argv"] == ["-m", "attune.runners.slime.stack_probe"]
    assert scalars["argv"] == ["-m", "attune.runners.slime.tbscalars", train["env"]["TENSORBOARD_DIR"]]
    i = train["argv"].index("--train-env-vars")
    assert train["argv"][:i + 1] == c.argv[1:i + 2]  # word for word, up to the one value bash expands
    assert json.loads(train["argv"][i + 1]) == {"NCCL_NVLS_ENABLE": "0"}
    assert train["argv"][i + 2:] == c.argv[i + 3:]
    assert train["cwd"] == str(slime_dir)
    e = train["env"]
    assert e["NCCL_NVLS_ENABLE"] == "0" and e["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert e["NCCL_DEBUG"] == f"$(touch {sentinel})"
    assert e["TENSORBOARD_DIR"] == str(tmp_path / "out $(touch pwned)") + "/attune-tp1-pp4-split16-rb12/tensorboard"
    assert e["PYTHONPATH"].startswith("/root/Megatron-LM:")
    assert not sentinel.exists() and not (tmp_path / "pwned").exists() and not (slime_dir / "pwned").exists()


def test_script_without_cluster_file_needs_the_path_variables(tmp_path, seed_cmd):
    fake = _fake_python(tmp_path)
    (tmp_path / "launch.sh").write_text(seed_cmd.to_shell())
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin"}
    p = subprocess.run(["bash", str(tmp_path / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "MEGATRON_DIR" in p.stderr  # set -u: an unset path variable stops the script
    env.update(SLIME_DIR=str(tmp_path), MEGATRON_DIR="/m", HF_CKPT="/h", TORCH_DIST="/t", SFT_DATA="/s",
               PROFILE_DIR="/p")
    p = subprocess.run(["bash", str(tmp_path / "launch.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    runs = [json.loads(l[5:]) for l in p.stdout.splitlines() if l.startswith("FAKE ")]
    train = next(r for r in runs if r["argv"][0] == "train_async.py")
    g = groups(train["argv"][1:])
    assert g["--hf-checkpoint"] == ("/h",) and g["--ref-load"] == ("/t",) and g["--prompt-data"] == ("/s",)
    assert train["env"]["TENSORBOARD_DIR"] == "/p/attune-tp1-pp4-split16-rb12/tensorboard"


# ---------------------------------------------------------------------------- issue 13: the launch must train
@pytest.mark.parametrize("model, gpus, layout", [
    ("Qwen3.6-27B", "8xH200", None),  # the seed's layout
    ("Llama-3.1-8B", "8xH100", Layout(tp=1, pp=1, dp=8, max_tokens_per_gpu=8192)),
])
def test_slime_does_not_open_the_rows_itself(seed_cmd, model, gpus, layout):
    """Bug 2: slime's global data source must not open --prompt-data (it reads --input-key prompts and, for a
    checkpoint with a processor, dies before step 0); attune's rollout function reads args.prompt_data."""
    if layout is None:
        cmd = seed_cmd
    else:
        cmd = slime_command(load_model(model), parse_cluster(gpus), layout, Workload(seq_length=8192))
    g = groups(cmd.flags)
    assert g["--disable-rollout-global-dataset"] == ()
    assert "--input-key" not in g and "--metadata-key" not in g
    assert g["--prompt-data"] and g["--rollout-function-path"] == (
        "attune.slime_rollout.pretokenized_sft_rollout.generate_rollout",)
    rb = parse_run(cmd.to_shell())
    assert rb.has_flag("--disable-rollout-global-dataset") and not rb.has_flag("--input-key")


def test_runtime_env_ships_attune(seed_cmd, tmp_path, seed):
    """Bug 3: slime's image has no attune; the job's runtime_env carries attune's package (py_modules), which
    slime's RolloutManager and training actors inherit, with or without a cluster file."""
    for cmd in (seed_cmd, command_for_recipe(seed, cfg_from(tmp_path))):
        rt = cmd.runtime_env()
        assert rt["py_modules"] == [ATTUNE_PACKAGE_DIR]
        assert "__pycache__/" in rt["excludes"]
    pkg = Path(ATTUNE_PACKAGE_DIR)
    assert pkg.name == "attune" and (pkg / "__init__.py").is_file()
    # what the nodes import from it: the rollout function named on the command line and the stack probe
    assert (pkg / "slime_rollout" / "pretokenized_sft_rollout.py").is_file()
    assert (pkg / "runners" / "slime" / "stack_probe.py").is_file()


def test_missing_attune_on_the_node_is_not_fatal(tmp_path, seed):
    """Bug 3: on an image without attune `python3 -m attune...stack_probe` fails; under `set -euo pipefail` the
    old script stopped there, before train_async.py. The probe is reported and training still starts."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "python3"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    "if sys.argv[1] == '-m' and sys.argv[2].startswith('attune.'):\n"
                    "    sys.stderr.write(\"No module named 'attune'\\n\")\n"
                    "    sys.exit(1)\n"
                    "print('FAKE ' + json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    slime_dir = tmp_path / "slime"
    slime_dir.mkdir()
    data = cluster_data(tmp_path, nvlink=0, python=str(fake))
    data["paths"].update(slime=str(slime_dir), output=str(tmp_path / "out"))
    c = command_for_recipe(seed, parse_cluster_config(data, "c.yaml"))
    (tmp_path / "launch.sh").write_text(c.to_shell())
    p = subprocess.run(["bash", str(tmp_path / "launch.sh")], cwd=tmp_path, capture_output=True, text=True,
                       env={"PATH": f"{bindir}:/usr/bin:/bin"}, timeout=60)
    assert p.returncode == 0, p.stderr
    runs = [json.loads(l[5:]) for l in p.stdout.splitlines() if l.startswith("FAKE ")]
    assert len(runs) == 1 and runs[0][0] == "train_async.py"  # training ran
    assert "No module named 'attune'" in p.stderr and "attune stack probe: not run" in p.stderr
    assert "TensorBoard scalars not read" in p.stderr  # the scalar dump after training is not fatal either


def test_scalars_are_read_after_a_failed_training_and_its_status_kept(tmp_path, seed):
    """The TensorBoard dump runs after training whatever its outcome, and the script exits with the training's
    status (so Ray still reports the job FAILED)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "python3"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    "print('FAKE ' + json.dumps(sys.argv[1:]))\n"
                    "sys.exit(3 if sys.argv[1] == 'train_async.py' else 0)\n")
    fake.chmod(0o755)
    (tmp_path / "slime").mkdir()
    data = cluster_data(tmp_path, nvlink=0, python=str(fake))
    data["paths"].update(slime=str(tmp_path / "slime"), output=str(tmp_path / "out"))
    c = command_for_recipe(seed, parse_cluster_config(data, "c.yaml"))
    (tmp_path / "launch.sh").write_text(c.to_shell())
    p = subprocess.run(["bash", str(tmp_path / "launch.sh")], cwd=tmp_path, capture_output=True, text=True,
                       env={"PATH": f"{bindir}:/usr/bin:/bin"}, timeout=60)
    runs = [json.loads(l[5:]) for l in p.stdout.splitlines() if l.startswith("FAKE ")]
    assert [r[:2] for r in runs] == [["-m", "attune.runners.slime.stack_probe"], ["train_async.py", "--actor-num-nodes"],
                                     ["-m", "attune.runners.slime.tbscalars"]]
    assert p.returncode == 3


def test_launch_says_how_attune_reaches_the_nodes(tmp_path, seed_cmd):
    """Bug 3: the printed launch (no cluster file) says how attune gets to the nodes, with a submission that
    really carries it: run the comment's `ray job submit` line under bash with a stand-in `ray`."""
    script = seed_cmd.to_shell()
    assert "attune on the nodes" in script and "py_modules" in script
    comment = [l[2:] for l in script.splitlines() if l.startswith("#   ")]
    submit = next(l.strip() for l in comment if l.strip().startswith("ray job submit"))
    args_file = tmp_path / "args.json"
    stub = (f"ray() {{ {shlex.quote(sys.executable)} -c 'import json, sys; "
            f"open(sys.argv[1], \"w\").write(json.dumps(sys.argv[2:]))' {shlex.quote(str(args_file))} \"$@\"; }}\n"
            "ATTUNE_PKG=/opt/ship/attune\n" + submit + "\n")
    p = subprocess.run(["bash", "-c", stub], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    argv = json.loads(args_file.read_text())
    runtime_env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    want = seed_cmd.runtime_env()
    assert runtime_env["py_modules"] == ["/opt/ship/attune"]
    assert runtime_env["env_vars"] == want["env_vars"] and runtime_env["excludes"] == want["excludes"]
    assert argv[argv.index("--") + 1:argv.index("--") + 2] == ["bash"]
    # the comment is only a comment: the script's commands are unchanged by it
    rb = parse_run(script)
    assert rb.entrypoint == ["python3", "train_async.py"] and not any("ray" in c.split() for c in rb.other_commands)


# ---------------------------------------------------------------------------- bad input
def test_launch_rejects_mismatches(qwen, seed_layout):
    layout, workload = seed_layout
    with pytest.raises(LaunchError, match="16 GPUs.*has 8"):
        slime_command(qwen, parse_cluster("8xH200"), replace(layout, dp=4), workload)
    with pytest.raises(LaunchError, match="bf16"):
        slime_command(qwen, parse_cluster("8xH200"), replace(layout, precision="fp16"), workload)
    with pytest.raises(LaunchError, match="window 5..19"):
        slime_command(qwen, parse_cluster("8xH200"), layout, workload, steps=10)
    with pytest.raises(LaunchError, match="cannot run on slime"):
        slime_command(qwen, parse_cluster("8xH200"), replace(layout, tp=8, pp=1, dp=1, first=None, last=None), workload)
    with pytest.raises(LaunchError, match="learned positions"):
        slime_command(load_model("gpt2"), parse_cluster("1xH100"), Layout(), Workload(seq_length=8192))


def test_trial_name_is_quoted_and_sanitised(qwen, seed_layout):
    layout, workload = seed_layout
    c = slime_command(qwen, parse_cluster("8xH200"), layout, workload, trial="my trial; rm -rf /")
    assert c.env["TENSORBOARD_DIR"] == "$PROFILE_DIR/my-trial-rm--rf/tensorboard"


def test_stage_of_rank(seed_layout):
    layout, _ = seed_layout  # TP1 PP4 DP2: ranks 0-1 stage 0, ..., 6-7 stage 3
    assert [stage_of_rank(r, layout) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(LaunchError, match="outside"):
        stage_of_rank(8, layout)


# ---------------------------------------------------------------------------- cluster file
def test_example_cluster_file_loads():
    cfg = load_cluster(EXAMPLE_CLUSTER)
    assert cfg.address == "http://10.0.12.7:8265" and cfg.slot_resource == "attune_trial_slot"
    assert cfg.cluster().world_size == 8 and cfg.nvlink == "auto" and cfg.paths.attune == "/root/attune"
    assert cfg.trial_timeout_s == 3600.0 and cfg.poll_s == 10.0


@pytest.mark.parametrize("mutate, key", [
    (lambda d: d["ray"].update(address="10.0.0.1:8265"), "ray.address"),
    (lambda d: d.pop("nodes"), "nodes"),
    (lambda d: d.update(gpus_per_node=0), "gpus_per_node"),
    (lambda d: d.update(gpu_type="V100"), "gpu_type"),
    (lambda d: d.update(nvlink="yes"), "nvlink"),
    (lambda d: d["paths"].pop("sft_data"), "paths.sft_data"),
    (lambda d: d["paths"].update(checkpoint="/x"), "paths.checkpoint"),
    (lambda d: d.update(extra=1), "extra"),
    (lambda d: d["env"].update({"PYTHONPATH": "/x"}), "env.PYTHONPATH"),
    (lambda d: d["env"].update({"BAD-NAME": "1"}), "env.BAD-NAME"),
    (lambda d: d.update(timeouts={"trial_s": -1}), "timeouts.trial_s"),
    (lambda d: d["ray"].update(slot_resource="a b"), "ray.slot_resource"),
])
def test_cluster_file_errors_name_file_and_key(tmp_path, mutate, key):
    import yaml

    d = cluster_data(tmp_path)
    mutate(d)
    p = tmp_path / "cluster.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(ClusterFileError) as ei:
        load_cluster(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: {key}:") and "\n" not in msg


def test_cluster_file_missing_and_bad_yaml(tmp_path):
    with pytest.raises(ClusterFileError, match="no such cluster file"):
        load_cluster(tmp_path / "nope.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("ray: [unclosed\n")
    with pytest.raises(ClusterFileError, match="malformed YAML"):
        load_cluster(p)


# ---------------------------------------------------------------------------- runner parse path (no Ray)
def seed_spec(tmp_path: Path | None = None, **over) -> TrialSpec:
    r = load_recipe(SEED)
    layout, workload = from_recipe_blocks(r["layout"], r["workload"])
    kw = dict(model=load_model("Qwen3.6-27B"), cluster=parse_cluster("8xH200"), layout=layout, workload=workload,
              engine=get_engine("slime"), trial_dir=tmp_path, timeout_s=3600, label="trial 3")
    kw.update(over)
    return TrialSpec(**kw)


def outcome(log: str, status: str = "SUCCEEDED", timed_out: bool = False) -> JobOutcome:
    return JobOutcome(submission_id="attune-x", status=status, log=log, attached=False, wall_s=1521.0,
                      timed_out=timed_out)


def test_seed_result_from_fixture_log():
    """The seed's `result` block, re-derived from a 20-step job log through the runner's parse path."""
    seed = load_recipe(SEED)
    res = slime_result(outcome((LOGS / "success_20steps.log").read_text()), seed_spec())
    want = seed["result"]
    assert res.status == OK and res.measured and res.reason == ""
    assert res.window == tuple(want["window"]) and res.window_tokens == want["window_tokens"]
    assert res.tokens_per_s_per_gpu == pytest.approx(want["tokens_per_s_per_gpu"], rel=5e-4)
    assert len(res.step_times_s) == want["steps_per_run"] and len(res.losses) == want["steps_per_run"]
    usd = 7.91 / 3600 / res.tokens_per_s_per_gpu * 1e6  # H200 USD/GPU-hour (attune.hardware) per million tokens
    assert round(usd, 2) == want["usd_per_million_tokens"]
    assert 0 < res.step_time_cv_percent < 1.0 and res.step_time_s > 0


def test_oom_fixture_maps_rank_to_stage():
    res = slime_result(outcome((LOGS / "oom_step2_last_stage.log").read_text(), "FAILED"), seed_spec())
    assert res.status == OOM and res.oom_stage == 3  # rank 6 of TP1 PP4 DP2
    assert "pipeline stage 3 (rank 6)" in res.reason and "7.58 GiB" in res.reason and res.log_tail


def test_crash_fixture_is_failed_with_tail():
    res = slime_result(outcome((LOGS / "crash_rollout_valueerror.log").read_text(), "FAILED"), seed_spec())
    assert res.status == FAILED and "ValueError: row 517" in res.reason and "Traceback" in res.log_tail


@pytest.mark.parametrize("name, words, stage", [
    ("nccl_timeout_rank4.log", "NCCL collective timeout on pipeline stage 2 (rank 4) at rollout 5", 2),
    ("actor_died_rank6.log", "Ray actor died on pipeline stage 3 (rank 6) at rollout 3", 3),
    ("train_exception_rank6.log", "exception on pipeline stage 3 (rank 6) at rollout 2: RuntimeError", 3),
    ("crash_rollout_valueerror.log", "exception in RolloutManager at rollout 4: ValueError", None),
])
def test_any_actor_crash_is_failed_with_its_kind_and_stage(name, words, stage):
    """Issue 13: not only CUDA OOMs: NCCL timeouts, dead Ray actors and training-loop exceptions are failed
    trials with their kind, and the pipeline stage of the rank the log names (TP1 PP4 DP2: rank // 2)."""
    res = slime_result(outcome((LOGS / name).read_text(), "FAILED"), seed_spec())
    assert res.status == FAILED and res.oom_stage is None and words in res.reason, res.reason
    assert res.extra["crash"]["stage"] == stage and res.log_tail


def test_timeout_outcome():
    log = (LOGS / "success_20steps.log").read_text().splitlines()
    res = slime_result(outcome("\n".join(log[:60]), "STOPPED", timed_out=True), seed_spec())
    assert res.status == TIMEOUT and "timeout" in res.reason


def test_incomplete_window_is_failed():
    log = (LOGS / "success_20steps.log").read_text().splitlines()
    res = slime_result(outcome("\n".join(log[:60]), "SUCCEEDED"), seed_spec())
    assert res.status == FAILED and "window 5..19" in res.reason


class FakeJobs:
    """Stands in for RayJobs: replays a fixed log."""

    address = "http://fake:8265"

    def __init__(self, log: str, status: str = "SUCCEEDED"):
        self.log, self.status_ = log, status
        self.submitted: list[tuple] = []

    def submit(self, entrypoint, runtime_env, sid, resources=None, metadata=None):
        self.submitted.append((entrypoint, runtime_env, sid, resources))
        return sid, False

    def wait(self, sid, timeout_s=None, poll_s=10.0, on_log=None, stop_grace_s=60.0, attached=False):
        half = len(self.log) // 2
        on_log(self.log[:half])
        on_log(self.log[half:])
        return JobOutcome(submission_id=sid, status=self.status_, log=self.log, attached=attached, wall_s=1521.0)


def test_runner_writes_log_result_and_launch(tmp_path):
    log = (LOGS / "success_20steps.log").read_text()
    jobs = FakeJobs(log)
    runner = SlimeRunner(cluster_file=EXAMPLE_CLUSTER, jobs=jobs, study="s1")
    res = runner.run(seed_spec(tmp_path, trial_number=3))
    assert res.status == OK and res.gpu_hours == pytest.approx(8 * 1521.0 / 3600)
    assert (tmp_path / "log.txt").read_text() == log
    saved = TrialResult.from_dict(json.loads((tmp_path / "result.json").read_text()))
    assert saved.tokens_per_s_per_gpu == pytest.approx(res.tokens_per_s_per_gpu)
    entry, runtime_env, sid, resources = jobs.submitted[0]
    assert resources == {"attune_trial_slot": 1}
    assert sid.startswith("attune-s1-t0003-tp1-pp4-split16-rb12-") and res.extra["submission_id"] == sid
    assert runtime_env["env_vars"]["PYTHONPATH"] == "/root/Megatron-LM:/root/attune:${PYTHONPATH}"
    assert runtime_env["py_modules"] == [ATTUNE_PACKAGE_DIR]  # attune travels with the job (issue 13, bug 3)
    assert shlex.split(entry)[2] == (tmp_path / "launch.sh").read_text()
    # the same trial maps to the same submission id (idempotent resubmission)
    assert runner.submission_id_for(seed_spec(tmp_path, trial_number=3)) == sid
    assert runner.submission_id_for(seed_spec(tmp_path, trial_number=3, label="trial 4")) != sid


def test_runner_needs_an_address():
    from attune.runners.base import RunnerError

    with pytest.raises(RunnerError, match="Ray cluster"):
        SlimeRunner()


def test_runner_refuses_what_the_launch_refuses(tmp_path):
    from attune.errors import UserInputError

    runner = SlimeRunner(jobs=FakeJobs(""))
    bad = seed_spec(tmp_path, cluster=parse_cluster("16xH200"))
    assert any("16" in r for r in runner.check(bad))
    with pytest.raises(UserInputError, match="16"):
        runner.run(bad)


def test_recipe_records_the_launch_versions_and_throughput_basis():
    """Emitted recipes: the stack block names the slime / Megatron-LM commits the launch was written for, and
    result.throughput_basis says what tokens_per_s_per_gpu divides by (a slime trial: actor_train_time, with
    the step_time throughput beside it)."""
    from types import SimpleNamespace

    from attune.reporting.recipe import _throughput_basis
    from attune.runners.torch_runner import torch_rerun

    slime_cfg = SimpleNamespace(runner=SimpleNamespace(name="slime"), engine=get_engine("slime"))
    s = SlimePayload().rerun(seed_spec()).stack
    assert s["slime"].startswith("624b824a ") and s["megatron_lm"].startswith("1dcf0daf ")
    assert "slime" not in torch_rerun(dataclasses.replace(seed_spec(), engine=get_engine("torch"))).stack
    res = slime_result(outcome((LOGS / "success_20steps.log").read_text()), seed_spec())
    best = SimpleNamespace(extra=res.extra)
    tp = _throughput_basis(slime_cfg, best, measured=True)
    assert tp["throughput_basis"] == "actor_train_time"
    assert tp["tokens_per_s_per_gpu_step_time"] == round(res.extra["throughput"]["tokens_per_s_per_gpu_step_time"], 2)
    assert tp["tokens_per_s_per_gpu_step_time"] < res.tokens_per_s_per_gpu
    assert _throughput_basis(slime_cfg, best, measured=False) == {"throughput_basis": "predicted"}
    assert _throughput_basis(slime_cfg, SimpleNamespace(extra={}), measured=True) == {"throughput_basis": "step"}


def test_save_option_for_real_runs(capsys):
    recipe = load_recipe(SEED)
    trial = command_for_recipe(recipe)
    assert "--save" not in trial.flags and "--save-interval" not in trial.flags  # a measurement saves nothing
    cmd = command_for_recipe(recipe, save="/ckpt/run 1")
    f = cmd.flags
    assert f[f.index("--save") + 1] == "/ckpt/run 1" and f[f.index("--save-interval") + 1] == "20"  # once, at the end
    assert "--save '/ckpt/run 1'" in cmd.to_shell()  # quoted
    f = command_for_recipe(recipe, save="/ckpt", save_interval=5).flags
    assert f[f.index("--save-interval") + 1] == "5"
    with pytest.raises(LaunchError, match="needs --save"):
        command_for_recipe(recipe, save_interval=5)
    with pytest.raises(LaunchError, match="positive"):
        command_for_recipe(recipe, save="/ckpt", save_interval=0)
    assert main(["slime", "command", "--recipe", str(SEED), "--save", "/c"]) == 0
    assert "--save /c" in capsys.readouterr().out
    assert main(["slime", "command", "--recipe", str(SEED), "--save-interval", "3"]) == 2


def test_activation_offloading_exports_the_te_switch_megatron_asserts():
    # Megatron-LM 1dcf0daf arguments.py lines 1245-1250: fine-grained activation offloading with Transformer Engine
    # >= 2.10 (slime's image: 2.16.1) asserts NVTE_CPU_OFFLOAD_V1=1 (found by tools/check_launches.py)
    m, cl = load_model("tiny-llama"), parse_cluster("8xH200")
    lay = Layout(tp=1, pp=1, dp=8, offload_modules=("core_attn",))
    cmd = slime_command(m, cl, lay, Workload(seq_length=1024, global_batch=16))
    assert cmd.env["NVTE_CPU_OFFLOAD_V1"] == "1" and "--fine-grained-activation-offloading" in cmd.flags
    assert cmd.runtime_env()["env_vars"]["NVTE_CPU_OFFLOAD_V1"] == "1"  # reaches the training actors
    plain = slime_command(m, cl, Layout(tp=1, pp=1, dp=8), Workload(seq_length=1024, global_batch=16))
    assert "NVTE_CPU_OFFLOAD_V1" not in plain.env
