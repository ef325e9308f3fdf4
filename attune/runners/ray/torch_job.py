"""Run one torch-trainer trial inside a Ray job (the ``ray-torch`` runner's payload).  # entry point

Entrypoint (built by :func:`entrypoint`)::

    python3 -m attune.runners.ray.torch_job --spec-b64 <base64 JSON of the TrialSpec>

The spec travels inside the entrypoint (no shared filesystem needed). The job rebuilds the TrialSpec, runs
``TorchRunner().run`` in a scratch trial folder on the node, copies torchrun's log to stdout while it runs
(so it reaches the Ray job log), and prints the result as one line ``ATTUNE_TRIAL_RESULT {json}``, which
:func:`parse_result_line` reads back. When Ray stops the job (SIGTERM to the entrypoint's process group),
every process below the entrypoint (torchrun and its workers run in sessions of their own) is killed
first, through psutil (:func:`attune.runners.procs.kill_descendants`).
"""

from __future__ import annotations

import argparse
import base64
import json
import signal
import sys
import tempfile
import threading
from dataclasses import fields
from pathlib import Path

from attune.runners.base import TrialSpec
from attune.runners.procs import kill_descendants
from attune.runners.shell import command
from attune.runners.torch_runner import TorchRunner
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec

__all__ = ["RESULT_MARKER", "encode_trial", "decode_trial", "entrypoint", "parse_result_line", "main"]

RESULT_MARKER = "ATTUNE_TRIAL_RESULT "
# How often the log copier looks for new torchrun output, s.
TAIL_INTERVAL_S = 0.5
# After SIGTERM to the processes below the entrypoint, how long before SIGKILL, s: Ray sends SIGKILL to the
# entrypoint itself after RAY_JOB_STOP_WAIT_TIME_S (3 s by default), so the kill must finish well before.
KILL_GRACE_S = 1.0


def _dc(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def encode_trial(spec, timeout_s: float | None = None, device: str | None = None) -> dict:
    """A JSON-ready dict of a TrialSpec (model, cluster spec string, layout, workload, engine, limits)."""
    m = _dc(spec.model)
    m["layer_types"] = list(m["layer_types"])
    m.pop("extra", None)
    w = _dc(spec.workload)
    w["window"] = list(w["window"])
    return {"model": m, "cluster": spec.cluster.spec, "layout": _dc(spec.layout), "workload": w,
            "engine": spec.engine.name, "label": spec.label, "trial_number": spec.trial_number,
            "data_path": spec.data_path,
            "memory_limit_gib": spec.memory_limit_gib, "timeout_s": timeout_s, "device": device}


def decode_trial(d: dict, trial_dir: Path | None = None):
    """The TrialSpec (and the device) of an encoded trial."""
    m = dict(d["model"])
    m["layer_types"] = tuple(m["layer_types"])
    w = dict(d["workload"])
    w["window"] = tuple(w["window"])
    spec = TrialSpec(model=ModelSpec(**m), cluster=parse_cluster(d["cluster"]), layout=Layout(**d["layout"]),
                     workload=Workload(**w), engine=get_engine(d.get("engine") or "torch"), trial_dir=trial_dir,
                     timeout_s=d.get("timeout_s"), label=d.get("label") or "", trial_number=d.get("trial_number"),
                     data_path=d.get("data_path"),
                     memory_limit_gib=d.get("memory_limit_gib"))
    return spec, d.get("device")


def entrypoint(encoded: dict, python: str = "python3") -> str:
    """The Ray job entrypoint for an encoded trial."""
    b64 = base64.b64encode(json.dumps(encoded, separators=(",", ":")).encode()).decode()
    return command([python, "-m", "attune.runners.ray.torch_job", "--spec-b64", b64])


def parse_result_line(log: str) -> dict | None:
    """The result dict from the last ``ATTUNE_TRIAL_RESULT`` line of a job log, or None."""
    for line in reversed(log.splitlines()):
        i = line.find(RESULT_MARKER)
        if i >= 0:
            try:
                return json.loads(line[i + len(RESULT_MARKER):])
            except json.JSONDecodeError:
                return None
    return None


def _on_sigterm(signum, frame):  # noqa: ARG001 - signal handler signature
    kill_descendants(KILL_GRACE_S)
    raise SystemExit(128 + signum)


def _copy_log(path: Path, stop: threading.Event) -> None:
    pos = 0
    while True:
        done = stop.is_set()
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        if chunk:
            pos += len(chunk)
            sys.stdout.write(chunk.decode("utf-8", errors="replace"))
            sys.stdout.flush()
        if done:
            return
        stop.wait(TAIL_INTERVAL_S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="attune: one torch-runner trial inside a Ray job")
    ap.add_argument("--spec-b64", required=True, help="base64 of the trial JSON (attune.runners.ray.torch_job.entrypoint)")
    ap.add_argument("--trial-dir", default=None, help="scratch folder on the node (default: a new temp folder)")
    args = ap.parse_args(argv)
    try:
        encoded = json.loads(base64.b64decode(args.spec_b64))
    except (ValueError, json.JSONDecodeError) as e:
        print(f"attune torch_job: --spec-b64 is not base64 JSON ({e.__class__.__name__})", file=sys.stderr)
        return 2
    trial_dir = Path(args.trial_dir) if args.trial_dir else Path(tempfile.mkdtemp(prefix="attune-rayjob-"))
    spec, device = decode_trial(encoded, trial_dir)
    signal.signal(signal.SIGTERM, _on_sigterm)

    stop = threading.Event()
    copier = threading.Thread(target=_copy_log, args=(trial_dir / "log.txt", stop), daemon=True)
    copier.start()
    try:
        result = TorchRunner(device=device).run(spec)
    finally:
        stop.set()
        copier.join(timeout=5.0)
    print(RESULT_MARKER + json.dumps(result.to_dict(), default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
