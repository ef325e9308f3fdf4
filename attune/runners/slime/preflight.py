"""``attune slime preflight``: one short Ray job that checks, on every node, what a slime study needs.

The job (:mod:`attune.runners.slime.preflight_probe`, shipped with attune through the job's runtime_env as
the trials are) reports raw facts per node; :func:`judge` turns them into :class:`PreflightCheck` rows against
the cluster file and the model:

* ``paths.slime`` / ``paths.megatron``: the checkouts exist (slime's ``train_async.py`` in it) and
  ``import slime`` / ``import megatron.core`` work in the cluster file's python with them on PYTHONPATH;
* ``paths.hf_checkpoint``: the folder holds a ``config.json`` with the model's geometry (layers, hidden, FFN,
  heads, KV heads, vocabulary: ``attune.spec.model.from_hf_config``);
* ``paths.torch_dist``: the folder holds Megatron-LM's tracker file ``latest_checkpointed_iteration.txt``;
* ``paths.sft_data``: the file is readable (and starts with parquet's ``PAR1`` when it is ``.parquet``);
* ``attune``: importable in a task of the job (what slime's actors inherit from the runtime_env);
* ``gpus``: enough nodes hold ``gpus_per_node`` GPUs of the cluster's type (name and memory per node);
* ``nvlink``: the NVLink count (``nvidia-smi topo -m``); a failure only when the cluster file says NVLink and a
  node has none.

:class:`PreflightReport` holds the rows; ``failures`` and ``reason`` (one line) say what is missing, by name.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from attune.errors import RunnerError, UserInputError
from attune.runners.ray.cluster import ClusterConfig
from attune.runners.ray.jobs import RayJobs, submission_id
from attune.runners.shell import command, ray_env_vars
from attune.runners.slime.launch import ATTUNE_PACKAGE_DIR, PY_MODULES_EXCLUDES
from attune.runners.slime.preflight_probe import MARKER
from attune.spec.model import ModelSpec, from_hf_config

__all__ = ["PreflightCheck", "PreflightReport", "PreflightFailed", "preflight_job", "judge", "run_preflight",
           "parse_preflight_log", "PREFLIGHT_TIMEOUT_S"]

# Seconds the whole preflight job may take (runtime_env upload, one import of megatron.core per node).
PREFLIGHT_TIMEOUT_S = 600.0
# ModelSpec fields a checkpoint's config.json must match (what the launch's MODEL_ARGS set).
_GEOMETRY = ("num_layers", "hidden", "ffn", "heads", "kv_heads", "vocab")
_PARQUET_MAGIC = b"PAR1".hex()


class PreflightFailed(RunnerError):
    """The cluster is missing something a slime trial needs (the message names it; exit code 1)."""


@dataclass(frozen=True, kw_only=True)
class PreflightCheck:
    """One check on one node."""

    node: str
    """Node address (or host name)."""
    check: str
    """What was checked: a cluster-file key (paths.slime, ...), attune, gpus or nvlink."""
    ok: bool
    """Whether it passed."""
    detail: str
    """What was found (the path and what is missing, the GPU names and memory, ...)."""


@dataclass(frozen=True, kw_only=True)
class PreflightReport:
    """Every node's checks."""

    checks: list[PreflightCheck]
    """One row per node and check, in node order."""
    nodes: int
    """Alive nodes checked."""

    @property
    def failures(self) -> list[PreflightCheck]:
        return [c for c in self.checks if not c.ok]

    @property
    def ok(self) -> bool:
        return not self.failures

    def reason(self) -> str:
        """One line: what is missing, by name (empty when nothing is)."""
        f = self.failures
        if not f:
            return ""
        first = "; ".join(f"{c.check} on {c.node}: {c.detail}" for c in f[:3])
        more = f" (and {len(f) - 3} more)" if len(f) > 3 else ""
        return f"slime preflight failed ({len(f)} of {len(self.checks)} checks on {self.nodes} node(s)): {first}{more}"

    def to_dict(self) -> dict:
        return {"ok": self.ok, "nodes": self.nodes, "checks": [c.__dict__ for c in self.checks]}


