"""The exact slime launch for a layout: environment, argv, a bash script and a Ray job entrypoint.

Sources: /work/shared/reference/slime-and-qwen.md (1.1 MODEL_ARGS, 1.2 argument groups, 1.3 how slime is
started and its env vars, 1.4 --debug-train-only, 1.5 dynamic batching, 2.1 TensorBoard) and the seed recipe
attune-tp1-pp4-split16-rb12.yaml (its `run` and `env` blocks, with the `python3 -m --async` bug fixed).

Entrypoint: ``train_async.py`` by default. A trial is an SFT run with ``--debug-train-only`` (no SGLang, no
weight sync); slime's SFT script (``scripts/run-qwen3.5-35B-A3B-sft.sh``) uses ``train_async.py`` so the next
rollout's rows are prefetched while the current step trains. ``train_async.py`` asserts ``not args.colocate``,
so the launch never passes ``--colocate`` (there is no rollout engine to colocate with anyway). ``async_=False``
gives ``train.py`` with the same flags.

What runs where:

* ``LaunchCommand.to_shell()`` is the script the Ray job runs on the head node: exports, the stack probe (one
  JSON line with the image's versions; non-fatal: where attune or the probe is missing it says so and the
  launch goes on), ``cd`` to the slime checkout, and ``python3 train_async.py`` with one flag per line. Every
  user-supplied value is quoted with shlex.quote.
* Ray does not pass a driver's environment to the actors it starts, so the environment also goes into the
  job's ``runtime_env`` (``LaunchCommand.runtime_env()``), which reaches slime's training and rollout actors.
* attune reaches the nodes through that runtime_env too: slime's image holds slime and Megatron-LM only, and
  the rollout function (``--rollout-function-path``) is imported in slime's RolloutManager actor, so the job
  ships attune's package directory as ``py_modules`` (reference slime-runtime-and-moe.md section 2); slime's
  actors inherit the job's runtime_env (section 1). Nothing needs installing in the image.
* Data: ``--disable-rollout-global-dataset`` keeps slime from opening ``--prompt-data`` itself (its global
  data source reads ``--input-key`` prompts and, for checkpoints that ship a processor, asserts they are
  lists, reference section 2); attune's rollout function reads ``args.prompt_data`` on its own.
  ``NCCL_NVLS_ENABLE`` with ``nvlink: auto`` is computed by the script on the node (``nvidia-smi topo -m``, as
  slime's scripts do) and handed to the training actors with slime's ``--train-env-vars``.
* ``LaunchCommand.ray_entrypoint()`` is ``bash -c '<the script>'``.

Without a cluster file the paths are shell variables: $SLIME_DIR, $MEGATRON_DIR, $HF_CKPT, $TORCH_DIST,
$SFT_DATA, $PROFILE_DIR.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from attune.errors import UserInputError
from attune.recipe.models import Recipe
from attune.recipe.target import recipe_target
from attune.runners.ray.cluster import PATH_VARS, ClusterConfig
from attune.runners.shell import bash_c, ray_env_vars, word
from attune.spec import flag_text
from attune.spec.engine import get_engine
from attune.spec.family_registry import launchable
from attune.spec.flags import table_describes, to_flags
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec
from attune.spec.precision import hardware_refusal, slime_env
from attune.spec.rules import check

__all__ = ["LaunchCommand", "LaunchError", "ShellText", "model_args", "slime_command", "command_for_recipe",
           "ROLLOUT_FUNCTION", "ASYNC_SCRIPT", "launch_versions", "SYNC_SCRIPT", "ATTUNE_PACKAGE_DIR", "stage_of_rank"]


class LaunchError(UserInputError):
    """A layout/model/cluster combination that cannot be launched; the message says what is allowed."""


# slime's entrypoints at its repository root (reference 1.3).
ASYNC_SCRIPT = "train_async.py"
SYNC_SCRIPT = "train.py"
# attune's rollout function: replays pretokenized rows under --debug-train-only (reference 1.4).
ROLLOUT_FUNCTION = "attune.slime_rollout.pretokenized_sft_rollout.generate_rollout"
# The stack probe module, run before training (one JSON line in the job log).
STACK_PROBE_MODULE = "attune.runners.slime.stack_probe"
# Seed recipe: --distributed-timeout-minutes 30 (min).
DISTRIBUTED_TIMEOUT_MIN = 30
# slime's scripts detect NVLink this way (HAS_NVLINK in scripts/run-qwen3.5-27B.sh, reference 1.2).
NVLINK_DETECT = "NVLINK_COUNT=$(nvidia-smi topo -m 2>/dev/null | grep -o 'NV[0-9][0-9]*' | wc -l || true)"
# The seed recipe's env value for NCCL_NVLS_ENABLE, verbatim.
NVLS_FROM_COUNT = '$([ "$NVLINK_COUNT" -gt 0 ] && echo 1 || echo 0)'
# The module that prints slime's TensorBoard scalars into the job log after training.
TB_SCALARS_MODULE = "attune.runners.slime.tbscalars"
# Variable holding the training's exit status (the script ends with it after reading the scalars).
TRAIN_RC_VAR = "ATTUNE_TRAIN_RC"
# Variable holding the probe's interpreter: attune.recipe.runblock takes the first command that names a
# python binary as the launch's main command, so the probe must not spell one out.
PROBE_PY_VAR = "ATTUNE_PROBE_PYTHON"
# attune's package directory on the submitting machine: shipped to every node as the job's runtime_env
# py_modules (this file is attune/runners/slime/launch.py).
ATTUNE_PACKAGE_DIR = str(Path(__file__).resolve().parents[2])
# What py_modules leaves out of the upload (Ray's runtime_env "excludes", gitignore syntax).
PY_MODULES_EXCLUDES = ["__pycache__/", "*.pyc"]
# slime's flag that stops its global data source from opening --prompt-data (utils/arguments.py:627,
# reference slime-runtime-and-moe.md section 2).
NO_GLOBAL_DATASET = "--disable-rollout-global-dataset"
_TRIAL_SAFE_RE = re.compile(r"[^A-Za-z0-9._-]+")


class ShellText(str):
    """A value the shell expands when the script runs.

    ``str(x)`` is the text as a bash word splitter reads it back (``$HF_CKPT``), ``x.shell`` how the script
    writes it (``"$HF_CKPT"``), and ``x.ray`` the form for a Ray runtime_env (``${HF_CKPT}``; Ray expands
    ``${VAR}`` in env_vars from the node's environment), or None when Ray cannot express it.
    """

    shell: str
    ray: str | None

    def __new__(cls, text: str, shell: str, ray: str | None = None) -> "ShellText":
        obj = super().__new__(cls, text)
        obj.shell = shell
        obj.ray = ray
        return obj

    @classmethod
    def var(cls, name: str) -> "ShellText":
        return cls(f"${name}", f'"${name}"', "${" + name + "}")


def _q(value: str) -> str:
    """One shell word for a value: ShellText as written, everything else quoted (attune.runners.shell.word)."""
    return value.shell if isinstance(value, ShellText) else word(value)


def _join(base: str, *parts: str) -> str:
    """base/part/...: a ShellText when base is one (the parts quoted), else a plain path."""
    tail = "/".join(p.strip("/") for p in parts if p)
    if isinstance(base, ShellText):
        ray = None if base.ray is None else f"{base.ray}/{tail}"
        return ShellText(f"{base}/{tail}", f"{base.shell}/{shlex.quote(tail)}", ray)
    return f"{base.rstrip('/')}/{tail}"


def _num(x: float | int) -> str:
    """A number as a flag value (``attune.spec.flag_text.number``); a bad one is a LaunchError."""
    return flag_text.number(x, LaunchError)


def _flt(x: float) -> str:
    """A float flag value that stays a float (``attune.spec.flag_text.floating``)."""
    return flag_text.floating(x, LaunchError)


def trial_slug(name: str) -> str:
    """A trial name safe for paths and Ray submission ids."""
    s = _TRIAL_SAFE_RE.sub("-", name).strip("-.")
    if not s:
        raise LaunchError(f"trial name {name!r} has no usable characters; allowed: letters, digits, . _ -")
    return s[:120]


# ---------------------------------------------------------------------- model arguments
def model_args(model: ModelSpec) -> list[str]:
    """Megatron-LM / slime architecture flags for a model: its family's (``ModelSpec.traits.model_args``,
    ``attune.spec.families``), MoE and latent attention included; a family without a slime launch is refused with
    its reason."""
    family = model.traits
    if family.model_args is None:
        raise LaunchError(f"model {model.name}: {family.launch_refusal}; allowed families: {', '.join(launchable())}")
    return family.model_args(model)


def stage_of_rank(rank: int, layout: Layout) -> int:
    """Pipeline stage of a global rank. Megatron's default rank order is tp-cp-ep-dp-pp: PP is outermost, so
    stage = rank // (TP x CP x DP) (megatron/core/parallel_state.py, RankGenerator order)."""
    per_stage = layout.tp * layout.cp * layout.dp
    if rank < 0 or rank >= layout.world_size:
        raise LaunchError(f"rank {rank} is outside the {layout.world_size} ranks of the layout")
    return rank // per_stage


