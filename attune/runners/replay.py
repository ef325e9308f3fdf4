"""The `replay` runner: answers a trial from a table of measured outcomes instead of running anything.

Table format (CSV with a header row, or YAML: a list of mappings or `{rows: [...]}`), one row per layout:

=========================  ==========  =========================================================================
column                     required    meaning
=========================  ==========  =========================================================================
``flags``                  yes         the layout's Megatron-LM / slime flags (as ``attune estimate -- ...``)
``outcome``                yes         ``ok``, ``oom`` or ``failed``
``tokens_per_s_per_gpu``   yes         measured throughput (rows with outcome ok), tokens/s/GPU
``step_time_s``            yes         mean step time over the window (outcome ok), s
``peak_gib``               no          peak memory per pipeline stage, ``;``-separated, GiB
``oom_stage``              no          the stage that ran out of memory (outcome oom)
``gpu_hours``              no          GPU-hours the run cost; default GPUs x steps x step time
=========================  ==========  =========================================================================

A ``trials.csv`` written by an earlier study is read as-is: its measured rows (``role`` set), the layout from
its layout columns, the outcome from ``outcome`` or the trial state (COMPLETE ok, PRUNED oom, FAIL failed),
the throughput from ``measured_tokens_per_s_per_gpu`` (or the prediction of a ``sim`` study). Layouts are
matched by the one layout key (`attune.spec.identity.layout_key`: every field that can change a measurement,
the uniform recompute group size and the overlap flags included); a trials.csv carries only its layout columns,
so the other fields are matched as unknown there. A layout missing from the table fails its trial with "not in
the table".
"""

from __future__ import annotations

import csv
import dataclasses
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictStr, ValidationError

from attune.errors import FlagError, LayoutError, UserInputError
from attune.runners.base import FAILED, OK, OOM, Capabilities, Rerun, Runner, TrialResult, TrialSpec
from attune.runners.rerun import engine_rerun
from attune.spec.flags import from_flags
from attune.spec.identity import layout_key
from attune.spec.knob_registry import TRIALS_CSV_COLUMNS as _CSV_LAYOUT_FIELDS
from attune.spec.layout import Layout
from attune.spec.model import ModelSpec
from attune.spec.rules import check
from attune.spec.textio import load_yaml, read_text
from attune.spec.validation import one_line

__all__ = ["ReplayRunner", "ReplayRow", "ReplayTableError", "REQUIRED_COLUMNS"]

REQUIRED_COLUMNS = ("flags", "outcome", "tokens_per_s_per_gpu", "step_time_s")
OPTIONAL_COLUMNS = ("peak_gib", "oom_stage", "gpu_hours")
OUTCOMES = (OK, OOM, FAILED)
# trials.csv: the columns that identify it and carry its layout (attune.reporting.trials_csv)
TRIALS_CSV_COLUMNS = ("state", "role", "tp", "pp", "cp", "vpp")
_STATE_OUTCOME = {"COMPLETE": OK, "PRUNED": OOM, "FAIL": FAILED}


class ReplayTableError(UserInputError):
    """A measurements table the replay runner cannot read (exit code 2)."""


def _row_key(layout: Layout, num_layers: int, unknown: tuple[str, ...] = ()) -> tuple:
    """What identifies a layout in a replay table: the one layout key (`attune.spec.identity.layout_key`), with
    the fields a table cannot carry (`unknown`: a trials.csv has no columns for them) set to their defaults on
    both sides."""
    if unknown:
        layout = dataclasses.replace(layout, **{f: _DEFAULTS[f] for f in unknown})
    return layout_key(layout, num_layers)


# Layout fields a trials.csv carries (the knob registry's TRIALS_CSV_COLUMNS); the rest are matched as unknown
_TRIALS_CSV_FIELDS = _CSV_LAYOUT_FIELDS
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Layout)}
_TRIALS_CSV_UNKNOWN = tuple(f for f in _DEFAULTS if f not in _TRIALS_CSV_FIELDS and f not in ("micro_batch_size",))


