"""The checks of `attune verify` that train nothing: configuration, optimizer component test, numerics rules."""

from __future__ import annotations

import datetime as dt
import warnings

from attune.correctness.component import decoder_layer_shapes, describe_shapes, run_component_test
from attune.correctness.rules import diff_args, load_rules, required_tests, unverified_reasons
from attune.correctness.verdict import ComponentCheck, ConfigurationCheck, FlagDiff, RulesCheck
from attune.recipe import Recipe, lint
from attune.spec.engine import Engine
from attune.spec.flags import to_flags
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec
from attune.spec.rules import check

# Lint findings under these recipe paths do not fail the configuration check: verify rewrites them.
ALLOWED_LINT_PREFIXES = ("correctness",)
# Optimizer steps of the component test: the seed recipe's "after one step ... and after three steps".
COMPONENT_STEPS = (1, 3)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".") or path.startswith(prefix + "[")


def configuration_check(recipe: Recipe, model: ModelSpec, world_size: int, engine: Engine, layout: Layout,
                        workload: Workload) -> ConfigurationCheck:
    """Check 1: `attune.spec.rules.check` on the layout, and `attune.recipe.lint` on the recipe.

    Lint errors inside the `correctness` block are allowed (verify rewrites that block); lint also checks that
    the `run` flags agree with `layout`.
    """
    errors = [f"layout: {e}" for e in check(layout, model, world_size, workload, engine)]
    allowed, warns = [], []
    for f in lint(recipe):
        text = f"{f.path}: {f.message}"
        if f.severity != "error":
            warns.append(text)
        elif any(_under(f.path, p) for p in ALLOWED_LINT_PREFIXES):
            allowed.append(text)
        else:
            errors.append(f"lint: {text}")
    return ConfigurationCheck(errors=tuple(errors), allowed_lint_errors=tuple(allowed), lint_warnings=tuple(warns))


def optimizer_config(layout: Layout) -> str:
    """The component-test configuration of the optimizer setting a layout uses."""
    if layout.optimizer_cpu_offload:
        return "cpu_offload"
    if layout.precision_aware_optimizer:
        return "precision_aware"
    return "default"


def component_shapes(model: ModelSpec) -> tuple[dict, str]:
    """Parameter shapes of one of the model's attention decoder layers, and a label describing them. An MoE
    layer (``model.ffn`` 0: every MLP is routed) is its attention, one routed expert's SwiGLU and the router."""
    moe = model.moe
    ffn = moe.expert_ffn if moe is not None else model.ffn
    shapes = decoder_layer_shapes(model.hidden, ffn, model.heads, model.kv_heads, model.head_dim,
                                  qk_norm=bool(model.qk_norm), attention_output_gate=bool(model.attn_output_gate),
                                  bias=bool(model.attn_bias))
    mlp = f"FFN {ffn}"
    if moe is not None:
        shapes["mlp.gate.weight"] = (moe.experts, model.hidden)  # the router (HF name: gate)
        mlp = f"one routed expert of FFN {ffn} and the {moe.experts}-expert router"
    label = (f"one {model.name} attention decoder layer: hidden {model.hidden}, {mlp}, "
             f"{model.heads} heads / {model.kv_heads} KV heads of {model.head_dim}; {describe_shapes(shapes)}")
    return shapes, label


def _today() -> str:
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def component_check(model: ModelSpec, layout: Layout, workload: Workload,
                    steps: tuple[int, ...] = COMPONENT_STEPS) -> ComponentCheck:
    """Check 3: the layout's optimizer setting against a float64 AdamW with the workload's hyperparameters."""
    config = optimizer_config(layout)
    shapes, label = component_shapes(model)
    results = tuple(run_component_test(config, shapes, steps=n, lr=workload.lr,
                                       betas=(workload.adam_beta1, workload.adam_beta2),
                                       weight_decay=workload.weight_decay, offload_fraction=layout.offload_fraction,
                                       shape_label=label)
                    for n in steps)
    return ComponentCheck(config=config, results=results, dates=tuple(_today() for _ in results))


def rules_check(reference: Layout, candidate: Layout, workload: Workload, tests_run: dict[str, bool]) -> RulesCheck:
    """Check 4: which tests the arms' flag differences require, and which of those did not run or failed."""
    rules = load_rules()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unknown flag is classed `unknown` and needs convergence: recorded
        diffs = diff_args(to_flags(reference, workload), to_flags(candidate, workload), rules)
    return RulesCheck(
        diffs=tuple(FlagDiff(flag=d.flag, reference=d.reference, candidate=d.candidate, cls=d.cls,
                             requires=tuple(d.requires)) for d in diffs),
        required_tests=tuple(sorted(required_tests(diffs))),
        unverified_reasons=tuple(unverified_reasons(diffs, tests_run)),
        version=rules.version)
