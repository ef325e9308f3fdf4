"""The options of attune's commands as data: one dataclass per command, each default written once, each field with
its docstring (the CLI's help text) and how the command line spells it (``attune.cli.options.add_options`` builds the
argparse options from these fields; ``attune.api.tune`` takes a ``TuneOptions``).

A field's ``metadata["cli"]`` is a :class:`Cli`: the flag (default ``--`` + the field name with dashes), the value
type by name (``kind``, mapped to a ranged argparse type by the CLI), the choices, and how a boolean is switched.
Fields without ``cli`` metadata are API-only.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from attune.runners.registry import TRIAL_KINDS, runner_names
from attune.search.storage import CONNECT_TIMEOUT_S
from attune.spec.engine import ENGINES

__all__ = ["Cli", "TargetOptions", "TuneOptions", "RunOptions", "VerifyOptions", "SAMPLERS", "HEARTBEAT_INTERVAL_S",
           "GRACE_PERIOD_S", "field_docs", "cli_fields"]

# proposal mechanisms of `--sampler` (attune.search.tuner)
SAMPLERS = ("model", "tpe")
# heartbeat of a measured trial (seconds; Optuna takes integers) and the silence after which it is stale:
# SQLite stores heartbeat times to the second, so the grace period spans several beats
HEARTBEAT_INTERVAL_S, GRACE_PERIOD_S = 5, 20


@dataclass(frozen=True, kw_only=True)
class Cli:
    """How the command line spells one option."""

    flag: str | None = None
    """The option string; None: ``--`` + the field name with dashes."""
    kind: str | None = None
    """Value type by name: positive_int, nonnegative_int, positive_float, fraction, unit_interval; None: text."""
    choices: tuple | None = None
    """Allowed values (argparse ``choices``)."""
    switch: str | None = None
    """A boolean field: ``on`` (the flag sets True) or ``off`` (the flag sets False)."""
    append: bool = False
    """The flag may repeat; the values are collected in order."""
    metavar: str | None = None
    """The value's name in the help."""
    required: bool = False
    """The command line must give it."""
    positional: bool = False
    """A positional argument (named by the field), not an option."""


