"""`attune verify`: the correctness check of a recipe; marks it verified or failed.

Checks, in order (each printed with its numbers):

1. configuration: the recipe's `layout` passes `attune.layout.check` for its model and GPU count, and
   `attune.recipe.lint` finds no errors (errors inside the `correctness` block are allowed and
   reported: verify rewrites that block). Lint also checks that the `run` flags agree with `layout`.
2. convergence: a reference arm (the model's baseline layout adapted to the runner, or
   `--reference RECIPE`'s layout) and the candidate arm (the recipe's layout) train on the same rows,
   seed, hyperparameters and steps; `compare_curves` compares their losses.
3. component test: the optimizer setting the candidate uses (precision-aware, CPU offload or the
   default) against a float64 AdamW on one of the model's decoder layers, after 1 and 3 steps.
4. rules: `diff_args` between the arms' flags; a difference whose required test did not run or
   failed leaves the recipe unverified.
5. negative controls (optional): lr x10, an inverted loss mask and an optimizer without bias
   correction must each FAIL; a control that passes means the check is blind and fails the recipe.

`verify_recipe` is the library entry; `run_verify` the CLI one (exit 0 pass, 1 fail; bad input
raises `VerifyError`, a ValueError the CLI turns into exit 2 with one line).
"""

from __future__ import annotations

from attune.errors import UserInputError

import datetime as dt
import json
import math
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from attune.spec.layout import Layout, Workload
from attune.errors import LayoutError
from attune.spec.rules import check, derive_dp
from attune.recipe.codec import from_recipe_blocks
from attune.spec.flags import to_flags

# Arms of the torch runner use the recipe's workload; without one, the small CPU workload of
# `attune tune --runner torch` (attune/search/tune.py build_config: 256-token rows, batch 8).
TORCH_DEFAULT_WORKLOAD = Workload(seq_length=256, global_batch=8, steps=20, window=(5, 19), lr=3e-3, min_lr=3e-4)
# Seconds before one arm is killed. A 20-step arm of a tiny model takes 20-30 s on 2 CPU cores
# (measured on this project's CI machine); 15 min is a generous cap for bigger recipes.
ARM_TIMEOUT_S = 900.0
# Optimizer steps of the component test: the seed recipe's "after one step ... and after three steps".
COMPONENT_STEPS = (1, 3)
# Negative control: the learning-rate factor of the mis-configured arm (the brief's "lr x10").
NEG_LR_FACTOR = 10.0
# Lint findings under these paths do not fail the configuration check: verify rewrites them.
ALLOWED_LINT_PREFIXES = ("correctness",)
# Run-block flags that set the arms' optimizer hyperparameters (Megatron-LM names) -> Workload field.
_RUN_HYPER_FLAGS = {"--lr": "lr", "--min-lr": "min_lr", "--lr-warmup-fraction": "warmup_fraction",
                    "--weight-decay": "weight_decay", "--adam-beta1": "adam_beta1", "--adam-beta2": "adam_beta2",
                    "--seed": "seed"}


class VerifyError(UserInputError):
    """Bad input to verify (missing file, unreadable recipe, a layout the runner cannot run)."""


def _one_line(text: str) -> str:
    s = " ".join(str(text).split())
    return s if s else "unknown error"


def _today() -> str:
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def _round(x: float | None, digits: int = 6) -> float | None:
    if x is None or not isinstance(x, (int, float)) or not math.isfinite(x) or x == 0:
        return x
    return float(f"{x:.{digits}g}")


# ---------------------------------------------------------------------- recipe -> arms
def target_of(recipe: dict, runner_name: str):
    """(model, cluster, engine) of a recipe's `model` and `gpu` blocks."""
    from attune.spec.engine import get_engine
    from attune.spec.hardware import parse_cluster
    from attune.spec.model import load_model

    if not isinstance(recipe, dict):
        raise VerifyError("recipe must be a mapping")
    for key in ("model", "gpu", "layout", "workload"):
        if not recipe.get(key):
            raise VerifyError(f"recipe has no '{key}' block")
    try:
        model = load_model(str(recipe["model"]))
    except ValueError as e:
        raise VerifyError(f"recipe model: {_one_line(e)}") from None
    gpu = recipe["gpu"]
    try:
        count, gtype = int(gpu["count"]), str(gpu["type"])
        per = int(gpu.get("per_node") or count)
        cluster = parse_cluster(f"{count}x{gtype}", per if count % per == 0 else None)
    except (KeyError, TypeError, ValueError) as e:
        raise VerifyError(f"recipe gpu block: {_one_line(e)}") from None
    engine = get_engine("torch" if runner_name == "torch" else "slime")
    return model, cluster, engine


