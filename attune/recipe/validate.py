"""Validate recipes: JSON Schema errors with paths, and lint findings.

`schema_errors` checks the recipe against attune/recipe/schema.yaml.
`lint` adds the checks a schema cannot express: that `run` starts a real slime entrypoint
with flags slime / Megatron-LM accept, that the layout flags in `run` agree with the
`layout` block, and that the layout, workload and result blocks are consistent.
"""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass
from importlib import resources
from pathlib import PurePosixPath
from typing import Any, Iterable

import yaml
from jsonschema import Draft202012Validator

from .io import load_schema, to_jsonable, get_path
from .runblock import RunBlock, is_expansion, parse_run

__all__ = ["Finding", "schema_errors", "lint", "load_known_flags", "has_errors"]

ERROR = "error"
WARNING = "warning"

# slime's two training entrypoints at the repository root (reference notes 1.3:
# "train.py vs train_async.py (repo root)").
_SLIME_ENTRYPOINTS = ("train.py", "train_async.py")
_ASYNC_ENTRYPOINT = "train_async.py"

# argparse `choices` of Megatron-LM 1dcf0daf megatron/training/arguments.py for the flags
# lint checks by value (--recompute-granularity/-method in _add_training_args,
# --moe-token-dispatcher-type in _add_moe_args, --attention-backend = AttnBackend enum names).
_FLAG_CHOICES = {
    "--recompute-granularity": ("full", "selective"),
    "--recompute-method": ("uniform", "block"),
    "--moe-token-dispatcher-type": ("allgather", "alltoall", "flex"),
    "--attention-backend": ("flash", "fused", "unfused", "local", "auto"),
}

# Layout field <- run flag, with the value the run gets when the flag is absent.
# Defaults: Megatron-LM 1dcf0daf arguments.py (parallel sizes default to 1, recompute and
# layer-split flags to None, --sequence-parallel off); slime arguments.py for
# --max-tokens-per-gpu (None). "none" is the layout's name for "no --recompute-granularity".
# --expert-tensor-parallel-size defaults to the TP size (Megatron validate_args), handled in
# code. Kind: int | str | switch.
_LAYOUT_FLAGS: tuple[tuple[str, tuple[str, ...], str, Any], ...] = (
    ("--tensor-model-parallel-size", ("tp",), "int", 1),
    ("--pipeline-model-parallel-size", ("pp",), "int", 1),
    ("--context-parallel-size", ("cp",), "int", 1),
    ("--expert-model-parallel-size", ("ep",), "int", 1),
    ("--expert-tensor-parallel-size", ("etp",), "int", None),
    ("--decoder-first-pipeline-num-layers", ("layer_split", "first"), "int", None),
    ("--decoder-last-pipeline-num-layers", ("layer_split", "last"), "int", None),
    ("--recompute-granularity", ("recompute", "granularity"), "str", "none"),
    ("--recompute-method", ("recompute", "method"), "str", None),
    ("--recompute-num-layers", ("recompute", "num_layers"), "int", None),
    ("--max-tokens-per-gpu", ("max_tokens_per_gpu",), "int", None),
    ("--sequence-parallel", ("sequence_parallel",), "switch", False),
    ("--num-virtual-stages-per-pipeline-rank", ("vpp",), "int", 1),
    ("--moe-token-dispatcher-type", ("dispatcher",), "str", None),
)
# Layout keys compared only when the recipe has them (attune's optional layout keys).
_OPTIONAL_LAYOUT_SWITCHES = (
    ("--use-precision-aware-optimizer", "precision_aware_optimizer"),
)
# Megatron-LM default of --optimizer-offload-fraction (arguments.py, _add_training_args).
_DEFAULT_OFFLOAD_FRACTION = 1.0
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

def _fmt_path(parts: Iterable[Any]) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out or "(root)"


def _join(path: str, key: str) -> str:
    return key if path == "(root)" else f"{path}.{key}"


def _schema_issues(recipe: Any) -> list[tuple[str, str]]:
    schema = load_schema()
    validator = Draft202012Validator(schema)
    issues: list[tuple[str, str]] = []
    for err in validator.iter_errors(to_jsonable(recipe)):
        path = _fmt_path(err.absolute_path)
        inst = err.instance
        if err.validator == "required" and isinstance(inst, dict):
            for key in err.validator_value:
                if key not in inst:
                    issues.append((_join(path, key), "required key is missing"))
        elif err.validator == "additionalProperties" and isinstance(inst, dict):
            props = err.schema.get("properties", {})
            patterns = err.schema.get("patternProperties", {})
            for key in inst:
                if key not in props and not any(re.search(pat, key) for pat in patterns):
                    issues.append((_join(path, str(key)), "unexpected key"))
        elif err.validator == "enum":
            issues.append((path, f"{_short.repr(inst)} is not one of {err.validator_value!r}"))
        elif err.validator == "type":
            want = err.validator_value
            want_s = " or ".join(want) if isinstance(want, list) else want
            issues.append((path, f"{_short.repr(inst)} is not of type {want_s}"
                                 f" (got {type(inst).__name__})"))
        else:
            msg = err.message
            if len(msg) > 200:
                msg = msg[:197] + "..."
            issues.append((path, msg))
    seen: set[tuple[str, str]] = set()
    unique = []
    for item in sorted(issues):
        if item not in seen:
            seen.add(item)
            unique.append(item)
    return unique


