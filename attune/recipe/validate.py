"""Validate recipes: JSON Schema errors with paths, and lint findings.

`schema_errors` checks the recipe against the typed model (attune/recipe/models.py).
`lint` adds the checks a schema cannot express: that `run` starts a real slime entrypoint
with flags slime / Megatron-LM accept, that the layout flags in `run` agree with the
`layout` block, and that the layout, workload and result blocks are consistent.
What a flag is (known, arity, type, choices, the layout key it must agree with) comes from the
flag table, attune/spec/megatron_flags.yaml; the layout rules are attune.spec.rules.check's.
"""

from __future__ import annotations

import difflib
import re
import reprlib
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any, Iterable

from attune.errors import FlagError, UserInputError
from attune.recipe.codec import from_recipe_blocks
from attune.recipe.models import Recipe
from attune.recipe.models import schema_issues as _model_schema_issues
from attune.spec.engine import DEFAULT_ENGINE, get_engine
from attune.spec.flags import FlagSpec, flag_prefixes, flag_table, known_flag, table_describes
from attune.spec.knobs import not_honoured
from attune.spec.model import load_model
from attune.spec.rules import check as layout_rules

from .io import get_path
from .runblock import RunBlock, is_expansion, parse_run

__all__ = ["Finding", "schema_errors", "lint", "load_known_flags", "has_errors"]

ERROR = "error"
WARNING = "warning"

# slime's two training entrypoints at the repository root (reference notes 1.3:
# "train.py vs train_async.py (repo root)").
_SLIME_ENTRYPOINTS = ("train.py", "train_async.py")
_ASYNC_ENTRYPOINT = "train_async.py"

# Which flags slime / Megatron-LM accept, their arity, value types and choices, and which run flag must
# agree with which layout key (`recipe:`), all come from the flag table attune/spec/megatron_flags.yaml
# (attune.spec.flags.flag_table). The optimizer-offload keys are one optional mapping in the recipe
# (null: no offload) and are compared by _check_offload.
_OFFLOAD = "layout.offload"
_ETP = "--expert-tensor-parallel-size"
_TP = "--tensor-model-parallel-size"
_VPP = "--num-virtual-stages-per-pipeline-rank"
_LAYERS_PER_VSTAGE = "--num-layers-per-virtual-pipeline-stage"
_SHELL_EXPR_RE = re.compile(r"[$`]")

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" | "warning"
    path: str  # JSON path in the recipe, e.g. "layout.recompute.num_layers" or "run"
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.path}: {self.message}"


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(f.severity == ERROR for f in findings)


# ------------------------------------------------------------------- schema

def _schema_issues(recipe: Any) -> list[tuple[str, str]]:
    """(path, message) of every schema violation, checked through the pydantic model (attune.recipe.models)."""
    return _model_schema_issues(recipe)


def schema_errors(recipe: Any) -> list[str]:
    """Schema violations, each 'json.path: what is wrong'. Empty when the recipe is valid.
    Dates (YAML reads `2026-10-18` as a date) are checked as ISO strings."""
    return [f"{path}: {msg}" for path, msg in _schema_issues(recipe)]


# ------------------------------------------------------------------- lint helpers

def load_known_flags() -> dict[str, Any]:
    """The flag table (attune/spec/megatron_flags.yaml) in the shape of the old known_flags.yaml:
    {"flags": {flag: arity}, "origin": {flag: owner}, "prefixes": {prefix: arity}}; arity is
    switch | value | values. A view: `attune.spec.flags.flag_table` holds the full records."""
    table = flag_table()
    return {"flags": {name: spec.arity for name, spec in table.items()},
            "origin": {name: spec.owner for name, spec in table.items()},
            "prefixes": {spec.name: spec.arity for spec in flag_prefixes()}}