@dataclass(frozen=True, kw_only=True)
class ReplayRow:
    """One row of a replay table."""

    line: int
    """Row number in the file (header is row 1), for messages."""
    layout: Layout
    """The layout the row measured."""
    outcome: str
    """ok, oom or failed."""
    tokens_per_s_per_gpu: float | None = None
    """Measured throughput, tokens/s/GPU (outcome ok)."""
    step_time_s: float | None = None
    """Mean step time, s (outcome ok)."""
    peak_gib: tuple[float, ...] = ()
    """Peak memory per pipeline stage, GiB."""
    oom_stage: int | None = None
    """Stage that ran out of memory."""
    gpu_hours: float | None = None
    """GPU-hours the run cost (None: GPUs x steps x step time)."""
    unknown: tuple[str, ...] = ()
    """Layout fields the table could not carry (a trials.csv's non-layout-column fields): matched as unknown."""

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ReplayTableError(f"row {self.line}: outcome '{self.outcome}'; allowed: {', '.join(OUTCOMES)}")
        if self.outcome == OK and not (self.tokens_per_s_per_gpu and self.tokens_per_s_per_gpu > 0):
            raise ReplayTableError(f"row {self.line}: outcome ok needs a positive tokens_per_s_per_gpu")


# The largest throughput a row may claim, tokens/s per GPU: a 1M-parameter model (6 FLOPs per parameter and
# token) on a 2.25 PFLOP/s dense-bf16 B200 (NVIDIA's datasheet) is ~4e8; anything above 1e9 is a typo.
MAX_TOKENS_PER_S_PER_GPU = 1e9


def _cell(v: Any) -> Any:
    """A table cell before typing: an empty cell is None, text is stripped, a YAML true/false is not a number."""
    if isinstance(v, bool):
        raise ValueError(f"must be a number, not {str(v).lower()}")
    if isinstance(v, str):
        v = v.strip()
        return v or None
    return v


