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

How the parse is built: each raw line is split into a typed ``_Line`` (Ray prefix, slime logging prefix, rank
marker); one classifier per kind of line turns it into a record (``_TrainPerf``, ``_TrainStep``,
``_TrainTimer``, ``_Ignored`` for rollout perf / critic lines) or, for every other line, into ``_Signals`` (OOM,
traceback, exception line, Ray error, job status). ``_Collected`` accumulates them in log order; small
functions then derive the per-rollout times (``_train_times``), the window (``_window_stats``), the OOM
(``_oom_info``) and the crash (``_crash_info``).

Crash rule: a traceback, a ``ray.exceptions.RayTaskError``/``RayActorError``/``ActorDiedError`` or a FAILED job
status marks the run crashed, unless ``ray job submit`` reported the job as succeeded (then any traceback was
handled). A CUDA OOM line always marks it crashed with kind "oom". The crash's kind, most specific first:
"oom" (CUDA), "host_oom" (Ray's memory monitor killed a worker), "nccl_timeout" (torch's NCCL watchdog),
"nccl_error" (``DistBackendError`` / an NCCL error), "actor_died" (``ActorDiedError`` / ``RayActorError`` /
``WorkerCrashedError``, a worker that exited or was killed), "exception" (a Python exception, e.g. in the
training loop), "job_failed" (only a FAILED status). Its rank comes from a ``[rankN]:`` marker or a
"rank N" on the crash line, else from the rank the same pid printed elsewhere; the runner maps it to a
pipeline stage. Formats: torch ProcessGroupNCCL's watchdog ("Watchdog caught collective operation timeout:
WorkNCCL(...) ran for N milliseconds before timing out"), Ray's exceptions module (``ActorDiedError``: "The
actor died unexpectedly before finishing this task"; ``OutOfMemoryError``: "Task was killed due to the node
running low on memory").