def launch_versions() -> dict[str, str]:
    """The slime and Megatron-LM commits the launch was written for (those the flag table describes):
    {"slime": "624b824a", "megatron_lm": "1dcf0daf"}."""
    d = table_describes()
    return {"slime": str(d.get("slime", "unknown")), "megatron_lm": str(d.get("megatron_lm", "unknown"))}


# ---------------------------------------------------------------------- the launch
@dataclass
class LaunchCommand:
    """One trial's slime launch: the script the Ray job runs and the runtime_env it is submitted with."""

    trial: str
    """Trial slug (TensorBoard run, output folder)."""
    python: str
    """The training image's interpreter."""
    script: str
    """train_async.py | train.py."""
    workdir: str
    """slime checkout (the script cds there first)."""
    env: dict[str, str]
    """Exported, in order; ShellText values are expanded by the shell."""
    argv: list[str]
    """python, script, flags..."""
    setup: list[str] = field(default_factory=list)
    """Raw shell lines before the exports (generated, never user input)."""
    probe: bool = True
    """Run the (non-fatal) stack probe before training."""
    read_tensorboard: bool = True
    """After training, print slime's TensorBoard scalars into the job log (non-fatal; the script then exits with
    the training's exit status)."""
    comment: str = ""
    """Header comment of the script."""
    py_modules: list[str] = field(default_factory=lambda: [ATTUNE_PACKAGE_DIR])
    """Local package directories the job ships to every node (runtime_env py_modules): attune itself."""

    @property
    def flags(self) -> list[str]:
        return self.argv[2:]

    def flag_groups(self) -> list[list[str]]:
        """The flags, each with its values: [['--num-layers', '64'], ['--swiglu'], ...]."""
        out: list[list[str]] = []
        for w in self.flags:
            if w.startswith("--") or not out:
                out.append([w])
            else:
                out[-1].append(w)
        return out

    def to_shell(self) -> str:
        """A complete bash script; user values are shlex-quoted, one flag per line."""
        lines = ["#!/usr/bin/env bash"]
        lines += [f"# {c}" if c else "#" for c in self.comment.splitlines()]
        lines += [f"# {c}" if c else "#" for c in self.shipping_note().splitlines()]
        lines.append("set -euo pipefail")
        lines += self.setup
        lines += [f"export {k}={_q(v)}" for k, v in self.env.items()]
        if self.probe or self.read_tensorboard:
            lines.append(f"{PROBE_PY_VAR}={_q(self.python)}")
        if self.probe:
            lines += self._probe_lines()
        lines.append(f"cd {_q(self.workdir)}")
        lines += self._train_lines()
        return "\n".join(lines) + "\n"

    def _probe_lines(self) -> list[str]:
        # Non-fatal under set -e: a command on the left of || never stops the script.
        return ["# software stack of the training image, one JSON line (attune stack probe); never fatal",
                f'"${PROBE_PY_VAR}" -m {STACK_PROBE_MODULE} || echo "attune stack probe: not run (attune is not '
                f'importable on this node, or the probe failed); the launch goes on" >&2']

    def _train_lines(self) -> list[str]:
        cmd = [f"{TRAIN_RC_VAR}=0"] if self.read_tensorboard else []
        cmd.append(f"{_q(self.python)} {_q(self.script)} \\")
        groups = self.flag_groups()
        for i, g in enumerate(groups):
            end = "" if i == len(groups) - 1 else " \\"
            if i == len(groups) - 1 and self.read_tensorboard:
                end = f" || {TRAIN_RC_VAR}=$?"  # keep going to read the scalars; exit with this status below
            cmd.append("  " + " ".join(_q(w) for w in g) + end)
        if self.read_tensorboard:
            cmd += ["# slime's TensorBoard scalars as one log line for attune (step times, tokens/s, loss); never fatal",
                    f'"${PROBE_PY_VAR}" -m {TB_SCALARS_MODULE} "$TENSORBOARD_DIR" || echo "attune: TensorBoard '
                    f'scalars not read; attune falls back to the log lines" >&2',
                    f'exit "${TRAIN_RC_VAR}"']
        return cmd

    def ray_entrypoint(self) -> str:
        """The Ray job entrypoint: the script run by bash on the head node."""
        return bash_c(self.to_shell())

    def runtime_env(self) -> dict:
        """Ray runtime_env for the job: every env var Ray can express (actors do not inherit the driver's) and
        attune's package as py_modules (slime's actors inherit the job's runtime_env)."""
        literal: dict[str, str] = {}
        expanded: dict[str, str] = {}
        for k, v in self.env.items():
            if isinstance(v, ShellText):
                if v.ray is None:
                    continue  # computed on the node; reaches the training actors via --train-env-vars
                expanded[k] = v.ray
            else:
                literal[k] = str(v)
        out: dict = {"env_vars": ray_env_vars(literal, expanded)}
        if self.py_modules:
            out["py_modules"] = list(self.py_modules)
            out["excludes"] = list(PY_MODULES_EXCLUDES)
        return out

    def shipping_note(self) -> str:
        """How attune reaches the nodes, with the submission that does it (a comment of the script)."""
        if not self.py_modules:
            return ("attune on the nodes: nothing is shipped with this job; the stack probe and the rollout "
                    "function need attune importable in the training image.")
        marker = "@ATTUNE_PKG@"
        env = self.runtime_env()
        env["py_modules"] = [marker]
        left, right = json.dumps(env).split(json.dumps(marker), 1)
        runtime_json = shlex.quote(left + '"') + '"$ATTUNE_PKG"' + shlex.quote('"' + right)
        return ("attune on the nodes: slime's image has no attune, so the Ray job ships it. The job's runtime_env\n"
                "carries attune's package directory as py_modules (and the exports below as env_vars); slime's\n"
                "RolloutManager and training actors inherit it. attune's slime runner submits it so; by hand:\n"
                "  ATTUNE_PKG=$(python3 -c 'import attune, os; print(os.path.dirname(attune.__file__))')\n"
                f"  ray job submit --address http://HEAD:8265 --runtime-env-json {runtime_json} "
                '-- bash -c "$(cat this-script.sh)"')


