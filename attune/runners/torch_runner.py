"""The `torch` runner: a trial is a short real PyTorch training run of the layout on local devices.

Two parts, kept apart so that the trainer can also run elsewhere (as a Ray job: ``attune.runners.ray.runner``):

* WHAT runs, the torch trainer (:data:`TORCH_CAPABILITIES`, :func:`torch_check`, :func:`write_trial_spec`,
  :func:`torch_result`): ``attune.runners.torch_worker`` under torchrun, one process per rank, gloo on CPU or
  NCCL on GPU. Supported: PP (uneven first/last stages, Megatron's 1F1B), DP (all-reduced gradients; sharded
  optimizer state with the distributed optimizer), EP of MoE models (experts / EP per rank, all-to-all token
  dispatch and combine, expert gradients reduced over the expert-DP group), full (block/uniform) and
  selective recompute, the layout's batching. TP, CP, VPP and ETP above 1 are refused by ``check`` with one
  line.
* WHERE it runs, this machine (:class:`TorchRunner`)::

      python -m torch.distributed.run --standalone --nproc-per-node N -m attune.runners.torch_worker --spec SPEC

  started through :func:`attune.runners.procs.run_logged`, which kills the whole process tree past
  ``spec.timeout_s``. ``spec.json``, ``ranks/``, ``log.txt`` and ``result.json`` land in the trial folder.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from attune.errors import require
from attune.runners.base import (
    FAILED,
    LOG_FILE,
    LOG_TAIL_CHARS,
    OK,
    OOM,
    TIMEOUT,
    Capabilities,
    Rerun,
    Runner,
    TrialResult,
    TrialSpec,
    step_time_stats,
)
from attune.runners.locks import DeviceLock, device_names
from attune.runners.procs import run_logged
from attune.runners.torch_spec import encode_spec, ep_refusal
from attune.spec.flags import to_flags
from attune.spec.layout import Layout, Workload
from attune.spec.placement import stage_layer_counts
from attune.spec.rules import check

__all__ = ["TorchRunner", "TORCH_WORKLOAD", "TORCH_CAPABILITIES", "torch_check", "torch_rerun", "write_trial_spec",
           "torch_result"]

GiB = 2**30
# The torch trainer's default workload: 256-token rows, 8 rows per step, 20 steps measured over 5..19 (the
# seed's window), a learning rate high enough that the tiny models' loss visibly falls in 20 steps; a trial
# of a tiny model takes seconds on 2 CPU cores.
TORCH_WORKLOAD = Workload(seq_length=256, global_batch=8, steps=20, window=(5, 19), lr=3e-3, min_lr=3e-4)
# The trainer implements PP x DP and, for MoE models, EP inside DP (attune.runners.torch_worker); 3 measured
# trials and 24 proposals per trial are `attune tune`'s defaults for it (a trial is a real run), with the small
# search space. EP has no runner cap (max_ep None): the layout rules bound it by the experts and by DP <= the
# world size, and `ep_refusal` names what the trainer does not do (ETP, other dispatchers).
TORCH_CAPABILITIES = Capabilities(
    measured=True, engine="torch", max_tp=1, max_cp=1, max_vpp=1, max_ep=None, default_workload=TORCH_WORKLOAD,
    default_search_space="small", default_trials=3, default_candidates=24,
    limits_note="PP, DP, EP and recompute only")


def _knob_limits(L: Layout, runner: str) -> list[str]:
    """Issue-15 knobs the torch trainer does not implement, one line each. A per-stage layout string (VPP 1)
    and core-attention selective recompute run for real: the worker builds its stages from
    ``stage_layer_counts`` and recomputes the attention core with ``set_recompute``."""
    out = []
    extra = [m for m in L.recompute_modules if m != "core_attn"]
    if extra:
        out.append(f"{runner} runner: recompute module(s) {', '.join(extra)} are not implemented by the torch trainer "
                   f"(it recomputes whole layers or the attention core only)")
    if L.offload_modules:
        out.append(f"{runner} runner: fine-grained activation offloading is not implemented by the torch trainer "
                   f"(on CPU workers host memory is device memory, so there is nothing to measure)")
    return out


def torch_check(spec: TrialSpec, runner: str, caps: Capabilities = TORCH_CAPABILITIES) -> list[str]:
    """Why the torch trainer cannot run ``spec`` (its limits, then the layout rules); [] when it can."""
    reasons = caps.limit_reasons(spec.layout, runner) + _knob_limits(spec.layout, runner)
    refusal = ep_refusal(spec.layout, spec.model)
    if refusal:
        reasons.append(f"{runner} runner: {refusal}")
    if reasons:
        return reasons
    errs = check(spec.layout, spec.model, spec.cluster.world_size, spec.workload, spec.engine)
    if errs:
        return [f"layout {spec.layout.label()} is invalid: " + "; ".join(errs)]
    return []


def write_trial_spec(spec: TrialSpec, trial_dir: Path, device: str) -> Path:
    """Write the worker's spec.json into ``trial_dir`` (and an empty ``ranks/``); returns its path."""
    ranks_dir = trial_dir / "ranks"
    ranks_dir.mkdir(exist_ok=True)
    for old in ranks_dir.glob("rank*"):
        old.unlink()
    spec_path = trial_dir / "spec.json"
    spec_path.write_text(json.dumps(encode_spec(
        spec.model, spec.layout, spec.workload, spec.engine.name, str(ranks_dir), device,
        spec.data_path, spec.memory_limit_gib, spec.timeout_s), indent=2))
    return spec_path