def schema_errors(recipe: Any) -> list[str]:
    """Schema violations, each 'json.path: what is wrong'. Empty when the recipe is valid.
    Dates (YAML reads `2026-10-18` as a date) are checked as ISO strings."""
    return [f"{path}: {msg}" for path, msg in _schema_issues(recipe)]


# ------------------------------------------------------------------- lint helpers

def load_known_flags() -> dict[str, Any]:
    """known_flags.yaml as {"flags": {flag: kind}, "origin": {flag: group},
    "prefixes": {prefix: kind}}."""
    text = resources.files("attune.recipe").joinpath("known_flags.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text) or {}
    flags: dict[str, str] = {}
    origin: dict[str, str] = {}
    for group, entries in data.items():
        if group == "prefixes" or not isinstance(entries, dict):
            continue
        for flag, kind in entries.items():
            flags[flag] = kind
            origin[flag] = group
    return {"flags": flags, "origin": origin, "prefixes": dict(data.get("prefixes") or {})}


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


def _kind(flag: str, known: dict[str, Any]) -> str | None:
    kind = known["flags"].get(flag)
    if kind is None:
        for prefix, pkind in known["prefixes"].items():
            if flag.startswith(prefix):
                return pkind
    return kind


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


def _check_flags(rb: RunBlock, known: dict[str, Any], out: list[Finding]) -> None:
    seen: dict[str, int] = {}
    for flag, args in rb.flag_args:
        if is_expansion(flag):
            continue
        seen[flag] = seen.get(flag, 0) + 1
        if seen[flag] == 2:
            out.append(Finding(WARNING, "run", f"{flag} is given more than once (argparse keeps the last)"))
        kind = _kind(flag, known)
        if kind is None:
            out.append(Finding(WARNING, "run", f"unknown flag {flag}: not a known slime or Megatron-LM flag"))
            continue
        if kind == "switch" and args:
            out.append(Finding(ERROR, "run", f"{flag} takes no value but is followed by {' '.join(args)!r}"))
        elif kind == "value" and len(args) != 1:
            what = "no value" if not args else f"{len(args)} values ({' '.join(args)!r})"
            out.append(Finding(ERROR, "run", f"{flag} takes one value, got {what}"))
        elif kind == "values" and not args and flag not in ("--spec", "--recompute-modules"):
            out.append(Finding(ERROR, "run", f"{flag} needs at least one value"))
        choices = _FLAG_CHOICES.get(flag)
        if choices and len(args) == 1 and not _SHELL_EXPR_RE.search(args[0]) and args[0] not in choices:
            out.append(Finding(ERROR, "run", f"{flag} {args[0]!r} is not one of {list(choices)}"))
    for word in rb.positionals:
        out.append(Finding(ERROR, "run", f"stray argument {word!r} after the entrypoint (not a flag value)"))


def _run_value(flags: dict[str, str | None], flag: str, kind: str, default: Any) -> tuple[bool, Any]:
    """(known, value) of a layout flag in the run; known is False for shell expressions."""
    if flag not in flags:
        return True, default
    raw = flags[flag]
    if kind == "switch":
        return True, True
    if raw is None or _SHELL_EXPR_RE.search(raw):
        return False, raw
    if kind == "int":
        v = _as_int(raw)
        return (v is not None), (v if v is not None else raw)
    return True, raw


def _check_layout_agreement(recipe: dict, rb: RunBlock, out: list[Finding]) -> None:
    layout = recipe.get("layout")
    if not isinstance(layout, dict):
        return
    flags = rb.flag_dict()
    opaque = any(is_expansion(k) for k, _ in rb.flags)
    for flag, keys, kind, default in _LAYOUT_FLAGS:
        path = "layout." + ".".join(keys)
        want = _get(layout, *keys)
        if flag == "--expert-tensor-parallel-size":
            ok, tp = _run_value(flags, "--tensor-model-parallel-size", "int", 1)
            default = tp if ok else None
        if keys == ("vpp",) and want is None:
            want = 1
        if keys == ("recompute", "granularity") and want is None:
            want = "none"
        if flag == "--num-virtual-stages-per-pipeline-rank" and flag not in flags \
                and "--num-layers-per-virtual-pipeline-stage" in flags:
            out.append(Finding(WARNING, path, "run sets VPP with --num-layers-per-virtual-pipeline-stage; "
                                              "lint cannot compare it with layout.vpp"))
            continue
        ok, got = _run_value(flags, flag, kind, default)
        if not ok:
            out.append(Finding(WARNING, path, f"cannot compare {flag} {got!r} (a shell expression) with {want!r}"))
            continue
        if got == want:
            continue
        if flag in flags:
            shown = flag if kind == "switch" else f"{flag} {flags[flag]}"
            out.append(Finding(ERROR, path, f"run has {shown}, layout says {want!r}"))
        else:
            sev = WARNING if opaque else ERROR
            hint = " (it may come from an opaque ${...[@]} expansion)" if opaque else ""
            out.append(Finding(sev, path, f"run does not set {flag} (so {got!r}), layout says {want!r}{hint}"))
    for flag, key in _OPTIONAL_LAYOUT_SWITCHES:
        if key in layout and isinstance(layout[key], bool) and (flag in flags) != layout[key]:
            has = "has" if flag in flags else "does not have"
            out.append(Finding(ERROR, f"layout.{key}", f"run {has} {flag}, layout says {layout[key]!r}"))
    offload = layout.get("offload")
    has_offload = "--optimizer-cpu-offload" in flags
    if offload is None and has_offload:
        out.append(Finding(ERROR, "layout.offload", "run has --optimizer-cpu-offload, layout says no offload (null)"))
    elif isinstance(offload, dict):
        if not has_offload:
            out.append(Finding(ERROR, "layout.offload", "layout has optimizer offload, run lacks --optimizer-cpu-offload"))
        else:
            frac = _as_float(flags.get("--optimizer-offload-fraction")) \
                if "--optimizer-offload-fraction" in flags else _DEFAULT_OFFLOAD_FRACTION
            if frac is not None and isinstance(offload.get("fraction"), (int, float)) \
                    and abs(frac - float(offload["fraction"])) > 1e-9:
                out.append(Finding(ERROR, "layout.offload.fraction",
                                   f"run offloads fraction {frac}, layout says {offload['fraction']!r}"))
            overlap = "--overlap-cpu-optimizer-d2h-h2d" in flags
            if isinstance(offload.get("overlap"), bool) and overlap != offload["overlap"]:
                has = "has" if overlap else "does not have"
                out.append(Finding(ERROR, "layout.offload.overlap",
                                   f"run {has} --overlap-cpu-optimizer-d2h-h2d, layout says {offload['overlap']!r}"))


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


def _check_layout(recipe: dict, out: list[Finding]) -> None:
    layout = recipe.get("layout")
    if not isinstance(layout, dict):
        return
    tp, pp, cp, dp, ep, etp = (layout.get(k) for k in ("tp", "pp", "cp", "dp", "ep", "etp"))
    count = _get(recipe, "gpu", "count")
    if all(_is_int(v) for v in (tp, pp, cp, dp, count)) and tp * pp * cp * dp != count:
        out.append(Finding(ERROR, "layout.dp", f"TP {tp} x PP {pp} x CP {cp} x DP {dp} = {tp * pp * cp * dp} "
                                               f"GPUs, gpu.count is {count}"))
    # MoE parallel folding: expert groups (EP x ETP) tile the TP x CP x DP ranks of a stage
    if all(_is_int(v) and v > 0 for v in (tp, cp, dp, ep, etp)) and (tp * cp * dp) % (ep * etp):
        out.append(Finding(ERROR, "layout.ep", f"EP {ep} x ETP {etp} does not divide TP x CP x DP = {tp * cp * dp}"))
    if layout.get("sequence_parallel") is True and tp == 1:
        out.append(Finding(WARNING, "layout.sequence_parallel",
                           "sequence parallel with TP 1: Megatron-LM turns it off"))
    vpp = layout.get("vpp")
    if _is_int(vpp) and vpp > 1 and pp == 1:
        out.append(Finding(ERROR, "layout.vpp", f"VPP {vpp} needs PP > 1"))
    split = layout.get("layer_split")
    if isinstance(split, dict) and pp == 1 and (split.get("first") is not None or split.get("last") is not None):
        out.append(Finding(ERROR, "layout.layer_split", "first/last stage layer counts need PP > 1"))
    rec = layout.get("recompute")
    if isinstance(rec, dict):
        gran = rec.get("granularity")
        if gran == "full" and (rec.get("method") is None or rec.get("num_layers") is None):
            out.append(Finding(WARNING, "layout.recompute", "full recompute without method and num_layers"))
        if gran != "full" and (rec.get("method") is not None or rec.get("num_layers") is not None):
            out.append(Finding(WARNING, "layout.recompute",
                               f"method/num_layers only apply to full recompute (granularity is {gran!r})"))
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
    out: list[Finding] = [Finding(ERROR, path, msg) for path, msg in _schema_issues(recipe)]
    if not isinstance(recipe, dict):
        return out
    run = recipe.get("run")
    if isinstance(run, str) and run.strip():
        rb = parse_run(run)
        script = _check_entrypoint(rb, out)
        _check_flags(rb, load_known_flags(), out)
        _check_layout_agreement(recipe, rb, out)
        _check_run_vs_recipe(recipe, rb, script, out)
    _check_layout(recipe, out)
    _check_status(recipe, out)
    return out
