"""Typed records of `attune verify`: each check's outcome and the verdict that combines them.

The records carry numbers, not prose: `attune.correctness.prose` turns them into the lines the CLI prints,
and `to_record()` / `to_dict()` into the recipe's `correctness` block and `verify.json`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from attune.correctness.component import ComponentResult
from attune.correctness.convergence import ConvergenceResult, round_sig
from attune.recipe.models import Correctness, Recipe, validate_block
from attune.runners.base import TrialResult
from attune.spec.layout import Layout

Status = Literal["verified", "failed"]


def one_line(text: Any) -> str:
    """`text` on one line (whitespace collapsed); "unknown error" when empty."""
    s = " ".join(str(text).split())
    return s if s else "unknown error"


def pass_fail(ok: bool) -> Literal["pass", "fail"]:
    return "pass" if ok else "fail"


@dataclass(frozen=True, kw_only=True)
class ConfigurationCheck:
    """Check 1: the recipe's layout passes the layout rules for its model and GPU count, and lint finds no errors."""

    errors: tuple[str, ...] = ()
    """Rule violations (`layout: ...`) and lint errors outside the allowed prefixes (`lint: path: message`)."""
    allowed_lint_errors: tuple[str, ...] = ()
    """Lint errors under a path verify rewrites (the `correctness` block): reported, not failing."""
    lint_warnings: tuple[str, ...] = ()
    """Lint findings of severity `warning`."""

    @property
    def passed(self) -> bool:
        return not self.errors

    @property
    def result(self) -> Literal["pass", "fail"]:
        return pass_fail(self.passed)

    def to_dict(self) -> dict:
        return {"result": self.result, "errors": list(self.errors), "allowed_lint_errors": list(self.allowed_lint_errors),
                "lint_warnings": list(self.lint_warnings)}


@dataclass(frozen=True, kw_only=True)
class ArmRun:
    """One training run of the check (reference, candidate or a negative-control arm)."""

    name: str
    """Key in `verify.json`'s `arms`: `reference`, `candidate`, `negative_lr`, `negative_mask`."""
    layout: Layout
    """The layout the arm trained with."""
    result: TrialResult
    """What the runner returned."""
    seconds: float
    """Wall time of the arm as seen by verify, s."""

    @property
    def ok(self) -> bool:
        return self.result.status == "ok"

    def to_record(self) -> dict:
        return {"layout": self.layout.label(), "result": self.result.to_dict()}


@dataclass(frozen=True, kw_only=True)
class ConvergenceCheck:
    """Check 2: the candidate arm's loss curve against the reference arm's (`compare_curves`)."""

    steps: int
    """Reference steps compared (at least 1 when an arm failed)."""
    passed: bool
    """Both arms ran and `compare_curves` passed."""
    note: str
    """Which arms ran with what, and why it failed where it did."""
    comparison: ConvergenceResult | None = None
    """The curve comparison; None where an arm did not run to completion."""

    @property
    def correlation(self) -> float | None:
        return round_sig(self.comparison.correlation, 8) if self.comparison else None

    @property
    def final_loss_difference(self) -> float | None:
        return round_sig(self.comparison.final_loss_difference, 3) if self.comparison else None

    @property
    def pointwise_failures(self) -> int | None:
        return self.comparison.pointwise_failures if self.comparison else None

    @property
    def reasons(self) -> list[str]:
        return self.comparison.reasons if self.comparison else [self.note]

    def to_record(self) -> dict:
        """The recipe's `correctness.convergence` block."""
        if self.comparison is not None:
            return self.comparison.to_record(note=self.note)
        return {"steps": self.steps, "result": "fail", "correlation": None, "final_loss_difference": None,
                "pointwise_failures": None, "note": self.note}


@dataclass(frozen=True, kw_only=True)
class ComponentCheck:
    """Check 3: the candidate's optimizer setting against a float64 AdamW after each of a few step counts."""

    config: str
    """`default`, `precision_aware` or `cpu_offload` (`attune.correctness.component.CONFIGS`)."""
    results: tuple[ComponentResult, ...]
    """One result per step count."""
    dates: tuple[str, ...]
    """UTC date each test ran (ISO), as the recipe records it."""

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def to_records(self) -> list[dict]:
        """The recipe's `correctness.component_tests` items."""
        return [dict(r.to_record(test=f"{self.config} Adam against an FP64 reference, {r.steps} step(s) "
                                      f"(component:optimizer)"), date=d)
                for r, d in zip(self.results, self.dates)]


@dataclass(frozen=True, kw_only=True)
class FlagDiff:
    """One flag that differs between the reference and the candidate arm."""

    flag: str
    """The Megatron-LM / slime flag."""
    reference: str | None
    """Its value in the reference arm."""
    candidate: str | None
    """Its value in the candidate arm."""
    cls: str
    """Numerics class: `layout`, `numerics` or `unknown`."""
    requires: tuple[str, ...]
    """Tests the difference needs (`convergence`, `component:optimizer`, ...)."""

    def to_dict(self) -> dict:
        return {"flag": self.flag, "reference": self.reference, "candidate": self.candidate, "class": self.cls,
                "requires": list(self.requires)}


@dataclass(frozen=True, kw_only=True)
class RulesCheck:
    """Check 4: the numerics rules over the arms' flag differences."""

    diffs: tuple[FlagDiff, ...]
    """Flags that differ between the arms."""
    required_tests: tuple[str, ...]
    """Tests the differences require, sorted."""
    unverified_reasons: tuple[str, ...]
    """Required tests that did not run or failed."""
    version: int | str
    """Version of the numerics rules (`numerics_rules.yaml`'s `version`)."""

    def to_dict(self) -> dict:
        return {"diffs": [d.to_dict() for d in self.diffs], "required_tests": list(self.required_tests),
                "unverified_reasons": list(self.unverified_reasons), "version": self.version}


