"""The runner interface: where a trial runs. A runner takes a TrialSpec and returns a TrialResult.

Runners are small plug-ins in the spirit of Optuna's samplers and storages: `sim` (the calibrated
analytic model, never measured), `torch` (real PyTorch runs on local devices via torchrun) and `slime`
(real slime runs on a GPU cluster through Ray Jobs). The study only sees this interface.
"""

from __future__ import annotations

from attune.errors import RunnerError

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec

OK, OOM, FAILED, TIMEOUT = "ok", "oom", "failed", "timeout"




@dataclass
class TrialSpec:
    model: ModelSpec
    cluster: Cluster
    layout: Layout
    workload: Workload
    engine: Engine
    trial_dir: Path | None = None  # where the runner keeps the trial's log and result.json
    timeout_s: float | None = None  # kill the trial (and its process group) after this
    label: str = ""
    data_path: str | None = None  # packed rows (parquet); None: generated from workload.seed
    memory_limit_gib: float | None = None  # host memory cap per CPU worker (torch runner on CPU)


@dataclass
class TrialResult:
    status: str  # ok | oom | failed | timeout
    measured: bool  # True for real runs, False for the sim runner
    tokens_per_s_per_gpu: float | None = None
    step_time_s: float | None = None  # mean over the window
    step_time_cv_percent: float | None = None
    step_times_s: list[float] = field(default_factory=list)  # every step, step 0 first
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss
    peak_memory_gib: list[float] = field(default_factory=list)  # per pipeline stage (max over its ranks)
    window: tuple[int, int] | None = None
    window_tokens: int | None = None
    gpu_hours: float = 0.0  # GPUs x wall time of the trial, including start-up
    wall_s: float = 0.0
    reason: str = ""  # why it failed / OOMed (the overflowing stage, the timeout)
    oom_stage: int | None = None
    log_tail: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["losses"] = {str(k): v for k, v in self.losses.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrialResult":
        d = dict(d)
        d["losses"] = {int(k): v for k, v in (d.get("losses") or {}).items()}
        if d.get("window") is not None:
            d["window"] = tuple(d["window"])
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2, default=_json_default))


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def window_metrics(step_times_s: list[float], tokens_per_step: int, gpus: int, window: tuple[int, int]) -> tuple[float, float, float]:
    """(tokens/s/GPU, mean step time in s, step-time CV in %) over steps window[0]..window[1] inclusive."""
    a, b = window
    times = step_times_s[a: b + 1]
    if not times or len(times) < b - a + 1:
        raise ValueError(f"window {a}..{b} needs {b + 1} steps, got {len(step_times_s)}")
    total = sum(times)
    mean = total / len(times)
    var = sum((t - mean) ** 2 for t in times) / len(times)
    return tokens_per_step * len(times) / total / gpus, mean, 100.0 * math.sqrt(var) / mean if mean > 0 else 0.0


class Runner(Protocol):
    name: str
    measured: bool  # whether results are real measurements

    def run(self, spec: TrialSpec) -> TrialResult: ...


def get_runner(name: str, **options) -> Runner:
    """The runner plug-in by name; optional dependencies are imported only here, lazily."""
    if name == "sim":
        from .sim import SimRunner
        return SimRunner(**options)
    if name == "torch":
        from .torch_runner import TorchRunner
        return TorchRunner(**options)
    if name == "slime":
        from .slime.runner import SlimeRunner
        return SlimeRunner(**options)
    raise RunnerError(f"unknown runner '{name}'; allowed: sim, torch, slime")