def _opt(default: Any = dataclasses.MISSING, **cli: Any) -> Any:
    meta = {"cli": Cli(**cli)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class TargetOptions:
    """What is trained on what: the options ``attune estimate``, ``run`` and ``tune`` share."""

    model: str = _opt(required=True)
    """bundled model name or a config.json path"""
    gpus: str = _opt(required=True)
    """cluster: 8xH200, 16xH100, 2x8xH100, 2xcpu"""
    gpus_per_node: int | None = _opt(None, kind="positive_int")
    """GPUs per node (default: the GPU type's, 8)"""
    engine: str | None = _opt(None, choices=tuple(ENGINES))
    """training engine (default: the runner's, else slime)"""
    seq: int | None = _opt(None, kind="positive_int")
    """tokens per row (default 8192)"""
    global_batch: int | None = _opt(None, kind="positive_int")
    """rows per optimizer step (default 128)"""
    price: float | None = _opt(None, kind="positive_float")
    """USD per GPU-hour (default: the GPU table's)"""


@dataclass(frozen=True, kw_only=True)
class TuneOptions(TargetOptions):
    """The options of ``attune tune`` (``attune.api.tune.tune_config``)."""

    runner: str = _opt(runner_names()[0], choices=runner_names(selectable=True))
    """where measured trials run (attune.runners.registry)"""
    trials: int | None = _opt(None, kind="positive_int")
    """target number of measured trials in the study (default: the runner's)"""
    search_space: str | None = _opt(None)
    """search space: a bundled name (dense, small) or a YAML path"""
    seed: int = _opt(0, kind="nonnegative_int")
    """sampler seed"""
    storage: str | None = _opt(None)
    """Optuna storage URL (default: SQLite study.db in --out)"""
    storage_timeout_s: float = _opt(CONNECT_TIMEOUT_S, flag="--storage-timeout", kind="positive_float")
    """database connection timeout, s"""
    study_name: str | None = _opt(None)
    """name of the study in the storage (default: model, GPUs, runner, engine and space)"""
    heartbeat_interval_s: int = _opt(HEARTBEAT_INTERVAL_S, flag="--heartbeat", kind="positive_int")
    """seconds between a measured trial's heartbeats"""
    grace_period_s: int = _opt(GRACE_PERIOD_S, flag="--grace-period", kind="positive_int")
    """heartbeat silence after which another tuner fails a trial as stale, s"""
    out: str | None = _opt(None)
    """output folder (default ./reports/<model>-<gpus>-<UTC date>/)"""
    candidates: int | None = _opt(None, kind="positive_int")
    """proposals to estimate per measured trial (default: the runner's)"""
    slack: float = _opt(0.8, kind="unit_interval")
    """skip candidates predicted slower than this fraction of the best measured so far"""
    steps: int | None = _opt(None, kind="positive_int")
    """training steps per measured trial"""
    timeout_s: float | None = _opt(None, flag="--timeout", kind="positive_float")
    """seconds per trial before it is killed"""
    cluster_file: str | None = _opt(None, flag="--cluster")
    """cluster YAML for the slime runner"""
    data: str | None = _opt(None)
    """packed rows (parquet from attune data build) for measured trials; default: seeded synthetic rows"""
    trial_kind: str = _opt(TRIAL_KINDS[0], choices=TRIAL_KINDS)
    """slime runner: what each Ray job runs (torch: the torch runner's trial, for local Ray heads)"""
    memory_headroom: float = _opt(0.02, kind="fraction")
    """fraction of GPU memory kept free when judging a predicted fit"""
    sampler: str = _opt(SAMPLERS[0], choices=SAMPLERS)
    """model: expected improvement under the study's recalibrated model; tpe: plain TPE"""
    recalibrate: bool = _opt(True, flag="--no-recalibrate", switch="off")
    """model sampler: refit the model to the study's measurements (--no-recalibrate: do not)"""
    min_gain: float = _opt(0.01, kind="fraction")
    """stop rule: the gain over the best measured worth a trial, a fraction"""
    p_stop: float = _opt(0.05, kind="fraction")
    """stop rule: stop when no layout has more than this probability of that gain"""
    budget_gpu_hours: float | None = _opt(None, kind="positive_float")
    """stop once the measured trials have used this many GPU-hours"""
    measurements: str | None = _opt(None)
    """replay runner: the table of measured outcomes (CSV or YAML, or an earlier trials.csv)"""
    allow_numerics: list[str] = _opt([], append=True, metavar="PRECISION")
    """also search low precision, a numerics change (fp8, or fp8-delayed, fp8-tensorwise, fp8-blockwise, mxfp8,
    nvfp4): the report sets the best one beside the bf16 best"""
    verify: bool = _opt(True, flag="--no-verify", switch="off")
    """check the correctness of a measured winner (--no-verify: skip it)"""
    save_recipe: bool = _opt(False, switch="on")
    """also copy the recipe into ./recipes/<model>/<gpu>/ (tracked recipes are never written otherwise)"""


@dataclass(frozen=True, kw_only=True)
class RunOptions(TargetOptions):
    """The options of ``attune run`` (one measured run; ``attune.api.run.run_once``)."""

    runner: str = _opt("torch", choices=runner_names(selectable=True, needs_measurements=False))
    """where the run runs (attune.runners.registry)"""
    recipe: str | None = _opt(None)
    """read model, GPUs, layout and workload from a recipe YAML"""
    steps: int = _opt(20, kind="positive_int")
    """training steps of the run"""
    timeout_s: float | None = _opt(None, flag="--timeout", kind="positive_float")
    """seconds before the run is killed"""
    out: str | None = _opt(None)
    """output folder (default ./reports/runs/<model>-<layout>-<stamp>/)"""
    cluster_file: str | None = _opt(None, flag="--cluster")
    """cluster YAML for the slime runner"""


@dataclass(frozen=True, kw_only=True)
class VerifyOptions:
    """The options of ``attune verify`` (``attune.api.verify.verify``)."""

    recipe: str = _opt(positional=True)
    """the recipe file to verify"""
    runner: str = _opt(RunOptions.runner, choices=runner_names(selectable=True, measured=True, verifiable=True))
    """where the arms train (attune.runners.registry)"""
    reference: str | None = _opt(None)
    """reference recipe (default: the model's baseline layout)"""
    steps: int = _opt(RunOptions.steps, kind="positive_int")
    """training steps of each arm"""
    negative_control: bool = _opt(False, switch="on")
    """also run arms that must fail (learning rate x10, an inverted loss mask, a broken optimizer)"""
    cluster_file: str | None = _opt(None, flag="--cluster")
    """cluster YAML for the slime runner"""
    out: str | None = _opt(None)
    """output folder (default ./reports/verify/<stamp>/); the verdict's recipe is written there as recipe.yaml"""
    in_place: bool = _opt(False, switch="on")
    """rewrite the recipe file itself with the verdict (only after a measured verdict)"""


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` and its bases (one line, whitespace collapsed)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def cli_fields(cls: type) -> list[tuple[dataclasses.Field, Cli, str]]:
    """(field, its Cli, its help text) of every command-line option of dataclass ``cls``, in field order."""
    docs = field_docs(cls)
    return [(f, f.metadata["cli"], docs.get(f.name, "")) for f in dataclasses.fields(cls) if "cli" in f.metadata]
