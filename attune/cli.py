"""attune's command line: a thin layer over the library. Bad input -> one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from attune.errors import AttuneError

EXIT_BAD_INPUT = 2


class CLIError(Exception):
    pass


# ---------------------------------------------------------------------- shared resolution
def _add_target_args(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    p.add_argument("--model", required=model_required, help="bundled model name or a config.json path")
    p.add_argument("--gpus", required=model_required, help="cluster: 8xH200, 16xH100, 2x8xH100, 2xcpu")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the GPU type's, 8)")
    p.add_argument("--engine", default="slime", choices=["slime", "megatron", "torch"])
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default 8192)")
    p.add_argument("--global-batch", type=int, default=None, help="rows per optimizer step (default 128)")
    p.add_argument("--price", type=float, default=None, help="USD per GPU-hour (default: the GPU table's)")


def _workload(args, base=None):
    from attune.spec.layout import Workload

    w = base or Workload()
    kw = {}
    if getattr(args, "seq", None):
        kw["seq_length"] = args.seq
    if getattr(args, "global_batch", None):
        kw["global_batch"] = args.global_batch
    return replace(w, **kw)


def _target(args):
    from attune.spec.engine import get_engine
    from attune.spec.hardware import parse_cluster
    from attune.spec.model import load_model

    model = load_model(args.model)
    cluster = parse_cluster(args.gpus, args.gpus_per_node, args.price)
    engine = get_engine(args.engine)
    return model, cluster, engine


def _layout_from_args(args, model, cluster, engine, workload):
    """A layout from --recipe, or from Megatron/slime flags after `--`, or the model's baseline."""
    from attune.spec.baselines import baseline_layout
    from attune.spec.flags import from_flags
    from attune.recipe.codec import from_recipe_blocks
    from .recipe import load_recipe

    ignored: list[str] = []
    if getattr(args, "recipe", None):
        r = load_recipe(args.recipe)
        layout, workload = from_recipe_blocks(r.get("layout") or {}, r.get("workload") or {}, workload)
        workload = _workload(args, workload)
        from attune.spec.rules import derive_dp
        layout = replace(layout, dp=derive_dp(cluster.world_size, layout.tp, layout.pp, layout.cp))
        source = f"recipe {args.recipe}"
    elif getattr(args, "flags", None):
        parsed = from_flags(args.flags, model, cluster.world_size, workload)
        layout, workload, ignored = parsed.layout, _workload(args, parsed.workload), parsed.ignored
        source = "flags"
    else:
        layout, note = baseline_layout(model, cluster, workload, engine)
        source = note
    if engine.forces_distributed_optimizer and not layout.distributed_optimizer:
        layout = replace(layout, distributed_optimizer=True)
    return layout, workload, source, ignored