_get = get_path


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _as_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _as_float(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _check_entrypoint(rb: RunBlock, out: list[Finding]) -> str | None:
    """Returns the entry script basename when it is a slime entrypoint."""
    want = "`python3 train.py` or `python3 train_async.py`"
    ep = rb.entrypoint
    if not ep:
        out.append(Finding(ERROR, "run", f"run starts no command; it must start {want}"))
        return None
    shown = " ".join(ep)
    if not re.match(r"^(?:.*/)?python(?:\d+(?:\.\d+)*)?$", ep[0]):
        out.append(Finding(ERROR, "run", f"run starts `{shown}`, not a Python slime entrypoint; it must start {want}"))
        return None
    if "-m" in ep or "-c" in ep:
        out.append(Finding(ERROR, "run", f"run starts `{shown}`, which is not a runnable slime entrypoint "
                                         f"(slime's train.py / train_async.py are scripts, not modules); use {want}"))
        return None
    script = ep[-1] if len(ep) > 1 else ""
    base = PurePosixPath(script).name
    if base not in _SLIME_ENTRYPOINTS:
        out.append(Finding(ERROR, "run", f"run starts `{shown}`, not slime's entrypoint; it must start {want}"))
        return None
    if rb.launcher and rb.launcher[:3] != ["ray", "job", "submit"]:
        out.append(Finding(WARNING, "run", f"unrecognized launcher `{' '.join(rb.launcher)}` "
                                           "(slime jobs are started with `ray job submit ... --`)"))
    return base


# difflib.get_close_matches cutoff for the "did you mean" hint of an unknown flag (its default, 0.6, also
# offers unrelated flags of similar length; 0.8 keeps one-word slips such as --recompute-num-layer).
_HINT_CUTOFF = 0.8


def _unknown_flag(flag: str) -> str:
    """The error for a flag the table does not hold, with the closest known name when there is one."""
    d = table_describes()
    close = difflib.get_close_matches(flag, list(flag_table()), n=1, cutoff=_HINT_CUTOFF)
    hint = f"; did you mean {close[0]}?" if close else ""
    return (f"unknown flag {flag}: not a slime {d.get('slime', '?')} or Megatron-LM {d.get('megatron_lm', '?')} "
            f"flag in attune's flag table (slime passes unknown flags to Megatron's parser with "
            f"ignore_unknown_args=True, so it would be silently ignored){hint}")


def _check_no_effect(rb: RunBlock, out: list[Finding]) -> None:
    """Known flags that do nothing in this run (the table's ``no_effect``), once each, with the reason."""
    flags, seen = rb.flag_dict(), set()
    for flag, _ in rb.flag_args:
        spec = None if is_expansion(flag) or flag in seen else known_flag(flag)
        seen.add(flag)
        if spec is not None and spec.no_effect is not None and spec.no_effect.applies(flags, rb.env):
            out.append(Finding(WARNING, "run", f"{flag} has no effect here: {spec.no_effect.reason} "
                                               f"({spec.no_effect.source})"))


def _check_flags(rb: RunBlock, out: list[Finding]) -> None:
    seen: dict[str, int] = {}
    for flag, args in rb.flag_args:
        if is_expansion(flag):
            continue
        seen[flag] = seen.get(flag, 0) + 1
        if seen[flag] == 2:
            out.append(Finding(WARNING, "run", f"{flag} is given more than once (argparse keeps the last)"))
        spec = known_flag(flag)
        if spec is None:
            out.append(Finding(ERROR, "run", _unknown_flag(flag)))
            continue
        if spec.arity == "switch" and args:
            out.append(Finding(ERROR, "run", f"{flag} takes no value but is followed by {' '.join(args)!r}"))
            continue
        if spec.arity == "value" and len(args) != 1:
            what = "no value" if not args else f"{len(args)} values ({' '.join(args)!r})"
            out.append(Finding(ERROR, "run", f"{flag} takes one value, got {what}"))
            continue
        if spec.arity == "values" and len(args) < spec.min_values:
            out.append(Finding(ERROR, "run", f"{flag} needs at least one value"))
            continue
        # the value's type and choices, as argparse checks them at launch (shell expressions are not known here)
        for arg in args:
            if _SHELL_EXPR_RE.search(arg):
                continue
            try:
                spec.convert(arg)
            except FlagError as e:
                out.append(Finding(ERROR, "run", str(e)))
                break
    for word in rb.positionals:
        out.append(Finding(ERROR, "run", f"stray argument {word!r} after the entrypoint (not a flag value)"))
    _check_no_effect(rb, out)


def _run_value(flags: dict[str, str | None], spec: FlagSpec, absent: Any) -> tuple[bool | None, Any]:
    """(comparable, value) of a flag in the run: comparable is False for a shell expression and None
    for a literal that is not a valid value (_check_flags reports it)."""
    if spec.name not in flags:
        return True, absent
    raw = flags[spec.name]
    if spec.arity == "switch":
        return True, True
    if raw is None or _SHELL_EXPR_RE.search(raw):
        return False, raw
    if spec.arity == "values":  # compared as the list of words (recipe keys hold lists)
        return True, raw.split()
    try:
        return True, (int(raw) if spec.type == "int" else float(raw) if spec.type == "float" else raw)
    except ValueError:
        return None, raw


def _recipe_specs(prefix: str) -> list[FlagSpec]:
    """The table's flags compared with a recipe key under ``prefix``, in table order."""
    return [s for s in flag_table().values() if s.recipe is not None and (s.recipe + ".").startswith(prefix + ".")]


def _by_recipe(path: str) -> FlagSpec:
    return next(s for s in flag_table().values() if s.recipe == path)


def _has_key(block: dict, keys: list[str]) -> bool:
    for k in keys[:-1]:
        block = block.get(k) if isinstance(block, dict) else None
    return isinstance(block, dict) and keys[-1] in block


def _check_layout_agreement(recipe: dict, rb: RunBlock, out: list[Finding]) -> None:
    layout = recipe.get("layout")
    if not isinstance(layout, dict):
        return
    flags = rb.flag_dict()
    opaque = any(is_expansion(k) for k, _ in rb.flags)
    for spec in _recipe_specs("layout"):
        if spec.recipe == _OFFLOAD or spec.recipe.startswith(_OFFLOAD + "."):
            continue
        flag, path, keys = spec.name, spec.recipe, spec.recipe.split(".")[1:]
        if spec.recipe_optional and not _has_key(layout, keys):
            continue  # the run block is the source of this key when the recipe leaves it out
        want = _get(layout, *keys)
        if want is None and spec.has_unset:
            want = spec.absent  # the layout's own name for "the flag is absent" (VPP 1, recompute "none")
        absent = spec.absent
        if flag == _ETP:  # Megatron-LM validate_args: ETP defaults to the TP size
            ok, tp = _run_value(flags, flag_table()[_TP], flag_table()[_TP].absent)
            absent = tp if ok else None
        if flag == _VPP and flag not in flags and _LAYERS_PER_VSTAGE in flags:
            out.append(Finding(WARNING, path, f"run sets VPP with {_LAYERS_PER_VSTAGE}; "
                                              "lint cannot compare it with layout.vpp"))
            continue
        ok, got = _run_value(flags, spec, absent)
        if ok is None:
            continue
        if not ok:
            out.append(Finding(WARNING, path, f"cannot compare {flag} {got!r} (a shell expression) with {want!r}"))
            continue
        if got == want:
            continue
        if flag in flags:
            shown = flag if spec.arity == "switch" else f"{flag} {flags[flag]}"
            out.append(Finding(ERROR, path, f"run has {shown}, layout says {want!r}"))
        else:
            sev = WARNING if opaque else ERROR
            hint = " (it may come from an opaque ${...[@]} expansion)" if opaque else ""
            out.append(Finding(sev, path, f"run does not set {flag} (so {got!r}), layout says {want!r}{hint}"))
    _check_offload(layout, flags, out)


def _check_offload(layout: dict, flags: dict[str, str | None], out: list[Finding]) -> None:
    offload_flag = _by_recipe(_OFFLOAD).name
    fraction, overlap = _by_recipe(_OFFLOAD + ".fraction"), _by_recipe(_OFFLOAD + ".overlap")
    offload = layout.get("offload")
    has_offload = offload_flag in flags
    if offload is None and has_offload:
        out.append(Finding(ERROR, _OFFLOAD, f"run has {offload_flag}, layout says no offload (null)"))
    elif isinstance(offload, dict):
        if not has_offload:
            out.append(Finding(ERROR, _OFFLOAD, f"layout has optimizer offload, run lacks {offload_flag}"))
        else:
            frac = _as_float(flags.get(fraction.name)) if fraction.name in flags else fraction.absent
            if frac is not None and isinstance(offload.get("fraction"), (int, float)) \
                    and abs(frac - float(offload["fraction"])) > 1e-9:
                out.append(Finding(ERROR, fraction.recipe,
                                   f"run offloads fraction {frac}, layout says {offload['fraction']!r}"))
            has_overlap = overlap.name in flags
            if isinstance(offload.get("overlap"), bool) and has_overlap != offload["overlap"]:
                has = "has" if has_overlap else "does not have"
                out.append(Finding(ERROR, overlap.recipe,
                                   f"run {has} {overlap.name}, layout says {offload['overlap']!r}"))


def _check_run_vs_recipe(recipe: dict, rb: RunBlock, script: str | None, out: list[Finding]) -> None:
    flags = rb.flag_dict()
    if script == _ASYNC_ENTRYPOINT and "--colocate" in flags:
        out.append(Finding(ERROR, "run", "train_async.py with --colocate: train_async.py asserts not colocate; "
                                         "use train.py or drop --colocate"))
    if "--use-dynamic-batch-size" in flags and "--max-tokens-per-gpu" not in flags:
        out.append(Finding(ERROR, "run", "--use-dynamic-batch-size needs --max-tokens-per-gpu (slime checks this)"))
    gb = _as_int(flags.get("--global-batch-size"))
    want_gb = _get(recipe, "workload", "global_batch")
    if gb is not None and _is_int(want_gb) and gb != want_gb:
        out.append(Finding(ERROR, "workload.global_batch", f"run has --global-batch-size {gb}, workload says {want_gb}"))
    nodes = _as_int(flags.get("--actor-num-nodes"))
    per_node = _as_int(flags.get("--actor-num-gpus-per-node"))
    count = _get(recipe, "gpu", "count")
    if nodes is not None and per_node is not None and _is_int(count) and nodes * per_node != count:
        out.append(Finding(ERROR, "gpu.count", f"run uses {nodes} x {per_node} = {nodes * per_node} GPUs, gpu.count is {count}"))
    gpn = _get(recipe, "gpu", "per_node")
    if per_node is not None and _is_int(gpn) and per_node > gpn:
        out.append(Finding(ERROR, "gpu.per_node", f"run asks for {per_node} GPUs per node, gpu.per_node is {gpn}"))
    # optimizer steps per run: num_rollout x rollout_batch x n_samples / global_batch
    # (reference notes 1.2: "8x8 = 64 samples = 1 optimizer step per rollout")
    n_roll = _as_int(flags.get("--num-rollout"))
    rbs = _as_int(flags.get("--rollout-batch-size"))
    nsp = _as_int(flags.get("--n-samples-per-prompt")) if "--n-samples-per-prompt" in flags else 1
    steps = _get(recipe, "result", "steps_per_run")
    if None not in (n_roll, rbs, nsp, gb) and gb and _is_int(steps):
        run_steps = n_roll * rbs * nsp / gb
        if run_steps != steps:
            out.append(Finding(WARNING, "result.steps_per_run",
                               f"run makes {run_steps:g} optimizer steps (--num-rollout {n_roll} x {rbs * nsp} "
                               f"samples / --global-batch-size {gb}), result says {steps}"))
    env = recipe.get("env")
    if isinstance(env, dict):
        for key, val in env.items():
            if key not in rb.env:
                out.append(Finding(WARNING, f"env.{key}", "not exported by the run block"))
            elif str(val) != rb.env[key]:
                out.append(Finding(WARNING, f"env.{key}", f"{val!r} differs from the run block's export {rb.env[key]!r}"))
        for key in rb.env:
            if key not in env:
                out.append(Finding(WARNING, f"env.{key}", f"run exports {key}, missing from env"))


# Where each message of attune.spec.rules.check points in the recipe (first match wins), and the
# rules lint reports as warnings: Megatron-LM turns sequence parallelism off at TP 1 (validate_args)
# rather than failing, and EP > 1 is a limit of attune's models, not of the recipe.
_RULE_PATHS: tuple[tuple[str, str], ...] = (
    (r"^world size", "layout.dp"),
    (r"^micro_batch_size must", "layout.rows_per_microbatch"),
    (r"^(tp|pp|dp|cp|vpp) must be", "layout.{0}"),
    (r"^EP ", "layout.ep"),
    (r"^TP x CP", "layout.tp"),
    (r"^TP ", "layout.tp"),
    (r"^sequence parallelism", "layout.sequence_parallel"),
    (r"^PP ", "layout.pp"),
    (r"^(first/last|layer split)|divide evenly|stage", "layout.layer_split"),
    (r"^(VPP|virtual pipeline)", "layout.vpp"),
    (r"recompute", "layout.recompute"),
    (r"^optimizer CPU offload|^offload fraction", "layout.offload"),
    (r"^the precision-aware optimizer", "layout.precision_aware_optimizer"),
    (r"distributed optimizer", "layout.distributed_optimizer"),
    (r"^global batch", "workload.global_batch"),
    (r"^sequence length", "workload.row_tokens"),
    (r"^max tokens", "layout.max_tokens_per_gpu"),
    (r"precision|bf16", "workload.precision"),
)
_RULE_WARNINGS = {r"^sequence parallelism needs TP > 1": " (Megatron-LM turns it off)",
                  r"^EP \d+: only dense models": " (a limit of attune's models, not of the recipe)"}


def _rule_path(message: str) -> str:
    for pattern, path in _RULE_PATHS:
        m = re.search(pattern, message)
        if m:
            return path.format(*m.groups())
    return "layout"


def _check_layout_rules(recipe: dict, rb: RunBlock | None, out: list[Finding]) -> None:
    """attune.spec.rules.check on the recipe's layout (as attune.recipe.target reads it, but with the
    layout block's own DP, so that it is checked against gpu.count), the model and the engine."""
    workload_block = recipe.get("workload") if isinstance(recipe.get("workload"), dict) else None
    precision_aware = None if rb is None else rb.has_flag(_by_recipe("layout.precision_aware_optimizer").name)
    try:
        layout, workload = from_recipe_blocks(recipe["layout"], workload_block, precision_aware_default=precision_aware)
    except UserInputError as e:
        if not any(f.path.startswith(("layout", "workload")) for f in out):
            out.append(Finding(ERROR, "layout", " ".join(str(e).split())))
        return
    except (TypeError, ValueError, AttributeError, KeyError):
        return  # a block of the wrong shape: the schema errors say what is wrong
    model_name = recipe.get("model")
    if not (isinstance(model_name, str) and model_name):
        return  # the schema errors name the missing model
    try:
        model = load_model(model_name)
    except (UserInputError, OSError, ValueError) as e:
        out.append(Finding(WARNING, "model", f"layout rules that need the model not checked: {' '.join(str(e).split())}"))
        return
    engine = get_engine(DEFAULT_ENGINE)
    if engine.forces_distributed_optimizer and not layout.distributed_optimizer:
        layout = replace(layout, distributed_optimizer=True)
    count = _get(recipe, "gpu", "count")
    world = count if _is_int(count) and count > 0 else layout.world_size
    for message in layout_rules(layout, model, world, workload, engine):
        suffix = next((s for p, s in _RULE_WARNINGS.items() if re.search(p, message)), None)
        out.append(Finding(ERROR if suffix is None else WARNING, _rule_path(message), message + (suffix or "")))
    # issue 15: named recompute / offload modules that do not act in some layer type (attune.spec.knobs)
    for message in not_honoured(layout.effective_recompute_modules if layout.recompute_modules else (), model, engine):
        out.append(Finding(WARNING, "layout.recompute.modules", message))
    for message in not_honoured(layout.offload_modules, model, engine):
        out.append(Finding(WARNING, "layout.offload_modules", message))


def _check_layout(recipe: dict, rb: RunBlock | None, out: list[Finding]) -> None:
    """The layout rules (attune.spec.rules.check) plus the two consistency checks it does not make:
    MoE parallel folding and the rows per microbatch dynamic batching packs."""
    layout = recipe.get("layout")
    if not isinstance(layout, dict):
        return
    _check_layout_rules(recipe, rb, out)
    rec = layout.get("recompute")
    # a Layout keeps method / num_layers only for full recompute, so the rules cannot see them otherwise
    if isinstance(rec, dict) and rec.get("granularity") != "full" \
            and (rec.get("method") is not None or rec.get("num_layers") is not None):
        out.append(Finding(WARNING, "layout.recompute",
                           f"method/num_layers only apply to full recompute (granularity is {rec.get('granularity')!r})"))
    tp, cp, dp, ep, etp = (layout.get(k) for k in ("tp", "cp", "dp", "ep", "etp"))
    # MoE parallel folding: expert groups (EP x ETP) tile the TP x CP x DP ranks of a stage
    if all(_is_int(v) and v > 0 for v in (tp, cp, dp, ep, etp)) and (tp * cp * dp) % (ep * etp):
        out.append(Finding(ERROR, "layout.ep", f"EP {ep} x ETP {etp} does not divide TP x CP x DP = {tp * cp * dp}"))
    mt, rpm = layout.get("max_tokens_per_gpu"), layout.get("rows_per_microbatch")
    row = _get(recipe, "workload", "row_tokens")
    if all(_is_int(v) for v in (mt, rpm, row, cp)) and row > 0:
        # slime packs bins of max_tokens_per_gpu x cp tokens; a longer row forms its own bin
        fit = max(1, (mt * cp) // row)
        if fit != rpm:
            out.append(Finding(WARNING, "layout.rows_per_microbatch",
                               f"{mt} tokens/GPU x CP {cp} holds {fit} row(s) of {row} tokens, layout says {rpm}"))


def _check_status(recipe: dict, out: list[Finding]) -> None:
    status = recipe.get("status")
    result = recipe.get("result") if isinstance(recipe.get("result"), dict) else {}
    corr = recipe.get("correctness") if isinstance(recipe.get("correctness"), dict) else None
    if status in ("measured", "verified"):
        if result.get("tokens_per_s_per_gpu") is None:
            out.append(Finding(ERROR, "result.tokens_per_s_per_gpu", f"a {status} recipe needs its measured throughput"))
        if result.get("measured") in (None, ""):
            out.append(Finding(ERROR, "result.measured", f"a {status} recipe needs the measurement date"))
    if status == "verified":
        if corr is None:
            out.append(Finding(ERROR, "correctness", "a verified recipe needs a correctness block"))
        elif corr.get("result") != "pass":
            out.append(Finding(ERROR, "correctness.result",
                               f"a verified recipe needs correctness.result 'pass', got {corr.get('result')!r}"))
    if corr is not None and corr.get("result") == "pass":
        conv = corr.get("convergence")
        if isinstance(conv, dict) and conv.get("result") == "fail":
            out.append(Finding(ERROR, "correctness.convergence.result", "failed, but correctness.result is 'pass'"))
        for i, test in enumerate(corr.get("component_tests") or []):
            if isinstance(test, dict) and test.get("result") == "fail":
                out.append(Finding(ERROR, f"correctness.component_tests[{i}].result",
                                   "failed, but correctness.result is 'pass'"))
    window = result.get("window")
    if isinstance(window, list) and len(window) == 2 and all(_is_int(v) for v in window):
        a, b = window
        if a > b:
            out.append(Finding(ERROR, "result.window", f"window [{a}, {b}] is reversed"))
        steps = result.get("steps_per_run")
        if _is_int(steps) and b >= steps:
            out.append(Finding(ERROR, "result.window", f"window ends at step {b}, the run has steps 0..{steps - 1}"))
        gb, row = _get(recipe, "workload", "global_batch"), _get(recipe, "workload", "row_tokens")
        wt = result.get("window_tokens")
        if a <= b and all(_is_int(v) for v in (gb, row, wt)) and (b - a + 1) * gb * row != wt:
            out.append(Finding(WARNING, "result.window_tokens",
                               f"{b - a + 1} steps x {gb} rows x {row} tokens = {(b - a + 1) * gb * row}, "
                               f"window_tokens says {wt}"))


# ------------------------------------------------------------------- lint

def lint(recipe: Any) -> list[Finding]:
    """All findings for a recipe: schema errors first, then run-block checks (entrypoint,
    flags, layout agreement, env), then layout/status/result consistency."""
    if isinstance(recipe, Recipe):  # lint reads the recipe as it is written
        recipe = recipe.to_dict()
    out: list[Finding] = [Finding(ERROR, path, msg) for path, msg in _schema_issues(recipe)]
    if not isinstance(recipe, dict):
        return out
    if not out:
        return _semantic(recipe, out)
    try:  # a recipe that breaks the schema: the checks below may meet values of any type
        return _semantic(recipe, list(out))
    except (TypeError, AttributeError, KeyError, ValueError, IndexError):
        return out  # the schema errors already say what is wrong


def _semantic(recipe: dict, out: list[Finding]) -> list[Finding]:
    run = recipe.get("run")
    rb = None
    if isinstance(run, str) and run.strip():
        rb = parse_run(run)
        if rb.launcher[:2] == ["attune", "run"]:
            # measured by attune's torch runner: `attune run --runner torch ... -- LAYOUT FLAGS` (not slime)
            _check_layout_agreement(recipe, rb, out)
        else:
            script = _check_entrypoint(rb, out)
            _check_flags(rb, out)
            _check_layout_agreement(recipe, rb, out)
            _check_run_vs_recipe(recipe, rb, script, out)
    _check_layout(recipe, rb, out)
    _check_status(recipe, out)
    return out
