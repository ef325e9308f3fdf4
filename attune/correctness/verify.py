"""`attune verify` as a pipeline of small steps: the correctness check that marks a recipe verified or failed.

Steps, in order (`verify_recipe` runs them; each is a function of its own):

1. target: the recipe's model, cluster, layout and workload (`attune.recipe.target.recipe_target`, the one
   recipe parser), on the runner's engine and default workload, run for `steps` steps
   (`Workload.with_steps`, the one window rule).
2. configuration: the layout passes `attune.spec.rules.check` and `attune.recipe.lint` finds no errors
   (`checks.configuration_check`). A failure stops here: nothing trains.
3. arms: a reference arm (the model's baseline layout within the runner's limits, or a given layout) and
   the candidate arm (the recipe's layout) train on the same rows, seed, hyperparameters and steps
   (`arms.Arms`); `arms.compare_arms` compares their loss curves (`convergence.compare_curves`).
4. component test: the candidate's optimizer setting against a float64 AdamW (`checks.component_check`).
5. rules: the numerics rules over the arms' flag differences (`checks.rules_check`).
6. negative controls (optional): lr x10, an inverted loss mask and a broken optimizer must each FAIL
   (`arms.negative_controls`).
7. verdict: a typed `Verdict` (`decide`). Writing files (`write_outputs`) and prose (`prose.report_lines`)
   are separate; progress goes to logging and to an optional callback, one line per finished step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from attune.correctness import prose
from attune.correctness.arms import Arms, compare_arms, negative_controls
from attune.correctness.checks import component_check, configuration_check, rules_check
from attune.correctness.precision_check import precision_component, precision_controls, thresholds_for
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
from attune.errors import UserInputError
from attune.recipe.models import Correctness, Recipe, schema_issues
from attune.recipe.target import RecipeTarget, recipe_target
from attune.runners.base import Runner
from attune.runners.registry import get_runner
from attune.runners.slime import stack_probe
from attune.search.options import VerifyOptions
from attune.spec.baselines import baseline_layout
from attune.spec.layout import Layout
from attune.spec.rules import derive_dp

log = logging.getLogger(__name__)

# Fewest steps of a verification: the convergence check needs 3 comparable points
# (attune.correctness.convergence.MIN_POINTS).
MIN_STEPS = 3
# The stack block's framework line where the arms ran attune's own torch trainer.
TORCH_FRAMEWORK = "attune torch runner (torchrun; gloo on CPU, NCCL on GPU)"

Progress = Callable[[str], None]


class VerifyError(UserInputError):
    """Bad input to verify (unreadable recipe, too few steps, a layout the runner cannot run); exit code 2."""


# ---------------------------------------------------------------------- step 1: the target
def resolve_target(recipe: Recipe, runner: Runner, steps: int) -> RecipeTarget:
    """The recipe's target on the runner's engine, its workload run for `steps` steps."""
    if steps < MIN_STEPS:
        raise VerifyError(f"--steps {steps}: the convergence check needs at least {MIN_STEPS} steps")
    caps = runner.capabilities
    # the layout rules are not checked here: the configuration check reports them as its verdict
    t = recipe_target(recipe, engine=caps.engine, base_workload=caps.default_workload, check_rules=False)
    return replace(t, workload=t.workload.with_steps(steps))


def reference_layout_of(reference_recipe: Recipe, target: RecipeTarget) -> Layout:
    """A reference recipe's layout for the candidate's model, its DP derived for the candidate's cluster."""
    if reference_recipe.model.lower() != target.model.name.lower():
        raise VerifyError(f"reference recipe is for {reference_recipe.model!r}, "
                          f"the candidate for {target.model.name!r}")
    lay = recipe_target(reference_recipe, engine=target.engine.name, gpus=target.cluster.spec).layout
    world = target.cluster.world_size
    return replace(lay, dp=derive_dp(world, lay.tp, lay.pp, lay.cp))


def baseline_reference(target: RecipeTarget, runner: Runner) -> tuple[Layout, str]:
    """The model's baseline layout within the runner's limits, and where it comes from."""
    lay, note = baseline_layout(target.model, target.cluster, target.workload, target.engine,
                                **runner.capabilities.baseline_limits())
    return lay, f"the {target.model.name} baseline layout ({note})"


# ---------------------------------------------------------------------- step 3: arms
def check_arms(arms: Arms, runner: Runner, layouts: dict[str, Layout]) -> None:
    """Refuse, before anything trains, an arm the runner cannot run (one line naming the arm)."""
    for name, lay in layouts.items():
        reasons = runner.check(arms.spec(lay))
        if reasons:
            raise VerifyError(f"{name} arm: {one_line(reasons[0])}")


