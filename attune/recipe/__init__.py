"""Recipes: YAML files describing a measured training layout (read, write, validate, show)."""

from .io import RecipeError, dump_recipe, load_recipe, load_schema, parse_recipe, to_jsonable, write_recipe
from .runblock import RunBlock, is_expansion, parse_run, split_commands
from .show import render, summarize, summary_rows
from .validate import Finding, has_errors, lint, load_known_flags, schema_errors

__all__ = [
    "RecipeError",
    "load_recipe",
    "parse_recipe",
    "dump_recipe",
    "write_recipe",
    "load_schema",
    "to_jsonable",
    "schema_errors",
    "lint",
    "Finding",
    "has_errors",
    "load_known_flags",
    "parse_run",
    "RunBlock",
    "split_commands",
    "is_expansion",
    "summarize",
    "summary_rows",
    "render",
]
