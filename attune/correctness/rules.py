"""Numerics rules: which argument differences between two arms need which correctness tests.

The classes, the tests and the fnmatch patterns live in `numerics_rules.yaml` beside this module (its
header documents them); each flag's own class, required tests, default and switch-ness come from the
flag table, `attune/spec/megatron_flags.yaml` (`attune.spec.flags.flag_table`). `diff_args` compares
the training arguments of a reference arm and a candidate arm and classes each difference;
`required_tests` says what must pass; `unverified_reasons` says why a recipe cannot be called verified
given the tests that ran.
"""

from __future__ import annotations

import fnmatch
import math
import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

import yaml

from attune.spec.flags import TABLE_FILE, FlagSpec, flag_table

RULES_PATH = Path(__file__).with_name("numerics_rules.yaml")

CONVERGENCE = "convergence"
CLASSES = ("layout", "numerics", "unknown")

Args = Union[str, Sequence[str], Mapping[str, Any]]


class UnknownArgumentWarning(UserWarning):
    """A differing flag that the numerics rules do not class."""


@dataclass(frozen=True)
class Rule:
    match: str  # the flag, or an fnmatch pattern
    cls: str
    requires: tuple[str, ...]  # tests beyond `convergence`
    default: str | None = None
    is_bool: bool = False
    note: str | None = None


@dataclass(frozen=True)
class Rules:
    args: Mapping[str, Rule]
    patterns: tuple[Rule, ...]
    tests: Mapping[str, str]
    version: int = 1

    def lookup(self, flag: str) -> Rule | None:
        if flag in self.args:
            return self.args[flag]
        for rule in self.patterns:
            if fnmatch.fnmatchcase(flag, rule.match):
                return rule
        return None


@dataclass(frozen=True)
class ArgDiff:
    flag: str
    reference: str | None  # normalised value; None when absent with no known default
    candidate: str | None
    cls: str  # layout | numerics | unknown
    requires: tuple[str, ...]  # every test this difference needs, `convergence` first
    note: str | None = None
    warning: str | None = None


def _parse_rule(match: str, entry: Mapping[str, Any], tests: Mapping[str, str]) -> Rule:
    if not isinstance(entry, Mapping) or "class" not in entry:
        raise ValueError(f"numerics rule {match!r} has no class")
    cls = entry["class"]
    if cls not in ("layout", "numerics"):
        raise ValueError(f"numerics rule {match!r}: class {cls!r} is not layout or numerics")
    requires = tuple(entry.get("requires") or ())
    for test in requires:
        if test not in tests:
            raise ValueError(f"numerics rule {match!r} requires unknown test {test!r}")
    default = entry.get("default")
    return Rule(match=match, cls=cls, requires=requires,
                default=None if default is None else _norm_value(default),
                is_bool=entry.get("type") == "bool", note=entry.get("note"))


def _table_rule(spec: FlagSpec, tests: Mapping[str, str]) -> Rule:
    """The rule of a classed flag of the flag table: its class, tests, default and switch-ness."""
    for test in spec.requires:
        if test not in tests:
            raise ValueError(f"{TABLE_FILE}: {spec.name} requires unknown test {test!r}")
    switch = spec.arity == "switch"
    default = None if switch or spec.default is None else _norm_value(spec.default)
    return Rule(match=spec.name, cls=spec.cls, requires=spec.requires, default=default, is_bool=switch,
                note=spec.note)


def load_rules(path: str | Path | None = None) -> Rules:
    """Load and validate the numerics rules: the classed flags of the flag table plus the classes, tests
    and patterns of `numerics_rules.yaml` (or of `path`; an `args:` mapping there adds or overrides
    per-flag rules in the same form as the table's `class`/`requires`/`default`/`type: bool`)."""
    data = yaml.safe_load(Path(path or RULES_PATH).read_text())
    tests = dict(data.get("tests") or {})
    if CONVERGENCE not in tests:
        raise ValueError("numerics rules must define the convergence test")
    args = {name: _table_rule(spec, tests) for name, spec in flag_table().items() if spec.cls is not None}
    for flag, entry in (data.get("args") or {}).items():
        if not str(flag).startswith("--"):
            raise ValueError(f"numerics rule {flag!r} is not a --flag")
        args[_norm_flag(flag)] = _parse_rule(_norm_flag(flag), entry, tests)
    patterns = tuple(_parse_rule(p["pattern"], p, tests) for p in (data.get("patterns") or ()))
    return Rules(args=args, patterns=patterns, tests=tests, version=int(data.get("version", 1)))


# --------------------------------------------------------------------------------------------
# Argument parsing