Metrics from elsewhere: ``parse_slime_log(..., metrics=TrainMetrics)`` takes the per-rollout perf dicts, the
loss and the grad norms from another source (slime's TensorBoard scalars, ``attune.runners.slime.tbscalars``)
and reads only the health signals (OOM, crash, NCCL version) from the stdout; both give the same ``SlimeRun``.

Two throughputs, both per GPU over the window: over ``perf/actor_train_time`` (training only; the
``tokens_per_s_per_gpu`` of the result and of the seed recipe) and over ``perf/step_time`` (= train_wait +
train: also the wait between steps, which holds the per-step pinned-CPU backup of the weights;
slime-runtime-and-moe.md section 3).
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from attune.errors import UserInputError
from attune.runners.base import step_time_stats

__all__ = [
    "OomInfo",
    "CrashInfo",
    "SlimeRun",
    "TrainMetrics",
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
_RAY_ERROR_RE = re.compile(r"ray\.exceptions\.(?:RayTaskError|RayActorError|ActorDiedError|WorkerCrashedError"
                           r"|OutOfMemoryError|NodeDiedError)")
# Crash kinds by the line that shows them (first match of a line wins; _CRASH_RANK orders kinds across lines).
# torch ProcessGroupNCCL watchdog: "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(... Timeout(ms)=1800000)".
_NCCL_TIMEOUT_RE = re.compile(r"Watchdog caught collective operation timeout|collective operation timeout"
                              r"|NCCL (?:communicator|operation).{0,40}tim(?:ed|e) ?out", re.IGNORECASE)
_NCCL_ERROR_RE = re.compile(r"DistBackendError|NCCL error in:|ncclInternalError|ncclSystemError|ncclUnhandledCudaError"
                            r"|NCCL communicator was aborted")
# Ray: the actor's worker died (exit, SIGKILL, segfault) or the node went away.
_ACTOR_DIED_RE = re.compile(r"ray\.exceptions\.(?:ActorDiedError|RayActorError|WorkerCrashedError|NodeDiedError)"
                            r"|The actor died unexpectedly|The actor is dead because|worker process has died"
                            r"|A worker died or was killed")
# Ray's memory monitor (host memory, not GPU): "ray.exceptions.OutOfMemoryError: Task was killed due to the node
# running low on memory".
_HOST_OOM_RE = re.compile(r"ray\.exceptions\.OutOfMemoryError|killed due to the node running low on memory")
# "class_name: MegatronTrainRayActor" in Ray's actor-death message; "pid=48217" in Ray's error lines.
_CLASS_NAME_RE = re.compile(r"class_name:\s*(?P<name>\w+)|ray::(?P<name2>\w+)\.\w+\(\)")
_PID_RE = re.compile(r"\bpid[=:]\s*(?P<pid>\d+)")
# c10 logging's glog-style stamp at the start of a message: "[E1018 12:40:11.123456789 ProcessGroupNCCL.cpp:632] ".
_GLOG_RE = re.compile(r"^\[[EWFI]\d{4} [^\]]*\]\s*")
# Order of crash kinds from most to least specific (the crash is the most specific one seen).
_CRASH_KINDS = ("oom", "host_oom", "nccl_timeout", "nccl_error", "actor_died", "exception", "job_failed")
# `ray job submit` / `ray job status` terminal lines.
_JOB_FAILED_RE = re.compile(r"Job '[^']*' failed|Status for job '[^']*': FAILED|\bJobStatus\.FAILED\b"
                            r"|Job entrypoint command failed")
_JOB_OK_RE = re.compile(r"Job '[^']*' succeeded|Status for job '[^']*': SUCCEEDED")
# The final "SomeError: message" line of a Python traceback.
_EXC_LINE_RE = re.compile(r"^(?P<exc>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Fault)"
                          r"(?:\([\w.]+\))?):?(?:\s|$)")
# NCCL's banner with NCCL_DEBUG=INFO: "NCCL INFO NCCL version 2.28.9+cuda12.9" (the recipe's nccl source).
_NCCL_RE = re.compile(r"NCCL version (?P<v>\d+\.\d+\.\d+)(?:\+cuda(?P<cuda>[\d.]+))?")
# The longest log line read, characters (the rest is cut): above any metrics line (MAX_DICT_LITERAL_CHARS) with
# its prefixes; a runaway line of megabytes would otherwise cost its regex passes.
MAX_LINE_CHARS = 256 * 1024
# The longest metrics dict literal parsed, characters: slime's step lines print a few dozen scalars (~2 KB with
# every timer); ast.literal_eval of a crafted, deeply nested or huge literal costs recursion and memory.
MAX_DICT_LITERAL_CHARS = 64 * 1024
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
_STEP_TIME_KEY = "perf/step_time"


# ---------------------------------------------------------------------- public records
@dataclass(frozen=True, kw_only=True)
class OomInfo:
    """A CUDA out-of-memory error found in the log."""

    requested_gib: float | None
    """"Tried to allocate X" converted to GiB."""
    gpu_index: int | None
    """Device index as the process sees it (Ray sets CUDA_VISIBLE_DEVICES, so often 0)."""
    total_capacity_gib: float | None
    """The device's total capacity, GiB, when the message states it."""
    actor: str | None
    """Ray actor name, e.g. MegatronTrainRayActor."""
    pid: int | None
    """Process id from Ray's actor prefix."""
    rank: int | None
    """torch.distributed rank, when a [rankN] marker ties it to the line or its pid."""
    rollout_id: int | None
    """First rollout id without a training perf line when the OOM was printed."""
    line: str
    """The OOM message (rank marker removed)."""
    count: int
    """OOM lines in the whole log (every rank that failed prints one)."""


@dataclass(frozen=True, kw_only=True)
class CrashInfo:
    """A fatal error: traceback, Ray task error or a FAILED job status."""

    kind: str
    """"oom" | "host_oom" | "nccl_timeout" | "nccl_error" | "actor_died" | "exception" | "job_failed" (see the
    module docstring)."""
    error: str | None
    """E.g. "ValueError: row 517 has 8191 tokens" (the first traceback's final line), the OOM line, the NCCL
    watchdog line or Ray's actor-death line."""
    actor: str | None
    """Ray actor that printed the error (or that died), when known."""
    pid: int | None
    """Its process id, when known."""
    tail: str
    """Last TAIL_LINES lines of the raw log (ANSI codes removed)."""
    rank: int | None = None
    """torch.distributed rank the crash line names or its pid printed, when the log tells."""
    rollout_id: int | None = None
    """First rollout id without a training perf line when the crash line was printed."""


@dataclass(frozen=True, kw_only=True)
class SlimeRun:
    """Everything attune reads from one slime job's stdout."""

    gpus: int
    """GPUs of the job (tokens/s are divided by it)."""
    window: tuple[int, int]
    """Measurement window, rollout ids, inclusive."""
    train_time_s: dict[int, float]
    """Rollout id -> perf/actor_train_time (or the Timer fallback), s."""
    time_source: dict[int, str]
    """Rollout id -> "perf" | "timer"."""
    tokens: dict[int, int]
    """Rollout id -> tokens trained (tok_per_s x time), tokens."""
    loss: dict[int, float]
    """Step -> train/loss."""
    grad_norm: dict[int, float]
    """Step -> train/grad_norm (nan kept)."""
    grad_norm_nan_count: int
    """Steps whose grad norm is nan (skipped updates)."""
    window_missing: tuple[int, ...]
    """Window rollout ids without a train time or token count."""
    complete: bool
    """Every window rollout id has a train time and a token count."""
    window_tokens: int | None
    """Tokens over the present window steps."""
    window_time_s: float | None
    """Summed train time over the present window steps, s."""
    tokens_per_s_per_gpu: float | None
    """window_tokens / window_time_s / gpus."""
    step_time_cv_percent: float | None
    """Step-time coefficient of variation of the window train times, % (attune.runners.base.step_time_stats)."""
    oom: OomInfo | None
    """The first CUDA OOM, if any."""
    crash: CrashInfo | None
    """The fatal error, if any."""
    nccl_version: str | None
    """From an "NCCL version X.Y.Z" banner, when NCCL_DEBUG=INFO printed one."""
    train_perf: dict[int, dict[str, float]] = field(default_factory=dict)
    """Rollout id -> the raw training perf dict."""
    step_time_s: dict[int, float] = field(default_factory=dict)
    """Rollout id -> perf/step_time (train_wait + train), s."""
    tokens_per_s_per_gpu_step_time: float | None = None
    """Window tokens / summed perf/step_time / gpus over the window steps with both (tokens/s/GPU including the
    wait between steps)."""
    metrics_source: str = "stdout"
    """Where the train times, tokens and losses came from: "stdout" (the log's lines) | "tensorboard"."""

    throughput_basis: ClassVar[str] = "actor_train_time"
    """What ``tokens_per_s_per_gpu`` divides by: slime's perf/actor_train_time (training only)."""

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
            "oom": None if self.oom is None else asdict(self.oom),
            "crash": None if self.crash is None else asdict(self.crash),
            "nccl_version": self.nccl_version,
            "train_perf": {str(k): {kk: _json_float(vv) for kk, vv in v.items()}
                           for k, v in sorted(self.train_perf.items())},
            "step_time_s": {str(k): _json_float(v) for k, v in sorted(self.step_time_s.items())},
            "tokens_per_s_per_gpu_step_time": _json_float(self.tokens_per_s_per_gpu_step_time),
            "throughput_basis": self.throughput_basis,
            "metrics_source": self.metrics_source,
        }


def _json_float(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


_FAST_OK_RE = re.compile(r"""^\{[^"\\()\[\]{}]*\}$""")
_FAST_WORDS_RE = re.compile(r"\b(?:True|False|None)\b")


def _fast_dict(text: str) -> dict[str, Any] | None:
    """The common step/perf dict (quoted names, numbers; no nesting, double quotes or escapes) through
    json.loads, ~10x faster than ast.literal_eval; None when the text is anything else (literal_eval reads it)."""
    if not _FAST_OK_RE.match(text) or _FAST_WORDS_RE.search(text):
        return None
    js = _NONFINITE_RE.sub(lambda m: m.group(1) + ("NaN" if m.group(2) == "nan" else "Infinity"), text.replace("'", '"'))
    try:
        value = json.loads(js)
    except ValueError:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, (int, float, str)) for v in value.values()):
        return None
    return value


