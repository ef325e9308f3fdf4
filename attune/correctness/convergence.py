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

The statistics come from numpy and scipy (`scipy.stats.pearsonr` for r, `scipy.stats.zscore` with
the population standard deviation for the residual outliers, as Bridge's `np.std`); the curves are
aligned on the reference's steps as arrays, with NaN where the candidate lacks a step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence, Union

import numpy as np

from attune.errors import UserInputError

Curve = Union[Mapping[int, float], Sequence[float]]

# Fewest compared points for which a correlation and a residual spread mean anything: Pearson's r
# of two points is always +-1, so 3 is the least that carries information (this project's rule).
MIN_POINTS = 3

# Loss-magnitude bands of the point-wise tolerance: Bridge's `validate_convergence` uses
# golden > 2.0 -> high, 0.5 < golden <= 2.0 -> medium, golden <= 0.5 -> low.
HIGH_LOSS_ABOVE = 2.0
MEDIUM_LOSS_ABOVE = 0.5

# Steps listed in a failure message before "... (N in all)" (this project's choice: one readable line).
STEPS_SHOWN = 8


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Pass thresholds of `compare_curves`.

    Defaults follow Megatron-Bridge `validate_convergence` (HEAD 067f987d). Where the function
    default and the CLI default (`scripts/performance/argument_parser.py`, README "Testing
    arguments") differ, the choice is stated per field.
    """

    correlation: float = 0.95
    """Pearson r must be at least this. Bridge function and CLI default: 0.95."""
    high_loss_tolerance: float = 0.10
    """Point-wise relative tolerance where the reference loss > 2.0. Bridge function/CLI: 0.10."""
    medium_loss_tolerance: float = 0.05
    """... where 0.5 < reference loss <= 2.0. Bridge function/CLI: 0.05."""
    low_loss_tolerance: float = 0.02
    """... where reference loss <= 0.5. Bridge function/CLI: 0.02."""
    final_loss_tolerance: float = 0.05
    """Relative difference of the last compared loss. Bridge function default 0.03, CLI default 0.05.
    We take the CLI value: it is what Bridge's performance pipeline runs with, and the seed recipes
    state their check as "validate_convergence with its pipeline thresholds"."""
    max_outlier_ratio: float = 0.1
    """Largest share of points allowed to fail the point-wise check, and largest share of 3-sigma
    residual outliers. Bridge function/CLI: 0.1 (one parameter for both checks)."""
    outlier_sigma: float = 3.0
    """Residual outlier distance in standard deviations. Bridge function/CLI: 3.0."""
    skip_first_fraction: float = 0.0
    """Share of leading points dropped before checks 2-5. Bridge function default 0.0, CLI default
    0.20. We take 0.0: both arms start from the same weights and see the same rows, so a layout
    change must match from the first step; skipping 20% of a 20-step check would hide exactly the
    early divergence a broken layout shows. Set it explicitly for runs with noisy warm-up."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.skip_first_fraction < 1.0:
            raise UserInputError(f"skip_first_fraction must be in [0, 1), got {self.skip_first_fraction}")
        if self.outlier_sigma <= 0 or self.max_outlier_ratio < 0:
            raise UserInputError(f"outlier_sigma must be > 0 and max_outlier_ratio >= 0 "
                                 f"(got {self.outlier_sigma}, {self.max_outlier_ratio})")

    def tolerance_for(self, reference_loss: float) -> float:
        """Point-wise relative tolerance for a reference loss of this magnitude."""
        return float(self.tolerances(np.array([reference_loss], dtype=np.float64))[0])

    def tolerances(self, reference: np.ndarray) -> np.ndarray:
        """Point-wise relative tolerance per reference loss, by its magnitude band."""
        magnitude = np.abs(reference)
        return np.select([magnitude > HIGH_LOSS_ABOVE, magnitude > MEDIUM_LOSS_ABOVE],
                         [self.high_loss_tolerance, self.medium_loss_tolerance],
                         default=self.low_loss_tolerance)


@dataclass(frozen=True, kw_only=True)
class CheckFailure:
    """One failed check."""

    check: str
    """Its name: `data`, `correlation`, `pointwise`, `final_loss` or `outliers`."""
    reason: str
    """One line with the numbers."""


@dataclass(frozen=True, kw_only=True)
class ConvergenceResult:
    """What `compare_curves` found; `to_record()` is the recipe's `correctness.convergence` block."""

    passed: bool
    """Every check passed."""
    correlation: float | None
    """Pearson r over the compared steps; None where undefined (fewer than `MIN_POINTS`, a constant curve)."""
    final_loss_difference: float | None
    """Relative difference |cand - ref| / |ref| at the last compared step."""
    pointwise_failures: int | None
    """Compared steps beyond their magnitude band's relative tolerance."""
    outliers: int | None
    """Residuals (cand - ref) beyond `outlier_sigma` standard deviations from their mean."""
    steps: tuple[int, ...]
    """Reference steps checked for presence and finiteness."""
    steps_compared: tuple[int, ...]
    """Steps after the warm-up skip, used by checks 2-5."""
    failures: tuple[CheckFailure, ...]
    """The failed checks, in check order."""
    thresholds: Thresholds
    """The thresholds applied."""
    max_pointwise_difference: float | None = None
    """Largest point-wise relative difference."""
    warnings: tuple[str, ...] = field(default_factory=tuple)
    """Non-fatal observations (candidate steps the reference lacks)."""

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
            "correlation": round_sig(self.correlation, 8),
            "final_loss_difference": round_sig(self.final_loss_difference, 3),
            "pointwise_failures": self.pointwise_failures,
            "thresholds": asdict(self.thresholds),
            "note": "; ".join(parts) if parts else None,
        }


def round_sig(value: float | None, digits: int) -> float | None:
    """`value` to `digits` significant digits; None, 0 and non-finite values unchanged."""
    if value is None or not math.isfinite(value) or value == 0.0:
        return value
    return float(f"{value:.{digits}g}")


def _as_step_map(curve: Curve, name: str) -> dict[int, float]:
    """Step -> loss. A sequence is indexed from step 0; mapping keys may be ints or int strings."""
    if isinstance(curve, (str, bytes)):
        raise TypeError(f"{name} curve must be a mapping step->loss or a sequence of losses")
    items = curve.items() if isinstance(curve, Mapping) else enumerate(curve)
    out: dict[int, float] = {}
    for key, value in items:
        step = int(key)
        if step in out:
            raise UserInputError(f"{name} curve has step {step} twice")
        out[step] = float(value) if value is not None else math.nan
    return out


def _describe_steps(steps: Sequence[int], limit: int = STEPS_SHOWN) -> str:
    steps = [int(s) for s in steps]
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f" ... ({len(steps)} in all)" if len(steps) > limit else "")