def _norm_flag(flag: str) -> str:
    """`tensor_model_parallel_size`, `--tensor-model-parallel-size` -> `--tensor-model-parallel-size`."""
    return "--" + str(flag).lstrip("-").replace("_", "-")


def _norm_value(value: Any) -> str:
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, (list, tuple)):
        return " ".join(_norm_value(v) for v in value)
    return str(value)


def parse_args(args: Args) -> dict[str, str]:
    """Flag -> value string from an argv list, a shell command string or a mapping.

    Tokens before the first `--flag` are ignored (the program); a flag's value is every following
    token up to the next `--flag`, joined by spaces; a flag without a value is `"true"`.
    `--flag=value` is accepted. Mapping keys may use Megatron's underscore names.
    """
    if isinstance(args, Mapping):
        out = {}
        for key, value in args.items():
            if value is None:
                continue
            out[_norm_flag(key)] = _norm_value(value)
        return out
    tokens = shlex.split(args.replace("\\\n", " ")) if isinstance(args, str) else list(args)
    out: dict[str, str] = {}
    current: str | None = None
    values: list[str] = []

    def flush():
        if current is not None:
            out[current] = " ".join(values) if values else "true"

    for tok in tokens:
        if tok.startswith("--") and len(tok) > 2:
            flush()
            if "=" in tok:
                name, val = tok.split("=", 1)
                current, values = _norm_flag(name), [val]
            else:
                current, values = _norm_flag(tok), []
        elif current is not None:
            values.append(tok)
    flush()
    return out


def _same_value(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.lower() == b.lower():
        return True
    try:
        fa, fb = float(a), float(b)
    except ValueError:
        return False
    return fa == fb or (math.isnan(fa) and math.isnan(fb))


def _effective(value: str | None, rule: Rule | None) -> str | None:
    if value is not None:
        return value
    if rule is None:
        return None
    if rule.is_bool:
        return "false"
    return rule.default


# --------------------------------------------------------------------------------------------
# Diffs and verdicts


def diff_args(reference_args: Args, candidate_args: Args,
              rules: Rules | None = None) -> list[ArgDiff]:
    """Every flag whose effective value differs between the two arms, classed by the rules.

    An absent flag takes its known default (false for switches) before comparing. Unknown flags
    that differ are classed `unknown`, need `convergence`, and raise `UnknownArgumentWarning`.
    """
    rules = rules if rules is not None else load_rules()
    ref = parse_args(reference_args)
    cand = parse_args(candidate_args)
    diffs: list[ArgDiff] = []
    for flag in sorted(set(ref) | set(cand)):
        rule = rules.lookup(flag)
        r = _effective(ref.get(flag), rule)
        c = _effective(cand.get(flag), rule)
        if _same_value(r, c):
            continue
        if rule is None:
            msg = (f"{flag} differs (reference {r!r}, candidate {c!r}) and is not classed in the "
                   f"numerics rules; only the convergence check covers it: class it in "
                   f"attune/spec/{TABLE_FILE}")
            warnings.warn(msg, UnknownArgumentWarning, stacklevel=2)
            diffs.append(ArgDiff(flag, r, c, "unknown", (CONVERGENCE,), None, msg))
        else:
            requires = (CONVERGENCE,) + tuple(t for t in rule.requires if t != CONVERGENCE)
            diffs.append(ArgDiff(flag, r, c, rule.cls, requires, rule.note))
    return diffs


def required_tests(diffs: Sequence[ArgDiff]) -> set[str]:
    """Tests that must pass; `convergence` is always required for an arm comparison."""
    needed = {CONVERGENCE}
    for d in diffs:
        needed.update(d.requires)
    return needed


def unverified_reasons(diffs: Sequence[ArgDiff], tests_run: Mapping[str, bool]) -> list[str]:
    """Why the candidate cannot be called verified; empty when every required test passed.

    `tests_run` maps a test name to whether it passed; a test absent from it did not run.
    """
    reasons: list[str] = []
    conv = tests_run.get(CONVERGENCE)
    if conv is None:
        reasons.append("the convergence check did not run (required for every arm comparison)")
    elif not conv:
        reasons.append("the convergence check failed")
    for d in diffs:
        for test in d.requires:
            if test == CONVERGENCE:
                continue
            status = tests_run.get(test)
            if status:
                continue
            what = "did not run" if status is None else "failed"
            reasons.append(f"{d.flag} differs (reference {d.reference!r}, candidate "
                           f"{d.candidate!r}), a {d.cls} argument that needs {test!r}, "
                           f"which {what}")
    return reasons


def rule_warnings(diffs: Sequence[ArgDiff]) -> list[str]:
    return [d.warning for d in diffs if d.warning]
