"""The `torch` runner: a trial is a short real PyTorch training run of the layout on local devices.

TorchRunner writes the trial spec as JSON, launches

    python -m torch.distributed.run --standalone --nproc-per-node N -m attune.runners.torch_worker --spec SPEC

in a new session (its own process group) with gloo on CPU or NCCL on GPU, waits at most
`spec.timeout_s` (then kills torchrun and every worker process group under it), reads the per-rank
JSON records and returns a TrialResult; `result.json` and `log.txt` land in `spec.trial_dir`.

Supported: PP (uneven first/last stages, Megatron's 1F1B), DP (all-reduced gradients; sharded
optimizer state with the distributed optimizer), full (block/uniform) and selective recompute, the
layout's batching. TP, CP, VPP and EP above 1 raise RunnerError before anything is launched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from attune.spec.rules import check
from attune.spec.placement import stage_layer_counts
from .base import FAILED, OK, OOM, TIMEOUT, RunnerError, TrialResult, TrialSpec, window_metrics
from .torch_worker import encode_spec

GiB = 2**30
# Seconds between SIGTERM and SIGKILL when a trial is killed (torchrun forwards SIGTERM to its workers).
KILL_GRACE_S = 3.0
# Characters of the log kept in a failed result's log_tail.
LOG_TAIL_CHARS = 4000


def _children(pid: int) -> list[int]:
    """Every descendant of pid (from /proc; torchrun starts each worker in a session of its own)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _signal_groups(pgids: set[int], sig: int) -> None:
    for g in pgids:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _child_groups(pid: int) -> set[int]:
    """Process groups of every live descendant (torchrun starts each worker in a session of its own)."""
    out = set()
    for c in _children(pid):
        try:
            out.add(os.getpgid(c))
        except ProcessLookupError:
            pass
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to torchrun's process group and the process group of every descendant."""
    pgids = {proc.pid} | _child_groups(proc.pid)
    _signal_groups(pgids, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _signal_groups(pgids | _child_groups(proc.pid), signal.SIGKILL)
    proc.wait()


class TorchRunner:
    name = "torch"
    measured = True

    def __init__(self, device: str | None = None, python: str | None = None, extra_env: dict | None = None):
        """device: "cpu" or "cuda" (default: cuda when the cluster is GPUs, else cpu)."""
        try:
            import torch  # noqa: F401
        except ImportError as e:
            raise RunnerError("the torch runner needs PyTorch (pip install 'attune[torch]')") from e
        self.device = device
        self.python = python or sys.executable
        self.extra_env = dict(extra_env or {})

    # -------------------------------------------------------------- checks and command
    def check(self, spec: TrialSpec) -> None:
        L = spec.layout
        unsupported = [f"{n} {v}" for n, v in (("TP", L.tp), ("CP", L.cp), ("VPP", L.vpp), ("EP", L.ep)) if v > 1]
        if unsupported:
            raise RunnerError(f"{', '.join(unsupported)} not supported by the torch runner (PP, DP and recompute only)")
        errs = check(L, spec.model, spec.cluster.world_size, spec.workload, spec.engine)
        if errs:
            raise RunnerError(f"layout {L.label()} is invalid: " + "; ".join(errs))
        if self._device(spec) == "cuda":
            import torch
            n = torch.cuda.device_count()
            if n < L.world_size:
                raise RunnerError(f"layout needs {L.world_size} GPUs, {n} visible to the torch runner")

    def _device(self, spec: TrialSpec) -> str:
        return self.device or ("cpu" if spec.cluster.gpu.is_cpu else "cuda")

    def command(self, spec: TrialSpec, spec_path: Path) -> list[str]:
        return [self.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(spec.layout.world_size),
                "-m", "attune.runners.torch_worker", "--spec", str(spec_path)]

    def _env(self) -> dict:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the attune package
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OMP_NUM_THREADS", "1")  # one thread per worker: ranks share the cores
        env.setdefault("MKL_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.extra_env)
        return env

    # -------------------------------------------------------------- run
    def run(self, spec: TrialSpec) -> TrialResult:
        self.check(spec)
        trial_dir = Path(spec.trial_dir) if spec.trial_dir else Path(tempfile.mkdtemp(prefix="attune-torch-"))
        trial_dir.mkdir(parents=True, exist_ok=True)
        ranks_dir = trial_dir / "ranks"
        ranks_dir.mkdir(exist_ok=True)
        for old in ranks_dir.glob("rank*"):
            old.unlink()
        spec_path = trial_dir / "spec.json"
        spec_path.write_text(json.dumps(encode_spec(
            spec.model, spec.layout, spec.workload, spec.engine.name, str(ranks_dir), self._device(spec),
            spec.data_path, spec.memory_limit_gib, spec.timeout_s), indent=2))
        log_path = trial_dir / "log.txt"
        t0 = time.monotonic()
        timed_out = False
        with open(log_path, "w") as log:
            proc = subprocess.Popen(self.command(spec, spec_path), stdout=log, stderr=subprocess.STDOUT,
                                    env=self._env(), start_new_session=True)
            try:
                rc = proc.wait(timeout=spec.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_tree(proc)
                rc = proc.returncode
            except BaseException:
                kill_tree(proc)
                raise
        wall = time.monotonic() - t0
        result = self._result(spec, ranks_dir, log_path.read_text(errors="replace"), rc, timed_out, wall)
        result.save(trial_dir / "result.json")
        return result

    def _result(self, spec: TrialSpec, ranks_dir: Path, log: str, rc: int | None, timed_out: bool,
                wall: float) -> TrialResult:
        L, w = spec.layout, spec.workload
        world = L.world_size
        records = []
        for r in range(world):
            p = ranks_dir / f"rank{r}.json"
            if p.exists():
                records.append(json.loads(p.read_text()))
        tail = log[-LOG_TAIL_CHARS:]
        base = dict(measured=True, wall_s=wall, gpu_hours=world * wall / 3600.0,
                    extra={"rc": rc, "world_size": world, "stage_layers": stage_layer_counts(L, spec.model.num_layers),
                           "ranks": records})
        ooms = sorted((r for r in records if r.get("status") == OOM), key=lambda r: r.get("failed_at", 0.0))
        if ooms:
            first = ooms[0]
            return TrialResult(status=OOM, oom_stage=first["stage"], log_tail=tail,
                               reason=f"out of memory on pipeline stage {first['stage']} (rank {first['rank']}): {first['reason']}",
                               **base)
        if timed_out:
            return TrialResult(status=TIMEOUT, reason=f"timeout after {spec.timeout_s:g} s", log_tail=tail, **base)
        bad = sorted((r for r in records if r.get("status") != OK), key=lambda r: r.get("failed_at", 0.0))
        if rc != 0 or bad or len(records) < world:
            if bad:
                why = f"rank {bad[0]['rank']} (stage {bad[0]['stage']}) failed: {bad[0]['reason']}"
            else:
                why = f"torchrun exited with code {rc}; {world - len(records)} of {world} ranks wrote no result"
            return TrialResult(status=FAILED, reason=why, log_tail=tail, **base)
        steps = [max(r["step_times_s"][i] for r in records) for i in range(w.steps)]
        losses = {i: v for i, v in enumerate(records[0]["losses"])}
        a, b = w.window
        b = min(b, w.steps - 1)
        a = min(a, b)
        tps, mean, cv = window_metrics(steps, w.tokens_per_step, world, (a, b))
        peaks = [max(r["peak_memory_bytes"] for r in records if r["stage"] == s) / GiB for s in range(L.pp)]
        return TrialResult(status=OK, tokens_per_s_per_gpu=tps, step_time_s=mean, step_time_cv_percent=cv,
                           step_times_s=steps, losses=losses, peak_memory_gib=peaks, window=(a, b),
                           window_tokens=w.tokens_per_step * (b - a + 1), **base)
