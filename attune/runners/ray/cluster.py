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

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from attune.errors import ClusterFileError
from attune.runners.shell import ShellValueError, check_ray_literal
from attune.spec.hardware import Cluster, parse_cluster
from attune.spec.textio import load_yaml, read_text
from attune.spec.validation import one_line

__all__ = ["ClusterConfig", "ClusterFileError", "SlimePaths", "load_cluster", "parse_cluster_config",
           "default_paths", "PATH_VARS", "DEFAULT_SLOT_RESOURCE", "ClusterFile"]

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


def _one_line_str(v: str) -> str:
    if not v.strip():
        raise ValueError("must be a non-empty string")
    if any(c in v for c in "\n\r\x00"):
        raise ValueError("must be one line")
    return v


def _ray_literal(v: str) -> str:
    try:
        return check_ray_literal(v, "")
    except ShellValueError as e:
        raise ValueError(str(e).removeprefix(": ")) from None


def _address(v: str) -> str:
    if not _ADDRESS_RE.match(v.strip()):
        raise ValueError(f"must be the Ray dashboard URL http(s)://HOST:PORT, e.g. http://10.0.0.1:8265 (got {v!r})")
    return v.strip().rstrip("/")


def _resource(v: str) -> str:
    if not _RESOURCE_RE.fullmatch(v):
        raise ValueError(f"must be a Ray custom resource name like {DEFAULT_SLOT_RESOURCE} (got {v!r})")
    return v


def _env_name(k: str) -> str:
    if not _ENV_NAME_RE.fullmatch(k):
        raise ValueError("not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
    if k in _RESERVED_ENV:
        raise ValueError(f"set by attune's launch; not allowed here ({', '.join(_RESERVED_ENV)})")
    return k


def _env_value(v: Any) -> str:
    """A string, number or switch (true/false: 1/0) as the job's environment value, literal for Ray."""
    if isinstance(v, bool):
        v = "1" if v else "0"
    if not isinstance(v, (str, int, float)):
        raise ValueError(f"must be a string or number (got {type(v).__name__})")
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"must be a finite number (got {v!r})")
    return "" if str(v) == "" else _ray_literal(_one_line_str(str(v)))


Line = Annotated[StrictStr, AfterValidator(_one_line_str)]
LiteralPath = Annotated[StrictStr, AfterValidator(_one_line_str), AfterValidator(_ray_literal)]
Count = Annotated[StrictInt, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False, strict=True)]


class RaySection(BaseModel):
    """``ray:``: the Ray dashboard (Jobs API) and the per-node trial slot resource."""

    model_config = ConfigDict(extra="forbid")
    address: Annotated[StrictStr, AfterValidator(_address)] = Field(
        description="the Ray dashboard URL, http://HEAD:8265")
    slot_resource: Annotated[StrictStr, AfterValidator(_resource)] = DEFAULT_SLOT_RESOURCE


class PathsSection(BaseModel):
    """``paths:``: literal paths on the nodes (quoted by the launch, never expanded)."""

    model_config = ConfigDict(extra="forbid")
    slime: LiteralPath = Field(description="without a cluster file it is $SLIME_DIR")
    megatron: LiteralPath = Field(description="without a cluster file it is $MEGATRON_DIR")
    hf_checkpoint: LiteralPath = Field(description="without a cluster file it is $HF_CKPT")
    torch_dist: LiteralPath = Field(description="without a cluster file it is $TORCH_DIST")
    sft_data: LiteralPath = Field(description="without a cluster file it is $SFT_DATA")
    output: LiteralPath = Field(description="without a cluster file it is $PROFILE_DIR")
    attune: Optional[LiteralPath] = None


class TimeoutsSection(BaseModel):
    """``timeouts:``, seconds, each finite and positive."""

    model_config = ConfigDict(extra="forbid")
    trial_s: Seconds = DEFAULT_TRIAL_TIMEOUT_S
    poll_s: Seconds = DEFAULT_POLL_S
    stop_grace_s: Seconds = DEFAULT_STOP_GRACE_S


class ClusterFile(BaseModel):
    """The cluster file as written (module docstring); closed: an unknown key is an error."""

    model_config = ConfigDict(extra="forbid")
    ray: RaySection = Field(description="a mapping with ray.address, http://HEAD:8265")
    nodes: Count
    gpus_per_node: Count
    gpu_type: Line
    nvlink: Union[Literal["auto"], Annotated[StrictInt, Field(ge=0)]] = "auto"
    python: Line = "python3"
    paths: PathsSection = Field(description=f"a mapping with {', '.join(PATH_VARS)}")
    env: Optional[dict[Annotated[StrictStr, AfterValidator(_env_name)],
                       Annotated[Any, AfterValidator(_env_value)]]] = None
    timeouts: Optional[TimeoutsSection] = None

    @field_validator("gpu_type")
    @classmethod
    def _known_gpu(cls, v: str, info: ValidationInfo) -> str:
        nodes, per = info.data.get("nodes"), info.data.get("gpus_per_node")
        if nodes and per:
            parse_cluster(f"{nodes}x{per}x{v}")  # HardwareError is a ValueError: one line naming the GPU types
        return v

    @field_validator("nvlink", mode="wrap")
    @classmethod
    def _nvlink(cls, v: Any, handler: Any) -> Any:
        try:
            return handler(v)
        except ValidationError:
            raise ValueError(f"must be auto or the NVLink count, an integer >= 0 (got {v!r})") from None


def parse_cluster_config(data: Any, source: str = "<cluster>") -> ClusterConfig:
    """Validate a parsed cluster file (a mapping) into a ClusterConfig."""
    src = source
    if not isinstance(data, dict):
        raise ClusterFileError(f"{src}: the cluster file must be a YAML mapping (got {type(data).__name__})")
    try:
        f = ClusterFile.model_validate(data)
    except ValidationError as e:
        raise ClusterFileError(f"{src}: {one_line(e, ClusterFile)}") from None
    t = f.timeouts or TimeoutsSection()
    return ClusterConfig(
        source=src, address=f.ray.address, nodes=f.nodes, gpus_per_node=f.gpus_per_node, gpu_type=f.gpu_type,
        paths=SlimePaths(**f.paths.model_dump()), nvlink=f.nvlink, python=f.python, env=dict(f.env or {}),
        slot_resource=f.ray.slot_resource, trial_timeout_s=t.trial_s, poll_s=t.poll_s, stop_grace_s=t.stop_grace_s)


def load_cluster(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster file; errors are one line naming the file and the key."""
    p = Path(path)
    data = load_yaml(read_text(p, "cluster file", ClusterFileError), str(p), ClusterFileError)
    return parse_cluster_config(data, str(p))
