"""What the CLI shows a person: rich tables and plain lines. The only module that formats for a terminal."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from attune.estimator import Estimate
from attune.spec.hardware import GPU
from attune.spec.model import ModelSpec


def console(stderr: bool = False) -> Console:
    """A console that keeps full-width tables when output is piped or captured."""
    con = Console(stderr=stderr)
    if not con.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
        con = Console(width=132, stderr=stderr)
    return con


def print_estimate(est: Estimate, source: str = "", ignored: list[str] | tuple[str, ...] = (),
                   con: Console | None = None) -> None:
    """Per-stage memory (GiB) against capacity, the verdict, and the predicted speed and cost."""
    con = con or console()
    m, p = est.memory, est.perf
    t = Table(title=f"{est.model.name} on {est.cluster.spec} ({est.engine.name}): {est.layout.label()}")
    for c in ["stage", "layers", "weights", "grads", "optimizer", "activations", "logits", "overhead", "total (GiB)"]:
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


def models_table(models: list[ModelSpec]) -> Table:
    t = Table(title="bundled models")
    for c in ("name", "family", "layers (full/GDN)", "hidden", "heads/kv", "vocab", "total params", "active params"):
        t.add_column(c, justify="right" if c not in ("name", "family") else "left")
    for m in models:
        s = m.summary()
        t.add_row(m.name, m.family, f"{m.num_layers} ({s['full_attention_layers']}/{s['gated_deltanet_layers']})",
                  str(m.hidden), f"{m.heads}/{m.kv_heads}", f"{m.vocab:,}", f"{m.total_params:,}", f"{m.active_params:,}")
    return t


def gpus_table(gpus: dict[str, GPU]) -> Table:
    t = Table(title="GPU types")
    for c in ("type", "name", "memory (GiB)", "BF16 dense (TFLOP/s)", "HBM (GB/s)", "NVLink (GB/s/dir)",
              "per node", "USD/GPU-hour"):
        t.add_column(c)
    for k, g in gpus.items():
        t.add_row(k, g.name, f"{g.capacity_gib:.2f}", f"{g.bf16_tflops:g}", f"{g.hbm_gbps:g}", f"{g.nvlink_gbps:g}",
                  str(g.gpus_per_node), f"{g.usd_per_hour:.2f}")
    return t


def gpu_row(key: str, g: GPU) -> dict:
    return {"type": key, "name": g.name, "memory_bytes": g.memory_bytes, "capacity_gib": round(g.capacity_gib, 2),
            "bf16_tflops": g.bf16_tflops, "hbm_gbps": g.hbm_gbps, "nvlink_gbps": g.nvlink_gbps,
            "gpus_per_node": g.gpus_per_node, "internode_gbps": g.internode_gbps,
            "usd_per_hour": g.usd_per_hour, "price_source": g.price_source, "source": g.source}


def format_run_result(res, layout, workload, source: str) -> str:
    """One measured run, in lines with units."""
    lines = [f"layout {layout.label()} ({source}); {workload.global_batch} rows x {workload.seq_length} tokens "
             f"per step, {workload.steps} steps"]
    lines.append(f"status: {res.status}" + (f" ({res.reason})" if res.reason else "")
                 + (" [measured]" if res.measured else " [predicted, nothing ran]"))
    if res.tokens_per_s_per_gpu is not None:
        a, b = res.window or (None, None)
        lines.append(f"throughput: {res.tokens_per_s_per_gpu:,.1f} tokens/s/GPU over steps {a}..{b}")
    if res.step_time_s is not None:
        lines.append(f"step time: {res.step_time_s:.3f} s mean, CV {res.step_time_cv_percent or 0.0:.2f} %")
    if res.peak_memory_gib:
        lines.append("peak memory per stage: " + ", ".join(f"stage {i} {g:.2f} GiB" for i, g in enumerate(res.peak_memory_gib)))
    if res.losses:
        steps = sorted(res.losses)
        lines.append(f"loss: {res.losses[steps[0]]:.4f} (step {steps[0]}) -> {res.losses[steps[-1]]:.4f} (step {steps[-1]})")
    lines.append(f"wall time: {res.wall_s:.1f} s, {res.gpu_hours:.4f} GPU-hours")
    return "\n".join(lines)