def parse_dict_literal(text: str) -> dict[str, Any]:
    """Parse a printed Python dict whose floats may be nan/inf/-inf; raises ValueError naming the text."""
    if len(text) > MAX_DICT_LITERAL_CHARS:
        raise ValueError(f"metrics dict literal of {len(text):,} characters is longer than the "
                         f"{MAX_DICT_LITERAL_CHARS:,} a slime step line prints: {text[:60]!r}...")
    fast = _fast_dict(text)
    if fast is not None:
        return fast
    # literal_eval rejects bare nan/inf names: swap them for placeholder strings, parse, then map back.
    safe = _NONFINITE_RE.sub(lambda m: f"'{_PLACEHOLDER}{m.group(1)}{m.group(2)}'", text)
    try:
        value = ast.literal_eval(safe)
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError) as exc:
        raise ValueError(f"unparseable metrics dict literal: {text[:120]!r} ({exc.__class__.__name__})") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"metrics literal is not a dict of names: {text[:120]!r}")
    return {k: _NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in value.items()}


@dataclass(frozen=True, kw_only=True)
class TrainMetrics:
    """slime's training metrics from one source (the stdout lines or the TensorBoard scalars)."""

    perf: dict[int, dict[str, float]]
    """Rollout id -> the training rank's perf dict (perf/actor_train_time, perf/actor_train_tok_per_s, ...)."""
    loss: dict[int, float]
    """Step (train/step) -> train/loss."""
    grad_norm: dict[int, float]
    """Step -> train/grad_norm (nan kept)."""
    timers: tuple[float, ...] = ()
    """"Timer actor_train end" elapsed values in log order, s (stdout only: the fallback train times)."""
    source: str = "stdout"
    """"stdout" | "tensorboard"."""

    def __post_init__(self) -> None:
        if self.source not in ("stdout", "tensorboard"):
            raise ValueError(f"TrainMetrics.source {self.source!r}; allowed: stdout, tensorboard")


