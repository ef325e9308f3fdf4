"""``attune calibrate``: predict every corpus row attune can express, score it, and optionally refit the
global coefficients and write them as the estimator's data file."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from pathlib import Path

import attune
from attune.calibrate.corpus import load_corpus
from attune.calibrate.fit import FitResult, current, moe_transfer_table, write_data
from attune.calibrate.precision_fit import fit_all_stages, groups_markdown, pairs_markdown
from attune.calibrate.ranking import SweepScore, leave_one_series_out_table, loso_markdown, sweeps, sweeps_markdown
from attune.calibrate.report import (
    Prediction,
    SeriesScore,
    default_coefficients,
    markdown,
    predict,
    scores,
    write_csv,
    write_parity_png,
)
from attune.calibrate.rows import Corpus, CorpusRow
from attune.estimator import coefficients as coefficients_module
from attune.estimator.coefficients import DATA_FILE, UNKNOWN_NAMES

__all__ = ["CalibrationOutcome", "calibrate", "package_data_file", "running_from_checkout"]


def running_from_checkout() -> bool:
    """Whether attune is imported from a source checkout (pyproject.toml and .git beside the package)."""
    root = Path(attune.__file__).resolve().parents[1]
    return (root / "pyproject.toml").is_file() and (root / ".git").exists()


def package_data_file() -> Path:
    """The estimator's coefficient data file in the imported package."""
    return Path(coefficients_module.__file__).resolve().parent / DATA_FILE


@dataclass(frozen=True, kw_only=True)
class CalibrationOutcome:
    """What ``calibrate`` predicted and wrote."""

    corpus: Corpus
    """Every row read, expressed or not."""
    predictions: tuple[Prediction, ...]
    """One per expressed row, with the coefficients the package ships (or the refit ones with ``fit``)."""
    scores: tuple[SeriesScore, ...]
    """Per series, then ``overall``."""
    out_dir: Path
    """Where the table and plot were written."""
    files: tuple[Path, ...]
    """The files written: CSV and markdown table, parity PNG (and the data file with ``fit``)."""
    fit: FitResult | None = None
    """The refit, when asked for."""
    data_file: Path | None = None
    """Where the refit coefficients were written."""
    stale_names: tuple[str, ...] = ()
    """Names in the shipped data file that are no coefficient (a renamed field: refit)."""
    moe_transfer: tuple[dict, ...] = ()
    """Per MoE model: in-sample and leave-one-model-out MAPE / bias (``moe_transfer_table``)."""
    sweeps: tuple[SweepScore, ...] = ()
    """The rank inside each sweep (one model, GPU and precision of a series): ``attune.calibrate.ranking``."""
    leave_one_series_out: tuple[dict, ...] = ()
    """Per bf16 dense series, in-sample and left out of the dense fit (with ``leave_one_out``)."""

    @property
    def unexpressed(self) -> list[CorpusRow]:
        return self.corpus.unexpressed

    @property
    def failures(self) -> list[Prediction]:
        return [p for p in self.predictions if p.failure]


def default_out_dir(today: _dt.date | None = None) -> Path:
    day = today or _dt.datetime.now(_dt.timezone.utc).date()
    return Path("reports") / f"calibration-{day.isoformat()}"


def calibrate(corpus_dir: str | Path | None = None, do_fit: bool = False, out_dir: str | Path | None = None,
              data_file: str | Path | None = None, leave_one_out: bool = False) -> CalibrationOutcome:
    """Predict and score the corpus; with ``do_fit`` refit first and write the data file (to ``data_file``,
    else the package's own file when running from a checkout, else ``out_dir/coefficients.yaml``); with
    ``leave_one_out`` also refit the dense stage once per bf16 dense series without it (minutes)."""
    corpus = load_corpus(corpus_dir)
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    result, written, coef_for = None, None, default_coefficients
    if do_fit:
        result = fit_all_stages(corpus)  # dense, MoE, then low precision (issue 22)
        transfer = moe_transfer_table(corpus, result.coefficients)
        target = Path(data_file) if data_file is not None else (
            package_data_file() if running_from_checkout() else out / DATA_FILE)
        written = write_data(result, target, corpus.directory, moe_transfer=transfer)
        coef_for = result.coefficients.for_row
    else:
        transfer = moe_transfer_table(corpus, current())
    preds = predict(corpus, coef_for)
    title = "Calibration against the public corpus" + (" (refit)" if do_fit else "")
    files = [write_csv(preds, out / "calibration.csv"), out / "calibration.md", out / "parity.png"]
    in_sweeps = sweeps(preds)
    loso = leave_one_series_out_table(corpus, preds) if leave_one_out else []
    extra = "\n".join(sweeps_markdown(in_sweeps) + loso_markdown(loso)) + "\n"
    files[1].write_text(markdown(preds, corpus.unexpressed, title, moe_transfer=transfer) + pairs_markdown(preds) + groups_markdown(preds)
                        + extra)
    write_parity_png(preds, files[2])
    if written is not None:
        files.append(written)
    return CalibrationOutcome(corpus=corpus, predictions=tuple(preds), scores=tuple(scores(preds)), out_dir=out,
                              files=tuple(files), fit=result, data_file=written,
                              stale_names=() if do_fit else UNKNOWN_NAMES, moe_transfer=tuple(transfer),
                              sweeps=tuple(in_sweeps), leave_one_series_out=tuple(loso))