def arms_note(target: RecipeTarget, runner: Runner, reference: Layout, source: str) -> str:
    w = target.workload
    return (f"candidate arm: this recipe's layout {target.layout.label()}; reference arm: {reference.label()} "
            f"({source}); {runner.name} runner, {w.global_batch} rows of {w.seq_length} tokens "
            f"per step, seed {w.seed}, lr {w.lr:g}")


def reference_text(target: RecipeTarget, reference: Layout, source: str) -> str:
    """The recipe's `correctness.reference`."""
    w = target.workload
    return (f"{reference.label()}: {source}; same rows (seed {w.seed}), "
            f"hyperparameters and {w.steps} steps as the candidate")


# ---------------------------------------------------------------------- step 7: the verdict
def failure_reasons(*, measured: bool, runner: str, recipe: Recipe, convergence: ConvergenceCheck,
                    component: ComponentCheck, rules: RulesCheck, controls: list[NegativeControl],
                    precision=None) -> list[str]:
    """Every reason the recipe is not verified ([] when it is)."""
    reasons: list[str] = []
    if not measured:
        reasons.append(f"the {runner} runner does not measure (nothing ran)")
    if recipe.result.tokens_per_s_per_gpu is None or recipe.result.measured in (None, ""):
        reasons.append("the recipe has no measured result (result.tokens_per_s_per_gpu and result.measured)")
    if not convergence.passed:
        why = "; ".join(convergence.comparison.reasons) if convergence.comparison else convergence.note
        reasons.append(f"convergence check failed ({why})")
    if not component.passed:
        reasons.append(f"component test {component.config} failed")
    if precision is not None and not precision.passed:
        reasons.append(precision.line())
    # the rules' own reasons, less those already given above
    reasons += [r for r in rules.unverified_reasons if not r.startswith("the convergence check")
                and "'component:optimizer', which failed" not in r
                and not (precision is not None and "'component:precision', which failed" in r)]
    reasons += [f"negative control passed, so the check cannot detect it: {c.changed}"
                for c in controls if c.observed == "pass"]
    return reasons


def pass_summary(convergence: ConvergenceCheck, component: ComponentCheck, controls: list[NegativeControl]) -> str:
    n_comp = sum(r.passed for r in component.results)
    s = (f"passed: configuration, convergence (correlation {convergence.correlation}, final loss relative "
         f"difference {convergence.final_loss_difference} over {convergence.steps} steps) and {n_comp} component "
         f"test(s) on this machine")
    if controls:
        s += f"; {sum(c.observed == 'fail' for c in controls)} of {len(controls)} negative controls failed as expected"
    return s


def controls_fit_recipe(controls: list[NegativeControl]) -> bool:
    """Whether the recipe schema accepts the `negative_controls` block (else they go to a sidecar file)."""
    if not controls:
        return True
    block = {"result": "pass", "negative_controls": [c.to_record() for c in controls]}
    return not any(path.startswith("negative_controls") for path, _ in schema_issues(block, Correctness))


def stack_block(target: RecipeTarget) -> dict:
    """The recipe's `stack`: the software versions on this machine (`stack_probe`)."""
    block = {k: v for k, v in stack_probe.stack_block(stack_probe.probe()).items() if v is not None}
    if target.engine.attune_trainer and "framework" not in block:
        block["framework"] = TORCH_FRAMEWORK
    return block


# ---------------------------------------------------------------------- the pipeline
@dataclass(frozen=True, kw_only=True)
class _Context:
    recipe: Recipe
    runner: Runner
    target: RecipeTarget
    workdir: Path
    say: Progress

    def common(self) -> dict:
        t = self.target
        return dict(layout=t.layout, world_size=t.cluster.world_size, gpu_type=t.cluster.type_key,
                    runner=self.runner.name, workdir=self.workdir)


def _reporter(progress: Progress | None) -> Progress:
    def say(line: str) -> None:
        log.info("%s", line)
        if progress is not None:
            progress(line)
    return say


