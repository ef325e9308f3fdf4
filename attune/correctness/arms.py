"""The arms of `attune verify`: training runs of the reference and candidate layouts, their comparison, and the
negative controls (arms and an optimizer that must fail).

Every arm trains on the same rows, seed, hyperparameters and steps through the same runner; only the layout
(or, for a control, the one thing it breaks) differs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from attune.correctness.checks import component_shapes
from attune.correctness.component import run_component_test
from attune.correctness.convergence import Thresholds, compare_curves
from attune.correctness.verdict import ArmRun, ConvergenceCheck, NegativeControl, one_line
from attune.errors import MissingDependency, require
from attune.runners.base import Runner, TrialSpec
from attune.spec.engine import Engine
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec
from attune.torchmodels.data import synthetic_rows

# Seconds before one arm is killed. A 20-step arm of a tiny model takes 20-30 s on 2 CPU cores
# (measured on this project's CI machine); 15 min is a generous cap for bigger recipes.
ARM_TIMEOUT_S = 900.0
# Negative control: the learning-rate factor of the mis-configured arm (the brief's "lr x10").
NEG_LR_FACTOR = 10.0
# Negative control: the broken optimizer of the component test (attune.correctness.component.NEGATIVE_CONTROLS).
NEG_OPTIMIZER = "broken_no_bias_correction"


@dataclass(frozen=True, kw_only=True)
class Arms:
    """What every arm of one verification shares: where, on what and with which runner it trains."""

    runner: Runner
    """The runner that trains every arm."""
    model: ModelSpec
    """The recipe's model."""
    cluster: Cluster
    """The recipe's cluster."""
    engine: Engine
    """The engine the runner trains with."""
    workload: Workload
    """Rows, seed, hyperparameters and steps of every arm."""
    workdir: Path
    """Each arm's trial folder is `workdir/<name>`."""
    timeout_s: float = ARM_TIMEOUT_S
    """Seconds before one arm is killed."""

    def spec(self, layout: Layout, workload: Workload | None = None, *, folder: str | None = None, label: str = "",
             data_path: str | None = None) -> TrialSpec:
        """The trial of one arm; without a folder, a spec to `check` only."""
        return TrialSpec(model=self.model, cluster=self.cluster, layout=layout, workload=workload or self.workload,
                         engine=self.engine, trial_dir=self.workdir / folder if folder else None,
                         timeout_s=self.timeout_s if folder else None, label=label, data_path=data_path)

    def run(self, name: str, layout: Layout, *, label: str, folder: str | None = None,
            workload: Workload | None = None, data_path: str | None = None) -> ArmRun:
        """Train one arm in `workdir/<folder or name>`; a failed arm is a result with its status, not an exception."""
        spec = self.spec(layout, workload, folder=folder or name, label=label, data_path=data_path)
        t0 = time.monotonic()
        res = self.runner.run(spec)
        return ArmRun(name=name, layout=layout, result=res, seconds=time.monotonic() - t0)


def compare_arms(reference: ArmRun, candidate: ArmRun, note: str, thresholds: Thresholds | None = None
                 ) -> ConvergenceCheck:
    """Check 2 on two arms: `compare_curves` of their losses (with ``thresholds``: a numerics class's own, e.g. a
    low-precision candidate's), or a failure naming the arm that did not finish."""
    if not (reference.ok and candidate.ok):
        why = "; ".join(f"{role} arm {a.result.status}: {one_line(a.result.reason)}"
                        for role, a in (("reference", reference), ("candidate", candidate)) if not a.ok)
        return ConvergenceCheck(steps=max(len(reference.result.losses), 1), passed=False, note=f"{note}; {why}")
    cr = compare_curves(reference.result.losses, candidate.result.losses, thresholds)
    return ConvergenceCheck(steps=len(cr.steps), passed=cr.passed, note=note, comparison=cr)


def _arm_control(changed: str, reference: ArmRun, arm: ArmRun) -> NegativeControl:
    conv = compare_arms(reference, arm, "negative control")
    rec = conv.to_record()
    return NegativeControl(
        changed=changed, observed=rec["result"] if arm.ok else "fail", arm=True,
        correlation=rec.get("correlation"), final_loss_difference=rec.get("final_loss_difference"),
        pointwise_failures=rec.get("pointwise_failures"),
        detail=f"arm {arm.result.status} in {arm.seconds:.1f} s" + ("" if arm.ok else f": {one_line(arm.result.reason)}"))