# ---------------------------------------------------------------------- one line, split
@dataclass(frozen=True, kw_only=True)
class _Line:
    """One log line with Ray's and slime's prefixes taken apart."""

    raw: str
    """The line as printed."""
    actor: str | None
    """Ray actor name from the "(Actor pid=N, ip=...)" prefix."""
    pid: int | None
    """Process id from that prefix."""
    file: str | None
    """slime logging's "%(filename)s" (e.g. model.py)."""
    msg: str
    """The message after both prefixes."""
    rank: int | None
    """Rank from a torch "[rankN]:" marker on the line."""
    body: str
    """msg with the "[rankN]:" markers removed (what error matching reads)."""


def _split_line(raw: str) -> _Line:
    text = raw.rstrip("\r\n")
    if "\x1b" in text:  # the substitutions only where they can match: most lines have neither
        text = _ANSI_RE.sub("", text)
    if "repeated" in text:
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
    rm = _RANK_MARK_RE.search(text) if "[rank" in text else None
    body = _RANK_MARK_RE.sub("", text).strip() if rm else text
    return _Line(raw=raw, actor=actor, pid=pid, file=file, msg=text,
                 rank=int(rm.group("rank")) if rm else None, body=body)


# ---------------------------------------------------------------------- line kinds
@dataclass(frozen=True, kw_only=True)
class _TrainPerf:
    """train_metric_utils.py:401 "perf <rollout_id>: {...}" from the training rank."""

    rollout_id: int
    """Rollout id the perf dict belongs to."""
    metrics: dict[str, float]
    """Its numeric entries."""


@dataclass(frozen=True, kw_only=True)
class _TrainStep:
    """model.py:918 "step <step>: {...}" (one per optimizer step)."""

    step: int
    """accumulated_step_id = rollout_id * steps_per_rollout + step_id (model.py:879)."""
    loss: float | None
    """train/loss."""
    grad_norm: float | None
    """train/grad_norm (nan on a skipped update)."""


@dataclass(frozen=True, kw_only=True)
class _TrainTimer:
    """timer.py:32 "Timer actor_train end (elapsed: X.Ys)" (global rank 0)."""

    elapsed_s: float
    """Elapsed training time, s (0.1 s resolution)."""


@dataclass(frozen=True, kw_only=True)
class _Ignored:
    """A metrics line that is not training data: a rollout perf line, a critic step, an unparseable dict."""


@dataclass(frozen=True, kw_only=True)
class _Signals:
    """What a non-metrics line says about the job's health."""

    oom: bool
    """A CUDA out-of-memory message."""
    traceback: bool
    """A "Traceback (most recent call last):" header."""
    exception: str | None
    """A "SomeError: message" line (a traceback's final line when one is open)."""
    ray_error: bool
    """A ray.exceptions error that ends a job."""
    job_failed: bool
    """`ray job submit`/`status` reported failure."""
    job_ok: bool
    """`ray job submit`/`status` reported success."""
    crash_kind: str | None = None
    """host_oom | nccl_timeout | nccl_error | actor_died when the line shows one (module docstring)."""


_Metric = _TrainPerf | _TrainStep | _TrainTimer | _Ignored


def _metrics_of(text: str) -> dict[str, Any] | None:
    try:
        return parse_dict_literal(text)
    except ValueError:
        return None


def _is_train_perf(line: _Line, metrics: dict[str, Any]) -> bool:
    if _TRAIN_TIME_KEY in metrics:
        return True
    if line.file == _ROLLOUT_PERF_FILE or line.actor == _ROLLOUT_ACTOR:
        return False
    return line.file == _TRAIN_PERF_FILE or line.actor == _TRAIN_ACTOR


