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
    moe = est.model.moe is not None  # MoE: dense and expert parts in separate columns (issue 14)
    cols = ["stage", "layers", "weights", "grads", "optimizer", "activations", "logits", "overhead", "total (GiB)"]
    if moe:
        cols[2:5] = ["dense weights", "dense grads", "dense optimizer", "expert weights", "expert grads",
                     "expert optimizer"]
        cols.insert(cols.index("activations") + 1, "of which expert")
    for c in cols:
        t.add_column(c, justify="right")
    for s in m.stages:
        style = "red" if s.total_gib > m.capacity_gib else None
        row = [str(s.stage), str(s.layers), f"{s.weights_gib:.1f}", f"{s.grads_gib:.1f}", f"{s.optimizer_gib:.1f}"]
        if moe:
            row += [f"{s.expert_weights_gib:.1f}", f"{s.expert_grads_gib:.1f}", f"{s.expert_optimizer_gib:.1f}"]
        row.append(f"{s.activations_gib:.1f}")
        if moe:
            row.append(f"{s.expert_activations_gib:.1f}")
        row += [f"{s.logits_gib:.1f}", f"{s.overhead_gib:.1f}", f"{s.total_gib:.1f}"]
        t.add_row(*row, style=style)
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


def print_explain(est: Estimate, con: Console | None = None) -> None:
    """The predicted step as a sum a profile can be checked against, and each stage's memory overheads."""
    con = con or console()
    p, br = est.perf, est.perf.breakdown
    parts = ("fwd_gemm", "fwd_attention", "fwd_gdn", "fwd_memory", "bwd_gemm", "bwd_attention", "bwd_gdn",
             "bwd_memory", "recompute", "tp_comm", "cp_comm", "pp_comm")
    t = Table(title="one microbatch per stage (ms): compute by kind, recompute, exposed communication")
    for c in ("stage",) + parts + ("total",):
        t.add_column(c.replace("_", " "), justify="right")
    for s in p.stages:
        t.add_row(str(s.stage), *(f"{1e3 * s.parts.get(k, 0.0):.2f}" for k in parts),
                  f"{1e3 * (s.forward_s + s.backward_s):.2f}")
    con.print(t)
    if br is None:
        return
    st = Table(title=f"step (s) on the pace-setting stage {br.critical_stage}, {br.microbatches} microbatches")
    st.add_column("term")
    st.add_column("seconds", justify="right")
    st.add_column("share", justify="right")
    rows = [(f"compute {k.replace('_', ' ')}", v) for k, v in br.compute_s.items() if v]
    rows += [("exposed host launch time (MoE routing sync)" if k == "moe_host" else f"exposed {k.upper()} communication",
              v) for k, v in br.exposed_comm_s.items() if v]
    rows += [("pipeline bubble", br.bubble_s), ("optimizer", br.optimizer_s), ("per-step overhead", br.overhead_s)]
    total = br.total_s
    for name, v in rows:
        st.add_row(name, f"{v:.4f}", f"{100 * v / total:.1f}%")
    st.add_row("total = step time", f"{total:.4f}", f"{p.step_time_s:.4f} s predicted")
    con.print(st)
    mt = Table(title="memory overheads per stage (GiB): allocated and reserved peaks, terms outside the tensors")
    names = sorted({k for s in est.memory.stages for k in s.overheads})
    for c in ["stage", "allocated", "reserved", "device total"] + [n.replace("_", " ") for n in names]:
        mt.add_column(c, justify="right")
    for s in est.memory.stages:
        mt.add_row(str(s.stage), f"{s.allocated_gib:.1f}", f"{s.reserved_gib:.1f}", f"{s.total_gib:.1f}",
                   *(f"{s.overheads.get(n, 0.0):.2f}" for n in names))
    con.print(mt)


def preflight_table(report) -> Table:
    """One table of the slime preflight: node, check, ok / MISSING, what was found."""
    t = Table(title=f"slime preflight: {report.nodes} node(s), "
                    f"{'all checks passed' if report.ok else f'{len(report.failures)} check(s) failed'}")
    for col in ("node", "check", "result", "detail"):
        t.add_column(col, overflow="fold")
    for c in report.checks:
        t.add_row(c.node, c.check, "ok" if c.ok else "[bold red]MISSING[/]", c.detail)
    return t


