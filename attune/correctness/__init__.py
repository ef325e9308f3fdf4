"""Correctness checks that a layout change leaves training numerics unchanged.

- `convergence`: loss-curve comparison of a reference and a candidate arm (five checks after
  Megatron-Bridge `validate_convergence`, strict about NaN and missing steps).
- `component`: optimizer component test of the default, precision-aware and CPU-offloaded AdamW
  against a float64 reference on real layer shapes (needs PyTorch, imported lazily).
- `rules`: which argument differences between two arms need which tests.
"""

from attune.correctness.convergence import (
    CheckFailure,
    ConvergenceResult,
    Thresholds,
    compare_curves,
)
from attune.correctness.rules import (
    ArgDiff,
    Rules,
    UnknownArgumentWarning,
    diff_args,
    load_rules,
    required_tests,
    unverified_reasons,
)

__all__ = [
    "ArgDiff",
    "CheckFailure",
    "ConvergenceResult",
    "Rules",
    "Thresholds",
    "UnknownArgumentWarning",
    "compare_curves",
    "diff_args",
    "load_rules",
    "required_tests",
    "unverified_reasons",
]
