"""The one parser from a recipe to what it describes: model, cluster, engine, layout and workload.

``recipe_target`` is what ``attune estimate --recipe``, ``attune verify`` and ``attune slime command``
call; it reads

* ``model`` (a bundled model name or a config.json path),
* ``gpu`` (``count``, ``type``, ``per_node``; absent ``per_node``: all GPUs on one node),
* ``layout`` (through ``attune.recipe.codec``; DP derived from the cluster's world size),
* ``workload`` (``row_tokens``, ``global_batch``) over a base workload, ``result.steps_per_run`` and
  ``result.window`` (the measured run's steps),
* the hyper-parameters of the ``run`` block's flags (``--lr``, ``--min-lr``, ``--lr-decay-style``,
  ``--lr-warmup-fraction``, ``--weight-decay``, ``--adam-beta1``, ``--adam-beta2``, ``--seed``; a shell
  expansion such as ``$LR`` keeps the base value),

and checks the layout with ``attune.spec.rules.check``. The precision-aware optimizer has ONE default:
the layout block's ``precision_aware_optimizer`` when given, else the run block's
``--use-precision-aware-optimizer`` when the recipe has a run block, else ``Layout``'s default (off).
Every problem is a one-line ``RecipeError`` naming the recipe path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from attune.errors import RecipeError, UserInputError
from attune.recipe.codec import from_recipe_blocks
from attune.recipe.models import Gpu, LayoutBlock, Recipe, Result, WorkloadBlock, validate_block
from attune.recipe.runblock import parse_run, unclosed_quote
from attune.spec.engine import DEFAULT_ENGINE, Engine, get_engine
from attune.spec.flags import LAYOUT_FLAGS, WORKLOAD_FLAGS
from attune.spec.hardware import Cluster, parse_cluster
from attune.spec.knob_registry import IDENTITY, recipe_paths
from attune.spec.layout import Layout, Workload
from attune.spec.model import ModelSpec, load_model
from attune.spec.rules import check, derive_dp

__all__ = ["RecipeTarget", "recipe_target", "HYPER_PARAMETERS"]

# Workload fields a recipe's run flags set (the optimizer's hyper-parameters and the seed); the flag of
# each comes from attune.spec.flags' table. Batch and row length come from the workload block instead.
HYPER_PARAMETERS = ("lr", "min_lr", "lr_decay_style", "warmup_fraction", "weight_decay", "adam_beta1",
                    "adam_beta2", "seed")
_HYPER_FLAGS = {flag: (name, kind) for flag, (name, kind) in WORKLOAD_FLAGS.items() if name in HYPER_PARAMETERS}
_PRECISION_AWARE_FLAG = next(f for f, (name, _) in LAYOUT_FLAGS.items() if name == "precision_aware_optimizer")


@dataclass(frozen=True, kw_only=True)
class RecipeTarget:
    """What a recipe describes, as attune's typed values."""

    model: ModelSpec
    """The model of the recipe's ``model`` field (or the caller's override)."""
    cluster: Cluster
    """The GPUs of the recipe's ``gpu`` block (or the caller's override)."""
    engine: Engine
    """The training engine the layout is judged for."""
    layout: Layout
    """The recipe's layout, DP derived from the cluster's world size."""
    workload: Workload
    """The base workload with the recipe's rows, batch, steps and run-flag hyper-parameters."""
    source: str
    """Where the target came from, for messages (e.g. ``recipe recipes/x.yaml``)."""


def _one_line(text: Any) -> str:
    return " ".join(str(text).split()) or "unknown error"


@dataclass(frozen=True, kw_only=True)
class _Parts:
    """The blocks recipe_target reads, typed: a Recipe's own, or those of a mapping as read (each block validated
    where it is read, so a message names its path)."""

    layout: LayoutBlock
    workload: WorkloadBlock | None
    result: Result | None
    run: Any


def _parts(recipe: Any, source: str) -> _Parts:
    if isinstance(recipe, Recipe):
        return _Parts(layout=recipe.layout, workload=recipe.workload,
                      result=recipe.result, run=recipe.run)
    if "layout" not in recipe:
        raise RecipeError(f"{source} layout: required key is missing")
    r = recipe
    return _Parts(layout=validate_block(r["layout"], LayoutBlock, "layout", source),
                  workload=validate_block(r["workload"], WorkloadBlock, "workload", source)
                  if r.get("workload") is not None else None,
                  result=validate_block(r["result"], Result, "result", source) if r.get("result") is not None else None,
                  run=r.get("run"))


def _model(name: Any, override: str | ModelSpec | None, source: str) -> ModelSpec:
    if isinstance(override, ModelSpec):
        return override
    name = override if override is not None else name
    if override is None and not (isinstance(name, str) and name):
        raise RecipeError(f"{source} model: required key is missing (a bundled model name or a config.json path)")
    try:
        return load_model(name)
    except UserInputError as e:
        raise RecipeError(f"{source} model: {_one_line(e)}") from None


def _cluster(gpu: Any, override: str | Cluster | None, source: str) -> Cluster:
    if isinstance(override, Cluster):
        return override
    if override is not None:
        return parse_cluster(override)
    if gpu is None:
        raise RecipeError(f"{source} gpu: required key is missing (count and type of the GPUs)")
    gpu = validate_block(gpu, Gpu, "gpu", source)
    per = gpu.per_node if gpu.per_node is not None else gpu.count
    if gpu.count % per:
        raise RecipeError(f"{source} gpu.count: {gpu.count} GPUs is not a multiple of gpu.per_node {per}")
    try:
        return parse_cluster(f"{gpu.count}x{gpu.type}", per)
    except UserInputError as e:
        raise RecipeError(f"{source} gpu: {_one_line(e)}") from None


