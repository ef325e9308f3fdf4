"""The argument parser of every sub-command, with typed and ranged options."""

from __future__ import annotations

import argparse

from attune.search.options import RunOptions, TargetOptions, TuneOptions, VerifyOptions
from attune.search.storage import CONNECT_TIMEOUT_S

from . import commands as c
from .options import Parser, add_options, nonnegative_int, positive_float, positive_int


def _target_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    add_options(p, TargetOptions, required=required)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show tracebacks (also ATTUNE_DEBUG=1)")
    p.add_argument("--verbose", "-v", action="store_true", help="log messages down to debug level")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="attune", description="Find the fastest distributed-training layout that fits.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (_add_estimate, _add_listings, _add_tune_run_verify, _add_recipe, _add_slime, _add_study,
                _add_calibrate, _add_data):
        add(sub)
    return p


def _command(sub, name: str, func, **kw) -> argparse.ArgumentParser:
    """A sub-command parser whose ``func`` default runs it."""
    s = sub.add_parser(name, **kw)
    s.set_defaults(func=func)
    return s


def _group(sub, name: str, dest: str, help: str):
    """A sub-command with sub-commands of its own (``attune recipe validate``)."""
    return sub.add_parser(name, help=help).add_subparsers(dest=dest, required=True, parser_class=Parser)


def _add_estimate(sub) -> None:
    s = _command(sub, "estimate", c.cmd_estimate, help="per-stage memory and predicted speed of one layout")
    _target_args(s, required=False)
    s.add_argument("--recipe", help="read model, GPUs, layout and workload from a recipe YAML")
    s.add_argument("--json", action="store_true")
    s.add_argument("--explain", action="store_true",
                   help="print the step as a breakdown to check against a profile (per stage: compute by kind, "
                        "recompute, exposed communication; bubble, optimizer, overhead) and the memory overheads")
    s.add_argument("flags", nargs=argparse.REMAINDER, help="-- Megatron/slime flags")
    _common(s)


def _add_listings(sub) -> None:
    for name, func, help in (("models", c.cmd_models, "list bundled models"), ("gpus", c.cmd_gpus, "list GPU types")):
        s = _command(sub, name, func, help=help)
        s.add_argument("--json", action="store_true")
        _common(s)


def _add_tune_run_verify(sub) -> None:
    s = _command(sub, "tune", c.cmd_tune, help="search layouts with an Optuna study and write the winner as a recipe")
    add_options(s, TuneOptions)
    _common(s)
    s = _command(sub, "run", c.cmd_run, help="one measured run of a layout")
    add_options(s, RunOptions, required=False)
    s.add_argument("--json", action="store_true")
    s.add_argument("flags", nargs=argparse.REMAINDER)
    _common(s)
    s = _command(sub, "verify", c.cmd_verify, help="correctness check of a recipe; marks it verified or failed")
    add_options(s, VerifyOptions)
    _common(s)


def _add_recipe(sub) -> None:
    rs = _group(sub, "recipe", "recipe_command", "recipe tools")
    for name, func, help in (("validate", c.cmd_recipe_validate, "schema errors and lint findings"),
                             ("show", c.cmd_recipe_show, "a readable summary")):
        s = _command(rs, name, func, help=help)
        s.add_argument("file")
        _common(s)


def _add_slime(sub) -> None:
    rs = _group(sub, "slime", "slime_command", "slime launch and log tools")
    s = _command(rs, "command", c.cmd_slime_command, help="the exact slime launch for a recipe")
    s.add_argument("--recipe", required=True)
    s.add_argument("--cluster", default=None)
    s.add_argument("--save", default=None, metavar="DIR",
                   help="a real run: save Megatron checkpoints to DIR (at the last step, or every --save-interval)")
    s.add_argument("--save-interval", type=positive_int, default=None, metavar="STEPS")
    _common(s)
    s = _command(rs, "preflight", c.cmd_slime_preflight,
                 help="check every node of the cluster for what a slime study needs")
    s.add_argument("--cluster", required=True, help="cluster YAML (docs/cluster.md)")
    s.add_argument("--model", default=None, help="model the checkpoint's config.json must match")
    s.add_argument("--json", action="store_true")
    _common(s)
    s = _command(rs, "parse-log", c.cmd_slime_parse_log, help="throughput, loss and failures from slime's stdout")
    s.add_argument("log")
    s.add_argument("--gpus", type=positive_int, required=True)
    s.add_argument("--window", type=nonnegative_int, nargs=2, default=[5, 19], metavar=("A", "B"))
    s.add_argument("--json", action="store_true")
    _common(s)


def _add_study(sub) -> None:
    rs = _group(sub, "study", "study_command", "shared study tools")
    s = _command(rs, "status", c.cmd_study_status,
                 help="workers seen, trials per state, best so far, stale trials, retries")
    s.add_argument("--storage", required=True, help="Optuna storage URL (postgresql://..., sqlite:///...) or .journal path")
    s.add_argument("--study", default=None, help="study name (default: the storage's only study)")
    s.add_argument("--storage-timeout", type=positive_float, default=CONNECT_TIMEOUT_S,
                   help=f"database connection timeout, s (default {CONNECT_TIMEOUT_S:g})")
    s.add_argument("--grace-period", type=positive_float, default=None,
                   help="heartbeat silence that makes a trial stale, s (default: the study's)")
    s.add_argument("--json", action="store_true")
    _common(s)


def _add_calibrate(sub) -> None:
    s = _command(sub, "calibrate", c.cmd_calibrate,
                 help="predict the public corpus of measured runs; --fit refits the coefficients")
    s.add_argument("--corpus", default=None,
                   help="folder with dense.yaml, moe.yaml, memory.yaml (default: shared/measurements beside the checkout)")
    s.add_argument("--fit", action="store_true",
                   help="refit the global coefficients and write them (the package's coefficients.yaml from a checkout)")
    s.add_argument("--out", default=None, help="output folder (default ./reports/calibration-<UTC date>/)")
    s.add_argument("--leave-one-out", action="store_true",
                   help="also refit the dense coefficients once per bf16 dense series without it and score that series")
    _common(s)


def _add_data(sub) -> None:
    rs = _group(sub, "data", "data_command", "training data tools")
    s = _command(rs, "build", c.cmd_data_build, help="pack tokenized SFT conversations into fixed-length rows (parquet)")
    s.add_argument("--input", required=True)
    s.add_argument("--tokenizer", required=True)
    s.add_argument("--row-tokens", type=positive_int, default=8192)
    s.add_argument("--seed", type=nonnegative_int, default=42)
    s.add_argument("--max-rows", type=positive_int, default=None)
    s.add_argument("--out", required=True)
    _common(s)
