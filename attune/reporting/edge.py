"""report.md's memory-edge section (issue 20): which real OOM (or fit) led to which edge step, and the winner's
per-stage memory margin against its measured peaks."""

from __future__ import annotations

from attune.search.tuner import TuneConfig, TuneOutcome


def edge_section(cfg: TuneConfig, out: TuneOutcome) -> list[str]:
    """The '## Memory edge' lines (none when the study took no edge step and the winner has no measured peaks)."""
    steps = out.study.user_attrs.get("edge_steps") or []
    best = out.best
    peaks = best.measured_peak_gib if best is not None and best.measured else None
    if not steps and not peaks:
        return []
    cap = cfg.cluster.gpu.capacity_gib
    L = ["## Memory edge\n"]
    if steps:
        L += ["Edge steps (`attune.search.edge`): after a real OOM, the cheapest change taking memory off the stage "
              "that ran out; after the best fit, the step toward less recompute when the model says it pays.\n",
              "| after trial | layout | why | step | trial | to | P(fit) | outcome | tokens/s/GPU |",
              "|---|---|---|---|---|---|---|---|---|"]
        for s in steps:
            v = s.get("tokens_per_s_per_gpu")
            L.append(f"| {s['after_trial']} | {s['from']} | {s['why']} | {s['kind']} | {s['trial']} | {s['to']} | "
                     f"{s['p_fit']:.2f} | {s.get('outcome') or '-'} | {'-' if v is None else f'{v:,.1f}'} |")
        L.append("")
    if peaks:
        pred = best.predicted_stage_gib or []
        L += [f"Winner **{best.label}**: memory margin per stage against its measured peaks "
              f"(capacity {cap:.1f} GiB).\n", "| stage | measured peak GiB | predicted GiB | margin GiB |",
              "|---|---|---|---|"]
        for s, p in enumerate(peaks):
            L.append(f"| {s} | {p:.2f} | {pred[s]:.2f} | {cap - p:.2f} |" if s < len(pred) else
                     f"| {s} | {p:.2f} | - | {cap - p:.2f} |")
        L.append("")
    return L
