"""Loss-curve convergence check between a reference arm and a candidate arm.

Two training runs that differ only in layout (TP, PP, recompute, offload...) and see the same rows
in the same order must produce the same loss curve up to reduction-order noise. `compare_curves`
decides that with five checks modelled on Megatron-Bridge's `validate_convergence`
(`scripts/performance/utils/evaluate.py`, HEAD 067f987d; summarised in
shared/reference/slime-and-qwen.md section 5), re-implemented here:

1. drop the first `skip_first_fraction` of the compared steps (warm-up);
2. Pearson correlation of the two curves >= `correlation`;
3. point-wise relative difference |cand - ref| / |ref| within a tolerance chosen by the magnitude
   of the reference loss; at most `max_outlier_ratio` of the points may exceed it;
4. final-loss relative difference <= `final_loss_tolerance`;
5. residuals (cand - ref) further than `outlier_sigma` standard deviations from their mean: at most
   `max_outlier_ratio` of the points.

Unlike Bridge, this check is strict about broken data. Bridge aligns the current run to the golden
steps and fills missing steps with NaN; NaN makes every comparison false, so a missing step or a
NaN loss never fails its point-wise, final-loss or outlier checks, and a NaN correlation passes
`correlation < threshold`. Here a missing step, a NaN or an infinite loss FAILS with a reason, and
so does a curve with fewer than `MIN_POINTS` points.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence, Union

import numpy as np

Curve = Union[Mapping[int, float], Sequence[float]]

# Fewest compared points for which a correlation and a residual spread mean anything: Pearson's r
# of two points is always +-1, so 3 is the least that carries information (this project's rule).
MIN_POINTS = 3

# Loss-magnitude bands of the point-wise tolerance: Bridge's `validate_convergence` uses
# golden > 2.0 -> high, 0.5 < golden <= 2.0 -> medium, golden <= 0.5 -> low.
HIGH_LOSS_ABOVE = 2.0
MEDIUM_LOSS_ABOVE = 0.5


@dataclass(frozen=True)
class Thresholds:
    """Pass thresholds of `compare_curves`.

    Defaults follow Megatron-Bridge `validate_convergence` (HEAD 067f987d). Where the function
    default and the CLI default (`scripts/performance/argument_parser.py`, README "Testing
    arguments") differ, the choice is stated per field.
    """

    # Pearson r must be at least this. Bridge function and CLI default: 0.95.
    correlation: float = 0.95
    # Point-wise relative tolerance where the reference loss > 2.0. Bridge function/CLI: 0.10.
    high_loss_tolerance: float = 0.10
    # ... where 0.5 < reference loss <= 2.0. Bridge function/CLI: 0.05.
    medium_loss_tolerance: float = 0.05
    # ... where reference loss <= 0.5. Bridge function/CLI: 0.02.
    low_loss_tolerance: float = 0.02
    # Relative difference of the last compared loss. Bridge function default 0.03, CLI default
    # 0.05. We take the CLI value: it is what Bridge's performance pipeline runs with, and the
    # seed recipes state their check as "validate_convergence with its pipeline thresholds".
    final_loss_tolerance: float = 0.05
    # Largest share of points allowed to fail the point-wise check, and largest share of 3-sigma
    # residual outliers. Bridge function/CLI: 0.1 (one parameter for both checks).
    max_outlier_ratio: float = 0.1
    # Residual outlier distance in standard deviations. Bridge function/CLI: 3.0.
    outlier_sigma: float = 3.0
    # Share of leading points dropped before checks 2-5. Bridge function default 0.0, CLI default
    # 0.20. We take 0.0: both arms start from the same weights and see the same rows, so a layout
    # change must match from the first step; skipping 20% of a 20-step check would hide exactly
    # the early divergence a broken layout shows. Set it explicitly for runs with noisy warm-up.
    skip_first_fraction: float = 0.0

    def tolerance_for(self, reference_loss: float) -> float:
        """Point-wise relative tolerance for a reference loss of this magnitude."""
        magnitude = abs(reference_loss)
        if magnitude > HIGH_LOSS_ABOVE:
            return self.high_loss_tolerance
        if magnitude > MEDIUM_LOSS_ABOVE:
            return self.medium_loss_tolerance
        return self.low_loss_tolerance


@dataclass(frozen=True)
class CheckFailure:
    """One failed check: its name (`data`, `correlation`, `pointwise`, `final_loss`, `outliers`)."""

    check: str
    reason: str


@dataclass(frozen=True)
class ConvergenceResult:
    passed: bool
    correlation: float | None
    final_loss_difference: float | None  # relative, |cand - ref| / |ref| at the last compared step
    pointwise_failures: int | None
    outliers: int | None
    steps: tuple[int, ...]  # reference steps checked for presence and finiteness
    steps_compared: tuple[int, ...]  # steps after the warm-up skip, used by checks 2-5
    failures: tuple[CheckFailure, ...]
    thresholds: Thresholds
    max_pointwise_difference: float | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def reasons(self) -> list[str]:
        return [f"{f.check}: {f.reason}" for f in self.failures]

    def to_record(self, note: str | None = None) -> dict:
        """The `correctness.convergence` block of a recipe (see the seed recipes)."""
        parts = []
        if note:
            parts.append(note)
        skipped = len(self.steps) - len(self.steps_compared)
        if skipped:
            parts.append(f"first {skipped} of {len(self.steps)} steps skipped as warm-up")
        if self.outliers is not None:
            parts.append(f"{self.outliers} residual outlier(s) beyond "
                         f"{self.thresholds.outlier_sigma:g} sigma")
        parts.extend(self.reasons)
        return {
            "steps": len(self.steps),
            "result": "pass" if self.passed else "fail",
            "correlation": _round_sig(self.correlation, 8),
            "final_loss_difference": _round_sig(self.final_loss_difference, 3),
            "pointwise_failures": self.pointwise_failures,
            "thresholds": asdict(self.thresholds),
            "note": "; ".join(parts) if parts else None,
        }


def _round_sig(value: float | None, digits: int) -> float | None:
    if value is None or not math.isfinite(value) or value == 0.0:
        return value
    return float(f"{value:.{digits}g}")


def _as_step_map(curve: Curve, name: str) -> dict[int, float]:
    """Step -> loss. A sequence is indexed from step 0; mapping keys may be ints or int strings."""
    if isinstance(curve, Mapping):
        out: dict[int, float] = {}
        for key, value in curve.items():
            step = int(key)
            if step in out:
                raise ValueError(f"{name} curve has step {step} twice")
            out[step] = float(value) if value is not None else math.nan
        return out
    if isinstance(curve, (str, bytes)):
        raise TypeError(f"{name} curve must be a mapping step->loss or a sequence of losses")
    return {i: (float(v) if v is not None else math.nan) for i, v in enumerate(curve)}


def _describe_steps(steps: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f" ... ({len(steps)} in all)" if len(steps) > limit else "")


def _pearson(a: np.ndarray, b: np.ndarray) -> float | None:
    """Pearson r, or None where a curve has zero variance (r is undefined there)."""
    da = a - a.mean()
    db = b - b.mean()
    denom = math.sqrt(float(np.dot(da, da)) * float(np.dot(db, db)))
    if denom == 0.0:
        return None
    return float(np.dot(da, db) / denom)


def compare_curves(reference: Curve, candidate: Curve,
                   thresholds: Thresholds | None = None) -> ConvergenceResult:
    """Compare a candidate loss curve with a reference one; see the module docstring."""
    th = thresholds if thresholds is not None else Thresholds()
    if not 0.0 <= th.skip_first_fraction < 1.0:
        raise ValueError(f"skip_first_fraction must be in [0, 1), got {th.skip_first_fraction}")
    ref = _as_step_map(reference, "reference")
    cand = _as_step_map(candidate, "candidate")
    steps = tuple(sorted(ref))
    failures: list[CheckFailure] = []
    warnings: list[str] = []

    # Data integrity over every reference step, warm-up included: a NaN during warm-up is a
    # broken run, not warm-up noise. (Bridge passes all of these silently; see module docstring.)
    missing = [s for s in steps if s not in cand]
    if missing:
        failures.append(CheckFailure(
            "data", f"candidate lacks {len(missing)} reference step(s): {_describe_steps(missing)}"))
    bad_cand = [s for s in steps if s in cand and not math.isfinite(cand[s])]
    if bad_cand:
        failures.append(CheckFailure(
            "data", "candidate loss is NaN or inf at step(s) "
                    f"{_describe_steps(bad_cand)}"))
    bad_ref = [s for s in steps if not math.isfinite(ref[s])]
    if bad_ref:
        failures.append(CheckFailure(
            "data", "reference loss is NaN or inf at step(s) "
                    f"{_describe_steps(bad_ref)}; the reference arm is not usable"))
    extra = sorted(set(cand) - set(ref))
    if extra:
        warnings.append(f"candidate steps absent from the reference were ignored: "
                        f"{_describe_steps(extra)}")

    usable = [s for s in steps if s in cand and math.isfinite(cand[s]) and math.isfinite(ref[s])]
    n_skip = int(math.floor(len(usable) * th.skip_first_fraction))
    compared = tuple(usable[n_skip:])
    if len(compared) < MIN_POINTS:
        failures.append(CheckFailure(
            "data", f"{len(compared)} comparable step(s) after the warm-up skip; "
                    f"at least {MIN_POINTS} are needed"))
        return ConvergenceResult(False, None, None, None, None, steps, compared,
                                 tuple(failures), th, None, tuple(warnings))

    r = np.array([ref[s] for s in compared], dtype=np.float64)
    c = np.array([cand[s] for s in compared], dtype=np.float64)

    # 2. correlation
    corr = _pearson(r, c)
    if corr is None:
        if not np.array_equal(r, c):
            failures.append(CheckFailure(
                "correlation", "undefined: one curve is constant over the compared steps"))
        else:
            corr = 1.0  # identical constant curves: perfectly matched
    elif corr < th.correlation:
        failures.append(CheckFailure(
            "correlation", f"Pearson r {corr:.6f} < {th.correlation:g}"))

    # 3. point-wise relative difference with magnitude-adaptive tolerance
    abs_diff = np.abs(c - r)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(r != 0.0, abs_diff / np.abs(r), np.where(abs_diff == 0.0, 0.0, np.inf))
    tol = np.array([th.tolerance_for(x) for x in r])
    violating = rel > tol
    n_violating = int(violating.sum())
    if n_violating / len(compared) > th.max_outlier_ratio:
        worst = [compared[i] for i in np.argsort(-rel)[:3]]
        failures.append(CheckFailure(
            "pointwise", f"{n_violating} of {len(compared)} steps beyond their relative "
                         f"tolerance (allowed share {th.max_outlier_ratio:g}); worst at steps "
                         f"{_describe_steps(worst)} with {float(rel.max()):.4g}"))

    # 4. final loss
    final_diff = float(rel[-1])
    if final_diff > th.final_loss_tolerance:
        failures.append(CheckFailure(
            "final_loss", f"relative difference {final_diff:.4g} at step {compared[-1]} > "
                          f"{th.final_loss_tolerance:g}"))

    # 5. residual outliers
    resid = c - r
    spread = float(resid.std())  # population std, as numpy's default
    if spread > 0.0:
        outlier_mask = np.abs(resid - resid.mean()) > th.outlier_sigma * spread
    else:
        outlier_mask = np.zeros(len(compared), dtype=bool)
    n_outliers = int(outlier_mask.sum())
    if n_outliers / len(compared) > th.max_outlier_ratio:
        at = [compared[i] for i in np.nonzero(outlier_mask)[0]]
        failures.append(CheckFailure(
            "outliers", f"{n_outliers} of {len(compared)} residuals beyond "
                        f"{th.outlier_sigma:g} sigma (allowed share {th.max_outlier_ratio:g}) "
                        f"at steps {_describe_steps(at)}"))

    return ConvergenceResult(
        passed=not failures,
        correlation=corr,
        final_loss_difference=final_diff,
        pointwise_failures=n_violating,
        outliers=n_outliers,
        steps=steps,
        steps_compared=compared,
        failures=tuple(failures),
        thresholds=th,
        max_pointwise_difference=float(rel.max()),
        warnings=tuple(warnings),
    )