def _run_flags(run: Any, source: str) -> dict[str, str | None] | None:
    """The run block's flags (flag -> value, None for a switch); None without a run block."""
    if run is None:
        return None
    if not isinstance(run, str):
        raise RecipeError(f"{source} run: Input should be a valid string (got {type(run).__name__})")
    if not run.strip():
        return None
    q = unclosed_quote(run)
    if q:
        raise RecipeError(f"{source} run: an unclosed quotation ({q}); the words after it would run as one")
    return parse_run(run).flag_dict()


# Layout fields with no recipe key: a recipe carries them in its run flags only (their recipe path in the knob
# registry is run.flags: the MoE kernel switches, the overlap flags, the numerics-class options)
_NUMERICS_LAYOUT = {flag: (name, kind) for flag, (name, kind) in LAYOUT_FLAGS.items()
                    if name in {f for item in IDENTITY if recipe_paths(item) == ("run.flags",) for f in item.covers}}


def _numerics_fields(flags: dict[str, str | None], source: str) -> dict[str, Any]:
    """The Layout fields of the run flags that the layout block does not name (`_NUMERICS_LAYOUT`: MoE kernel
    switches, communication overlap, ``--moe-expert-capacity-factor``, ``--mtp-num-layers``, low precision ...);
    dropping them would change the recipe's layout."""
    out: dict[str, Any] = {}
    for flag, (name, kind) in _NUMERICS_LAYOUT.items():
        if flag not in flags:
            continue
        value = flags[flag]
        if kind == "bool":
            out[name] = True
            continue
        if value is None or value.startswith("$"):
            continue
        if kind == "str":  # the low-precision recipe (issue 22)
            out[name] = value
            continue
        try:
            out[name] = int(value) if kind == "int" else float(value)
        except ValueError:
            raise RecipeError(f"{source} run: {flag} {value!r} is not a number") from None
    return out


def _hyper_parameters(flags: dict[str, str | None]) -> dict[str, Any]:
    upd: dict[str, Any] = {}
    for flag, (name, kind) in _HYPER_FLAGS.items():
        value = flags.get(flag)
        if value is None:
            continue
        try:
            upd[name] = {"int": int, "float": float}.get(kind, str)(value)
        except ValueError:
            pass  # a shell expansion ($LR): the base workload's value stays
    return upd


def _steps(result: Result | None) -> dict[str, Any]:
    if result is None:
        return {}
    upd: dict[str, Any] = {}
    if result.steps_per_run is not None:
        upd["steps"] = result.steps_per_run
    if result.window is not None:
        upd["window"] = (result.window[0], result.window[1])
    return upd


def recipe_target(recipe: dict | Recipe, *, engine: str | Engine | None = None, base_workload: Workload | None = None,
                  gpus: str | Cluster | None = None, model: str | ModelSpec | None = None,
                  source: str = "recipe", check_rules: bool = True) -> RecipeTarget:
    """The model, cluster, engine, layout and workload of ``recipe`` (a mapping from ``load_recipe`` or a
    ``Recipe``), checked with ``attune.spec.rules.check``.

    engine: engine name (default ``slime``); base_workload: the workload the recipe's values are laid
    over (default ``Workload()``); gpus: a GPU spec (``8xH200``) or a ``Cluster`` in place of the
    ``gpu`` block (DP is re-derived for it); model: a model name/path or ``ModelSpec`` in place of the
    ``model`` field; source: how messages name the recipe (e.g. its path); check_rules=False skips
    ``attune.spec.rules.check`` (``attune verify`` reports rule violations as its configuration check).
    Raises ``RecipeError`` (one line with the recipe path) or another ``UserInputError`` of the override.
    """
    if not isinstance(recipe, (Recipe, dict)):
        raise RecipeError(f"{source}: expected a mapping of recipe fields, got {type(recipe).__name__}")
    m = _model(recipe.model if isinstance(recipe, Recipe) else recipe.get("model"), model, source)
    cluster = _cluster(recipe.gpu if isinstance(recipe, Recipe) else recipe.get("gpu"), gpus, source)
    eng = engine if isinstance(engine, Engine) else get_engine(engine or DEFAULT_ENGINE)

    p = _parts(recipe, source)
    layout_block, workload_block, result = p.layout, p.workload, p.result
    flags = _run_flags(p.run, source)
    precision_aware = None if flags is None else _PRECISION_AWARE_FLAG in flags

    try:
        layout, workload = from_recipe_blocks(
            layout_block.model_dump(exclude_unset=True),
            workload_block.model_dump(exclude_unset=True) if workload_block else None,
            base_workload or Workload(), precision_aware_default=precision_aware)
        layout = replace(layout, dp=derive_dp(cluster.world_size, layout.tp, layout.pp, layout.cp))
        if flags:  # the fields that live in the run flags only (the layout block names EP, ETP, dispatcher)
            layout = replace(layout, **_numerics_fields(flags, source))
    except UserInputError as e:
        raise RecipeError(f"{source} layout: {_one_line(e)}") from None
    try:
        upd = _steps(result)
        if "steps" in upd and "window" not in upd:
            workload = workload.with_steps(upd.pop("steps"))
        if flags:
            upd.update(_hyper_parameters(flags))
        workload = replace(workload, **upd)
    except UserInputError as e:
        raise RecipeError(f"{source} workload: {_one_line(e)}") from None
    if eng.forces_distributed_optimizer and not layout.distributed_optimizer:
        layout = replace(layout, distributed_optimizer=True)
    errors = check(layout, m, cluster.world_size, workload, eng) if check_rules else []
    if errors:
        raise RecipeError(f"{source} layout: {'; '.join(errors)}")
    return RecipeTarget(model=m, cluster=cluster, engine=eng, layout=layout, workload=workload, source=source)
