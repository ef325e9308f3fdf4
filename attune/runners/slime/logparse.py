"""Parse the stdout of a slime training job (as printed under ``ray job submit``).

What is read (formats from /work/shared/reference/slime-and-qwen.md, sections 2.1-2.3):

* Ray prefixes every actor's output with ``(ActorName pid=N[, ip=A.B.C.D])``, sometimes wrapped in ANSI
  colour codes and sometimes followed by a ``[repeated Nx across cluster]`` de-duplication note.
* slime logs with ``[%(asctime)s{prefix}] %(filename)s:%(lineno)d - %(message)s``.
* Training perf line, once per rollout: ``train_metric_utils.py:401 - perf <rollout_id>: {...}`` with
  ``perf/actor_train_time`` (s) and ``perf/actor_train_tok_per_s`` (job-wide tokens/s, NOT per GPU).
* Rollout perf line with the same ``perf <rollout_id>:`` shape from ``rollout_metrics.py:268`` /
  ``(RolloutManager ...)``: ignored here (it carries ``perf/rollout_time``, ``perf/tokens_per_gpu_per_sec``).
* Train line, once per optimizer step: ``model.py:918 - step <step>: {'train/loss': ..., 'train/grad_norm': nan}``.
  ``critic-step`` lines are ignored.
* ``Timer actor_train end (elapsed: 52.4s)`` (timer.py, rank 0): fallback train time when a rollout has no
  training perf line; 0.1 s resolution.

Indexing: per-rollout quantities (train time, tokens) are keyed by rollout id; the loss curve and grad norms
by ``step`` (= rollout_id * steps_per_rollout + step_id, model.py:879). With one optimizer step per rollout
(the 27B recipe: rollout batch = global batch) the two coincide. The measurement window is over rollout ids.

If a rollout id is reported twice (a restarted job in one log) the last report wins.

Crash rule: a traceback, a ``ray.exceptions.RayTaskError``/``RayActorError``/``ActorDiedError`` or a FAILED job
status marks the run crashed, unless ``ray job submit`` reported the job as succeeded (then any traceback was
handled). A CUDA OOM line always marks it crashed with kind "oom".
"""

from __future__ import annotations

import ast
import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "OomInfo",
    "CrashInfo",
    "SlimeRun",
    "parse_slime_log",
    "parse_dict_literal",
    "format_summary",
]

# Default measurement window (rollout ids, inclusive): the seed recipe's `result.window: [5, 19]`.
DEFAULT_WINDOW = (5, 19)
# Lines of raw log kept as the crash tail (enough for a Python traceback plus Ray's error summary).
TAIL_LINES = 60
# Characters of the error line shown by format_summary (the full line stays in SlimeRun).
SUMMARY_ERROR_CHARS = 160

# ANSI colour escape sequences (Ray colours actor prefixes on a TTY).
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Ray actor/task prefix: "(MegatronTrainRayActor pid=1234, ip=10.0.0.1)" (Ray log_monitor format).
_RAY_PREFIX_RE = re.compile(r"^\((?P<actor>[^\s()]+)\s+pid=(?P<pid>\d+)(?:,\s*ip=(?P<ip>[^)\s]+))?\)\s?")
# Ray's log de-duplication suffix.
_RAY_REPEAT_RE = re.compile(r"\s*\[repeated \d+x across cluster\]\s*$")
# slime logging prefix: "[2026-10-18 12:00:01] model.py:918 - " (configure_logger in slime).
_LOG_PREFIX_RE = re.compile(r"^\[(?P<time>[^\]]*)\]\s+(?P<file>[\w.\-]+\.py):(?P<line>\d+)\s+-\s+(?P<msg>.*)$")
# perf line (train_metric_utils.py:401 and rollout_metrics.py:268).
_PERF_RE = re.compile(r"(?<![\w-])perf (?P<id>\d+): (?P<dict>\{.*\})\s*$")
# train line (model.py:918); the lookbehind drops "critic-step".
_STEP_RE = re.compile(r"(?<![\w-])step (?P<id>\d+): (?P<dict>\{.*\})\s*$")
# timer.py:32 end line.
_TIMER_RE = re.compile(r"Timer actor_train end \(elapsed: (?P<s>[0-9.eE+-]+)\s*s\)")
# torch's c10 rank marker, e.g. "[rank6]:[W1018 ...] ProcessGroupNCCL.cpp..." or "[rank6]: Traceback".
_RANK_MARK_RE = re.compile(r"\[rank(?P<rank>\d+)\]:")
# Other explicit rank mentions on an error line.
_RANK_WORD_RE = re.compile(r"\b(?:global_rank|rank)[= ](?P<rank>\d+)\b", re.IGNORECASE)
# CUDA OOM: torch >= 2.5 "torch.OutOfMemoryError", older "torch.cuda.OutOfMemoryError" / "RuntimeError".
_OOM_RE = re.compile(r"(?:torch\.OutOfMemoryError|torch\.cuda\.OutOfMemoryError|OutOfMemoryError|RuntimeError)"
                     r":\s*CUDA out of memory")
