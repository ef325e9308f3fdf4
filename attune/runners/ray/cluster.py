"""The cluster file: where slime trials run (a Ray cluster) and where their inputs live on it.

A small YAML file (format and an example: docs/cluster.md, examples/cluster.yaml)::

    ray:
      address: http://10.0.12.7:8265      # the Ray dashboard (Jobs API), http(s)://HOST:PORT
      slot_resource: attune_trial_slot    # custom Ray resource, 1 per node: one trial per node at a time
    nodes: 1
    gpus_per_node: 8
    gpu_type: H200
    nvlink: auto                          # NVLink links per GPU, or auto (nvidia-smi topo -m on the node)
    python: python3                       # the training image's python
    paths:
      slime: /root/slime
      megatron: /root/Megatron-LM
      hf_checkpoint: /data/Qwen3.6-27B
      torch_dist: /data/Qwen3.6-27B_torch_dist
      sft_data: /data/qwen35-tulu3-fixed8192-v1.parquet
      output: /data/attune
      attune: /root/attune                # optional: an attune checkout on the nodes (added to PYTHONPATH)
    env:                                  # optional extra environment for the job and its actors
      NCCL_DEBUG: INFO
    timeouts:
      trial_s: 3600                       # a trial that runs longer is stopped and reported "timeout"
      poll_s: 10                          # job status / log polling interval
      stop_grace_s: 60                    # after a stop request, how long to wait for the job to end

Without a cluster file the paths stay shell variables ($SLIME_DIR, $MEGATRON_DIR, $HF_CKPT, $TORCH_DIST,
$SFT_DATA, $PROFILE_DIR) for the launch script, see :func:`default_paths`.

Paths are literal: the launch quotes them, nothing in them is expanded by a shell. Ray expands ``$NAME`` in a job's
runtime_env env_vars with no escape (attune.runners.shell), so a path or env value holding ``$NAME`` / ``${...}`` is
refused with one line rather than changed on the node.
"""

from __future__ import annotations

from attune.errors import ClusterFileError

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attune.runners.shell import ShellValueError, check_ray_literal
from attune.spec.hardware import Cluster, parse_cluster
from attune.spec.textio import load_yaml, read_text
from attune.errors import HardwareError

__all__ = ["ClusterConfig", "ClusterFileError", "SlimePaths", "load_cluster", "parse_cluster_config",
           "default_paths", "PATH_VARS", "DEFAULT_SLOT_RESOURCE"]

# The custom Ray resource each node advertises once (`ray start --resources '{"attune_trial_slot": 1}'`); a trial
# job asks for one, so Ray admits at most one trial per node. GPUs are left to slime's own placement group.
DEFAULT_SLOT_RESOURCE = "attune_trial_slot"
# Defaults, seconds: a 20-step 27B trial takes ~25 min on 8 H200 including start-up (seed: 3.34 GPU-hours / 8 GPUs).
DEFAULT_TRIAL_TIMEOUT_S = 3600.0
DEFAULT_POLL_S = 10.0
DEFAULT_STOP_GRACE_S = 60.0

# path key -> the shell variable used when there is no cluster file (names of slime's and the seed's scripts)
PATH_VARS: dict[str, str] = {
    "slime": "SLIME_DIR",
    "megatron": "MEGATRON_DIR",
    "hf_checkpoint": "HF_CKPT",
    "torch_dist": "TORCH_DIST",
    "sft_data": "SFT_DATA",
    "output": "PROFILE_DIR",
}
_OPTIONAL_PATHS = ("attune",)
_TOP_KEYS = ("ray", "nodes", "gpus_per_node", "gpu_type", "nvlink", "python", "paths", "env", "timeouts")
_RAY_KEYS = ("address", "slot_resource")
_TIMEOUT_KEYS = ("trial_s", "poll_s", "stop_grace_s")
_ADDRESS_RE = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+:\d+/?$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESOURCE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
# Environment attune's launch sets itself; the cluster file may not override them (they would silently
# change the measured configuration).
_RESERVED_ENV = ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_NVLS_ENABLE", "PYTHONPATH", "TENSORBOARD_DIR")




@dataclass(frozen=True)
class SlimePaths:
    slime: str
    megatron: str
    hf_checkpoint: str
    torch_dist: str
    sft_data: str
    output: str
    attune: str | None = None


@dataclass(frozen=True)
class ClusterConfig:
    source: str  # the file it was read from
    address: str  # Ray dashboard, http://HEAD:8265
    nodes: int
    gpus_per_node: int
    gpu_type: str
    paths: SlimePaths
    nvlink: int | str = "auto"  # NVLink count per GPU, or "auto"
    python: str = "python3"
    env: dict[str, str] = field(default_factory=dict)
    slot_resource: str = DEFAULT_SLOT_RESOURCE
    trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S
    poll_s: float = DEFAULT_POLL_S
    stop_grace_s: float = DEFAULT_STOP_GRACE_S

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def cluster(self) -> Cluster:
        """The hardware description (attune.hardware.Cluster) of this cluster."""
        return parse_cluster(f"{self.nodes}x{self.gpus_per_node}x{self.gpu_type}")


def default_paths() -> dict[str, str]:
    """Path key -> ``$VAR`` used when there is no cluster file."""
    return {k: f"${v}" for k, v in PATH_VARS.items()}


def _err(src: str, key: str, msg: str) -> ClusterFileError:
    return ClusterFileError(f"{src}: {key}: {msg}")


