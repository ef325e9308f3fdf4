"""The lines `attune verify` reports, one function per check, from the typed records (no I/O here)."""

from __future__ import annotations

from attune.correctness.verdict import (
    ArmRun,
    ComponentCheck,
    ConfigurationCheck,
    ConvergenceCheck,
    NegativeControl,
    RulesCheck,
    Verdict,
    one_line,
)
from attune.spec.layout import Layout


def configuration_lines(conf: ConfigurationCheck, layout: Layout, world_size: int, gpu_type: str) -> list[str]:
    lines = [f"configuration: {conf.result} (layout {layout.label()} on {world_size} x {gpu_type}; "
             f"{len(conf.errors)} error(s), {len(conf.allowed_lint_errors)} allowed lint error(s), "
             f"{len(conf.lint_warnings)} lint warning(s))"]
    lines += [f"  error: {e}" for e in conf.errors]
    lines += [f"  allowed (verify rewrites correctness): {e}" for e in conf.allowed_lint_errors]
    return lines


def arm_line(role: str, arm: ArmRun) -> str:
    """`reference arm TP1 PP2 ...: ok in 21.3 s; 1,234.5 tokens/s/GPU, loss 6.9 -> 4.1`."""
    res = arm.result
    line = f"{role} arm {arm.layout.label()}: {res.status} in {arm.seconds:.1f} s"
    if not arm.ok:
        return line + f" ({one_line(res.reason)})"
    losses = list(res.losses.values())
    if losses:
        line += f"; {res.tokens_per_s_per_gpu:,.1f} tokens/s/GPU, loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    return line


def convergence_line(conv: ConvergenceCheck) -> str:
    failed = conv.comparison is not None and not conv.comparison.passed
    return (f"convergence: {'pass' if conv.passed else 'fail'} over {conv.steps} steps: correlation {conv.correlation}, "
            f"final loss relative difference {conv.final_loss_difference}, pointwise failures {conv.pointwise_failures}"
            + (f" ({'; '.join(conv.comparison.reasons)})" if failed else ""))


def component_lines(comp: ComponentCheck) -> list[str]:
    return [f"component test {comp.config}, {r.steps} step(s): {'pass' if r.passed else 'fail'}: worst relative L2 "
            f"error {r.worst_error:.3g} ({r.worst_tensor}) vs bound {r.bound:.3g}" for r in comp.results]


def rules_lines(rules: RulesCheck) -> list[str]:
    return ([f"rules: {len(rules.diffs)} differing flag(s); required {', '.join(rules.required_tests)}; "
             f"{len(rules.unverified_reasons)} unverified reason(s)"]
            + [f"  unverified: {r}" for r in rules.unverified_reasons])


def rules_text(rules: RulesCheck) -> str:
    """The recipe's `correctness.rules` text."""
    flags = ", ".join(f"{d.flag} {d.cls}" for d in rules.diffs) or "none"
    return (f"argument classes of attune/correctness/numerics_rules.yaml (version {rules.version}): "
            f"{len(rules.diffs)} flag difference(s) between the arms ({flags}); required tests: "
            f"{', '.join(rules.required_tests)}; 'convergence' by attune.correctness.compare_curves "
            f"(Megatron-Bridge validate_convergence thresholds)")


def control_line(c: NegativeControl) -> str:
    nums = ""
    if c.correlation is not None or c.final_loss_difference is not None:
        nums = f": correlation {c.correlation}, final loss relative difference {c.final_loss_difference}"
    return f"negative control: {c.changed}: expected fail, observed {c.observed}{nums}"


def result_line(verdict: Verdict) -> str:
    corr = verdict.correctness_block()
    return f"result: {corr['result']}: {corr['summary']}"


def report_lines(verdict: Verdict) -> list[str]:
    """Every line of the verification, in check order (what the CLI prints as the checks complete)."""
    lines = configuration_lines(verdict.configuration, verdict.layout, verdict.world_size, verdict.gpu_type)
    if verdict.configuration.passed:
        for role in ("reference", "candidate"):
            if role in verdict.arms:
                lines.append(arm_line(role, verdict.arms[role]))
        if verdict.convergence is not None:
            lines.append(convergence_line(verdict.convergence))
        if verdict.component is not None:
            lines += component_lines(verdict.component)
        if verdict.rules is not None:
            lines += rules_lines(verdict.rules)
        lines += [control_line(c) for c in verdict.negative_controls]
    lines.append(result_line(verdict))
    return lines