@dataclass(frozen=True, kw_only=True)
class NegativeControl:
    """Check 5 (optional): a deliberately broken arm or optimizer that the checks must FAIL."""

    changed: str
    """What was broken."""
    observed: Literal["pass", "fail", "not run"]
    """What the checks said; `pass` means the check is blind to this breakage."""
    detail: str
    """How it ran (arm status and time, or the component test's numbers, or why it did not run)."""
    correlation: float | None = None
    """Pearson r of the control arm against the reference arm (arm controls)."""
    final_loss_difference: float | None = None
    """Final-loss relative difference against the reference arm (arm controls)."""
    pointwise_failures: int | None = None
    """Point-wise failures against the reference arm (arm controls)."""
    arm: bool = False
    """Whether this control trained an arm (its curve numbers are then recorded, even when None)."""

    expected: Literal["fail"] = "fail"
    """Every negative control is expected to fail."""

    def to_record(self) -> dict:
        """One item of the recipe's `correctness.negative_controls`."""
        out: dict[str, Any] = {"changed": self.changed, "expected": self.expected, "observed": self.observed}
        if self.arm:
            out.update(correlation=self.correlation, final_loss_difference=self.final_loss_difference,
                       pointwise_failures=self.pointwise_failures)
        out["detail"] = self.detail
        return out


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The outcome of verifying one recipe: every check, the arms, and the resulting status."""

    status: Status
    """`verified` when every check passed, else `failed`."""
    summary: str
    """One line: what passed, or every reason it failed."""
    reasons: tuple[str, ...]
    """Why it failed (empty when verified)."""
    configuration: ConfigurationCheck
    """Check 1."""
    layout: Layout
    """The candidate layout (the recipe's)."""
    world_size: int
    """GPUs (or CPU workers) of the recipe's cluster."""
    gpu_type: str
    """The cluster's GPU type key."""
    runner: str
    """Name of the runner that trained the arms."""
    workdir: Path
    """Where the arms' trial folders and `verify.json` are."""
    reference_layout: Layout | None = None
    """The reference arm's layout (None when the configuration check failed)."""
    reference: str | None = None
    """The recipe's `correctness.reference` text."""
    convergence: ConvergenceCheck | None = None
    """Check 2 (None when the configuration check failed)."""
    component: ComponentCheck | None = None
    """Check 3."""
    rules: RulesCheck | None = None
    """Check 4."""
    rules_text: str | None = None
    """The recipe's `correctness.rules` text."""
    negative_controls: tuple[NegativeControl, ...] = ()
    """Check 5 (empty unless asked for)."""
    controls_in_recipe: bool = True
    """Whether the recipe schema accepts `negative_controls`; if not they go to a `verify.json` sidecar."""
    arms: dict[str, ArmRun] = field(default_factory=dict)
    """The arms that ran, by name."""
    stack: dict | None = None
    """The recipe's `stack` block (software versions where the arms ran)."""

    @property
    def passed(self) -> bool:
        return self.status == "verified"

    def correctness_block(self) -> dict:
        """The recipe's `correctness` block."""
        corr: dict[str, Any] = {"result": pass_fail(self.passed), "configuration": self.configuration.result}
        if not self.configuration.passed:
            corr["summary"] = self.summary
            corr["convergence"] = None
            return corr
        corr["reference"] = self.reference
        corr["convergence"] = self.convergence.to_record() if self.convergence else None
        corr["component_tests"] = self.component.to_records() if self.component else []
        corr["rules"] = self.rules_text
        corr["summary"] = self.summary
        if self.negative_controls and self.controls_in_recipe:
            corr["negative_controls"] = [c.to_record() for c in self.negative_controls]
        elif self.negative_controls:
            corr["summary"] = self.summary + "; negative controls: " + "; ".join(
                f"{c.changed}: observed {c.observed}" for c in self.negative_controls)
        return corr

    def sidecar(self) -> dict | None:
        """`verify.json` beside the recipe: the negative controls where the recipe schema has no room for them."""
        if self.negative_controls and not self.controls_in_recipe:
            return {"negative_controls": [c.to_record() for c in self.negative_controls]}
        return None

    def to_dict(self) -> dict:
        """`verify.json` in the work folder: everything verify found, as JSON-ready data."""
        out: dict[str, Any] = {"status": self.status, "correctness": self.correctness_block(), "stack": self.stack,
                               "arms": {k: a.to_record() for k, a in self.arms.items()},
                               "configuration": self.configuration.to_dict(), "workdir": str(self.workdir)}
        if self.configuration.passed:
            out.update(rules=self.rules.to_dict() if self.rules else None,
                       negative_controls=[c.to_record() for c in self.negative_controls], reasons=list(self.reasons))
        if self.sidecar():
            out["sidecar"] = self.sidecar()
        return out


def apply_verdict(recipe: Recipe, verdict: Verdict) -> Recipe:
    """A copy of `recipe` with verify's status, correctness block and stack (the recipe itself is not changed)."""
    update: dict[str, Any] = {"status": verdict.status,
                              "correctness": validate_block(verdict.correctness_block(), Correctness, "correctness")}
    if verdict.stack:
        update["stack"] = dict(verdict.stack)
    return recipe.model_copy(update=update)