def models_table(models: list[ModelSpec]) -> Table:
    t = Table(title="bundled models")
    for c in ("name", "family", "layers (full/GDN)", "hidden", "heads/kv", "vocab", "experts (top-k)", "total params",
              "activated params", "active params (MFU)"):
        t.add_column(c, justify="right" if c not in ("name", "family") else "left")
    for m in models:
        s = m.summary()
        moe = m.moe
        t.add_row(m.name, moe.family if moe else m.family,
                  f"{m.num_layers} ({s['full_attention_layers']}/{s['gated_deltanet_layers']})",
                  str(m.hidden), f"{m.heads}/{m.kv_heads}", f"{m.vocab:,}", f"{moe.experts} ({moe.top_k})" if moe else "-",
                  f"{m.total_params:,}", f"{m.activated_params:,}", f"{m.active_params:,}")
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


def calibration_lines(outcome) -> list[str]:
    """``attune calibrate``: per-series MAPE and rank correlation, the refit, unexpressed rows, files."""
    pct = lambda v: "-" if v is None else f"{100 * v:5.1f}%"  # noqa: E731
    lines = [f"corpus {outcome.corpus.directory}: {len(outcome.corpus.rows)} rows, "
             f"{len(outcome.corpus.expressed)} expressed ({len(outcome.predictions)} predicted)"]
    w = max([len(s.series) for s in outcome.scores] + [6])
    lines.append(f"{'series':{w}s}  rows  MAPE    bias    Spearman  layouts  verdicts  components")
    for s in outcome.scores:
        rho = "-" if s.spearman is None else f"{s.spearman:5.2f}"
        ver = f"{s.verdicts_right}/{s.verdicts}" if s.verdicts else "-"
        lines.append(f"{s.series:{w}s}  {s.rows:4d}  {pct(s.mape):6s}  {pct(s.bias):6s}  {rho:8s}  "
                     f"{'varied' if s.varies_layout else 'same':7s}  {ver:8s}  {pct(s.component_mape)}")
    if outcome.moe_transfer:
        lines.append("MoE models (shared MoE coefficients): in-sample MAPE / bias, left out of the MoE fit MAPE / bias")
        lines += [f"  {t['model']:24s} {t['rows']:3d} rows  {pct(t['in_sample_mape'])} {pct(t['in_sample_bias'])}   "
                  f"left out {pct(t['lomo_mape'])} {pct(t['lomo_bias'])}" for t in outcome.moe_transfer]
    if outcome.sweeps:
        lines.append("rank inside each sweep (one model, GPU, precision of a series): rows, layouts, Spearman, "
                     "fastest right, MAPE")
        lines += [f"  {s.series} / {s.model} / {s.gpu} / {s.precision}: {s.rows} rows, {s.layouts} layouts, "
                  f"Spearman {'-' if s.spearman is None else f'{s.spearman:.2f}'}, fastest "
                  f"{'right' if s.best_right else 'wrong'}, MAPE {pct(s.mape).strip()}" for s in outcome.sweeps]
    if outcome.leave_one_series_out:
        lines.append("dense, leave one series out: in-sample MAPE -> left-out MAPE (bias), Spearman, verdicts")
        for t in outcome.leave_one_series_out:
            i, o = t["in_sample"], t["left_out"]
            rho = "-" if o.spearman is None else f"{o.spearman:.2f}"
            ver = f"{o.verdicts_right}/{o.verdicts}" if o.verdicts else "-"
            lines.append(f"  {t['series']:{w}s} {pct(i.mape)} -> {pct(o.mape)} ({pct(o.bias).strip()})  {rho:5s} {ver}")
    if outcome.fit is not None:
        f = outcome.fit
        lines.append(f"refit: cost {f.start_cost:.4g} -> {f.cost:.4g} in {f.evaluations} evaluations ({f.message})")
        for p, v, rel in f.changes():
            lines.append(f"  {p.key:40s} {p.start:10.4g} -> {v:10.4g} ({100 * rel:+6.1f}%)  bounds [{p.lo:g}, {p.hi:g}] {p.unit}")
        lines.append(f"coefficients written to {outcome.data_file}")
    for p in outcome.failures:
        lines.append(f"estimate failed: {p.row.id}: {p.failure}")
    if outcome.stale_names:
        lines.append(f"stale names in the coefficient data file (refit with --fit): {', '.join(outcome.stale_names)}")
    reasons: dict[str, list[str]] = {}
    for r in outcome.unexpressed:
        reasons.setdefault(r.reason or "", []).append(r.id)
    if reasons:
        lines.append(f"not expressed: {len(outcome.unexpressed)} rows")
        for why, ids in sorted(reasons.items(), key=lambda t: -len(t[1])):
            lines.append(f"  {len(ids):3d} {why}: {', '.join(ids[:3])}{', ...' if len(ids) > 3 else ''}")
    lines.append("written: " + ", ".join(str(p) for p in outcome.files))
    return lines