def verify_recipe(recipe: Recipe, runner: Runner | str = VerifyOptions.runner, *, workdir: str | Path,
                  reference_layout: Layout | None = None, reference_source: str | None = None,
                  steps: int = VerifyOptions.steps,
                  negative_control: bool = False, progress: Progress | None = None) -> Verdict:
    """Verify a recipe (not changed) by training its arms in `workdir`; returns the `Verdict`.

    runner: a runner or a registry name. reference_layout: the reference arm's layout (default: the model's
    baseline within the runner's limits), described by `reference_source`. progress: called with one line
    per finished step (also logged at INFO). Raises `VerifyError` for bad input; a failing check is a
    verdict with status `failed`, not an exception.
    """
    if not isinstance(recipe, Recipe):
        raise VerifyError(f"recipe must be a Recipe (attune.recipe.validate_recipe), got {type(recipe).__name__}")
    runner = get_runner(runner) if isinstance(runner, str) else runner
    target = resolve_target(recipe, runner, steps)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = _Context(recipe=recipe, runner=runner, target=target, workdir=workdir, say=_reporter(progress))

    conf = configuration_check(recipe, target.model, target.cluster.world_size, target.engine, target.layout,
                               target.workload)
    for line in prose.configuration_lines(conf, target.layout, target.cluster.world_size, target.cluster.type_key):
        ctx.say(line)
    if not conf.passed:
        return _configuration_failed(ctx, conf)
    if reference_layout is None:
        reference_layout, source = baseline_reference(target, runner)
        reference_source = reference_source or source
    return _run_checks(ctx, conf, reference_layout, reference_source or "the given reference layout",
                       negative_control)


def _configuration_failed(ctx: _Context, conf: ConfigurationCheck) -> Verdict:
    summary = "failed: configuration check: " + "; ".join(conf.errors)
    v = Verdict(status="failed", summary=summary, reasons=(summary,), configuration=conf, **ctx.common())
    ctx.say(prose.result_line(v))
    return v


def _run_checks(ctx: _Context, conf: ConfigurationCheck, reference: Layout, source: str,
                negative_control: bool) -> Verdict:
    t, runner = ctx.target, ctx.runner
    arms = Arms(runner=runner, model=t.model, cluster=t.cluster, engine=t.engine, workload=t.workload,
                workdir=ctx.workdir)
    check_arms(arms, runner, {"reference": reference, "candidate": t.layout})
    runs: dict[str, ArmRun] = {}
    runs["reference"] = arms.run("reference", reference, label="reference")
    ctx.say(prose.arm_line("reference", runs["reference"]))
    runs["candidate"] = arms.run("candidate", t.layout, label="candidate")
    ctx.say(prose.arm_line("candidate", runs["candidate"]))

    # a low-precision candidate (issue 22): its numerics class's tolerance against the bf16 reference, and the
    # component:precision test (attune.correctness.precision_check)
    th = thresholds_for(t.layout)
    conv = compare_arms(runs["reference"], runs["candidate"], arms_note(t, runner, reference, source)
                        + (" (low-precision tolerance: 0.5% point-wise and final)" if th else ""), th)
    ctx.say(prose.convergence_line(conv))
    comp = component_check(t.model, t.layout, t.workload)
    for line in prose.component_lines(comp):
        ctx.say(line)
    prec = precision_component(t.model, t.layout) if th is not None else None
    if prec is not None:
        ctx.say(prec.line())
    tests = {"convergence": conv.passed, "component:optimizer": comp.passed}
    if prec is not None:
        tests["component:precision"] = prec.passed
    rules = rules_check(reference, t.layout, t.workload, tests)
    for line in prose.rules_lines(rules):
        ctx.say(line)

    controls: list[NegativeControl] = []
    if negative_control:
        controls, control_arms = negative_controls(arms, runs["reference"], t.layout)
        runs.update((a.name, a) for a in control_arms)
        if th is not None:  # a wrong scale and an E5M2 forward must fail too
            more, more_arms = precision_controls(arms, runs["reference"], t.layout, t.model)
            controls += more
            runs.update((a.name, a) for a in more_arms)
        for c in controls:
            ctx.say(prose.control_line(c))

    reasons = failure_reasons(measured=runner.capabilities.measured, runner=runner.name, recipe=ctx.recipe,
                              convergence=conv, component=comp, rules=rules, controls=controls, precision=prec)
    v = Verdict(status="failed" if reasons else "verified",
                summary=("failed: " + "; ".join(reasons)) if reasons else pass_summary(conv, comp, controls),
                reasons=tuple(reasons), configuration=conf, reference_layout=reference,
                reference=reference_text(t, reference, source), convergence=conv, component=comp, rules=rules,
                rules_text=prose.rules_text(rules), negative_controls=tuple(controls),
                controls_in_recipe=controls_fit_recipe(controls), arms=runs, stack=stack_block(t),
                **ctx.common())
    ctx.say(prose.result_line(v))
    return v


# ---------------------------------------------------------------------- files
VERIFY_JSON = "verify.json"


def write_outputs(verdict: Verdict, out_dir: str | Path) -> Path:
    """Write `verify.json` (every check's numbers, the arms' results) into `out_dir`; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / VERIFY_JSON
    path.write_text(json.dumps(verdict.to_dict(), indent=2, default=str))
    return path
