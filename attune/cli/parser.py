"""The argument parser of every sub-command, with typed and ranged options."""

from __future__ import annotations

import argparse

from attune.search.storage import CONNECT_TIMEOUT_S
from attune.spec.engine import ENGINES as ENGINE_TABLE

from . import commands as c
from .options import Parser, fraction, nonnegative_int, positive_float, positive_int, unit_interval

ENGINES = list(ENGINE_TABLE)  # one owner: attune.spec.engine
RUNNERS = ["sim", "torch", "slime"]


def _target_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required, help="bundled model name or a config.json path")
    p.add_argument("--gpus", required=required, help="cluster: 8xH200, 16xH100, 2x8xH100, 2xcpu")
    p.add_argument("--gpus-per-node", type=positive_int, default=None, help="GPUs per node (default: the GPU type's, 8)")
    p.add_argument("--engine", default=None, choices=ENGINES, help="training engine (default slime)")
    p.add_argument("--seq", type=positive_int, default=None, help="tokens per row (default 8192)")
    p.add_argument("--global-batch", type=positive_int, default=None, help="rows per optimizer step (default 128)")
    p.add_argument("--price", type=positive_float, default=None, help="USD per GPU-hour (default: the GPU table's)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show tracebacks (also ATTUNE_DEBUG=1)")
    p.add_argument("--verbose", "-v", action="store_true", help="log messages down to debug level")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="attune", description="Find the fastest distributed-training layout that fits.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    s = sub.add_parser("estimate", help="per-stage memory and predicted speed of one layout")
    _target_args(s, required=False)
    s.add_argument("--recipe", help="read model, GPUs, layout and workload from a recipe YAML")
    s.add_argument("--json", action="store_true")
    s.add_argument("--explain", action="store_true",
                   help="print the step as a breakdown to check against a profile (per stage: compute by kind, "
                        "recompute, exposed communication; bubble, optimizer, overhead) and the memory overheads")
    s.add_argument("flags", nargs=argparse.REMAINDER, help="-- Megatron/slime flags")
    _common(s)
    s.set_defaults(func=c.cmd_estimate)

    s = sub.add_parser("models", help="list bundled models")
    s.add_argument("--json", action="store_true")
    _common(s)
    s.set_defaults(func=c.cmd_models)
    s = sub.add_parser("gpus", help="list GPU types")
    s.add_argument("--json", action="store_true")
    _common(s)
    s.set_defaults(func=c.cmd_gpus)

    s = sub.add_parser("tune", help="search layouts with an Optuna study and write the winner as a recipe")
    _target_args(s)
    s.add_argument("--runner", default="sim", choices=RUNNERS + ["replay"])
    s.add_argument("--trials", type=positive_int, default=None, help="target number of measured trials in the study")
    s.add_argument("--search-space", default=None, help="search space: a bundled name (dense, small) or a YAML path")
    s.add_argument("--seed", type=nonnegative_int, default=0, help="sampler seed")
    s.add_argument("--storage", default=None, help="Optuna storage URL (default: SQLite study.db in --out)")
    s.add_argument("--storage-timeout", type=positive_float, default=CONNECT_TIMEOUT_S,
                   help=f"database connection timeout, s (default {CONNECT_TIMEOUT_S:g})")
    s.add_argument("--study-name", default=None)
    s.add_argument("--heartbeat", type=positive_int, default=None,
                   help="seconds between a measured trial's heartbeats (default 5)")
    s.add_argument("--grace-period", type=positive_int, default=None,
                   help="heartbeat silence after which another tuner fails a trial as stale, s (default 20)")
    s.add_argument("--out", default=None, help="output folder (default ./reports/<model>-<gpus>-<UTC date>/)")
    s.add_argument("--candidates", type=positive_int, default=None, help="proposals to estimate per measured trial")
    s.add_argument("--slack", type=unit_interval, default=0.8,
                   help="skip candidates predicted slower than this fraction of the best measured so far")
    s.add_argument("--steps", type=positive_int, default=None, help="training steps per measured trial")
    s.add_argument("--timeout", type=positive_float, default=None, help="seconds per trial before it is killed")
    s.add_argument("--cluster", default=None, help="cluster YAML for the slime runner")
    s.add_argument("--data", default=None,
                   help="packed rows (parquet from attune data build) for measured trials; default: seeded synthetic rows")
    s.add_argument("--trial-kind", default="slime", choices=["slime", "torch"],
                   help="slime runner: what each Ray job runs (torch: the torch runner's trial, for local Ray heads)")
    s.add_argument("--memory-headroom", type=fraction, default=0.02,
                   help="fraction of GPU memory kept free when judging a predicted fit (default 0.02)")
    s.add_argument("--sampler", default="model", choices=["model", "tpe"],
                   help="model: expected improvement under the study's recalibrated model (default); tpe: plain TPE")
    s.add_argument("--no-recalibrate", action="store_true",
                   help="model sampler: do not refit the model to the study's measurements")
    s.add_argument("--min-gain", type=fraction, default=0.01,
                   help="stop rule: the gain over the best measured worth a trial, a fraction (default 0.01)")
    s.add_argument("--p-stop", type=fraction, default=0.05,
                   help="stop rule: stop when no layout has more than this probability of that gain (default 0.05)")
    s.add_argument("--budget-gpu-hours", type=positive_float, default=None,
                   help="stop once the measured trials have used this many GPU-hours")
    s.add_argument("--measurements", default=None,
                   help="replay runner: the table of measured outcomes (CSV or YAML, or an earlier trials.csv)")
    s.add_argument("--allow-numerics", action="append", default=[], metavar="PRECISION",
                   help="also search low precision, a numerics change (fp8, or fp8-delayed, fp8-tensorwise, "
                        "fp8-blockwise, mxfp8, nvfp4): the report sets the best one beside the bf16 best")
    s.add_argument("--no-verify", action="store_true", help="skip the correctness check of the winner")
    s.add_argument("--save-recipe", action="store_true",
                   help="also copy the recipe into ./recipes/<model>/<gpu>/ (tracked recipes are never written otherwise)")
    _common(s)
    s.set_defaults(func=c.cmd_tune)

    s = sub.add_parser("run", help="one measured run of a layout")
    _target_args(s, required=False)
    s.add_argument("--runner", default="torch", choices=RUNNERS)
    s.add_argument("--recipe")
    s.add_argument("--steps", type=positive_int, default=20)
    s.add_argument("--timeout", type=positive_float, default=None)
    s.add_argument("--out", default=None, help="output folder (default ./reports/runs/<model>-<layout>-<stamp>/)")
    s.add_argument("--cluster", default=None)
    s.add_argument("--json", action="store_true")
    s.add_argument("flags", nargs=argparse.REMAINDER)
    _common(s)
    s.set_defaults(func=c.cmd_run)

    s = sub.add_parser("verify", help="correctness check of a recipe; marks it verified or failed")
    s.add_argument("recipe")
    s.add_argument("--runner", default="torch", choices=["torch", "slime"])
    s.add_argument("--reference", default=None, help="reference recipe (default: the model's baseline layout)")
    s.add_argument("--steps", type=positive_int, default=20)
    s.add_argument("--negative-control", action="store_true")
    s.add_argument("--cluster", default=None)
    s.add_argument("--out", default=None, help="output folder (default ./reports/verify/<stamp>/); the verdict's "
                                               "recipe is written there as recipe.yaml")
    s.add_argument("--in-place", action="store_true",
                   help="rewrite the recipe file itself with the verdict (only after a measured verdict)")
    _common(s)
    s.set_defaults(func=c.cmd_verify)

    r = sub.add_parser("recipe", help="recipe tools")
    rs = r.add_subparsers(dest="recipe_command", required=True, parser_class=Parser)
    s = rs.add_parser("validate", help="schema errors and lint findings")
    s.add_argument("file")
    _common(s)
    s.set_defaults(func=c.cmd_recipe_validate)
    s = rs.add_parser("show", help="a readable summary")
    s.add_argument("file")
    _common(s)
    s.set_defaults(func=c.cmd_recipe_show)

    r = sub.add_parser("slime", help="slime launch and log tools")
    rs = r.add_subparsers(dest="slime_command", required=True, parser_class=Parser)
    s = rs.add_parser("command", help="the exact slime launch for a recipe")
    s.add_argument("--recipe", required=True)
    s.add_argument("--cluster", default=None)
    s.add_argument("--save", default=None, metavar="DIR",
                   help="a real run: save Megatron checkpoints to DIR (at the last step, or every --save-interval)")
    s.add_argument("--save-interval", type=positive_int, default=None, metavar="STEPS")
    _common(s)
    s.set_defaults(func=c.cmd_slime_command)
    s = rs.add_parser("preflight", help="check every node of the cluster for what a slime study needs")
    s.add_argument("--cluster", required=True, help="cluster YAML (docs/cluster.md)")
    s.add_argument("--model", default=None, help="model the checkpoint's config.json must match")
    s.add_argument("--json", action="store_true")
    _common(s)
    s.set_defaults(func=c.cmd_slime_preflight)
    s = rs.add_parser("parse-log", help="throughput, loss and failures from slime's stdout")
    s.add_argument("log")
    s.add_argument("--gpus", type=positive_int, required=True)
    s.add_argument("--window", type=nonnegative_int, nargs=2, default=[5, 19], metavar=("A", "B"))
    s.add_argument("--json", action="store_true")
    _common(s)
    s.set_defaults(func=c.cmd_slime_parse_log)

    r = sub.add_parser("study", help="shared study tools")
    rs = r.add_subparsers(dest="study_command", required=True, parser_class=Parser)
    s = rs.add_parser("status", help="workers seen, trials per state, best so far, stale trials, retries")
    s.add_argument("--storage", required=True, help="Optuna storage URL (postgresql://..., sqlite:///...) or .journal path")
    s.add_argument("--study", default=None, help="study name (default: the storage's only study)")
    s.add_argument("--storage-timeout", type=positive_float, default=CONNECT_TIMEOUT_S,
                   help=f"database connection timeout, s (default {CONNECT_TIMEOUT_S:g})")
    s.add_argument("--grace-period", type=positive_float, default=None,
                   help="heartbeat silence that makes a trial stale, s (default: the study's)")
    s.add_argument("--json", action="store_true")
    _common(s)
    s.set_defaults(func=c.cmd_study_status)

    s = sub.add_parser("calibrate", help="predict the public corpus of measured runs; --fit refits the coefficients")
    s.add_argument("--corpus", default=None,
                   help="folder with dense.yaml, moe.yaml, memory.yaml (default: shared/measurements beside the checkout)")
    s.add_argument("--fit", action="store_true",
                   help="refit the global coefficients and write them (the package's coefficients.yaml from a checkout)")
    s.add_argument("--out", default=None, help="output folder (default ./reports/calibration-<UTC date>/)")
    s.add_argument("--leave-one-out", action="store_true",
                   help="also refit the dense coefficients once per bf16 dense series without it and score that series")
    _common(s)
    s.set_defaults(func=c.cmd_calibrate)

    r = sub.add_parser("data", help="training data tools")
    rs = r.add_subparsers(dest="data_command", required=True, parser_class=Parser)
    s = rs.add_parser("build", help="pack tokenized SFT conversations into fixed-length rows (parquet)")
    s.add_argument("--input", required=True)
    s.add_argument("--tokenizer", required=True)
    s.add_argument("--row-tokens", type=positive_int, default=8192)
    s.add_argument("--seed", type=nonnegative_int, default=42)
    s.add_argument("--max-rows", type=positive_int, default=None)
    s.add_argument("--out", required=True)
    _common(s)
    s.set_defaults(func=c.cmd_data_build)
    return p