# "Tried to allocate 7.58 GiB" (PyTorch CUDACachingAllocator message).
_OOM_ALLOC_RE = re.compile(r"Tried to allocate (?P<n>[0-9.]+) (?P<unit>[KMGT]iB|B)")
# "GPU 0 has a total capacity of 139.81 GiB" (torch >= 2.1) or "(GPU 0; 79.35 GiB total capacity" (older).
_OOM_GPU_RE = re.compile(r"GPU (?P<gpu>\d+) has a total capacity of (?P<n>[0-9.]+) (?P<unit>[KMGT]iB)"
                         r"|\(GPU (?P<gpu2>\d+); (?P<n2>[0-9.]+) (?P<unit2>[KMGT]iB) total capacity")
# Binary unit factors to GiB (PyTorch prints IEC units).
_TO_GIB = {"B": 1 / 1024**3, "KiB": 1 / 1024**2, "MiB": 1 / 1024, "GiB": 1.0, "TiB": 1024.0}
_TRACEBACK_RE = re.compile(r"^Traceback \(most recent call last\):")
# Ray exceptions that end a job.
_RAY_ERROR_RE = re.compile(r"ray\.exceptions\.(?:RayTaskError|RayActorError|ActorDiedError|WorkerCrashedError)")
# `ray job submit` / `ray job status` terminal lines.
_JOB_FAILED_RE = re.compile(r"Job '[^']*' failed|Status for job '[^']*': FAILED|\bJobStatus\.FAILED\b"
                            r"|Job entrypoint command failed")
_JOB_OK_RE = re.compile(r"Job '[^']*' succeeded|Status for job '[^']*': SUCCEEDED")
# The final "SomeError: message" line of a Python traceback.
_EXC_LINE_RE = re.compile(r"^(?P<exc>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Fault)"
                          r"(?:\([\w.]+\))?):?(?:\s|$)")
# NCCL's banner with NCCL_DEBUG=INFO: "NCCL INFO NCCL version 2.28.9+cuda12.9" (the recipe's nccl source).
_NCCL_RE = re.compile(r"NCCL version (?P<v>\d+\.\d+\.\d+)(?:\+cuda(?P<cuda>[\d.]+))?")
# Tokens that ast.literal_eval cannot read but Python's float repr prints.
_NONFINITE_RE = re.compile(r"(?<![\w'\"])(-?)(nan|inf)(?![\w'\"])")
_PLACEHOLDER = "__attune_nonfinite__"
_NONFINITE = {f"{_PLACEHOLDER}nan": math.nan, f"{_PLACEHOLDER}-nan": math.nan,
              f"{_PLACEHOLDER}inf": math.inf, f"{_PLACEHOLDER}-inf": -math.inf}

# Actor names / files of the two perf-line sources (reference §2.2).
_TRAIN_ACTOR = "MegatronTrainRayActor"
_ROLLOUT_ACTOR = "RolloutManager"
_TRAIN_PERF_FILE = "train_metric_utils.py"
_ROLLOUT_PERF_FILE = "rollout_metrics.py"
_TRAIN_TIME_KEY = "perf/actor_train_time"
_TRAIN_TOKPS_KEY = "perf/actor_train_tok_per_s"


