"""Human-facing output: the estimate table, and the study report (markdown, CSV, PNG plots)."""

from __future__ import annotations

from attune.estimator import Estimate


def print_estimate(est: Estimate, source: str = "", ignored: list[str] | None = None, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    if not con.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        con = Console(width=132)
    m, p = est.memory, est.perf
    t = Table(title=f"{est.model.name} on {est.cluster.spec} ({est.engine.name}): {est.layout.label()}")
    cols = ["stage", "layers", "weights", "grads", "optimizer", "activations", "logits", "overhead", "total (GiB)"]
    for c in cols:
        t.add_column(c, justify="right")
    for s in m.stages:
        style = "red" if s.total_gib > m.capacity_gib else None
        t.add_row(str(s.stage), str(s.layers), f"{s.weights_gib:.1f}", f"{s.grads_gib:.1f}", f"{s.optimizer_gib:.1f}",
                  f"{s.activations_gib:.1f}", f"{s.logits_gib:.1f}", f"{s.overhead_gib:.1f}", f"{s.total_gib:.1f}",
                  style=style)
    con.print(t)
    con.print(f"capacity {m.capacity_gib:.1f} GiB per GPU; {m.verdict()}", highlight=False)
    if m.host_needed_gib:
        con.print(f"CPU-offloaded optimizer: {m.host_needed_gib:.0f} GiB of host memory per node "
                  f"(of {m.host_capacity_gib:.0f} GiB usable)", highlight=False)
    b = m.batch
    con.print(f"microbatch: {b.rows_per_microbatch} row(s), {b.tokens_per_gpu:,} tokens per GPU; "
              f"{b.microbatches} microbatches per DP rank per step", highlight=False)
    con.print(f"predicted: step {p.step_time_s:.2f} s (pipeline {p.pipeline_s:.2f} s incl. bubble {p.bubble_s:.2f} s, "
              f"DP comm {p.dp_comm_s:.2f} s, optimizer {p.optimizer_s:.2f} s, overhead {p.overhead_s:.2f} s); "
              f"{p.tokens_per_s_per_gpu:,.1f} tokens/s/GPU; MFU {p.mfu:.4f}; "
              f"{p.usd_per_million_tokens:.3f} USD per million tokens at {est.cluster.gpu.usd_per_hour:.2f} USD/GPU-hour",
              highlight=False)
    if source:
        con.print(f"layout from: {source}", highlight=False)
    if ignored:
        con.print(f"ignored flags (no effect on memory or speed): {' '.join(ignored)}", highlight=False)


# ---------------------------------------------------------------------- study plots
def _save(fig, out_dir, name: str, title: str, made: list) -> None:
    """Write a figure as out_dir/name (PNG, 110 dpi) and record (title, name) for the report."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    made.append((title, name))


def plot_study(cfg, out, out_dir) -> list[tuple[str, str]]:
    """PNG plots beside report.md; returns (title, file name) pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attune.estimator import estimate
    from attune.spec.layout import Layout

    kind = "measured" if cfg.runner.measured else "predicted"
    trials = out.study.get_trials(deepcopy=False)
    made: list[tuple[str, str]] = []

    # 1. best so far over measured trials
    meas = [t for t in trials if t.user_attrs.get("role")]
    xs, ys, best = [], [], 0.0
    for i, t in enumerate(meas):
        if t.value is not None:
            best = max(best, t.value)
        xs.append(i + 1)
        ys.append(best)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step(xs, ys, where="post", label=f"best so far ({kind})")
    ax.scatter([i + 1 for i, t in enumerate(meas) if t.value is not None],
               [t.value for t in meas if t.value is not None], s=14, color="grey", label="trial")
    ax.set_xlabel("measured trial")
    ax.set_ylabel("tokens/s/GPU")
    ax.set_title("Best so far")
    ax.legend()
    _save(fig, out_dir, "best_so_far.png", "Best tokens/s/GPU so far over measured trials", made)

    # 2. memory breakdown of winner and baseline per stage against capacity
    pairs = [(n, t) for n, t in (("winner", out.best), ("baseline", out.baseline)) if t is not None and "layout" in t.user_attrs]
    if pairs:
        fig, axes = plt.subplots(1, len(pairs), figsize=(6 * len(pairs), 4), squeeze=False)
        parts = ("weights_gib", "grads_gib", "optimizer_gib", "activations_gib", "logits_gib", "overhead_gib")
        for ax, (name, t) in zip(axes[0], pairs):
            est = estimate(cfg.model, cfg.cluster, Layout(**t.user_attrs["layout"]), cfg.workload, cfg.engine,
                           cfg.coefficients, check_layout=False)
            bottom = [0.0] * len(est.memory.stages)
            for part in parts:
                vals = [s.to_dict()["breakdown"][part] for s in est.memory.stages]
                ax.bar([str(s.stage) for s in est.memory.stages], vals, bottom=bottom, label=part.replace("_gib", ""))
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.axhline(est.memory.capacity_gib, color="red", linestyle="--", label="capacity")
            ax.set_title(f"{name}: {t.user_attrs.get('label')}", fontsize=9)
            ax.set_xlabel("pipeline stage")
            ax.set_ylabel("GiB per GPU (predicted)")
        axes[0][0].legend(fontsize=7)
        _save(fig, out_dir, "memory_by_stage.png", "Predicted memory per stage against capacity: winner and baseline", made)

    # 3. predicted throughput of every feasible candidate
    feas = [(t.user_attrs["predicted_peak_gib"], t.user_attrs["predicted_tokens_per_s_per_gpu"])
            for t in trials if "predicted_tokens_per_s_per_gpu" in t.user_attrs and "predicted_peak_gib" in t.user_attrs]
    if feas:
        cap = cfg.cluster.gpu.capacity_gib
        fig, ax = plt.subplots(figsize=(7, 4))
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
        _save(fig, out_dir, "candidates.png", "Predicted throughput and memory of every estimated candidate", made)

    # 4. winner against baseline
    if out.best is not None and out.baseline is not None and out.baseline.value is not None:
        fig, ax = plt.subplots(figsize=(5, 4))
        names = ["baseline", "winner"]
        vals = [out.baseline.value, out.best.value]
        ax.bar(names, vals, color=["grey", "tab:green"])
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom")
        ax.set_ylabel(f"tokens/s/GPU ({kind})")
        ax.set_title(f"{100 * (vals[1] / vals[0] - 1):+.0f}% over the baseline")
        _save(fig, out_dir, "winner_vs_baseline.png", "Winner against baseline", made)
    return made