def pearson(a: np.ndarray, b: np.ndarray) -> float | None:
    """Pearson r (``scipy.stats.pearsonr``), or None where a curve is constant (r is undefined there)."""
    if np.ptp(a) == 0.0 or np.ptp(b) == 0.0:
        return None
    from scipy import stats  # loaded when a verify compares curves (scipy.stats takes about a second to import)

    return float(stats.pearsonr(a, b).statistic)


def relative_difference(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """|cand - ref| / |ref|; 0 where both are equal, inf where only the reference is 0."""
    abs_diff = np.abs(candidate - reference)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(reference != 0.0, abs_diff / np.abs(reference), np.where(abs_diff == 0.0, 0.0, np.inf))


def residual_outliers(residuals: np.ndarray, sigma: float) -> np.ndarray:
    """Mask of residuals whose z-score (``scipy.stats.zscore``, population std) exceeds ``sigma``.

    None are outliers when every residual is equal (zero spread).
    """
    if np.ptp(residuals) == 0.0:
        return np.zeros(len(residuals), dtype=bool)
    from scipy import stats

    return np.abs(stats.zscore(residuals, ddof=0)) > sigma


@dataclass(frozen=True, kw_only=True)
class _Aligned:
    """Both curves on the reference's steps; the candidate is NaN where it lacks a step."""

    steps: np.ndarray
    reference: np.ndarray
    candidate: np.ndarray
    present: np.ndarray
    extra: list[int]


def _align(reference: Curve, candidate: Curve) -> _Aligned:
    ref = _as_step_map(reference, "reference")
    cand = _as_step_map(candidate, "candidate")
    steps = np.array(sorted(ref), dtype=np.int64)
    return _Aligned(
        steps=steps,
        reference=np.array([ref[s] for s in steps.tolist()], dtype=np.float64),
        candidate=np.array([cand.get(s, math.nan) for s in steps.tolist()], dtype=np.float64),
        present=np.array([s in cand for s in steps.tolist()], dtype=bool),
        extra=sorted(set(cand) - set(ref)))


def _data_failures(a: _Aligned) -> list[CheckFailure]:
    """Missing, NaN or infinite losses over every reference step, warm-up included (a NaN during
    warm-up is a broken run, not warm-up noise; Bridge passes all of these silently)."""
    out = []
    missing = a.steps[~a.present]
    if missing.size:
        out.append(CheckFailure(check="data", reason=f"candidate lacks {missing.size} reference step(s): "
                                                      f"{_describe_steps(missing)}"))
    bad_cand = a.steps[a.present & ~np.isfinite(a.candidate)]
    if bad_cand.size:
        out.append(CheckFailure(check="data", reason="candidate loss is NaN or inf at step(s) "
                                                      f"{_describe_steps(bad_cand)}"))
    bad_ref = a.steps[~np.isfinite(a.reference)]
    if bad_ref.size:
        out.append(CheckFailure(check="data", reason="reference loss is NaN or inf at step(s) "
                                                      f"{_describe_steps(bad_ref)}; the reference arm is not usable"))
    return out


def _correlation_check(r: np.ndarray, c: np.ndarray, th: Thresholds) -> tuple[float | None, list[CheckFailure]]:
    corr = pearson(r, c)
    if corr is None:
        if np.array_equal(r, c):
            return 1.0, []  # identical constant curves: perfectly matched
        return None, [CheckFailure(check="correlation", reason="undefined: one curve is constant over the compared steps")]
    if corr < th.correlation:
        return corr, [CheckFailure(check="correlation", reason=f"Pearson r {corr:.6f} < {th.correlation:g}")]
    return corr, []


def compare_curves(reference: Curve, candidate: Curve,
                   thresholds: Thresholds | None = None) -> ConvergenceResult:
    """Compare a candidate loss curve with a reference one; see the module docstring."""
    th = thresholds if thresholds is not None else Thresholds()
    a = _align(reference, candidate)
    steps = tuple(int(s) for s in a.steps)
    failures = _data_failures(a)
    warnings = ([f"candidate steps absent from the reference were ignored: {_describe_steps(a.extra)}"]
                if a.extra else [])

    usable = np.isfinite(a.candidate) & np.isfinite(a.reference)  # NaN marks a missing step too
    n_skip = int(math.floor(int(usable.sum()) * th.skip_first_fraction))
    idx = np.flatnonzero(usable)[n_skip:]
    compared = tuple(int(s) for s in a.steps[idx])
    if len(compared) < MIN_POINTS:
        failures.append(CheckFailure(
            check="data", reason=f"{len(compared)} comparable step(s) after the warm-up skip; "
                                 f"at least {MIN_POINTS} are needed"))
        return ConvergenceResult(passed=False, correlation=None, final_loss_difference=None,
                                 pointwise_failures=None, outliers=None, steps=steps, steps_compared=compared,
                                 failures=tuple(failures), thresholds=th, warnings=tuple(warnings))
    r, c = a.reference[idx], a.candidate[idx]

    # 2. correlation
    corr, fails = _correlation_check(r, c, th)
    failures += fails

    # 3. point-wise relative difference with magnitude-adaptive tolerance
    rel = relative_difference(r, c)
    n_violating = int(np.count_nonzero(rel > th.tolerances(r)))
    if n_violating / len(compared) > th.max_outlier_ratio:
        worst = [compared[i] for i in np.argsort(-rel)[:3]]
        failures.append(CheckFailure(
            check="pointwise", reason=f"{n_violating} of {len(compared)} steps beyond their relative "
                                      f"tolerance (allowed share {th.max_outlier_ratio:g}); worst at steps "
                                      f"{_describe_steps(worst)} with {float(rel.max()):.4g}"))

    # 4. final loss
    final_diff = float(rel[-1])
    if final_diff > th.final_loss_tolerance:
        failures.append(CheckFailure(
            check="final_loss", reason=f"relative difference {final_diff:.4g} at step {compared[-1]} > "
                                       f"{th.final_loss_tolerance:g}"))

    # 5. residual outliers
    outlier_mask = residual_outliers(c - r, th.outlier_sigma)
    n_outliers = int(np.count_nonzero(outlier_mask))
    if n_outliers / len(compared) > th.max_outlier_ratio:
        at = [compared[i] for i in np.flatnonzero(outlier_mask)]
        failures.append(CheckFailure(
            check="outliers", reason=f"{n_outliers} of {len(compared)} residuals beyond "
                                     f"{th.outlier_sigma:g} sigma (allowed share {th.max_outlier_ratio:g}) "
                                     f"at steps {_describe_steps(at)}"))

    return ConvergenceResult(
        passed=not failures, correlation=corr, final_loss_difference=final_diff,
        pointwise_failures=n_violating, outliers=n_outliers, steps=steps, steps_compared=compared,
        failures=tuple(failures), thresholds=th, max_pointwise_difference=float(rel.max()),
        warnings=tuple(warnings))