def _perf_line(line: _Line) -> _TrainPerf | _Ignored | None:
    m = _PERF_RE.search(line.msg)
    if not m:
        return None
    metrics = _metrics_of(m.group("dict"))
    if metrics is None or not _is_train_perf(line, metrics):
        return _Ignored()
    return _TrainPerf(rollout_id=int(m.group("id")),
                      metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})


def _step_line(line: _Line) -> _TrainStep | _Ignored | None:
    m = _STEP_RE.search(line.msg)
    if not m:
        return None
    metrics = _metrics_of(m.group("dict"))
    if metrics is None or not any(k.startswith("train/") for k in metrics):
        return _Ignored()
    loss, grad = metrics.get("train/loss"), metrics.get("train/grad_norm")
    return _TrainStep(step=int(m.group("id")), loss=None if loss is None else float(loss),
                      grad_norm=None if grad is None else float(grad))


def _timer_line(line: _Line) -> _TrainTimer | None:
    m = _TIMER_RE.search(line.msg)
    return _TrainTimer(elapsed_s=float(m.group("s"))) if m else None


def _metric_line(line: _Line) -> _Metric | None:
    """The line's training metric record, or None when it is not a metrics line."""
    for classify in (_perf_line, _step_line, _timer_line):
        rec = classify(line)
        if rec is not None:
            return rec
    return None


def _nccl_version(line: _Line) -> str | None:
    m = _NCCL_RE.search(line.msg)
    return m.group("v") if m else None


def _crash_kind(body: str) -> str | None:
    for kind, pattern in (("host_oom", _HOST_OOM_RE), ("nccl_timeout", _NCCL_TIMEOUT_RE),
                          ("nccl_error", _NCCL_ERROR_RE), ("actor_died", _ACTOR_DIED_RE)):
        if pattern.search(body):
            return kind
    return None


def _signals(line: _Line) -> _Signals:
    body = line.body
    exc = _EXC_LINE_RE.match(body)
    return _Signals(oom=bool(_OOM_RE.search(body)), traceback=bool(_TRACEBACK_RE.match(body)),
                    exception=body.strip() if exc else None, ray_error=bool(_RAY_ERROR_RE.search(body)),
                    job_failed=bool(_JOB_FAILED_RE.search(body)), job_ok=bool(_JOB_OK_RE.search(body)),
                    crash_kind=_crash_kind(body))


# ---------------------------------------------------------------------- the whole log
@dataclass
class _Collected:
    """Everything read from the log's lines, in log order (the one mutable record of the parse)."""

    perf: dict[int, dict[str, float]] = field(default_factory=dict)
    loss: dict[int, float] = field(default_factory=dict)
    grad_norm: dict[int, float] = field(default_factory=dict)
    timers: list[float] = field(default_factory=list)  # "Timer actor_train end" elapsed values, s
    pid_rank: dict[int, int] = field(default_factory=dict)
    ooms: list[tuple[_Line, int]] = field(default_factory=list)  # (line, rollout id it happened in)
    first_exc: tuple[_Line, str] | None = None
    in_traceback: bool = False
    saw_traceback: bool = False
    saw_ray_error: bool = False
    saw_failed: bool = False
    saw_ok: bool = False
    nccl_version: str | None = None
    crash_lines: dict[str, tuple[_Line, int]] = field(default_factory=dict)  # kind -> its first (line, rollout id)
    exc_rollout: int = 0  # rollout id when the first exception line was printed
    died_actor: str | None = None  # the actor class Ray's death / task error names ("class_name: X", "ray::X.f()")
    died_pid: int | None = None  # the pid Ray's error lines name

    def _rollout_now(self) -> int:
        return max(self.perf) + 1 if self.perf else 0

    def add(self, line: _Line) -> None:
        if line.rank is not None and line.pid is not None:
            self.pid_rank.setdefault(line.pid, line.rank)
        if self.nccl_version is None:
            self.nccl_version = _nccl_version(line)
        rec = _metric_line(line)
        if rec is None:
            self._add_signals(line, _signals(line))
        elif isinstance(rec, _TrainPerf):
            self.perf[rec.rollout_id] = rec.metrics  # a restarted job's second report wins
        elif isinstance(rec, _TrainStep):
            if rec.loss is not None:
                self.loss[rec.step] = rec.loss
            if rec.grad_norm is not None:
                self.grad_norm[rec.step] = rec.grad_norm
        elif isinstance(rec, _TrainTimer):
            self.timers.append(rec.elapsed_s)

    def _add_signals(self, line: _Line, s: _Signals) -> None:
        if s.oom:
            self.ooms.append((line, self._rollout_now()))
        if s.crash_kind is not None:
            self.crash_lines.setdefault(s.crash_kind, (line, self._rollout_now()))
        if s.ray_error or "class_name:" in line.body or (  # and the detail lines after Ray's error ("\tpid: N")
                (self.saw_ray_error or self.crash_lines) and self.died_pid is None):
            cm, pm = _CLASS_NAME_RE.search(line.body), _PID_RE.search(line.body)
            if cm and self.died_actor is None:
                self.died_actor = cm.group("name") or cm.group("name2")
            if pm and self.died_pid is None:
                self.died_pid = int(pm.group("pid"))
        if s.traceback:
            self.saw_traceback = self.in_traceback = True
        elif self.in_traceback and self.first_exc is None and s.exception:
            self.first_exc = (line, s.exception)
            self.exc_rollout = self._rollout_now()
            self.in_traceback = False
        self.saw_ray_error |= s.ray_error
        self.saw_failed |= s.job_failed
        self.saw_ok |= s.job_ok