def torch_result(spec: TrialSpec, ranks_dir: Path, log: str, rc: int | None, timed_out: bool,
                 wall: float) -> TrialResult:
    """The TrialResult of a torchrun trial from its per-rank records, exit code and log (pure but for reads)."""
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
    stats = step_time_stats(steps[a: b + 1], tokens=w.tokens_per_step * (b - a + 1), gpus=world)
    peaks = [max(r["peak_memory_bytes"] for r in records if r["stage"] == s) / GiB for s in range(L.pp)]
    return TrialResult(status=OK, tokens_per_s_per_gpu=stats.tokens_per_s_per_gpu, step_time_s=stats.mean_s,
                       step_time_cv_percent=stats.cv_percent, step_times_s=steps, losses=losses,
                       peak_memory_gib=peaks, window=(a, b), window_tokens=w.tokens_per_step * (b - a + 1), **base)


def torch_rerun(spec: TrialSpec) -> Rerun:
    """`attune run --runner torch` with the layout's flags: how a layout the torch trainer measured (on this machine
    or as a Ray job) reruns; the stack names the PyTorch it ran on."""
    wl = spec.workload
    argv = ["attune", "run", "--runner", TorchRunner.name, "--model", spec.model.name, "--gpus", spec.cluster.spec,
            "--steps", str(wl.steps), "--", *to_flags(spec.layout, wl, spec.engine)]
    stack = {}
    try:
        import torch  # noqa: PLC0415 - optional extra: the version when it is installed

        stack["pytorch"] = str(torch.__version__)
    except ImportError:
        pass
    return Rerun(command=shlex.join(argv) + "\n", stack=stack)


class TorchRunner(Runner):
    """The torch trainer under torchrun on this machine."""

    name = "torch"
    capabilities = TORCH_CAPABILITIES

    def __init__(self, device: str | None = None, python: str | None = None, extra_env: dict | None = None):
        """device: "cpu" or "cuda" (default: cuda when the cluster is GPUs, else cpu). python: the interpreter
        torchrun runs under (default: this one). extra_env: environment added to the workers'."""
        require("torch", "torch")
        self.device = device
        self.python = python or sys.executable
        self.extra_env = dict(extra_env or {})

    # -------------------------------------------------------------- checks and command
    def check(self, spec: TrialSpec) -> list[str]:
        reasons = torch_check(spec, self.name)
        if reasons:
            return reasons
        if self._device(spec) == "cuda":
            import torch  # noqa: PLC0415 - optional extra, present: __init__ required it

            n = torch.cuda.device_count()
            if n < spec.layout.world_size:
                return [f"layout needs {spec.layout.world_size} GPUs, {n} visible to the torch runner"]
        return []

    def _device(self, spec: TrialSpec) -> str:
        return self.device or ("cpu" if spec.cluster.gpu.is_cpu else "cuda")

    def rerun_command(self, spec: TrialSpec) -> Rerun:
        return torch_rerun(spec)

    def command(self, spec: TrialSpec, spec_path: Path) -> list[str]:
        return [self.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(spec.layout.world_size),
                "-m", "attune.runners.torch_worker", "--spec", str(spec_path)]

    def _env(self) -> dict:
        # a subprocess environment (not this process's): the workers import attune from this checkout
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the attune package
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OMP_NUM_THREADS", "1")  # one thread per worker: ranks share the cores
        env.setdefault("MKL_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.extra_env)
        return env

    # -------------------------------------------------------------- run
    def _execute(self, spec: TrialSpec, trial_dir: Path) -> TrialResult:
        spec = replace(spec, trial_dir=trial_dir)
        spec_path = write_trial_spec(spec, trial_dir, self._device(spec))
        log_path = trial_dir / LOG_FILE
        env = self._env()
        # one trial at a time per device on this machine (attune.runners.locks); the wait is not trial time
        with DeviceLock(device_names(self._device(spec), spec.layout.world_size, env.get("CUDA_VISIBLE_DEVICES"))) as lk:
            out = run_logged(self.command(spec, spec_path), log_path=log_path, env=env, timeout_s=spec.timeout_s,
                             hold_fds=lk.fds)
        return torch_result(spec, trial_dir / "ranks", log_path.read_text(errors="replace"), out.returncode,
                            out.timed_out, out.wall_s)