# ---------------------------------------------------------------------------------------------- the job
def preflight_job(cfg: ClusterConfig, python: str | None = None) -> tuple[str, dict]:
    """(entrypoint, runtime_env) of the preflight job: the probe module, attune shipped as py_modules."""
    spec = {"paths": {k: getattr(cfg.paths, k) for k in ("slime", "megatron", "hf_checkpoint", "torch_dist",
                                                          "sft_data")},
            "python": python or cfg.python, "timeout_s": PREFLIGHT_TIMEOUT_S}
    # Ray runs the entrypoint with a shell: every word quoted, paths and python stay literal (shell.command)
    entry = command([python or cfg.python, "-m", "attune.runners.slime.preflight_probe", json.dumps(spec)])
    env = {"env_vars": ray_env_vars(cfg.env, source=f"{cfg.source}: env"), "py_modules": [ATTUNE_PACKAGE_DIR], "excludes": list(PY_MODULES_EXCLUDES)}
    return entry, env


def parse_preflight_log(log: str) -> list[dict] | None:
    """The nodes' facts from the job log's marker line, or None."""
    for line in reversed(log.splitlines()):
        i = line.find(MARKER)
        if i >= 0:
            try:
                return list(json.loads(line[i + len(MARKER):])["nodes"])
            except (ValueError, KeyError, TypeError):
                return None
    return None


# ---------------------------------------------------------------------------------------------- judging
def _config_matches(config: dict, model: ModelSpec | None) -> tuple[bool, str]:
    if model is None:
        return True, "config.json present (no model to compare)"
    try:
        got = from_hf_config(config, name="checkpoint")
    except (UserInputError, KeyError, TypeError, ValueError) as e:
        return False, f"config.json is not a config attune reads: {' '.join(str(e).split())[:160]}"
    diff = [f"{k} {getattr(got, k)} (model {getattr(model, k)})" for k in _GEOMETRY
            if getattr(got, k) != getattr(model, k)]
    if diff:
        return False, f"config.json does not match {model.name}: " + ", ".join(diff)
    return True, f"config.json matches {model.name}"


def _node_rows(n: dict, cfg: ClusterConfig, model: ModelSpec | None) -> list[PreflightCheck]:
    node = str(n.get("node_ip") or n.get("host") or n.get("node_id", "?"))
    rows: list[PreflightCheck] = []

    def add(check: str, ok: bool, detail: str) -> None:
        rows.append(PreflightCheck(node=node, check=check, ok=ok, detail=detail))

    if "error" in n:
        add("node", False, f"the check did not run there: {n['error']}")
        return rows
    p = cfg.paths
    imports = n.get("imports") or {}
    for key, path, module, extra_ok, extra_msg in (
            ("paths.slime", p.slime, "slime", n.get("slime_entrypoint"), "no train_async.py in it"),
            ("paths.megatron", p.megatron, "megatron.core", True, "")):
        if not n.get(f"{key.split('.')[1]}_dir"):
            add(key, False, f"{path}: no such directory")
        elif not extra_ok:
            add(key, False, f"{path}: {extra_msg}")
        elif imports.get(module):
            add(key, False, f"{path}: import {module} fails in {cfg.python}: {imports[module]}")
        else:
            add(key, True, f"{path}: import {module} works")
    if not n.get("hf_dir"):
        add("paths.hf_checkpoint", False, f"{p.hf_checkpoint}: no such directory")
    elif n.get("hf_config") is None:
        add("paths.hf_checkpoint", False, f"{p.hf_checkpoint}: no readable config.json ({n.get('hf_config_error')})")
    else:
        ok, detail = _config_matches(n["hf_config"], model)
        add("paths.hf_checkpoint", ok, f"{p.hf_checkpoint}: {detail}")
    if not n.get("torch_dist_dir"):
        add("paths.torch_dist", False, f"{p.torch_dist}: no such directory")
    elif not n.get("torch_dist_tracker"):
        add("paths.torch_dist", False, f"{p.torch_dist}: no latest_checkpointed_iteration.txt (not a Megatron checkpoint)")
    else:
        add("paths.torch_dist", True, f"{p.torch_dist}: Megatron checkpoint")
    if n.get("data_head") is None:
        add("paths.sft_data", False, f"{p.sft_data}: not readable ({n.get('data_error')})")
    elif p.sft_data.endswith(".parquet") and n["data_head"] != _PARQUET_MAGIC:
        add("paths.sft_data", False, f"{p.sft_data}: not a parquet file (no PAR1 header)")
    else:
        add("paths.sft_data", True, f"{p.sft_data}: readable, {n.get('data_bytes', 0):,} bytes")
    if "tokenizer" in n:  # preflight_probe.tokenizer_match: the data's tokenizer is the checkpoint's
        add("tokenizer", bool(n["tokenizer"].get("ok")), str(n["tokenizer"].get("detail")))
    if n.get("attune"):
        add("attune", True, f"importable through the job's runtime_env ({n['attune']})")
    else:
        add("attune", False, f"not importable through the job's runtime_env: {n.get('attune_error')}")
    return rows