@dataclass(frozen=True, kw_only=True)
class _TrainTimes:
    """Per-rollout training times and token counts."""

    time_s: dict[int, float]
    """Rollout id -> train time, s."""
    source: dict[int, str]
    """Rollout id -> "perf" | "timer"."""
    tokens: dict[int, int]
    """Rollout id -> tokens trained."""


def _train_times(perf: dict[int, dict[str, float]], timers: list[float]) -> _TrainTimes:
    """The perf line first, the Timer line as a fallback.

    Timer lines come from rank 0 and perf lines from the last pipeline stage, so their relative order in Ray's
    merged stream is not reliable; the k-th "Timer actor_train end" line is taken as rollout (first reported
    rollout id + k).
    """
    first_id = min(perf) if perf else 0
    timer_for = {first_id + k: t for k, t in enumerate(timers)}
    time_s: dict[int, float] = {}
    source: dict[int, str] = {}
    tokens: dict[int, int] = {}
    for rid in sorted(set(perf) | set(timer_for)):
        metrics = perf.get(rid, {})
        t, src = metrics.get(_TRAIN_TIME_KEY), "perf"
        if t is None or not math.isfinite(t):
            t, src = timer_for.get(rid), "timer"
        if t is None:
            continue
        time_s[rid], source[rid] = t, src
        tps = metrics.get(_TRAIN_TOKPS_KEY)
        if tps is not None and math.isfinite(tps) and src == "perf":
            # tok_per_s = sum(total_lengths) / actor_train_time (train_metric_utils.py), so the product is the
            # integer token count up to float rounding.
            tokens[rid] = int(round(tps * t))
    return _TrainTimes(time_s=time_s, source=source, tokens=tokens)


@dataclass(frozen=True, kw_only=True)
class _WindowStats:
    """Throughput and variability over the measurement window."""

    missing: tuple[int, ...]
    """Window rollout ids without a train time or a token count."""
    tokens: int | None
    """Tokens over the present window steps."""
    time_s: float | None
    """Train time over the present window steps, s."""
    tokens_per_s_per_gpu: float | None
    """tokens / time_s / gpus."""
    cv_percent: float | None
    """Step-time CV over the window steps with a time, %."""
    tokens_per_s_per_gpu_step_time: float | None = None
    """Tokens / summed perf/step_time / gpus over the window steps with a step time and a token count."""


def _step_time_throughput(tt: _TrainTimes, step_time_s: dict[int, float], window: tuple[int, int],
                          gpus: int) -> float | None:
    ids = [i for i in range(window[0], window[1] + 1) if i in step_time_s and i in tt.tokens]
    if not ids:
        return None
    return step_time_stats([step_time_s[i] for i in ids], tokens=sum(tt.tokens[i] for i in ids),
                           gpus=gpus).tokens_per_s_per_gpu


def _window_stats(tt: _TrainTimes, window: tuple[int, int], gpus: int) -> _WindowStats:
    """Throughput over the window steps with a time and a token count; the CV over those with a time. Both
    come from attune.runners.base.step_time_stats, the one step-time statistics definition."""
    ids = range(window[0], window[1] + 1)
    missing = tuple(i for i in ids if i not in tt.time_s or i not in tt.tokens)
    present = [i for i in ids if i in tt.time_s and i in tt.tokens]
    timed = [tt.time_s[i] for i in ids if i in tt.time_s]
    cv = step_time_stats(timed).cv_percent if timed else None
    if not present:
        return _WindowStats(missing=missing, tokens=None, time_s=None, tokens_per_s_per_gpu=None, cv_percent=cv)
    tokens = sum(tt.tokens[i] for i in present)
    stats = step_time_stats([tt.time_s[i] for i in present], tokens=tokens, gpus=gpus)
    return _WindowStats(missing=missing, tokens=tokens, time_s=stats.total_s,
                        tokens_per_s_per_gpu=stats.tokens_per_s_per_gpu, cv_percent=cv)


