"""slime's TensorBoard scalars: read them, carry them through the job log, turn them into training metrics.

slime writes TensorBoard scalars into ``$TENSORBOARD_DIR`` with ``--use-tensorboard`` (reference
slime-and-qwen.md 2.1, slime-runtime-and-moe.md section 1): ``SummaryWriter.add_scalar(key, value, step)`` from
two processes, the training rank (TP0, last stage, DP0) and the RolloutManager, each with its own event file.
The step of a scalar is its dict's step key: ``train/step`` for ``train/*`` (loss, grad norm), ``rollout/step``
(= the rollout id without ``--wandb-always-use-train-step``) for ``perf/*`` and ``rollout/*``. The training
rank's file is the one holding ``perf/actor_train_time``.

The folder lives on the cluster, which the tuning machine may not see, so the launch script runs this module
after training (``python3 -m attune.runners.slime.tbscalars "$TENSORBOARD_DIR"``, never fatal): it prints one
line, ``attune-tensorboard-scalars: {json}``, into the job log, and :func:`scalars_from_log` reads it back.
:func:`train_metrics` turns the scalars into the ``TrainMetrics`` that ``parse_slime_log`` takes instead of
the stdout lines (which stay the fallback, and the source of OOM / crash detection).

TensorBoard stores a scalar as a 32-bit float (``simple_value``), so times and losses read from it match the
stdout's to about 1e-7 relative; the token count per rollout (tokens/s x time) is rounded to an integer and
comes out the same.

tensorboard is imported lazily (the ``slime`` extra: ``pip install 'attune[slime]'``); without it
:func:`read_tensorboard_dir` raises a one-line ``MissingDependency``.
"""
# entry point: `python3 -m attune.runners.slime.tbscalars DIR` runs on the node after training and prints one line

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from attune.errors import MissingDependency
from attune.runners.slime.logparse import TrainMetrics

__all__ = ["EventFileScalars", "read_tensorboard_dir", "dump_line", "scalars_from_log", "train_metrics",
           "MARKER", "TENSORBOARD_HINT"]

# The job-log line that carries the scalars (one line; the last one in a log wins).
MARKER = "attune-tensorboard-scalars: "
TENSORBOARD_HINT = "reading slime's TensorBoard scalars needs tensorboard: pip install 'attune[slime]'"
# Tag prefixes carried through the log: the training perf dict and the train metrics (rollout/* and eval/* are
# not read; leaving them out keeps the line short, about 15 kB for 20 rollouts).
KEPT_PREFIXES = ("perf/", "train/")
# The training rank's file holds this tag (slime/observability/train_metric_utils.py, reference 2.2).
_TRAIN_TIME_TAG = "perf/actor_train_time"
_LOSS_TAG = "train/loss"
_GRAD_TAG = "train/grad_norm"


@dataclass(frozen=True, kw_only=True)
class EventFileScalars:
    """The scalars of one TensorBoard event file (one writer process)."""

    name: str
    """The file's path relative to the TensorBoard folder."""
    scalars: dict[str, dict[int, float]]
    """Tag -> step -> value (the last value written at a step wins)."""

    @property
    def is_training_rank(self) -> bool:
        """Whether the training rank wrote it (it holds perf/actor_train_time)."""
        return _TRAIN_TIME_TAG in self.scalars

    def to_json(self) -> dict:
        return {"name": self.name, "scalars": {tag: [[step, _json_num(v)] for step, v in sorted(by_step.items())]
                                               for tag, by_step in sorted(self.scalars.items())}}

    @classmethod
    def from_json(cls, d: dict) -> "EventFileScalars":
        scalars = {str(tag): {int(step): (math.nan if v is None else float(v)) for step, v in pairs}
                   for tag, pairs in (d.get("scalars") or {}).items()}
        return cls(name=str(d.get("name", "")), scalars=scalars)


def _json_num(v: float) -> float | None:
    return v if math.isfinite(v) else None  # JSON has no nan; a missing value reads back as nan


def _event_accumulator():
    try:
        from tensorboard.backend.event_processing import event_accumulator  # noqa: PLC0415 - optional, heavy
    except ImportError:
        raise MissingDependency(TENSORBOARD_HINT) from None
    return event_accumulator


def read_tensorboard_dir(tb_dir: str | Path, prefixes: tuple[str, ...] = KEPT_PREFIXES) -> list[EventFileScalars]:
    """The scalars of every event file under ``tb_dir`` whose tag starts with one of ``prefixes``, one record per
    file, in path order. A missing folder gives []."""
    root = Path(tb_dir)
    if not root.is_dir():
        return []
    ea_mod = _event_accumulator()
    out: list[EventFileScalars] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "tfevents" in p.name):
        acc = ea_mod.EventAccumulator(str(path), size_guidance={ea_mod.SCALARS: 0})  # 0: keep every event
        acc.Reload()
        scalars: dict[str, dict[int, float]] = {}
        for tag in acc.Tags().get("scalars", []):
            if not tag.startswith(prefixes):
                continue
            scalars[tag] = {int(e.step): float(e.value) for e in acc.Scalars(tag)}
        if scalars:
            out.append(EventFileScalars(name=str(path.relative_to(root)), scalars=scalars))
    return out


def dump_line(files: list[EventFileScalars]) -> str:
    """The job-log line carrying ``files`` (no newline)."""
    return MARKER + json.dumps({"files": [f.to_json() for f in files]}, separators=(",", ":"))


def scalars_from_log(log: str) -> list[EventFileScalars] | None:
    """The scalars the launch script printed into the job log (the last marker line), or None when there is none
    or it does not parse (a cut-off log)."""
    for line in reversed(log.splitlines()):
        i = line.find(MARKER)
        if i < 0:
            continue
        try:
            data = json.loads(line[i + len(MARKER):])
            return [EventFileScalars.from_json(f) for f in data.get("files", [])]
        except (ValueError, TypeError, AttributeError):
            return None
    return None


def train_metrics(files: list[EventFileScalars]) -> TrainMetrics | None:
    """slime's training metrics from its TensorBoard scalars: the training rank's perf/* by rollout id, and
    train/loss and train/grad_norm by step. None when no file holds perf/actor_train_time."""
    train = [f for f in files if f.is_training_rank]
    if not train:
        return None
    perf: dict[int, dict[str, float]] = {}
    loss: dict[int, float] = {}
    grad: dict[int, float] = {}
    for f in train:  # path order: a restarted job's later file overrides the earlier one
        for tag, by_step in f.scalars.items():
            if tag.startswith("perf/"):
                for step, v in by_step.items():
                    perf.setdefault(step, {})[tag] = v
            elif tag == _LOSS_TAG:
                loss.update(by_step)
            elif tag == _GRAD_TAG:
                grad.update(by_step)
    for f in files:  # train/* may come from a file without perf/* (a writer per metric group)
        if not f.is_training_rank:
            for step, v in f.scalars.get(_LOSS_TAG, {}).items():
                loss.setdefault(step, v)
            for step, v in f.scalars.get(_GRAD_TAG, {}).items():
                grad.setdefault(step, v)
    return TrainMetrics(perf=perf, loss=loss, grad_norm=grad, source="tensorboard")


def main(argv: list[str]) -> int:
    """Print the scalars of the folder argv[0] as one marker line; 0 even when there are none."""
    if len(argv) != 1:
        print("usage: python3 -m attune.runners.slime.tbscalars TENSORBOARD_DIR", file=sys.stderr)
        return 2
    files = read_tensorboard_dir(argv[0])
    print(dump_line(files), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