@dataclass(frozen=True)
class OomInfo:
    """A CUDA out-of-memory error found in the log."""

    requested_gib: float | None  # "Tried to allocate X" converted to GiB
    gpu_index: int | None  # device index as the process sees it (Ray sets CUDA_VISIBLE_DEVICES, so often 0)
    total_capacity_gib: float | None
    actor: str | None  # Ray actor name, e.g. MegatronTrainRayActor
    pid: int | None
    rank: int | None  # torch.distributed rank, when a [rankN] marker ties it to the pid
    rollout_id: int | None  # first rollout id without a training perf line when the OOM was printed
    line: str
    count: int  # OOM lines in the whole log (every rank that failed prints one)


@dataclass(frozen=True)
class CrashInfo:
    """A fatal error: traceback, Ray task error or a FAILED job status."""

    kind: str  # "oom" | "exception" | "job_failed"
    error: str | None  # e.g. "ValueError: row 517 has 8191 tokens" (first traceback's final line)
    actor: str | None
    pid: int | None
    tail: str  # last TAIL_LINES lines of the raw log


@dataclass(frozen=True)
class SlimeRun:
    """Everything attune reads from one slime job's stdout."""

    gpus: int
    window: tuple[int, int]
    train_time_s: dict[int, float]  # rollout id -> perf/actor_train_time (or the Timer fallback), s
    time_source: dict[int, str]  # rollout id -> "perf" | "timer"
    tokens: dict[int, int]  # rollout id -> tokens trained (tok_per_s x time), tokens
    loss: dict[int, float]  # step -> train/loss
    grad_norm: dict[int, float]  # step -> train/grad_norm (nan kept)
    grad_norm_nan_count: int
    window_missing: tuple[int, ...]  # window rollout ids without a train time or token count
    complete: bool  # every window rollout id has a train time and a token count
    window_tokens: int | None  # tokens over the present window steps
    window_time_s: float | None  # summed train time over the present window steps, s
    tokens_per_s_per_gpu: float | None  # window_tokens / window_time_s / gpus
    step_time_cv_percent: float | None  # sample stdev / mean of window train times x 100
    oom: OomInfo | None
    crash: CrashInfo | None
    nccl_version: str | None  # from an "NCCL version X.Y.Z" banner, when NCCL_DEBUG=INFO printed one
    train_perf: dict[int, dict[str, float]] = field(default_factory=dict)  # raw training perf dicts

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping: int keys become strings, nan/inf become None (counted in grad_norm_nan_count)."""
        return {
            "gpus": self.gpus,
            "window": list(self.window),
            "complete": self.complete,
            "window_missing": list(self.window_missing),
            "tokens_per_s_per_gpu": _json_float(self.tokens_per_s_per_gpu),
            "step_time_cv_percent": _json_float(self.step_time_cv_percent),
            "window_tokens": self.window_tokens,
            "window_time_s": _json_float(self.window_time_s),
            "train_time_s": {str(k): _json_float(v) for k, v in sorted(self.train_time_s.items())},
            "time_source": {str(k): v for k, v in sorted(self.time_source.items())},
            "tokens": {str(k): v for k, v in sorted(self.tokens.items())},
            "loss": {str(k): _json_float(v) for k, v in sorted(self.loss.items())},
            "grad_norm": {str(k): _json_float(v) for k, v in sorted(self.grad_norm.items())},
            "grad_norm_nan_count": self.grad_norm_nan_count,
            "oom": None if self.oom is None else {
                "requested_gib": self.oom.requested_gib,
                "gpu_index": self.oom.gpu_index,
                "total_capacity_gib": self.oom.total_capacity_gib,
                "actor": self.oom.actor,
                "pid": self.oom.pid,
                "rank": self.oom.rank,
                "rollout_id": self.oom.rollout_id,
                "line": self.oom.line,
                "count": self.oom.count,
            },
            "crash": None if self.crash is None else {
                "kind": self.crash.kind,
                "error": self.crash.error,
                "actor": self.crash.actor,
                "pid": self.crash.pid,
                "tail": self.crash.tail,
            },
            "nccl_version": self.nccl_version,
            "train_perf": {str(k): {kk: _json_float(vv) for kk, vv in v.items()}
                           for k, v in sorted(self.train_perf.items())},
        }


def _json_float(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def parse_dict_literal(text: str) -> dict[str, Any]:
    """Parse a printed Python dict whose floats may be nan/inf/-inf; raises ValueError naming the text."""
    # literal_eval rejects bare nan/inf names: swap them for placeholder strings, parse, then map back.
    safe = _NONFINITE_RE.sub(lambda m: f"'{_PLACEHOLDER}{m.group(1)}{m.group(2)}'", text)
    try:
        value = ast.literal_eval(safe)
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"unparseable metrics dict literal: {text[:120]!r} ({exc.__class__.__name__})") from None
    if not isinstance(value, dict):
        raise ValueError(f"metrics literal is not a dict: {text[:120]!r}")
    return {k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in value.items()}


@dataclass(frozen=True)
class _Line:
    raw: str
    actor: str | None
    pid: int | None
    file: str | None
    msg: str


def _split_line(raw: str) -> _Line:
    text = _ANSI_RE.sub("", raw).rstrip("\r\n")
    text = _RAY_REPEAT_RE.sub("", text)
    actor = pid = None
    m = _RAY_PREFIX_RE.match(text)
    if m:
        actor, pid = m.group("actor"), int(m.group("pid"))
        text = text[m.end():]
    file = None
    lm = _LOG_PREFIX_RE.match(text)
    if lm:
        file, text = lm.group("file"), lm.group("msg")
    return _Line(raw=raw, actor=actor, pid=pid, file=file, msg=text)


def _is_train_perf(line: _Line, metrics: dict[str, Any]) -> bool:
    if _TRAIN_TIME_KEY in metrics:
        return True
    if line.file == _ROLLOUT_PERF_FILE or line.actor == _ROLLOUT_ACTOR:
        return False
    return line.file == _TRAIN_PERF_FILE or line.actor == _TRAIN_ACTOR


def _to_gib(n: str | None, unit: str | None) -> float | None:
    if n is None or unit is None:
        return None
    return float(n) * _TO_GIB[unit]


def parse_slime_log(text: str, gpus: int, window: tuple[int, int] = DEFAULT_WINDOW) -> SlimeRun:
    """Parse one slime job's stdout into a SlimeRun (pure: no I/O)."""
    if gpus <= 0:
        raise ValueError(f"gpus must be positive, got {gpus}")
    a, b = window
    if a > b:
        raise ValueError(f"window start {a} is after its end {b}")

    raw_lines = text.splitlines()
    perf: dict[int, dict[str, float]] = {}
    loss: dict[int, float] = {}
    grad_norm: dict[int, float] = {}
    timers: list[float] = []  # "Timer actor_train end" elapsed values in log order, s
    pid_rank: dict[int, int] = {}
    oom_lines: list[tuple[_Line, int | None]] = []
    first_exc: tuple[_Line, str] | None = None
    in_traceback = False
    saw_traceback = saw_ray_error = saw_failed = saw_ok = False
    nccl_version: str | None = None

    for raw in raw_lines:
        line = _split_line(raw)
        msg = line.msg

        rm = _RANK_MARK_RE.search(msg)
        if rm and line.pid is not None:
            pid_rank.setdefault(line.pid, int(rm.group("rank")))
        body = _RANK_MARK_RE.sub("", msg).strip() if rm else msg

        if nccl_version is None:
            nm = _NCCL_RE.search(msg)
            if nm:
                nccl_version = nm.group("v")

        pm = _PERF_RE.search(msg)
        if pm:
            try:
                metrics = parse_dict_literal(pm.group("dict"))
            except ValueError:
                metrics = None
            if metrics is not None and _is_train_perf(line, metrics):
                rid = int(pm.group("id"))
                perf[rid] = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
            continue

        sm = _STEP_RE.search(msg)
        if sm:
            try:
                metrics = parse_dict_literal(sm.group("dict"))
            except ValueError:
                metrics = None
            if metrics is not None and any(k.startswith("train/") for k in metrics):
                step = int(sm.group("id"))
                if "train/loss" in metrics:
                    loss[step] = float(metrics["train/loss"])
                if "train/grad_norm" in metrics:
                    grad_norm[step] = float(metrics["train/grad_norm"])
            continue

        tm = _TIMER_RE.search(msg)
        if tm:
            timers.append(float(tm.group("s")))
            continue

        if _OOM_RE.search(body):
            oom_lines.append((line, max(perf) + 1 if perf else 0))
        if _TRACEBACK_RE.match(body):
            saw_traceback = True
            in_traceback = True
        elif in_traceback and first_exc is None:
            em = _EXC_LINE_RE.match(body)
            if em:
                first_exc = (line, body.strip())
                in_traceback = False
        if _RAY_ERROR_RE.search(body):
            saw_ray_error = True
        if _JOB_FAILED_RE.search(body):
            saw_failed = True
        if _JOB_OK_RE.search(body):
            saw_ok = True

    # Training times and tokens: the perf line first, the Timer line as a fallback. Timer lines come from
    # rank 0 and perf lines from the last pipeline stage, so their relative order in Ray's merged stream is not
    # reliable; the k-th "Timer actor_train end" line is taken as rollout (first reported rollout id + k).
    first_id = min(perf) if perf else 0
    timer_for = {first_id + k: t for k, t in enumerate(timers)}
    train_time: dict[int, float] = {}
    source: dict[int, str] = {}
    tokens: dict[int, int] = {}
    for rid in sorted(set(perf) | set(timer_for)):
        metrics = perf.get(rid, {})
        t = metrics.get(_TRAIN_TIME_KEY)
        src = "perf"
        if t is None or not math.isfinite(t):
            t, src = timer_for.get(rid), "timer"
        if t is None:
            continue
        train_time[rid], source[rid] = t, src
        tps = metrics.get(_TRAIN_TOKPS_KEY)
        if tps is not None and math.isfinite(tps) and src == "perf":
            # tok_per_s = sum(total_lengths) / actor_train_time (train_metric_utils.py), so the product is the
            # integer token count up to float rounding.
            tokens[rid] = int(round(tps * t))

    window_ids = list(range(a, b + 1))
    missing = tuple(i for i in window_ids if i not in train_time or i not in tokens)
    present = [i for i in window_ids if i in train_time and i in tokens]
    window_tokens = sum(tokens[i] for i in present) if present else None
    window_time = sum(train_time[i] for i in present) if present else None
    tps_gpu = (window_tokens / window_time / gpus) if present and window_time and window_time > 0 else None
    times = [train_time[i] for i in window_ids if i in train_time]
    cv = (statistics.stdev(times) / statistics.fmean(times) * 100.0) if len(times) >= 2 else None

    oom = None
    if oom_lines:
        line, rid = oom_lines[0]
        body = _RANK_MARK_RE.sub("", line.msg)
        am = _OOM_ALLOC_RE.search(body)
        gm = _OOM_GPU_RE.search(body)
        rank = None
        rmk = _RANK_MARK_RE.search(line.msg) or _RANK_WORD_RE.search(body)
        if rmk:
            rank = int(rmk.group("rank"))
        elif line.pid is not None:
            rank = pid_rank.get(line.pid)
        gpu_idx = cap = None
        if gm:
            gpu_idx = int(gm.group("gpu") or gm.group("gpu2"))
            cap = _to_gib(gm.group("n") or gm.group("n2"), gm.group("unit") or gm.group("unit2"))
        oom = OomInfo(
            requested_gib=_to_gib(am.group("n"), am.group("unit")) if am else None,
            gpu_index=gpu_idx,
            total_capacity_gib=cap,
            actor=line.actor,
            pid=line.pid,
            rank=rank,
            rollout_id=rid,
            line=body.strip(),
            count=len(oom_lines),
        )

    crash = None
    fatal = (saw_traceback or saw_ray_error or saw_failed) and not saw_ok
    if oom is not None or fatal:
        kind = "oom" if oom is not None else ("exception" if (saw_traceback or saw_ray_error) else "job_failed")
        exc_line = first_exc[0] if first_exc else None
        crash = CrashInfo(
            kind=kind,
            error=first_exc[1] if first_exc else (oom.line if oom else None),
            actor=(oom.actor if oom else (exc_line.actor if exc_line else None)),
            pid=(oom.pid if oom else (exc_line.pid if exc_line else None)),
            tail="\n".join(_ANSI_RE.sub("", r) for r in raw_lines[-TAIL_LINES:]),
        )

    return SlimeRun(
        gpus=gpus,
        window=(a, b),
        train_time_s=dict(sorted(train_time.items())),
        time_source=dict(sorted(source.items())),
        tokens=dict(sorted(tokens.items())),
        loss=dict(sorted(loss.items())),
        grad_norm=dict(sorted(grad_norm.items())),
        grad_norm_nan_count=sum(1 for v in grad_norm.values() if math.isnan(v)),
        window_missing=missing,
        complete=not missing,
        window_tokens=window_tokens,
        window_time_s=window_time,
        tokens_per_s_per_gpu=tps_gpu,
        step_time_cv_percent=cv,
        oom=oom,
        crash=crash,
        nccl_version=nccl_version,
        train_perf=dict(sorted(perf.items())),
    )


