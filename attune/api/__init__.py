"""What the CLI, tests and notebooks call: resolve a target, estimate it, run it once, tune, verify.

Each function takes typed arguments and returns typed records; none prints or exits. The tune and verify
entry points live in their modules (``attune.api.tune.tune``, ``attune.api.verify.verify``) so that the
module names stay importable.
"""

from attune.api.data import build_data
from attune.api.estimate import estimate_target
from attune.api.run import RunOutcome, run_once
from attune.api.target import Target, resolve_target, workload_with
from attune.runners.registry import runner_capabilities

__all__ = ["Target", "resolve_target", "workload_with", "estimate_target", "run_once", "RunOutcome",
           "runner_capabilities", "build_data"]