def _gpu_rows(nodes: list[dict], cfg: ClusterConfig) -> list[PreflightCheck]:
    """GPUs and NVLink per node. A node short of GPUs fails only while fewer than ``cfg.nodes`` nodes hold
    ``gpus_per_node`` GPUs of the type (a CPU-only head node is fine when the GPU nodes are enough)."""
    ran = [n for n in nodes if "error" not in n]

    def typed(n: dict) -> int:
        return sum(cfg.gpu_type.lower() in str(g.get("name", "")).lower() for g in n.get("gpus") or [])

    enough = sum(typed(n) >= cfg.gpus_per_node for n in ran) >= cfg.nodes
    rows: list[PreflightCheck] = []
    for n in ran:
        node = str(n.get("node_ip") or n.get("host"))
        gpus = n.get("gpus") or []
        mem = sorted({round(g["memory_mib"] / 1024, 1) for g in gpus})
        names = sorted({g["name"] for g in gpus})
        what = (f"{len(gpus)} GPUs ({', '.join(names)}; {', '.join(f'{m:g}' for m in mem)} GiB each)" if gpus
                else f"no GPUs ({n.get('nvidia_smi') or 'nvidia-smi lists none'})")
        rows.append(PreflightCheck(node=node, check="gpus", ok=typed(n) >= cfg.gpus_per_node or enough,
                                   detail=f"{what}; the cluster file wants {cfg.nodes} node(s) x {cfg.gpus_per_node} "
                                          f"x {cfg.gpu_type}"))
        nv = n.get("nvlink_count")
        wants_nvlink = isinstance(cfg.nvlink, int) and not isinstance(cfg.nvlink, bool) and cfg.nvlink > 0
        rows.append(PreflightCheck(node=node, check="nvlink", ok=not (wants_nvlink and not nv),
                                   detail=("nvidia-smi topo -m not available" if nv is None else f"{nv} NVLink links")
                                   + f" (cluster file: nvlink {cfg.nvlink})"))
    return rows


def judge(nodes: list[dict], cfg: ClusterConfig, model: ModelSpec | None = None) -> PreflightReport:
    """The report of the nodes' facts (``parse_preflight_log``) against the cluster file and the model."""
    checks: list[PreflightCheck] = []
    for n in nodes:
        checks += _node_rows(n, cfg, model)
    checks += _gpu_rows(nodes, cfg)
    if not nodes:
        checks.append(PreflightCheck(node="-", check="node", ok=False, detail="the Ray cluster has no alive node"))
    return PreflightReport(checks=checks, nodes=len(nodes))


def run_preflight(jobs: RayJobs, cfg: ClusterConfig, model: ModelSpec | None = None, python: str | None = None,
                  study: str = "attune", timeout_s: float = PREFLIGHT_TIMEOUT_S, poll_s: float = 1.0) -> PreflightReport:
    """Submit the preflight job, wait for it and judge what it found. Raises RunnerError when the job itself
    does not report (the message says why: attune not importable on the head node, Ray unreachable, ...)."""
    entry, env = preflight_job(cfg, python)
    sid = submission_id(study, None, f"preflight-{int(time.time() * 1000)}")
    used, _ = jobs.submit(entry, env, sid, metadata={"attune_kind": "preflight"})
    outcome = jobs.wait(used, timeout_s=timeout_s, poll_s=poll_s, stop_grace_s=30.0)
    nodes = parse_preflight_log(outcome.log)
    if nodes is None:
        tail = [x for x in outcome.log.strip().splitlines() if x.strip()][-1:] or [outcome.message or outcome.status]
        raise PreflightFailed(f"slime preflight job {used} {outcome.status.lower()} without a report "
                              f"(is attune importable on the head node through the runtime_env?): {tail[0][:200]}")
    return judge(nodes, cfg, model)