def _int_cell(v: Any) -> Any:
    """As :func:`_cell`; text is read as a number first, so ``2.0`` is the whole number 2 and ``2.5`` is refused."""
    v = _cell(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def _plausible(x: float | None) -> float | None:
    if x is not None and x > MAX_TOKENS_PER_S_PER_GPU:
        raise ValueError(f"{x:g} tokens/s per GPU is not a plausible measurement (at most {MAX_TOKENS_PER_S_PER_GPU:g})")
    return x


def _peaks(v: Any) -> Any:
    """``peak_gib``: ``;``-separated GiB per stage in a CSV cell, or a YAML list."""
    if v is None or isinstance(v, (int, float)) and not isinstance(v, bool):
        return () if v is None else (v,)
    return [x for x in str(v).split(";") if x.strip()] if isinstance(v, str) else v


def _bool(v: Any) -> bool:
    return str(v).strip().lower() in ("true", "1", "yes")


# A finite number >= 0 of a cell (None for an empty one); a whole number where it counts something
Num = Annotated[Optional[Annotated[float, Field(ge=0, allow_inf_nan=False)]], BeforeValidator(_cell)]
Whole = Annotated[Optional[Annotated[int, Field(ge=0)]], BeforeValidator(_int_cell)]
Tps = Annotated[Num, AfterValidator(_plausible)]
Switch = Annotated[bool, BeforeValidator(_bool)]
Text = Annotated[Optional[str], BeforeValidator(_cell)]


class FlagsRow(BaseModel):
    """One row of a flags table (module docstring); other columns are ignored."""

    model_config = ConfigDict(extra="ignore")
    flags: StrictStr = Field(description="the layout's Megatron-LM / slime flags")
    outcome: Annotated[Literal["ok", "oom", "failed"], BeforeValidator(lambda v: str(v).strip().lower())]
    tokens_per_s_per_gpu: Tps
    step_time_s: Num
    peak_gib: Annotated[tuple[Annotated[float, Field(ge=0, allow_inf_nan=False), BeforeValidator(_cell)], ...],
                        BeforeValidator(_peaks)] = ()
    oom_stage: Whole = None
    gpu_hours: Num = None


class TrialsCsvRow(BaseModel):
    """One row of a trials.csv an earlier study wrote (attune.reporting.trials_csv); the columns replay reads."""

    model_config = ConfigDict(extra="ignore")
    state: Optional[str] = None
    role: Text = None
    runner: Text = None
    outcome: Text = None
    tp: Whole = None
    pp: Whole = None
    cp: Whole = None
    dp: Whole = None
    sp: Switch = False
    first: Whole = None
    last: Whole = None
    vpp: Whole = None
    recompute_granularity: Text = None
    recompute_method: Text = None
    recompute_num_layers: Whole = None
    optimizer_cpu_offload: Switch = False
    max_tokens_per_gpu: Whole = None
    measured_tokens_per_s_per_gpu: Tps = None
    predicted_tokens_per_s_per_gpu: Num = None
    measured_peak_gib: Num = None
    step_time_s: Num = None
    gpu_hours: Num = None
    predicted_peak_stage: Whole = None


def _row(model: type[BaseModel], raw: dict, where: str):
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise ReplayTableError(f"{where}: {one_line(e, model)}") from None


def _read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise ReplayTableError(f"{path}: no such measurements file (a CSV or YAML table, see the README)")
    text = read_text(path, "measurements file", ReplayTableError)
    if path.suffix.lower() in (".yaml", ".yml"):
        data = load_yaml(text, str(path), ReplayTableError)
        rows = data.get("rows") if isinstance(data, dict) else data
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ReplayTableError(f"{path}: expected a list of rows (mappings) or {{rows: [...]}}")
        return [{str(k): ("" if v is None else v) for k, v in r.items()} for r in rows]
    try:
        reader = csv.DictReader(text.splitlines())
        return [dict(r) for r in reader] if reader.fieldnames else []
    except csv.Error as e:
        raise ReplayTableError(f"{path}: not a CSV table ({e})") from None


class ReplayRunner(Runner):
    """Answers each trial from `measurements` (module docstring); runs nothing."""

    name = "replay"
    capabilities = Capabilities(measured=True, default_trials=20, default_candidates=8, needs_measurements=True,
                                verifiable=False)

    def __init__(self, measurements: str | Path | None = None, *, model: ModelSpec | None = None,
                 world_size: int | None = None, rows: list[ReplayRow] | None = None):
        if rows is None:
            if measurements is None or model is None or world_size is None:
                raise UserInputError("the replay runner needs --measurements FILE (a CSV or YAML table)")
            rows = self.read(measurements, model, world_size)
        self.source = str(measurements) if measurements is not None else "the given rows"
        self.rows = rows
        self._num_layers = model.num_layers if model is not None else None
        self._table: dict[tuple, ReplayRow] = {}
        self._unknowns: list[tuple[str, ...]] = []
        if self._num_layers is not None:
            self._index(self._num_layers)

    def _index(self, num_layers: int) -> None:
        table: dict[tuple, ReplayRow] = {}
        for r in self.rows:
            k = _row_key(r.layout, num_layers, r.unknown)
            if k in table:
                raise ReplayTableError(f"{self.source}: rows {table[k].line} and {r.line} are the same layout "
                                       f"({r.layout.label()}); keep one row per layout")
            table[k] = r
        self._table, self._num_layers = table, num_layers
        self._unknowns = sorted({r.unknown for r in self.rows})

    @classmethod
    def read(cls, path: str | Path, model: ModelSpec, world_size: int) -> list[ReplayRow]:
        """The rows of a measurements table (a flags table or a trials.csv); ReplayTableError on bad input."""
        path = Path(path)
        raw = _read_rows(path)
        if not raw:
            raise ReplayTableError(f"{path}: no rows (a header and one row per layout: {', '.join(REQUIRED_COLUMNS)})")
        cols = set(raw[0])
        if "flags" not in cols and set(TRIALS_CSV_COLUMNS) <= cols:
            return cls._from_trials_csv(path, raw, model, world_size)
        missing = [c for c in REQUIRED_COLUMNS if c not in cols]
        if missing:
            raise ReplayTableError(f"{path}: missing column(s) {', '.join(missing)}; required: "
                                   f"{', '.join(REQUIRED_COLUMNS)} (optional: {', '.join(OPTIONAL_COLUMNS)})")
        rows = []
        for n, r in enumerate(raw, start=2):
            where = f"{path} row {n}"
            c = _row(FlagsRow, r, where)
            try:
                parsed = from_flags(shlex.split(c.flags), model, world_size)
            except (FlagError, LayoutError) as e:
                raise ReplayTableError(f"{where}: {str(e).splitlines()[0]}") from None
            except ValueError as e:  # shlex: an unclosed quote
                raise ReplayTableError(f"{where}: flags: {' '.join(str(e).split())[:200]}") from None
            if parsed.ignored:
                raise ReplayTableError(f"{where}: unknown flag {parsed.ignored[0]} (not a layout or workload flag "
                                       f"of attune's flag table)")
            rows.append(ReplayRow(line=n, layout=parsed.layout, outcome=c.outcome,
                                  tokens_per_s_per_gpu=c.tokens_per_s_per_gpu, step_time_s=c.step_time_s,
                                  peak_gib=c.peak_gib, oom_stage=c.oom_stage, gpu_hours=c.gpu_hours))
        return rows

    @staticmethod
    def _from_trials_csv(path: Path, raw: list[dict], model: ModelSpec, world_size: int) -> list[ReplayRow]:
        rows, seen = [], {}
        for n, r in enumerate(raw, start=2):
            if not r.get("role") or r.get("state") not in _STATE_OUTCOME:
                continue
            where = f"{path} row {n}"
            c = _row(TrialsCsvRow, r, where)
            try:
                lay = Layout(tp=c.tp, pp=c.pp, cp=c.cp, dp=c.dp or 1, sp=c.sp, first=c.first, last=c.last,
                             vpp=c.vpp or 1, recompute_granularity=c.recompute_granularity or "none",
                             recompute_method=c.recompute_method, recompute_num_layers=c.recompute_num_layers,
                             optimizer_cpu_offload=c.optimizer_cpu_offload, max_tokens_per_gpu=c.max_tokens_per_gpu)
            except LayoutError as e:
                raise ReplayTableError(f"{where}: {e}") from None
            outcome = (c.outcome or _STATE_OUTCOME[r["state"]]).lower()
            tps = c.measured_tokens_per_s_per_gpu
            if tps is None and outcome == OK and c.runner == "sim":
                tps = c.predicted_tokens_per_s_per_gpu
            if outcome == OK and tps is None:
                outcome = FAILED
            peak = c.measured_peak_gib
            row = ReplayRow(line=n, layout=lay, outcome=outcome, tokens_per_s_per_gpu=tps, unknown=_TRIALS_CSV_UNKNOWN,
                            step_time_s=c.step_time_s, peak_gib=(peak,) if peak else (),
                            oom_stage=c.predicted_peak_stage if outcome == OOM else None, gpu_hours=c.gpu_hours)
            k = _row_key(lay, model.num_layers, _TRIALS_CSV_UNKNOWN)
            if k in seen and seen[k].outcome != FAILED and row.outcome != FAILED:
                raise ReplayTableError(f"{path}: rows {seen[k].line} and {n} both measured layout {lay.label()}; "
                                       f"a study measures a layout once (a duplicated row?)")
            if k in seen and seen[k].outcome != FAILED and row.outcome == FAILED:
                continue  # a failed re-measurement of a layout the study measured (retries)
            seen[k] = row
        rows = sorted(seen.values(), key=lambda x: x.line)
        if not rows:
            raise ReplayTableError(f"{path}: a trials.csv without measured trials (no row has a role)")
        return rows

    def check(self, spec: TrialSpec) -> list[str]:
        return check(spec.layout, spec.model, spec.cluster.world_size, spec.workload, spec.engine)

    def rerun_command(self, spec: TrialSpec) -> Rerun:
        """The engine's launch (the table holds measurements of it)."""
        return engine_rerun(spec)

    def _execute(self, spec: TrialSpec, trial_dir: Path) -> TrialResult:
        if self._num_layers != spec.model.num_layers:
            self._index(spec.model.num_layers)
        L = spec.model.num_layers
        row = next((r for u in self._unknowns if (r := self._table.get(_row_key(spec.layout, L, u)))), None)
        if row is None:
            return TrialResult(status=FAILED, measured=True,
                               reason=f"layout {spec.layout.label()} not in the table {self.source}")
        w, gpus = spec.workload, spec.cluster.world_size
        if row.outcome == OOM:
            return TrialResult(status=OOM, measured=True, peak_memory_gib=list(row.peak_gib), oom_stage=row.oom_stage,
                               reason=f"out of memory (replayed from {self.source} row {row.line})",
                               gpu_hours=row.gpu_hours or 0.0)
        if row.outcome == FAILED:
            return TrialResult(status=FAILED, measured=True, reason=f"failed (replayed from {self.source} row {row.line})",
                               gpu_hours=row.gpu_hours or 0.0)
        step = row.step_time_s or w.tokens_per_step / (row.tokens_per_s_per_gpu * gpus)
        a, b = w.window
        hours = row.gpu_hours if row.gpu_hours is not None else gpus * w.steps * step / 3600.0
        return TrialResult(status=OK, measured=True, tokens_per_s_per_gpu=row.tokens_per_s_per_gpu, step_time_s=step,
                           step_time_cv_percent=None, step_times_s=[step] * w.steps, peak_memory_gib=list(row.peak_gib),
                           window=(a, b), window_tokens=w.tokens_per_step * (b - a + 1), gpu_hours=hours,
                           extra={"replayed_from": self.source, "row": row.line})