def _to_gib(n: str | None, unit: str | None) -> float | None:
    if n is None or unit is None:
        return None
    return float(n) * _TO_GIB[unit]


def _oom_info(c: _Collected) -> OomInfo | None:
    """The first OOM line, with its rank, device and requested size."""
    if not c.ooms:
        return None
    line, rid = c.ooms[0]
    body = line.body
    am = _OOM_ALLOC_RE.search(body)
    gm = _OOM_GPU_RE.search(body)
    word = _RANK_WORD_RE.search(body)
    rank = line.rank if line.rank is not None else (int(word.group("rank")) if word else c.pid_rank.get(line.pid))
    gpu_idx = cap = None
    if gm:
        gpu_idx = int(gm.group("gpu") or gm.group("gpu2"))
        cap = _to_gib(gm.group("n") or gm.group("n2"), gm.group("unit") or gm.group("unit2"))
    return OomInfo(requested_gib=_to_gib(am.group("n"), am.group("unit")) if am else None, gpu_index=gpu_idx,
                   total_capacity_gib=cap, actor=line.actor, pid=line.pid, rank=rank, rollout_id=rid,
                   line=body.strip(), count=len(c.ooms))


def _line_rank(c: _Collected, line: _Line | None, pid: int | None = None) -> int | None:
    """The rank a line names ([rankN]: marker, "rank N"), else the rank its pid (or ``pid``) printed."""
    if line is not None and line.rank is not None:
        return line.rank
    word = _RANK_WORD_RE.search(line.body) if line is not None else None
    if word:
        return int(word.group("rank"))
    for p in (line.pid if line is not None else None, pid):
        if p is not None and p in c.pid_rank:
            return c.pid_rank[p]
    return None


# Crash kinds that end a job by themselves (a watchdog abort, a dead worker, Ray's memory monitor).
_TERMINAL_KINDS = ("host_oom", "nccl_timeout", "actor_died")


def _crash_info(c: _Collected, oom: OomInfo | None, raw_lines: list[str]) -> CrashInfo | None:
    """The module's crash rule: an OOM always; a traceback, Ray error, FAILED status, NCCL watchdog timeout,
    dead actor or host OOM kill unless the job succeeded. The kind is the most specific one seen."""
    terminal = any(k in c.crash_lines for k in _TERMINAL_KINDS)
    fatal = (c.saw_traceback or c.saw_ray_error or c.saw_failed or terminal) and not c.saw_ok
    if oom is None and not fatal:
        return None
    tail = "\n".join(_ANSI_RE.sub("", r) for r in raw_lines[-TAIL_LINES:])
    exc_line, exc = c.first_exc if c.first_exc else (None, None)
    if oom is not None:
        return CrashInfo(kind="oom", error=exc or oom.line, actor=oom.actor, pid=oom.pid, tail=tail, rank=oom.rank,
                         rollout_id=oom.rollout_id)
    kind = next((k for k in _CRASH_KINDS if k in c.crash_lines), None)
    if kind is not None:
        line, rid = c.crash_lines[kind]
        pid = line.pid if line.pid is not None else c.died_pid
        actor = line.actor or c.died_actor
        if kind == "actor_died" and c.died_actor:
            actor = c.died_actor  # the dead actor, not the driver that printed the error
        return CrashInfo(kind=kind, error=_GLOG_RE.sub("", line.body).strip(), actor=actor, pid=pid, tail=tail,
                         rank=_line_rank(c, line, c.died_pid), rollout_id=rid)
    kind = "exception" if (c.saw_traceback or c.saw_ray_error) else "job_failed"
    actor, pid = (exc_line.actor, exc_line.pid) if exc_line else (None, None)
    return CrashInfo(kind=kind, error=exc, actor=actor, pid=pid, tail=tail,
                     rank=_line_rank(c, exc_line) if exc_line else None,
                     rollout_id=c.exc_rollout if exc_line else None)