def workload_of(recipe: dict, runner_name: str, steps: int) -> Workload:
    """The arms' workload: the recipe's rows and batch, its run flags' hyperparameters, `steps` steps."""
    base = TORCH_DEFAULT_WORKLOAD if runner_name == "torch" else Workload()
    _, w = from_recipe_blocks(recipe.get("layout") or {}, recipe.get("workload") or {}, base)
    upd: dict[str, Any] = {}
    run = recipe.get("run")
    if isinstance(run, str) and run.strip():
        from .recipe import parse_run

        flags = parse_run(run).flag_dict()
        for flag, name in _RUN_HYPER_FLAGS.items():
            v = flags.get(flag)
            if v is None:
                continue
            try:
                upd[name] = int(v) if name == "seed" else float(v)
            except ValueError:
                pass  # a shell expansion ($LR): keep the default
        if flags.get("--lr-decay-style"):
            upd["lr_decay_style"] = str(flags["--lr-decay-style"])
    if steps < 3:
        raise VerifyError(f"--steps {steps}: the convergence check needs at least 3 steps")
    upd["steps"] = steps
    upd["window"] = (min(5, steps // 4), steps - 1)  # the seed's 5..19 window, shortened for short runs
    return replace(w, **upd)


def layout_of(recipe: dict, world_size: int) -> Layout:
    try:
        lay, _ = from_recipe_blocks(recipe.get("layout") or {}, recipe.get("workload") or {})
    except (LayoutError, TypeError, ValueError) as e:
        raise VerifyError(f"recipe layout: {_one_line(e)}") from None
    return lay


def reference_layout_of(recipe: dict, model, cluster) -> Layout:
    """A reference recipe's layout, its DP derived for the candidate's cluster."""
    if str(recipe.get("model", "")).lower() != model.name.lower():
        raise VerifyError(f"reference recipe is for {recipe.get('model')!r}, the candidate for {model.name!r}")
    lay = layout_of(recipe, cluster.world_size)
    try:
        return replace(lay, dp=derive_dp(cluster.world_size, lay.tp, lay.pp, lay.cp))
    except LayoutError as e:
        raise VerifyError(f"reference layout: {_one_line(e)}") from None


def optimizer_config(layout: Layout) -> str:
    """The component-test configuration of the optimizer setting a layout uses."""
    if layout.optimizer_cpu_offload:
        return "cpu_offload"
    if layout.precision_aware_optimizer:
        return "precision_aware"
    return "default"


# ---------------------------------------------------------------------- checks
def configuration_check(recipe: dict, model, cluster, engine, layout: Layout, workload: Workload) -> dict:
    from .recipe import lint

    errors = [f"layout: {e}" for e in check(layout, model, cluster.world_size, workload, engine)]
    findings = lint(recipe)
    allowed, warns = [], []
    for f in findings:
        text = f"{f.path}: {f.message}"
        if f.severity != "error":
            warns.append(text)
        elif any(f.path == p or f.path.startswith(p + ".") or f.path.startswith(p + "[") for p in ALLOWED_LINT_PREFIXES):
            allowed.append(text)
        else:
            errors.append(f"lint: {text}")
    return {"result": "fail" if errors else "pass", "errors": errors, "allowed_lint_errors": allowed,
            "lint_warnings": warns}


def _arm(runner, model, cluster, layout, workload, engine, trial_dir: Path, label: str, data_path=None):
    from .runners.base import TrialSpec

    spec = TrialSpec(model, cluster, layout, workload, engine, trial_dir=trial_dir, timeout_s=ARM_TIMEOUT_S,
                     label=label, data_path=data_path)
    t0 = time.monotonic()
    res = runner.run(spec)
    return res, time.monotonic() - t0


def _compare(ref_res, cand_res, note: str) -> tuple[dict, Any]:
    from .correctness import compare_curves

    if ref_res.status != "ok" or cand_res.status != "ok":
        bad = [(n, r) for n, r in (("reference", ref_res), ("candidate", cand_res)) if r.status != "ok"]
        why = "; ".join(f"{n} arm {r.status}: {_one_line(r.reason)}" for n, r in bad)
        return ({"steps": max(len(ref_res.losses), 1), "result": "fail", "correlation": None,
                 "final_loss_difference": None, "pointwise_failures": None, "note": f"{note}; {why}"}, None)
    cr = compare_curves(ref_res.losses, cand_res.losses)
    return cr.to_record(note=note), cr


def component_shapes(model) -> tuple[dict, str]:
    from .correctness.component import decoder_layer_shapes, describe_shapes

    shapes = decoder_layer_shapes(model.hidden, model.ffn, model.heads, model.kv_heads, model.head_dim,
                                  qk_norm=bool(model.qk_norm), attention_output_gate=bool(model.attn_output_gate),
                                  bias=bool(model.attn_bias))
    label = (f"one {model.name} attention decoder layer: hidden {model.hidden}, FFN {model.ffn}, "
             f"{model.heads} heads / {model.kv_heads} KV heads of {model.head_dim}; {describe_shapes(shapes)}")
    return shapes, label


def component_tests(config: str, model, layout: Layout, workload: Workload) -> list[tuple[dict, Any]]:
    from .correctness.component import run_component_test

    shapes, label = component_shapes(model)
    out = []
    for n in COMPONENT_STEPS:
        res = run_component_test(config, shapes, steps=n, lr=workload.lr, betas=(workload.adam_beta1, workload.adam_beta2),
                                 weight_decay=workload.weight_decay, offload_fraction=layout.offload_fraction,
                                 shape_label=label)
        rec = res.to_record(test=f"{config} Adam against an FP64 reference, {n} step(s) (component:optimizer)")
        rec["date"] = _today()
        out.append((rec, res))
    return out


def _rules_check(ref: Layout, cand: Layout, workload: Workload, tests_run: dict) -> dict:
    from .correctness import diff_args, load_rules, required_tests, unverified_reasons

    rules = load_rules()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        diffs = diff_args(to_flags(ref, workload), to_flags(cand, workload), rules)
    need = sorted(required_tests(diffs))
    reasons = unverified_reasons(diffs, tests_run)
    return {"diffs": [{"flag": d.flag, "reference": d.reference, "candidate": d.candidate, "class": d.cls,
                       "requires": list(d.requires)} for d in diffs],
            "required_tests": need, "unverified_reasons": reasons, "version": rules.version}


def _inverted_mask_rows(model, workload: Workload, path: Path) -> str | None:
    """Parquet of the arms' synthetic rows with the loss mask inverted; None where pyarrow is missing."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return None
    from .torchmodels.data import synthetic_rows

    rows = synthetic_rows(workload.steps * workload.global_batch, workload.seq_length, model.vocab, workload.seed)
    pq.write_table(pa.table({"tokens": [[int(t) for t in r] for r in rows.tokens],
                             "loss_mask": [[1 - int(m) for m in r] for r in rows.loss_mask]}), str(path))
    return str(path)


def _stack(runner_name: str) -> dict:
    from .runners.slime import stack_probe

    block = {k: v for k, v in stack_probe.stack_block(stack_probe.probe()).items() if v is not None}
    if runner_name == "torch" and "framework" not in block:
        block["framework"] = "attune torch runner (torchrun; gloo on CPU, NCCL on GPU)"
    return block


# ---------------------------------------------------------------------- the library entry
def verify_recipe(recipe: dict, runner="torch", reference_layout: Layout | None = None, steps: int = 20,
                  negative_control: bool = False, workdir: str | Path | None = None, log=None,
                  reference_source: str | None = None) -> dict:
    """Verify a recipe dict. Returns {status, correctness, stack, report, arms, ...}; the recipe is not changed.

    runner: a runner object or a name ("torch", "slime"). log: a callable for progress lines (default none).
    """
    from attune.spec.baselines import baseline_layout
    from .correctness.component import run_component_test
    from .recipe import schema_errors
    from .runners.base import RunnerError, get_runner

    say = log or (lambda s: None)
    if isinstance(runner, str):
        runner = get_runner(runner)
    rname = getattr(runner, "name", "runner")
    model, cluster, engine = target_of(recipe, rname)
    workload = workload_of(recipe, rname, steps)
    cand = layout_of(recipe, cluster.world_size)
    workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="attune-verify-"))
    workdir.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def out(s: str) -> None:
        lines.append(s)
        say(s)

    # 1. configuration
    conf = configuration_check(recipe, model, cluster, engine, cand, workload)
    out(f"configuration: {conf['result']} (layout {cand.label()} on {cluster.world_size} x {cluster.type_key}; "
        f"{len(conf['errors'])} error(s), {len(conf['allowed_lint_errors'])} allowed lint error(s), "
        f"{len(conf['lint_warnings'])} lint warning(s))")
    for e in conf["errors"]:
        out(f"  error: {e}")
    for e in conf["allowed_lint_errors"]:
        out(f"  allowed (verify rewrites correctness): {e}")
    corr: dict[str, Any] = {"result": "fail", "configuration": conf["result"]}
    result = {"status": "failed", "correctness": corr, "stack": None, "report": lines, "arms": {},
              "configuration": conf, "workdir": str(workdir)}
    if conf["result"] == "fail":
        corr["summary"] = "failed: configuration check: " + "; ".join(conf["errors"])
        corr["convergence"] = None
        out(f"result: fail: {corr['summary']}")
        return result

    # 2. arms
    if reference_layout is None:
        limits = dict(max_tp=1, max_cp=1) if rname == "torch" else {}
        reference_layout, note = baseline_layout(model, cluster, workload, engine, **limits)
        reference_source = reference_source or f"the {model.name} baseline layout ({note})"
    reference_source = reference_source or "the given reference layout"
    for name, lay in (("reference", reference_layout), ("candidate", cand)):
        if hasattr(runner, "check"):
            from .runners.base import TrialSpec
            try:
                runner.check(TrialSpec(model, cluster, lay, workload, engine))
            except RunnerError as e:
                raise VerifyError(f"{name} arm: {_one_line(e)}") from None
    corr["reference"] = (f"{reference_layout.label()}: {reference_source}; same rows (seed {workload.seed}), "
                         f"hyperparameters and {workload.steps} steps as the candidate")
    arms: dict[str, Any] = {}
    ref_res, ref_s = _arm(runner, model, cluster, reference_layout, workload, engine, workdir / "reference", "reference")
    out(f"reference arm {reference_layout.label()}: {ref_res.status} in {ref_s:.1f} s" + _arm_numbers(ref_res))
    cand_res, cand_s = _arm(runner, model, cluster, cand, workload, engine, workdir / "candidate", "candidate")
    out(f"candidate arm {cand.label()}: {cand_res.status} in {cand_s:.1f} s" + _arm_numbers(cand_res))
    arms["reference"] = {"layout": reference_layout.label(), "result": ref_res.to_dict()}
    arms["candidate"] = {"layout": cand.label(), "result": cand_res.to_dict()}
    note = (f"candidate arm: this recipe's layout {cand.label()}; reference arm: {reference_layout.label()} "
            f"({reference_source}); {rname} runner, {workload.global_batch} rows of {workload.seq_length} tokens "
            f"per step, seed {workload.seed}, lr {workload.lr:g}")
    conv, cr = _compare(ref_res, cand_res, note)
    corr["convergence"] = conv
    out(f"convergence: {conv['result']} over {conv['steps']} steps: correlation {conv['correlation']}, "
        f"final loss relative difference {conv['final_loss_difference']}, pointwise failures {conv['pointwise_failures']}"
        + ("" if cr is None or cr.passed else f" ({'; '.join(cr.reasons)})"))

    # 3. component tests
    config = optimizer_config(cand)
    comps = component_tests(config, model, cand, workload)
    corr["component_tests"] = [rec for rec, _ in comps]
    comp_ok = all(res.passed for _, res in comps)
    for rec, res in comps:
        out(f"component test {config}, {res.steps} step(s): {rec['result']}: worst relative L2 error "
            f"{res.worst_error:.3g} ({res.worst_tensor}) vs bound {res.bound:.3g}")

    # 4. rules
    tests_run = {"convergence": conv["result"] == "pass", "component:optimizer": comp_ok}
    rules = _rules_check(reference_layout, cand, workload, tests_run)
    corr["rules"] = (f"argument classes of attune/correctness/numerics_rules.yaml (version {rules['version']}): "
                     f"{len(rules['diffs'])} flag difference(s) between the arms "
                     f"({', '.join(d['flag'] + ' ' + d['class'] for d in rules['diffs']) or 'none'}); required tests: "
                     f"{', '.join(rules['required_tests'])}; 'convergence' by attune.correctness.compare_curves "
                     f"(Megatron-Bridge validate_convergence thresholds)")
    out(f"rules: {len(rules['diffs'])} differing flag(s); required {', '.join(rules['required_tests'])}; "
        f"{len(rules['unverified_reasons'])} unverified reason(s)")
    for r in rules["unverified_reasons"]:
        out(f"  unverified: {r}")

    # 5. negative controls
    controls: list[dict] = []
    if negative_control:
        neg_w = replace(workload, lr=workload.lr * NEG_LR_FACTOR, min_lr=workload.min_lr * NEG_LR_FACTOR)
        res, s = _arm(runner, model, cluster, cand, neg_w, engine, workdir / "neg-lr", "negative control lr x10")
        arms["negative_lr"] = {"layout": cand.label(), "result": res.to_dict()}
        rec, _ = _compare(ref_res, res, "negative control")
        controls.append(_control_record(f"candidate arm with lr x{NEG_LR_FACTOR:g} ({workload.lr:g} -> {neg_w.lr:g}; "
                                        f"min lr x{NEG_LR_FACTOR:g})", rec, res, s))
        mask_path = _inverted_mask_rows(model, workload, workdir / "inverted-mask.parquet") if rname == "torch" else None
        if mask_path:
            res, s = _arm(runner, model, cluster, cand, workload, engine, workdir / "neg-mask", "negative control mask",
                          data_path=mask_path)
            arms["negative_mask"] = {"layout": cand.label(), "result": res.to_dict()}
            rec, _ = _compare(ref_res, res, "negative control")
            controls.append(_control_record("candidate arm with the loss mask inverted (prompt tokens supervised, "
                                            "response tokens not); same token ids", rec, res, s))
        else:
            controls.append({"changed": "inverted loss mask", "expected": "fail", "observed": "not run",
                             "detail": "not feasible: needs the torch runner and pyarrow to write the rows"})
        shapes, label = component_shapes(model)
        bad = run_component_test("broken_no_bias_correction", shapes, steps=1, lr=workload.lr,
                                 betas=(workload.adam_beta1, workload.adam_beta2), weight_decay=workload.weight_decay,
                                 shape_label=label)
        controls.append({"changed": "component test of an Adam without bias correction (broken_no_bias_correction)",
                         "expected": "fail", "observed": "pass" if bad.passed else "fail",
                         "detail": f"worst relative L2 error {bad.worst_error:.3g} ({bad.worst_tensor}) vs bound "
                                   f"{bad.bound:.3g} after 1 step"})
        for c in controls:
            nums = ""
            if c.get("correlation") is not None or c.get("final_loss_difference") is not None:
                nums = f": correlation {c.get('correlation')}, final loss relative difference {c.get('final_loss_difference')}"
            out(f"negative control: {c['changed']}: expected fail, observed {c['observed']}{nums}")

    # verdict
    reasons: list[str] = []
    if not getattr(runner, "measured", False):
        reasons.append(f"the {rname} runner does not measure (nothing ran)")
    res_block = recipe.get("result") if isinstance(recipe.get("result"), dict) else {}
    if res_block.get("tokens_per_s_per_gpu") is None or res_block.get("measured") in (None, ""):
        reasons.append("the recipe has no measured result (result.tokens_per_s_per_gpu and result.measured)")
    if conv["result"] != "pass":
        reasons.append("convergence check failed" + (f" ({'; '.join(cr.reasons)})" if cr is not None else
                                                     f" ({conv.get('note')})"))
    if not comp_ok:
        reasons.append(f"component test {config} failed")
    reasons += [r for r in rules["unverified_reasons"] if not r.startswith("the convergence check")
                and "'component:optimizer', which failed" not in r]
    for c in controls:
        if c["observed"] == "pass":
            reasons.append(f"negative control passed, so the check cannot detect it: {c['changed']}")
    passed = not reasons
    corr["result"] = "pass" if passed else "fail"
    n_comp = sum(res.passed for _, res in comps)
    if passed:
        summary = (f"passed: configuration, convergence (correlation {conv['correlation']}, final loss relative "
                   f"difference {conv['final_loss_difference']} over {conv['steps']} steps) and {n_comp} component "
                   f"test(s) on this machine")
        if controls:
            summary += f"; {sum(c['observed'] == 'fail' for c in controls)} of {len(controls)} negative controls failed as expected"
    else:
        summary = "failed: " + "; ".join(reasons)
    corr["summary"] = summary
    if controls:
        trial = dict(recipe, correctness=dict(corr, negative_controls=controls))
        if any("negative_controls" in e for e in schema_errors(trial)):
            corr["summary"] = summary + "; negative controls: " + "; ".join(
                f"{c['changed']}: observed {c['observed']}" for c in controls)
            result["sidecar"] = {"negative_controls": controls}
        else:
            corr["negative_controls"] = controls
    result.update(status="verified" if passed else "failed", stack=_stack(rname), arms=arms, rules=rules,
                  negative_controls=controls, reasons=reasons)
    out(f"result: {corr['result']}: {corr['summary']}")
    (workdir / "verify.json").write_text(json.dumps({k: v for k, v in result.items() if k != "report"}, indent=2,
                                                    default=str))
    return result


def _arm_numbers(res) -> str:
    if res.status != "ok":
        return f" ({_one_line(res.reason)})"
    losses = list(res.losses.values())
    return (f"; {res.tokens_per_s_per_gpu:,.1f} tokens/s/GPU, loss {losses[0]:.4f} -> {losses[-1]:.4f}"
            if losses else "")


def _control_record(changed: str, rec: dict, res, seconds: float) -> dict:
    return {"changed": changed, "expected": "fail", "observed": rec["result"] if res.status == "ok" else "fail",
            "correlation": rec.get("correlation"), "final_loss_difference": rec.get("final_loss_difference"),
            "pointwise_failures": rec.get("pointwise_failures"),
            "detail": (f"arm {res.status} in {seconds:.1f} s" + (f": {_one_line(res.reason)}" if res.status != "ok" else ""))}


# ---------------------------------------------------------------------- the CLI entry
def apply_result(recipe: dict, result: dict) -> dict:
    """The recipe with verify's status, correctness block and stack."""
    out = dict(recipe)
    out["status"] = result["status"]
    out["correctness"] = result["correctness"]
    if result.get("stack"):
        out["stack"] = result["stack"]
    return out


def run_verify(args) -> int:
    from .recipe import load_recipe, write_recipe
    from .runners.base import get_runner

    path = Path(args.recipe)
    if not path.is_file():
        raise VerifyError(f"{args.recipe}: no such recipe file")
    recipe = load_recipe(path)
    opts = {"cluster_file": args.cluster} if args.runner == "slime" and getattr(args, "cluster", None) else {}
    runner = get_runner(args.runner, **opts)
    ref_layout, ref_source = None, None
    if getattr(args, "reference", None):
        rp = Path(args.reference)
        if not rp.is_file():
            raise VerifyError(f"{args.reference}: no such reference recipe file")
        model, cluster, _ = target_of(recipe, args.runner)
        ref_layout = reference_layout_of(load_recipe(rp), model, cluster)
        ref_source = f"the layout of reference recipe {args.reference}"
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    workdir = Path("reports") / "verify" / f"{path.stem}-{stamp}"
    res = verify_recipe(recipe, runner, ref_layout, steps=args.steps, negative_control=args.negative_control,
                        workdir=workdir, log=print, reference_source=ref_source)
    write_recipe(apply_result(recipe, res), path)
    if res.get("sidecar"):
        (path.parent / "verify.json").write_text(json.dumps(res["sidecar"], indent=2, default=str))
    print(f"{path}: status {res['status']}; arms and losses in {workdir}")
    if res["status"] != "verified":
        print(f"attune verify: {res['correctness']['summary']}", file=sys.stderr)
    return 0 if res["status"] == "verified" else 1