def _paths(cfg: ClusterConfig | None) -> dict[str, str]:
    if cfg is None:
        return {k: ShellText.var(v) for k, v in PATH_VARS.items()}
    p = cfg.paths
    return {"slime": p.slime, "megatron": p.megatron, "hf_checkpoint": p.hf_checkpoint,
            "torch_dist": p.torch_dist, "sft_data": p.sft_data, "output": p.output}


def _pythonpath(megatron: str, attune_dir: str | None) -> ShellText:
    parts = [megatron] + ([attune_dir] if attune_dir else [])
    shell = ":".join(_q(p) for p in parts) + ':"${PYTHONPATH:-}"'
    text = ":".join(str(p) for p in parts) + ":${PYTHONPATH:-}"
    ray = ":".join(p.ray if isinstance(p, ShellText) else p for p in parts) + ":${PYTHONPATH}"
    return ShellText(text, shell, ray)


def _check_launchable(model: ModelSpec, cluster_spec: Cluster, layout: Layout, workload: Workload,
                      cluster_cfg: ClusterConfig | None, steps: int) -> None:
    """Raise LaunchError (one line, what is allowed) for a combination slime cannot run."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise LaunchError(f"steps must be a positive integer (got {steps!r})")
    for flag, v in (("--lr", workload.lr), ("--min-lr", workload.min_lr), ("--lr-warmup-fraction", workload.warmup_fraction),
                    ("--weight-decay", workload.weight_decay), ("--adam-beta1", workload.adam_beta1),
                    ("--adam-beta2", workload.adam_beta2)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise LaunchError(f"{flag} {v!r}: must be a finite number")
    a, b = workload.window
    if not 0 <= a <= b < steps:
        raise LaunchError(f"measurement window {a}..{b} must lie within the {steps} steps 0..{steps - 1}")
    if layout.world_size != cluster_spec.world_size:
        raise LaunchError(f"layout {layout.label()} uses {layout.world_size} GPUs, the cluster {cluster_spec.spec} "
                          f"has {cluster_spec.world_size}; they must match")
    if cluster_cfg is not None and (cluster_cfg.nodes, cluster_cfg.gpus_per_node) != (cluster_spec.nodes, cluster_spec.gpus_per_node):
        raise LaunchError(f"{cluster_cfg.source}: the cluster file has {cluster_cfg.nodes} x {cluster_cfg.gpus_per_node} "
                          f"GPUs, the trial asks for {cluster_spec.nodes} x {cluster_spec.gpus_per_node}")
    if layout.precision != "bf16":
        raise LaunchError(f"precision {layout.precision}: slime trains in bf16 only (it sets bf16 = not fp16)")
    errs = check(layout, model, cluster_spec.world_size, workload, get_engine("slime"))
    refused = hardware_refusal(layout, cluster_spec.gpu.generation, cluster_spec.gpu.is_cpu)
    if refused:
        errs.append(refused)
    if errs:
        raise LaunchError(f"layout {layout.label()} cannot run on slime: " + "; ".join(errs))
    if model.positions == "learned" and workload.seq_length > model.max_positions:
        raise LaunchError(f"{model.name} has {model.max_positions} learned positions; rows of {workload.seq_length} "
                          f"tokens do not fit (use a row length <= {model.max_positions})")


def _launch_env(paths: dict[str, str], nvlink: str | int, cluster_cfg: ClusterConfig | None,
                slug: str) -> tuple[dict[str, str], list[str]]:
    """(exported environment, setup lines before it)."""
    env: dict[str, str] = {
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # Megatron: comm/compute overlap ordering (slime scripts, seed env)
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",  # slime SFT script, seed env
        "TORCHINDUCTOR_COMPILE_THREADS": "1",  # seed env
        "PYTHONUNBUFFERED": "1",  # slime's scripts: log lines reach the job log as they are printed
    }
    setup: list[str] = []
    if nvlink == "auto":
        setup.append(NVLINK_DETECT)
        env["NCCL_NVLS_ENABLE"] = ShellText(NVLS_FROM_COUNT, NVLS_FROM_COUNT, None)
    else:
        env["NCCL_NVLS_ENABLE"] = "1" if int(nvlink) > 0 else "0"
    env["PYTHONPATH"] = _pythonpath(paths["megatron"], cluster_cfg.paths.attune if cluster_cfg else None)
    env["TENSORBOARD_DIR"] = _join(paths["output"], slug, "tensorboard")  # slime's logger reads this (ref 2.1)
    if cluster_cfg is not None:
        env.update(cluster_cfg.env)
    return env, setup


def _data_flags(model: ModelSpec, paths: dict[str, str], workload: Workload, steps: int) -> list[str]:
    """Checkpoints, attune's rollout function over the packed rows, batch and SFT loss."""
    gb = str(workload.global_batch)
    flags = ["--hf-checkpoint", paths["hf_checkpoint"], "--ref-load", paths["torch_dist"],
             "--rollout-function-path", ROLLOUT_FUNCTION, "--prompt-data", paths["sft_data"], NO_GLOBAL_DATASET,
             "--num-rollout", str(steps), "--rollout-batch-size", gb, "--global-batch-size", gb,
             "--loss-type", "sft_loss"]
    # no --loss-mask-type: only slime's own SFT rollout reads it (the flag table's no_effect); attune's rollout
    # replays the loss mask stored with each row (attune data build --tokenizer ... records its type)
    if model.positions == "learned":
        # slime's placeholder seq_length is 4096 (slime/backends/megatron_utils/arguments.py lines 164-165) and
        # Megatron-LM's validate_args asserts max_position_embeddings >= seq_length (arguments.py lines 828-831): a
        # learned position table shorter than that (GPT-2 1,024, GPT-3 2,048) needs the row length named
        flags += ["--seq-length", str(workload.seq_length)]
    return flags + ["--calculate-per-token-loss", "--disable-compute-advantages-and-returns", "--debug-train-only"]


