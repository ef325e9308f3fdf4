"""``attune estimate``: memory per stage and predicted speed of a resolved target."""

from __future__ import annotations

from attune.api.target import Target
from attune.estimator import Estimate, estimate
from attune.estimator.coefficients import Coefficients


def estimate_target(target: Target, coef: Coefficients | None = None) -> Estimate:
    """The estimate of a target's layout (its rules are checked: a broken rule is a ``LayoutError``)."""
    return estimate(target.model, target.cluster, target.layout, target.workload, target.engine, coef)