def format_summary(run: SlimeRun) -> str:
    """Human-readable multi-line summary; every number carries its unit."""
    a, b = run.window
    out = []
    ids = sorted(run.train_time_s)
    span = f"rollouts {ids[0]}-{ids[-1]}" if ids else "no rollouts"
    state = "complete" if run.complete else f"incomplete, missing {_ranges(run.window_missing)}"
    out.append(f"slime run: {len(ids)} steps with a train time ({span}); window {a}-{b} {state}")
    if run.tokens_per_s_per_gpu is not None:
        out.append(f"throughput: {run.tokens_per_s_per_gpu:,.2f} tokens/s/GPU over the window "
                   f"({run.window_tokens:,} tokens in {run.window_time_s:,.1f} s on {run.gpus} GPUs)")
    else:
        out.append(f"throughput: n/a tokens/s/GPU (no window step with a time and a token count, {run.gpus} GPUs)")
    wtimes = [run.train_time_s[i] for i in range(a, b + 1) if i in run.train_time_s]
    if wtimes:
        cv = "n/a %" if run.step_time_cv_percent is None else f"{run.step_time_cv_percent:.2f} %"
        out.append(f"step time: mean {statistics.fmean(wtimes):.2f} s, min {min(wtimes):.2f} s, "
                   f"max {max(wtimes):.2f} s, CV {cv} over {len(wtimes)} steps")
    if run.loss:
        s0, s1 = min(run.loss), max(run.loss)
        out.append(f"loss: {run.loss[s0]:.4f} nats at step {s0} -> {run.loss[s1]:.4f} nats at step {s1} "
                   f"({len(run.loss)} steps)")
    out.append(f"grad norm: {run.grad_norm_nan_count} nan of {len(run.grad_norm)} steps")
    if run.oom is not None:
        o = run.oom
        req = "n/a GiB" if o.requested_gib is None else f"{o.requested_gib:.2f} GiB"
        where = ", ".join(x for x in (
            o.actor and f"{o.actor} pid {o.pid}",
            o.rank is not None and f"rank {o.rank}",
            o.gpu_index is not None and f"GPU {o.gpu_index}",
            o.total_capacity_gib is not None and f"capacity {o.total_capacity_gib:.2f} GiB",
            o.rollout_id is not None and f"rollout {o.rollout_id}",
        ) if x)
        out.append(f"OOM: tried to allocate {req} ({where}); {o.count} OOM lines")
    if run.crash is not None:
        err = run.crash.error or "no exception line found"
        if len(err) > SUMMARY_ERROR_CHARS:
            err = err[:SUMMARY_ERROR_CHARS] + "..."
        out.append(f"crash: {run.crash.kind}: {err}")
    else:
        out.append("crash: none")
    if run.nccl_version:
        out.append(f"nccl: {run.nccl_version} (from the log)")
    return "\n".join(out)


def _ranges(ids: tuple[int, ...]) -> str:
    if not ids:
        return "none"
    parts, start, prev = [], ids[0], ids[0]
    for i in ids[1:] + (None,):  # type: ignore[operator]
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return "steps " + ", ".join(parts)
