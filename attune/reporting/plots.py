"""The study's PNG plots, drawn with matplotlib's object API (`Figure`; no pyplot, no global backend)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from attune.estimator import estimate
from attune.search.records import TrialRecord, records
from attune.search.tuner import TuneConfig, TuneOutcome

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# resolution of every plot (dots per inch)
DPI = 110
MEMORY_PARTS = ("weights_gib", "grads_gib", "optimizer_gib", "activations_gib", "logits_gib", "overhead_gib")


def _figure(**kw) -> Figure:
    """A matplotlib Figure (matplotlib loads on the first plot: about a second to import, which commands that
    draw nothing do not pay)."""
    from matplotlib.figure import Figure

    return Figure(**kw)


def _save(fig: Figure, out_dir: Path, name: str, title: str, made: list) -> None:
    """Write a figure as out_dir/name (PNG) and record (title, name) for the report."""
    fig.tight_layout()
    fig.savefig(Path(out_dir) / name, dpi=DPI)
    made.append((title, name))


def _best_so_far(meas: list[TrialRecord], kind: str) -> Figure:
    xs, ys, best = [], [], 0.0
    for i, t in enumerate(meas):
        if t.value is not None:
            best = max(best, t.value)
        xs.append(i + 1)
        ys.append(best)
    fig = _figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.step(xs, ys, where="post", label=f"best so far ({kind})")
    ax.scatter([i + 1 for i, t in enumerate(meas) if t.value is not None],
               [t.value for t in meas if t.value is not None], s=14, color="grey", label="trial")
    ax.set_xlabel("measured trial")
    ax.set_ylabel("tokens/s/GPU")
    ax.set_title("Best so far")
    ax.legend()
    return fig


def _memory_by_stage(cfg: TuneConfig, pairs: list[tuple[str, TrialRecord]]) -> Figure:
    fig = _figure(figsize=(6 * len(pairs), 4))
    axes = fig.subplots(1, len(pairs), squeeze=False)
    for ax, (name, t) in zip(axes[0], pairs):
        est = estimate(cfg.model, cfg.cluster, t.to_layout(), cfg.workload, cfg.engine, cfg.coefficients,
                       check_layout=False)
        bottom = [0.0] * len(est.memory.stages)
        for part in MEMORY_PARTS:
            vals = [s.to_dict()["breakdown"][part] for s in est.memory.stages]
            ax.bar([str(s.stage) for s in est.memory.stages], vals, bottom=bottom, label=part.replace("_gib", ""))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.axhline(est.memory.capacity_gib, color="red", linestyle="--", label="capacity")
        ax.set_title(f"{name}: {t.label}", fontsize=9)
        ax.set_xlabel("pipeline stage")
        ax.set_ylabel("GiB per GPU (predicted)")
    axes[0][0].legend(fontsize=7)
    return fig


def _candidates(feas: list[tuple[float, float]], cap: float) -> Figure:
    fig = _figure(figsize=(7, 4))
    ax = fig.subplots()
    ok = [(m, v) for m, v in feas if m <= cap]
    bad = [(m, v) for m, v in feas if m > cap]
    if ok:
        ax.scatter(*zip(*ok), s=8, label="fits")
    if bad:
        ax.scatter(*zip(*bad), s=8, color="lightcoral", label="predicted OOM")
    ax.axvline(cap, color="red", linestyle="--")
    ax.set_xlabel("predicted peak memory (GiB)")
    ax.set_ylabel("predicted tokens/s/GPU")
    ax.set_title("All estimated candidates")
    ax.legend()
    return fig


def _winner_vs_baseline(base: float, best: float, kind: str) -> Figure:
    fig = _figure(figsize=(5, 4))
    ax = fig.subplots()
    vals = [base, best]
    ax.bar(["baseline", "winner"], vals, color=["grey", "tab:green"])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom")
    ax.set_ylabel(f"tokens/s/GPU ({kind})")
    ax.set_title(f"{100 * (vals[1] / vals[0] - 1):+.0f}% over the baseline")
    return fig


def plot_study(cfg: TuneConfig, out: TuneOutcome, out_dir: Path) -> list[tuple[str, str]]:
    """PNG plots beside report.md; returns (title, file name) pairs."""
    kind = "measured" if cfg.runner.capabilities.measured else "predicted"
    recs = records(out.study)
    made: list[tuple[str, str]] = []
    _save(_best_so_far([r for r in recs if r.is_measured], kind), out_dir, "best_so_far.png",
          "Best tokens/s/GPU so far over measured trials", made)
    pairs = [(n, t) for n, t in (("winner", out.best), ("baseline", out.baseline)) if t is not None and t.layout]
    if pairs:
        _save(_memory_by_stage(cfg, pairs), out_dir, "memory_by_stage.png",
              "Predicted memory per stage against capacity: winner and baseline", made)
    feas = [(r.predicted_peak_gib, r.predicted_tokens_per_s_per_gpu) for r in recs
            if r.predicted_tokens_per_s_per_gpu is not None and r.predicted_peak_gib is not None]
    if feas:
        _save(_candidates(feas, cfg.cluster.gpu.capacity_gib), out_dir, "candidates.png",
              "Predicted throughput and memory of every estimated candidate", made)
    if out.best is not None and out.baseline is not None and out.baseline.value is not None:
        _save(_winner_vs_baseline(out.baseline.value, out.best.value, kind), out_dir, "winner_vs_baseline.png",
              "Winner against baseline", made)
    return made
