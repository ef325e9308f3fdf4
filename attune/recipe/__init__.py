"""Recipes: YAML files describing a measured training layout (typed models, read, write, validate, show,
and the one parser from a recipe to its model, cluster, engine, layout and workload)."""

from attune.errors import RecipeError
from attune.recipe.io import (
    dump_recipe,
    load_recipe,
    load_recipe_model,
    load_schema,
    parse_recipe,
    to_jsonable,
    write_recipe,
)
from attune.recipe.models import Recipe, schema_errors, validate_recipe
from attune.recipe.runblock import RunBlock, is_expansion, parse_run, split_commands
from attune.recipe.show import render, summarize, summary_rows
from attune.recipe.target import RecipeTarget, recipe_target
from attune.recipe.validate import Finding, has_errors, lint, load_known_flags

__all__ = [
    "RecipeError",
    "Recipe",
    "validate_recipe",
    "RecipeTarget",
    "recipe_target",
    "load_recipe",
    "load_recipe_model",
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