def _layout_flags(layout: Layout) -> list[str]:
    """The layout through the one flag codec; slime sets bf16 itself (and a placeholder --seq-length)."""
    return [f for f in to_flags(layout) if f not in ("--bf16", "--fp16")]


def _optimizer_flags(workload: Workload) -> list[str]:
    return ["--optimizer", "adam", "--lr", _num(workload.lr), "--lr-decay-style", workload.lr_decay_style,
            "--min-lr", _num(workload.min_lr), "--lr-warmup-fraction", _num(workload.warmup_fraction),
            "--weight-decay", _num(workload.weight_decay), "--adam-beta1", _num(workload.adam_beta1),
            "--adam-beta2", _num(workload.adam_beta2)]


def _runtime_flags(slug: str, nvlink: str | int) -> list[str]:
    """Numerics switches of the seed, TensorBoard, and the node-computed NVLS switch for the actors."""
    flags = ["--attention-dropout", _flt(0.0), "--hidden-dropout", _flt(0.0),
             "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--attention-backend", "flash",
             "--distributed-timeout-minutes", str(DISTRIBUTED_TIMEOUT_MIN),
             "--use-tensorboard"]  # TENSORBOARD_DIR names the folder (--tb-project-name/-experiment-name unused)
    if nvlink == "auto":
        # runtime_env cannot run nvidia-smi: the script computes the switch and slime hands it to the actors
        js = '{"NCCL_NVLS_ENABLE": "$NCCL_NVLS_ENABLE"}'
        flags += ["--train-env-vars", ShellText(js, '"{\\"NCCL_NVLS_ENABLE\\": \\"$NCCL_NVLS_ENABLE\\"}"', None)]
    return flags


