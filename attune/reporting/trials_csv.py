"""trials.csv: one row per trial of the study: its number and state, and the columns derived from its
`TrialRecord` (layout fields, predicted against measured). `write_csv` writes it from the trials directly with the
csv module (the file `trials_frame(study).to_csv(...)` writes, without importing pandas: about a second of the main
command), except that an integer column with empty cells keeps its integers (pandas made the column float and
wrote ``1.0``; the replay runner reads both as 1)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import optuna

from attune.search.records import TrialRecord
from attune.spec.knob_registry import TRIALS_CSV_COLUMNS

# layout fields copied into their own columns (the knob registry's list)
LAYOUT_COLUMNS = TRIALS_CSV_COLUMNS
# the columns of trials.csv, in order
CSV_FIELDS = ["number", "state", "role", "kind", "runner", "label", *LAYOUT_COLUMNS, "predicted_peak_gib",
              "predicted_peak_stage", "measured_peak_gib", "predicted_tokens_per_s_per_gpu",
              "measured_tokens_per_s_per_gpu", "memory_error_percent", "throughput_error_percent", "reason",
              "retry_of", "host", "pid"]


def record_row(r: TrialRecord) -> dict:
    """The trials.csv columns a record contributes (everything but number and state)."""
    lay = r.layout or {}
    return {
        "role": r.role or "", "kind": r.kind or "", "runner": r.runner or "", "label": r.label or "",
        **{k: lay.get(k, "") for k in LAYOUT_COLUMNS},
        "predicted_peak_gib": r.predicted_peak_gib,
        "predicted_peak_stage": "" if r.predicted_peak_stage is None else r.predicted_peak_stage,
        "measured_peak_gib": r.measured_peak_max_gib,
        "predicted_tokens_per_s_per_gpu": r.predicted_tokens_per_s_per_gpu,
        "measured_tokens_per_s_per_gpu": r.measured_throughput,
        "memory_error_percent": r.memory_error_percent,
        "throughput_error_percent": r.throughput_error_percent,
        "reason": r.reason or "",
        # which trial this one re-measures (its worker was killed), and the worker that ran it
        "retry_of": "" if r.retry_of is None else r.retry_of, "host": r.host or "", "pid": "" if r.pid is None else r.pid,
    }


def trials_frame(study: optuna.Study):
    """A pandas DataFrame with the trials.csv columns: number and state from `study.trials_dataframe()`, the
    rest from the trials' records."""
    df = study.trials_dataframe(attrs=("number", "state"), multi_index=False)
    rows = {t.number: record_row(TrialRecord.from_trial(t)) for t in study.get_trials(deepcopy=False)}
    if df.empty:
        return df.reindex(columns=CSV_FIELDS)
    for col in CSV_FIELDS[2:]:
        df[col] = [rows[n][col] for n in df["number"]]
    return df[CSV_FIELDS].astype(object)


def _cell(v) -> str:
    """A cell as pandas' to_csv writes an object column: empty for None and NaN, else str()."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return str(v)


def write_csv(study: optuna.Study, path: Path) -> Path:
    """Write trials.csv (empty cells for missing values, CRLF lines as the csv module writes); returns its path."""
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
            row = {"number": t.number, "state": t.state.name, **record_row(TrialRecord.from_trial(t))}
            w.writerow([_cell(row[c]) for c in CSV_FIELDS])
    return path