def parse_slime_log(text: str | Iterable[str], gpus: int, window: tuple[int, int] = DEFAULT_WINDOW,
                    metrics: TrainMetrics | None = None) -> SlimeRun:
    """Parse one slime job's stdout into a SlimeRun (pure: no I/O).

    metrics: the training metrics from another source (slime's TensorBoard scalars); None reads them from the
    stdout lines. The OOM, the crash and the NCCL version always come from the stdout."""
    if gpus <= 0:
        raise UserInputError(f"gpus must be a positive GPU count, got {gpus}")
    a, b = window
    if a > b:
        raise UserInputError(f"window start {a} is after its end {b} (rollout ids, inclusive)")
    # a str, or any iterable of lines (an open file: streamed, memory bounded by the steps, not the log size)
    lines = text.splitlines() if isinstance(text, str) else text
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    collected = _Collected()
    for raw in lines:
        raw = raw.rstrip("\r\n")
        if len(raw) > MAX_LINE_CHARS:  # a runaway line (a dumped tensor): its head is what can matter
            raw = raw[:MAX_LINE_CHARS]
        tail.append(raw)
        collected.add(_split_line(raw))
    if metrics is None:
        metrics = TrainMetrics(perf=collected.perf, loss=collected.loss, grad_norm=collected.grad_norm,
                               timers=tuple(collected.timers), source="stdout")
    tt = _train_times(metrics.perf, list(metrics.timers))
    ws = _window_stats(tt, (a, b), gpus)
    step_times = {rid: m[_STEP_TIME_KEY] for rid, m in metrics.perf.items()
                  if _STEP_TIME_KEY in m and math.isfinite(m[_STEP_TIME_KEY])}
    oom = _oom_info(collected)
    return SlimeRun(
        gpus=gpus,
        window=(a, b),
        train_time_s=dict(sorted(tt.time_s.items())),
        time_source=dict(sorted(tt.source.items())),
        tokens=dict(sorted(tt.tokens.items())),
        loss=dict(sorted(metrics.loss.items())),
        grad_norm=dict(sorted(metrics.grad_norm.items())),
        grad_norm_nan_count=sum(1 for v in metrics.grad_norm.values() if math.isnan(v)),
        window_missing=ws.missing,
        complete=not ws.missing,
        window_tokens=ws.tokens,
        window_time_s=ws.time_s,
        tokens_per_s_per_gpu=ws.tokens_per_s_per_gpu,
        step_time_cv_percent=ws.cv_percent,
        oom=oom,
        crash=_crash_info(collected, oom, list(tail)),
        nccl_version=collected.nccl_version,
        train_perf=dict(sorted(metrics.perf.items())),
        step_time_s=dict(sorted(step_times.items())),
        tokens_per_s_per_gpu_step_time=_step_time_throughput(tt, step_times, (a, b), gpus),
        metrics_source=metrics.source,
    )


def format_summary(run: SlimeRun) -> str:
    """Human-readable multi-line summary; every number carries its unit."""
    a, b = run.window
    out = []
    ids = sorted(run.train_time_s)
    span = f"rollouts {ids[0]}-{ids[-1]}" if ids else "no rollouts"
    state = "complete" if run.complete else f"incomplete, missing {_ranges(run.window_missing)}"
    out.append(f"slime run: {len(ids)} steps with a train time ({span}); window {a}-{b} {state}; "
               f"metrics from {run.metrics_source}")
    if run.tokens_per_s_per_gpu is not None:
        out.append(f"throughput: {run.tokens_per_s_per_gpu:,.2f} tokens/s/GPU over actor_train_time (training only) "
                   f"over the window ({run.window_tokens:,} tokens in {run.window_time_s:,.1f} s on {run.gpus} GPUs)")
        if run.tokens_per_s_per_gpu_step_time is not None:
            out.append(f"throughput: {run.tokens_per_s_per_gpu_step_time:,.2f} tokens/s/GPU over step_time "
                       f"(train_wait + train, including the wait between steps)")
    else:
        out.append(f"throughput: n/a tokens/s/GPU (no window step with a time and a token count, {run.gpus} GPUs)")
    wtimes = [run.train_time_s[i] for i in range(a, b + 1) if i in run.train_time_s]
    if wtimes:
        cv = "n/a %" if run.step_time_cv_percent is None else f"{run.step_time_cv_percent:.2f} %"
        out.append(f"step time: mean {step_time_stats(wtimes).mean_s:.2f} s, min {min(wtimes):.2f} s, "
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
        where = ", ".join(x for x in (run.crash.actor and f"{run.crash.actor} pid {run.crash.pid}",
                                      run.crash.rank is not None and f"rank {run.crash.rank}",
                                      run.crash.rollout_id is not None and f"rollout {run.crash.rollout_id}") if x)
        out.append(f"crash: {run.crash.kind}: {err}" + (f" ({where})" if where else ""))
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