def _pos_int(src: str, key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _err(src, key, f"must be a positive integer (got {v!r})")
    return v


def _pos_seconds(src: str, key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise _err(src, key, f"must be a positive number of seconds (got {v!r})")
    return float(v)


def _str(src: str, key: str, v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise _err(src, key, f"must be a non-empty string (got {v!r})")
    if any(c in v for c in "\n\r\x00"):
        raise _err(src, key, "must be one line")
    return v


def _literal(src: str, key: str, v: str) -> str:
    try:
        return check_ray_literal(v, f"{src}: {key}")
    except ShellValueError as e:
        raise ClusterFileError(str(e)) from None


def _unknown(src: str, where: str, d: dict, allowed: tuple[str, ...]) -> None:
    for k in d:
        if k not in allowed:
            raise _err(src, f"{where}{k}", f"unknown key; allowed: {', '.join(allowed)}")


def parse_cluster_config(data: Any, source: str = "<cluster>") -> ClusterConfig:
    """Validate a parsed cluster file (a mapping) into a ClusterConfig."""
    src = source
    if not isinstance(data, dict):
        raise ClusterFileError(f"{src}: the cluster file must be a YAML mapping (got {type(data).__name__})")
    _unknown(src, "", data, _TOP_KEYS)
    ray = data.get("ray")
    if not isinstance(ray, dict):
        raise _err(src, "ray", "missing or not a mapping; it needs ray.address (http://HEAD:8265)")
    _unknown(src, "ray.", ray, _RAY_KEYS)
    address = ray.get("address")
    if not isinstance(address, str) or not _ADDRESS_RE.match(address.strip()):
        raise _err(src, "ray.address", f"must be the Ray dashboard URL http(s)://HOST:PORT, e.g. http://10.0.0.1:8265 "
                                       f"(got {address!r})")
    slot = ray.get("slot_resource", DEFAULT_SLOT_RESOURCE)
    if not isinstance(slot, str) or not _RESOURCE_RE.fullmatch(slot):
        raise _err(src, "ray.slot_resource", f"must be a Ray custom resource name like {DEFAULT_SLOT_RESOURCE} "
                                             f"(got {slot!r})")
    for k in ("nodes", "gpus_per_node", "gpu_type"):
        if k not in data:
            raise _err(src, k, "missing")
    nodes = _pos_int(src, "nodes", data["nodes"])
    per = _pos_int(src, "gpus_per_node", data["gpus_per_node"])
    gpu_type = _str(src, "gpu_type", data["gpu_type"])
    try:
        parse_cluster(f"{nodes}x{per}x{gpu_type}")
    except HardwareError as e:
        raise _err(src, "gpu_type", str(e)) from None
    nvlink = data.get("nvlink", "auto")
    if not (nvlink == "auto" or (isinstance(nvlink, int) and not isinstance(nvlink, bool) and nvlink >= 0)):
        raise _err(src, "nvlink", f"must be auto or the NVLink count, an integer >= 0 (got {nvlink!r})")
    python = _str(src, "python", data.get("python", "python3"))
    paths = data.get("paths")
    if not isinstance(paths, dict):
        raise _err(src, "paths", f"missing or not a mapping; it needs {', '.join(PATH_VARS)}")
    _unknown(src, "paths.", paths, tuple(PATH_VARS) + _OPTIONAL_PATHS)
    pv: dict[str, str | None] = {}
    for k in PATH_VARS:
        if k not in paths:
            raise _err(src, f"paths.{k}", f"missing (without a cluster file it is ${PATH_VARS[k]})")
        pv[k] = _literal(src, f"paths.{k}", _str(src, f"paths.{k}", paths[k]))
    pv["attune"] = (_literal(src, "paths.attune", _str(src, "paths.attune", paths["attune"]))
                    if paths.get("attune") is not None else None)
    env = data.get("env") or {}
    if not isinstance(env, dict):
        raise _err(src, "env", "must be a mapping NAME: value")
    env_out: dict[str, str] = {}
    for k, v in env.items():
        if not isinstance(k, str) or not _ENV_NAME_RE.fullmatch(k):
            raise _err(src, f"env.{k}", "not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        if k in _RESERVED_ENV:
            raise _err(src, f"env.{k}", f"set by attune's launch; not allowed here ({', '.join(_RESERVED_ENV)})")
        if isinstance(v, bool):
            v = "1" if v else "0"
        if not isinstance(v, (str, int, float)):
            raise _err(src, f"env.{k}", f"must be a string or number (got {type(v).__name__})")
        if isinstance(v, float) and not math.isfinite(v):
            raise _err(src, f"env.{k}", f"must be a finite number (got {v!r})")
        env_out[k] = _literal(src, f"env.{k}", _str(src, f"env.{k}", str(v))) if str(v) != "" else ""
    timeouts = data.get("timeouts") or {}
    if not isinstance(timeouts, dict):
        raise _err(src, "timeouts", f"must be a mapping with {', '.join(_TIMEOUT_KEYS)}")
    _unknown(src, "timeouts.", timeouts, _TIMEOUT_KEYS)
    return ClusterConfig(
        source=src, address=address.strip().rstrip("/"), nodes=nodes, gpus_per_node=per, gpu_type=gpu_type,
        paths=SlimePaths(**pv), nvlink=nvlink, python=python, env=env_out, slot_resource=slot,
        trial_timeout_s=_pos_seconds(src, "timeouts.trial_s", timeouts.get("trial_s", DEFAULT_TRIAL_TIMEOUT_S)),
        poll_s=_pos_seconds(src, "timeouts.poll_s", timeouts.get("poll_s", DEFAULT_POLL_S)),
        stop_grace_s=_pos_seconds(src, "timeouts.stop_grace_s", timeouts.get("stop_grace_s", DEFAULT_STOP_GRACE_S)),
    )


def load_cluster(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster file; errors are one line naming the file and the key."""
    p = Path(path)
    data = load_yaml(read_text(p, "cluster file", ClusterFileError), str(p), ClusterFileError)
    return parse_cluster_config(data, str(p))
