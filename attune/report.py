"""Human-facing output: the estimate table, and the study report (markdown, CSV, PNG plots)."""

from __future__ import annotations

from .estimate import Estimate


def print_estimate(est: Estimate, source: str = "", ignored: list[str] | None = None, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
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