# ---------------------------------------------------------------------- commands
def cmd_models(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from attune.spec.model import bundled_names, load_model

    t = Table(title="bundled models")
    for c in ("name", "family", "layers (full/GDN)", "hidden", "heads/kv", "vocab", "total params", "active params"):
        t.add_column(c, justify="right" if c not in ("name", "family") else "left")
    rows = []
    for n in bundled_names():
        m = load_model(n)
        s = m.summary()
        rows.append(s)
        t.add_row(n, m.family, f"{m.num_layers} ({s['full_attention_layers']}/{s['gated_deltanet_layers']})",
                  str(m.hidden), f"{m.heads}/{m.kv_heads}", f"{m.vocab:,}", f"{m.total_params:,}", f"{m.active_params:,}")
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        Console().print(t)
    return 0


def cmd_gpus(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from attune.spec.hardware import GPUS, detect_local_gpus

    t = Table(title="GPU types")
    for c in ("type", "name", "memory (GiB)", "BF16 dense (TFLOP/s)", "HBM (GB/s)", "NVLink (GB/s/dir)",
              "per node", "USD/GPU-hour"):
        t.add_column(c)
    rows = []
    for k, g in GPUS.items():
        rows.append({"type": k, "name": g.name, "memory_bytes": g.memory_bytes, "capacity_gib": round(g.capacity_gib, 2),
                     "bf16_tflops": g.bf16_tflops, "hbm_gbps": g.hbm_gbps, "nvlink_gbps": g.nvlink_gbps,
                     "gpus_per_node": g.gpus_per_node, "internode_gbps": g.internode_gbps,
                     "usd_per_hour": g.usd_per_hour, "price_source": g.price_source, "source": g.source})
        t.add_row(k, g.name, f"{g.capacity_gib:.2f}", f"{g.bf16_tflops:g}", f"{g.hbm_gbps:g}", f"{g.nvlink_gbps:g}",
                  str(g.gpus_per_node), f"{g.usd_per_hour:.2f}")
    if args.json:
        print(json.dumps({"gpus": rows, "local": detect_local_gpus()}, indent=2))
    else:
        Console().print(t)
        local = detect_local_gpus()
        Console().print(f"local GPUs (NVML): {', '.join(local) if local else 'none detected'}")
    return 0


def cmd_estimate(args) -> int:
    from attune.estimator import estimate

    model, cluster, engine = _target(args)
    workload = _workload(args)
    layout, workload, source, ignored = _layout_from_args(args, model, cluster, engine, workload)
    est = estimate(model, cluster, layout, workload, engine)
    d = est.to_dict()
    d["layout_source"] = source
    d["ignored_flags"] = ignored
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        from .report import print_estimate
        print_estimate(est, source, ignored)
    return 0


def cmd_recipe_validate(args) -> int:
    from rich.console import Console

    from .recipe import has_errors, lint, load_recipe

    r = load_recipe(args.file)
    findings = lint(r)
    con = Console(stderr=False)
    for f in findings:
        con.print(f"{f.severity}: {f.path}: {f.message}", markup=False, highlight=False)
    n_err = sum(f.severity == "error" for f in findings)
    n_warn = len(findings) - n_err
    con.print(f"{args.file}: {n_err} error(s), {n_warn} warning(s)", markup=False, highlight=False)
    return 1 if has_errors(findings) else 0


def cmd_recipe_show(args) -> int:
    from rich.console import Console

    from .recipe import load_recipe, render

    Console().print(render(load_recipe(args.file)))
    return 0


def cmd_tune(args) -> int:
    from .search.tune import run_tune

    return run_tune(args)


def cmd_run(args) -> int:
    from .runs import run_once

    return run_once(args)


def cmd_verify(args) -> int:
    from .verify import run_verify

    return run_verify(args)


def cmd_slime_command(args) -> int:
    from .recipe import load_recipe
    from .runners.slime.cluster import load_cluster
    from .runners.slime.launch import command_for_recipe

    cfg = load_cluster(args.cluster) if args.cluster else None
    cmd = command_for_recipe(load_recipe(args.recipe), cfg)
    print(cmd.to_shell())
    return 0


def cmd_slime_parse_log(args) -> int:
    from .runners.slime.logparse import format_summary, parse_slime_log

    p = Path(args.log)
    if not p.exists():
        raise CLIError(f"{args.log}: no such log file")
    run = parse_slime_log(p.read_text(errors="replace"), gpus=args.gpus, window=tuple(args.window))
    print(json.dumps(run.to_dict(), indent=2) if args.json else format_summary(run))
    return 0 if run.complete and not run.crash else 1


def cmd_data_build(args) -> int:
    from .datasets.build import main as build_main

    argv = ["--input", args.input, "--tokenizer", args.tokenizer, "--row-tokens", str(args.row_tokens),
            "--seed", str(args.seed), "--out", args.out]
    if args.max_rows:
        argv += ["--max-rows", str(args.max_rows)]
    return build_main(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attune", description="Find the fastest distributed-training layout that fits.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("estimate", help="per-stage memory and predicted speed of one layout")
    _add_target_args(s)
    s.add_argument("--recipe", help="read the layout and workload blocks of a recipe YAML")
    s.add_argument("--json", action="store_true")
    s.add_argument("flags", nargs=argparse.REMAINDER, help="-- Megatron/slime flags")
    s.set_defaults(func=cmd_estimate)

    s = sub.add_parser("models", help="list bundled models")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_models)
    s = sub.add_parser("gpus", help="list GPU types")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_gpus)

    s = sub.add_parser("tune", help="search layouts with an Optuna study and write the winner as a recipe")
    _add_target_args(s)
    s.add_argument("--runner", default="sim", choices=["sim", "torch", "slime"])
    s.add_argument("--trials", type=int, default=None, help="target number of measured trials in the study")
    s.add_argument("--search-space", default=None, help="search space YAML (default: search_spaces/dense.yaml)")
    s.add_argument("--seed", type=int, default=0, help="TPE sampler seed")
    s.add_argument("--storage", default=None, help="Optuna storage URL (default: a journal file in --out)")
    s.add_argument("--study-name", default=None)
    s.add_argument("--out", default=None, help="output folder (default reports/<model>-<gpus>-<UTC date>/)")
    s.add_argument("--candidates", type=int, default=None, help="proposals to estimate per measured trial")
    s.add_argument("--slack", type=float, default=0.8,
                   help="skip candidates predicted slower than this fraction of the best measured so far")
    s.add_argument("--steps", type=int, default=None, help="training steps per measured trial")
    s.add_argument("--timeout", type=float, default=None, help="seconds per trial before it is killed")
    s.add_argument("--cluster", default=None, help="cluster YAML for the slime runner")
    s.add_argument("--data", default=None,
                   help="packed rows (parquet from attune data build) for measured trials; default: seeded synthetic rows")
    s.add_argument("--trial-kind", default="slime", choices=["slime", "torch"],
                   help="slime runner: what each Ray job runs (torch: the torch runner's trial, for local Ray heads)")
    s.add_argument("--memory-headroom", type=float, default=0.02,
                   help="fraction of GPU memory kept free when judging a predicted fit (default 0.02)")
    s.add_argument("--no-verify", action="store_true", help="skip the correctness check of the winner")
    s.add_argument("--no-copy", action="store_true", help="do not copy the recipe into recipes/")
    s.set_defaults(func=cmd_tune)

    s = sub.add_parser("run", help="one measured run of a layout")
    _add_target_args(s)
    s.add_argument("--runner", default="torch", choices=["sim", "torch", "slime"])
    s.add_argument("--recipe")
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--timeout", type=float, default=None)
    s.add_argument("--out", default=None)
    s.add_argument("--cluster", default=None)
    s.add_argument("--json", action="store_true")
    s.add_argument("flags", nargs=argparse.REMAINDER)
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("verify", help="correctness check of a recipe; marks it verified or failed")
    s.add_argument("recipe")
    s.add_argument("--runner", default="torch", choices=["torch", "slime"])
    s.add_argument("--reference", default=None, help="reference recipe (default: the model's baseline layout)")
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--negative-control", action="store_true")
    s.add_argument("--cluster", default=None)
    s.set_defaults(func=cmd_verify)

    r = sub.add_parser("recipe", help="recipe tools")
    rs = r.add_subparsers(dest="recipe_command", required=True)
    s = rs.add_parser("validate", help="schema errors and lint findings")
    s.add_argument("file")
    s.set_defaults(func=cmd_recipe_validate)
    s = rs.add_parser("show", help="a readable summary")
    s.add_argument("file")
    s.set_defaults(func=cmd_recipe_show)

    r = sub.add_parser("slime", help="slime launch and log tools")
    rs = r.add_subparsers(dest="slime_command", required=True)
    s = rs.add_parser("command", help="the exact slime launch for a recipe")
    s.add_argument("--recipe", required=True)
    s.add_argument("--cluster", default=None)
    s.set_defaults(func=cmd_slime_command)
    s = rs.add_parser("parse-log", help="throughput, loss and failures from slime's stdout")
    s.add_argument("log")
    s.add_argument("--gpus", type=int, required=True)
    s.add_argument("--window", type=int, nargs=2, default=[5, 19], metavar=("A", "B"))
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_slime_parse_log)

    r = sub.add_parser("data", help="training data tools")
    rs = r.add_subparsers(dest="data_command", required=True)
    s = rs.add_parser("build", help="pack tokenized SFT conversations into fixed-length rows (parquet)")
    s.add_argument("--input", required=True)
    s.add_argument("--tokenizer", required=True)
    s.add_argument("--row-tokens", type=int, default=8192)
    s.add_argument("--seed", type=int, default=42)
    s.add_argument("--max-rows", type=int, default=None)
    s.add_argument("--out", required=True)
    s.set_defaults(func=cmd_data_build)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "flags", None) and args.flags and args.flags[0] == "--":
        args.flags = args.flags[1:]
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("attune: interrupted", file=sys.stderr)
        return 130
    except AttuneError as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"attune: error: {msg}", file=sys.stderr)
        return e.exit_code
    except (CLIError, ValueError, RuntimeError, OSError, ImportError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"attune: error: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