def lr_control(arms: Arms, reference: ArmRun, candidate: Layout) -> tuple[NegativeControl, ArmRun]:
    """The candidate arm with the learning rate (and its floor) x `NEG_LR_FACTOR`: its curve must not match."""
    w = arms.workload
    neg = replace(w, lr=w.lr * NEG_LR_FACTOR, min_lr=w.min_lr * NEG_LR_FACTOR)
    arm = arms.run("negative_lr", candidate, folder="neg-lr", label="negative control lr x10", workload=neg)
    changed = (f"candidate arm with lr x{NEG_LR_FACTOR:g} ({w.lr:g} -> {neg.lr:g}; "
               f"min lr x{NEG_LR_FACTOR:g})")
    return _arm_control(changed, reference, arm), arm


def inverted_mask_rows(model: ModelSpec, workload: Workload, path: Path) -> str:
    """Parquet of the arms' synthetic rows (`synthetic_rows`, as the torch trainer draws them) with the loss mask
    inverted; needs pyarrow (`MissingDependency` naming the `data` extra)."""
    pa = require("pyarrow", "data")
    pq = require("pyarrow.parquet", "data")
    rows = synthetic_rows(workload.steps * workload.global_batch, workload.seq_length, model.vocab, workload.seed)
    pq.write_table(pa.table({"tokens": [[int(t) for t in r] for r in rows.tokens],
                             "loss_mask": [[1 - int(m) for m in r] for r in rows.loss_mask]}), str(path))
    return str(path)


MASK_CHANGED = ("candidate arm with the loss mask inverted (prompt tokens supervised, response tokens not); "
                "same token ids")


def mask_control(arms: Arms, reference: ArmRun, candidate: Layout) -> tuple[NegativeControl, ArmRun | None]:
    """The candidate arm on the same rows with the loss mask inverted: its curve must not match.

    Runs only where attune's torch trainer reads the rows from this machine (the `torch` engine) and pyarrow
    can write them; otherwise the control is recorded as not run.
    """
    path = None
    if arms.engine.attune_trainer:
        try:
            path = inverted_mask_rows(arms.model, arms.workload, arms.workdir / "inverted-mask.parquet")
        except MissingDependency:
            path = None
    if path is None:
        return NegativeControl(changed="inverted loss mask", observed="not run",
                               detail="not feasible: needs the torch runner and pyarrow to write the rows"), None
    arm = arms.run("negative_mask", candidate, folder="neg-mask", label="negative control mask", data_path=path)
    return _arm_control(MASK_CHANGED, reference, arm), arm


def optimizer_control(model: ModelSpec, workload: Workload) -> NegativeControl:
    """The component test of an Adam without bias correction: it must fail."""
    shapes, label = component_shapes(model)
    bad = run_component_test(NEG_OPTIMIZER, shapes, steps=1, lr=workload.lr,
                             betas=(workload.adam_beta1, workload.adam_beta2), weight_decay=workload.weight_decay,
                             shape_label=label)
    return NegativeControl(
        changed=f"component test of an Adam without bias correction ({NEG_OPTIMIZER})",
        observed="pass" if bad.passed else "fail",
        detail=f"worst relative L2 error {bad.worst_error:.3g} ({bad.worst_tensor}) vs bound {bad.bound:.3g} after 1 step")


def negative_controls(arms: Arms, reference: ArmRun, candidate: Layout) -> tuple[list[NegativeControl], list[ArmRun]]:
    """Check 5: lr x10, the inverted loss mask and the broken optimizer; each must FAIL."""
    controls, runs = [], []
    ctl, arm = lr_control(arms, reference, candidate)
    controls.append(ctl)
    runs.append(arm)
    ctl, arm = mask_control(arms, reference, candidate)
    controls.append(ctl)
    if arm is not None:
        runs.append(arm)
    controls.append(optimizer_control(arms.model, arms.workload))
    return controls, runs
