"""What a study leaves behind: trials.csv, report.md with PNG plots, and the winner as a recipe.

Sits above `attune.search` (it reads the study's `TrialRecord`s) and `attune.runners` (a recipe's `run` block
is the runner's `rerun_command`: the launch of what measured it)."""

from attune.reporting.markdown import write_report
from attune.reporting.plots import plot_study
from attune.reporting.recipe import build_recipe, recipe_path, rerun_of
from attune.reporting.trials_csv import CSV_FIELDS, trials_frame, write_csv

__all__ = ["write_report", "plot_study", "build_recipe", "recipe_path", "rerun_of", "CSV_FIELDS", "trials_frame",
           "write_csv"]
