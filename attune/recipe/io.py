"""Read and write recipe YAML files in the reference recipe's style.

The written style follows recipes/qwen3.6-27b/h200/attune-tp1-pp4-split16-rb12.yaml:
keys in the order the typed model (``attune.recipe.models.Recipe``) lists them, which is the
reference recipe's order; unknown keys after the known ones in their original order; multi-line
strings (``run``, ``notes``) as literal block scalars; block style everywhere; no anchors or
aliases; unicode kept as is and long lines not folded. Reading then writing the seed recipe gives
back its bytes after the three header comment lines (comments are not kept: ``write_recipe``
takes a ``header`` to write them).

``load_recipe``/``parse_recipe`` return the mapping as written (not validated: ``attune recipe
validate`` reports every problem of a broken file); ``load_recipe_model`` returns the validated
``Recipe``.
"""

from __future__ import annotations

import datetime as _dt
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from attune.errors import RecipeError
from attune.recipe.models import SCHEMA_FILE, Recipe, recipe_json_schema, validate_recipe
from attune.spec.textio import NoAliasLoader

__all__ = [
    "RecipeError",
    "load_schema",
    "load_recipe",
    "load_recipe_model",
    "parse_recipe",
    "dump_recipe",
    "write_recipe",
    "to_jsonable",
]

# Emitter line width: large enough that PyYAML never folds a long string, as in the
# reference recipe where every value sits on one line (PyYAML's default folds at 80).
_NO_FOLD_WIDTH = 1 << 20




def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class _StrictLoader(NoAliasLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML keeps the last silently) and aliases (a 342-byte
    alias bomb expands to gigabytes when the recipe is walked; attune.spec.textio)."""


def _construct_mapping_no_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    loader.flatten_mapping(node)
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                "found an unhashable key", key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"found duplicate key {key!r}", key_node.start_mark)
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping_no_duplicates)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return _one_line(f"{where}{problem}")


def parse_recipe(text: str, source: str = "<string>") -> dict:
    """Parse recipe YAML text; `source` names it in errors. Raises RecipeError."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        raise RecipeError(f"{source}: malformed YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise RecipeError(f"{source}: YAML nested too deeply") from None
    if data is None:
        raise RecipeError(f"{source}: empty file, expected a mapping of recipe fields")
    if not isinstance(data, dict):
        raise RecipeError(
            f"{source}: top level is a {type(data).__name__}, expected a mapping of recipe fields")
    return data


def load_recipe(path: str | Path) -> dict:
    """Load one recipe file. Raises RecipeError (one line, naming the file) when the file is
    missing or unreadable, is not valid YAML, or is not a mapping. Does not validate."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"{p}: no such recipe file") from None
    except IsADirectoryError:
        raise RecipeError(f"{p}: is a directory, expected a recipe file") from None
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{p}: not UTF-8 text ({_one_line(exc.reason)} at byte {exc.start})") from None
    except OSError as exc:
        raise RecipeError(f"{p}: cannot read ({_one_line(exc.strerror or exc)})") from None
    return parse_recipe(text, str(p))


def load_recipe_model(path: str | Path) -> Recipe:
    """Load one recipe file as a validated ``Recipe``. Raises RecipeError (one line, naming the file
    and the first problem's path, e.g. ``r.yaml layout.tp: Input should be a valid integer (got '4')``)."""
    return validate_recipe(load_recipe(path), source=str(path))


def load_schema() -> dict:
    """The published recipe JSON Schema (attune/recipe/recipe.schema.json, generated from ``Recipe``)."""
    try:
        return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    except FileNotFoundError:  # a source tree before `write_schema()` ran: the model is the source
        return recipe_json_schema()


def to_jsonable(value: Any) -> Any:
    """A copy of `value` with dates as ISO strings and tuples as lists (what JSON Schema sees)."""
    if isinstance(value, (_dt.date, _dt.datetime)):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value


# ---------------------------------------------------------------- key order

def _order_tree(schema: dict) -> dict:
    """Nested key order from the schema: {"": [keys], key: subtree}, following $refs only
    into local $defs. Arrays of objects use their item schema's order."""
    defs = schema.get("$defs", {})

    def resolve(node: Any) -> dict:
        seen = 0
        while isinstance(node, dict) and seen < 8:
            if "$ref" in node:
                ref = node["$ref"]
                node = defs.get(ref.rsplit("/", 1)[-1], {}) if ref.startswith("#/$defs/") else {}
            elif "anyOf" in node:  # an optional block: {anyOf: [{$ref: ...}, {type: null}]}
                node = next((b for b in node["anyOf"] if isinstance(b, dict) and b.get("type") != "null"), {})
            else:
                break
            seen += 1
        return node if isinstance(node, dict) else {}

    def walk(node: Any) -> dict:
        node = resolve(node)
        tree: dict = {}
        props = node.get("properties")
        if isinstance(props, dict):
            tree[""] = list(props)
            for key, sub in props.items():
                child = walk(sub)
                if child:
                    tree[key] = child
        items = node.get("items")
        if isinstance(items, dict):
            child = walk(items)
            if child:
                tree["[]"] = child
        return tree

    return walk(schema)


@lru_cache(maxsize=1)
def _key_order() -> dict:
    return _order_tree(recipe_json_schema())


def _plain(value: Any) -> Any:
    """numpy scalars / arrays and tuples to plain Python, so SafeDumper can write them."""
    mod = type(value).__module__
    if mod == "numpy" or mod.startswith("numpy."):
        if hasattr(value, "tolist"):
            return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return value


def _ordered(value: Any, tree: dict) -> Any:
    value = _plain(value)
    if isinstance(value, dict):
        order = tree.get("", [])
        keys = [k for k in order if k in value] + [k for k in value if k not in order]
        return {k: _ordered(value[k], tree.get(k, {}) if isinstance(k, str) else {}) for k in keys}
    if isinstance(value, list):
        item_tree = tree.get("[]", {})
        return [_ordered(v, item_tree) for v in value]
    return value


# ---------------------------------------------------------------- dumper

class _RecipeDumper(yaml.SafeDumper):
    """SafeDumper without aliases and with literal blocks for multi-line strings."""

    def ignore_aliases(self, data: Any) -> bool:  # noqa: D102 - PyYAML hook
        return True


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_RecipeDumper.add_representer(str, _represent_str)


def dump_recipe(recipe: dict | Recipe, header: str | None = None) -> str:
    """The recipe (a mapping or a ``Recipe``) as YAML text in the reference recipe's style. `header`,
    when given, is written first as comment lines (each prefixed with '# ')."""
    if isinstance(recipe, Recipe):
        recipe = recipe.to_dict()
    if not isinstance(recipe, dict):
        raise TypeError(f"dump_recipe: expected a dict or a Recipe, got {type(recipe).__name__}")
    body = yaml.dump(
        _ordered(recipe, _key_order()),
        Dumper=_RecipeDumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=_NO_FOLD_WIDTH,
    )
    if header:
        lines = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
        return lines + body
    return body


def write_recipe(recipe: dict | Recipe, path: str | Path, header: str | None = None) -> Path:
    """Write the recipe to `path` (parents created) in the reference style; returns the path."""
    p = Path(path)
    text = dump_recipe(recipe, header=header)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text, encoding="utf-8")
    return p


def get_path(d: Any, *keys: str) -> Any:
    """recipe["a"]["b"]... or None where a level is missing or not a mapping."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d
