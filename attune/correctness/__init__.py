"""Correctness checks that a layout change leaves training numerics unchanged.

- `convergence`: loss-curve comparison of a reference and a candidate arm (five checks after
  Megatron-Bridge `validate_convergence`, strict about NaN and missing steps).
- `component`: optimizer component test of the default, precision-aware and CPU-offloaded AdamW
  against a float64 reference on real layer shapes (needs PyTorch, imported lazily).
- `rules`: which argument differences between two arms need which tests.
- `verify`: `attune verify` as a pipeline of small steps (`verify_recipe -> Verdict`), over `checks`
  (configuration, component, rules), `arms` (reference, candidate and negative-control runs), `verdict`
  (the typed records) and `prose` (the lines reported). Import them from their modules: this package
  exports only the leaf checks, so importing it pulls in no runner or recipe code.
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