def _save_flags(save: str | None, save_interval: int | None, steps: int) -> list[str]:
    """Megatron checkpoints of a real run: ``--save DIR --save-interval N`` (slime re-registers both,
    slime/utils/arguments.py lines 854-855 at 624b824a, and asserts --save when --save-interval is given,
    line 1844). slime's training loop saves when ``should_run_periodic_action(rollout_id, save_interval, ...,
    num_rollout)`` holds (train_async.py lines 55-61), which includes the last rollout, so the default interval
    (the step count) saves once, at the end. Without ``save`` a trial saves nothing (it is a measurement)."""
    if save is None:
        if save_interval is not None:
            raise LaunchError("--save-interval needs --save DIR (slime asserts --save when save_interval is set)")
        return []
    if not str(save).strip():
        raise LaunchError("--save needs a directory (got an empty path)")
    n = steps if save_interval is None else save_interval
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise LaunchError(f"--save-interval must be a positive number of steps (got {save_interval!r})")
    return ["--save", save, "--save-interval", str(n)]


def slime_command(model: ModelSpec, cluster_spec: Cluster, layout: Layout, workload: Workload,
                  cluster_cfg: ClusterConfig | None = None, steps: int | None = None, async_: bool = True,
                  trial: str | None = None, python: str | None = None, probe: bool = True,
                  save: str | None = None, save_interval: int | None = None) -> LaunchCommand:
    """The slime launch of one trial: `steps` optimizer steps (= rollouts) of `layout` on `cluster_spec`.

    steps defaults to workload.steps (20 in the seed). trial names the TensorBoard run and the output folder.
    save: a directory for Megatron checkpoints (a real run; ``--save``), every `save_interval` steps and at
    the last (default: the last only).
    """
    steps = workload.steps if steps is None else steps
    _check_launchable(model, cluster_spec, layout, workload, cluster_cfg, steps)
    save_flags = _save_flags(save, save_interval, steps)
    slug = trial_slug(trial or f"attune-{layout.slug()}")
    paths = _paths(cluster_cfg)
    py = python or (cluster_cfg.python if cluster_cfg else "python3")
    nvlink = cluster_cfg.nvlink if cluster_cfg else "auto"
    env, setup = _launch_env(paths, nvlink, cluster_cfg, slug)
    env.update(slime_env(layout))  # low precision (issue 22): blockwise fp8 wants fp32 block scales
    if layout.offload_modules:
        # Megatron-LM 1dcf0daf arguments.py lines 1245-1250: with fine-grained activation offloading and Transformer
        # Engine >= 2.10 (slime's image installs 2.16.1, docker/Dockerfile line 60) validate_args asserts this, so TE
        # offloads activations only, not weights
        env["NVTE_CPU_OFFLOAD_V1"] = "1"
    flags = (["--actor-num-nodes", str(cluster_spec.nodes), "--actor-num-gpus-per-node", str(cluster_spec.gpus_per_node)]
             + model_args(model) + _data_flags(model, paths, workload, steps) + _layout_flags(layout)
             + _optimizer_flags(workload) + _runtime_flags(slug, nvlink) + save_flags)
    script = ASYNC_SCRIPT if async_ else SYNC_SCRIPT
    written_for = launch_versions()
    comment = (f"attune slime trial {slug}: {model.name}, {layout.label()}, {steps} steps of "
               f"{workload.global_batch} x {workload.seq_length} tokens on {cluster_spec.spec}\n"
               f"written for slime {written_for['slime']} and Megatron-LM {written_for['megatron_lm']} with slime's "
               f"Megatron patch (the flag table attune/spec/megatron_flags.yaml)\n"
               f"generated by attune.runners.slime.launch; submitted as a Ray job, the actors get the "
               f"exported environment through the job's runtime_env")
    return LaunchCommand(trial=slug, python=py, script=script, workdir=paths["slime"], env=env,
                         argv=[py, script] + flags, setup=setup, probe=probe, comment=comment)


# ---------------------------------------------------------------------- from a recipe
def command_for_recipe(recipe: dict | Recipe, cluster_cfg: ClusterConfig | None = None, async_: bool = True,
                       source: str = "recipe", save: str | None = None,
                       save_interval: int | None = None) -> LaunchCommand:
    """The slime launch of a recipe's model, gpu, layout and workload (the `attune slime command` view).

    The recipe is read by attune.recipe.target.recipe_target, the one recipe parser: optimizer settings from
    the recipe's `run` flags when it has them (else attune's defaults, which are the seed's), the step count and
    window from its `result` block (else 20 steps, window 5..19). source names the recipe in messages.
    save / save_interval: checkpoints of a real run (``slime_command``).
    """
    t = recipe_target(recipe, engine="slime", source=source)
    return slime_command(t.model, t.cluster, t.layout, t.workload, cluster_cfg=cluster_cfg, async_=async_,
                         trial=f"attune-{t.layout.slug()}", save=save, save_interval=save_interval)
