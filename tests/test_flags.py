"""The one Megatron-LM / slime flag table (attune/spec/megatron_flags.yaml) and what derives from it."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

import pytest

from attune.correctness.rules import diff_args, load_rules
from attune.errors import FlagError
from attune.recipe import load_known_flags
from attune.spec.flags import (
    LAYOUT_FLAGS,
    SPECIAL_FLAGS,
    WORKLOAD_FLAGS,
    FlagSpec,
    flag_parser,
    flag_table,
    from_flags,
    known_flag,
    table_describes,
    to_flags,
)
from attune.spec.layout import Layout, Workload

# A layout per Layout field that differs from the base in that field (valid for Qwen3.6-27B's 64 layers).
BASE = Layout(tp=2, pp=2, dp=2, distributed_optimizer=False)
_PA = dict(distributed_optimizer=True, precision_aware_optimizer=True)
VARIANTS = {
    "tp": dict(tp=4),
    "pp": dict(pp=4),
    "cp": dict(cp=2),
    "ep": dict(ep=2),
    "etp": dict(ep=2, etp=2),
    "moe_dispatcher": dict(moe_dispatcher="alltoall"),
    "moe_grouped_gemm": dict(moe_grouped_gemm=True),
    "moe_permute_fusion": dict(moe_permute_fusion=True),
    "moe_shared_expert_overlap": dict(moe_shared_expert_overlap=True),
    "moe_ep_overlap": dict(moe_ep_overlap=True),
    "moe_capacity_factor": dict(moe_capacity_factor=1.25),
    "moe_force_balance": dict(moe_force_balance=True),
    "mtp_layers": dict(mtp_layers=1),
    "sp": dict(sp=True),
    "first": dict(first=30),
    "last": dict(last=30),
    "vpp": dict(vpp=2),
    "micro_batch_size": dict(micro_batch_size=2),
    "max_tokens_per_gpu": dict(max_tokens_per_gpu=16384),
    "recompute_granularity": dict(recompute_granularity="selective"),
    "recompute_method": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
    "recompute_num_layers": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "distributed_optimizer": dict(distributed_optimizer=True),
    "precision_aware_optimizer": dict(_PA),
    "optimizer_cpu_offload": dict(_PA, optimizer_cpu_offload=True),
    "offload_fraction": dict(_PA, optimizer_cpu_offload=True, offload_fraction=0.3),
    "overlap_cpu_optimizer": dict(_PA, optimizer_cpu_offload=True, overlap_cpu_optimizer=True),
    "precision": dict(precision="fp16"),
    "overlap_grad_reduce": dict(overlap_grad_reduce=True),
    "overlap_param_gather": dict(overlap_param_gather=True),
    "tp_comm_overlap": dict(tp_comm_overlap=True),
    # issue 15
    "pipeline_layout": dict(pp=4, pipeline_layout="Et*16|t*17|t*17|t*14L"),
    "account_for_embedding": dict(pp=2, account_for_embedding=True, account_for_loss=True),
    "account_for_loss": dict(pp=2, account_for_loss=True, account_for_embedding=True),
    "recompute_modules": dict(recompute_granularity="selective", recompute_modules=("core_attn", "mlp")),
    "offload_modules": dict(offload_modules=("core_attn", "attn_proj")),
    # issue 22: low precision
    "fp8_format": dict(fp8_format="hybrid"),
    "fp8_recipe": dict(fp8_format="e4m3", fp8_recipe="blockwise"),
    "fp8_param_gather": dict(fp8_format="e4m3", fp8_param_gather=True),
    "fp4_format": dict(fp4_format="e2m1"),
}
# Layout fields that are numerics, not layout, by their flags' class: --bf16 / --fp16 change the arithmetic.
NUMERICS_FIELDS = {"precision", "moe_capacity_factor", "moe_force_balance",  # dropping or re-routing tokens changes the loss
                   "mtp_layers",  # multi-token prediction adds a loss term
                   "fp8_format", "fp8_recipe", "fp8_param_gather", "fp4_format"}  # low-precision GEMMs (issue 22)


def _flags_of(owner: str, name: str) -> list[FlagSpec]:
    return [s for s in flag_table().values() if s.target == (owner, name)]


def test_table_loads_typed_records():
    table = flag_table()
    assert len(table) > 200
    assert dict(table_describes())["slime"] == "624b824a" and dict(table_describes())["megatron_lm"] == "1dcf0daf"
    for name, spec in table.items():
        assert isinstance(spec, FlagSpec) and spec.name == name and name.startswith("--")
        assert spec.arity in ("switch", "value", "values") and spec.owner in ("megatron", "slime", "slime-patch")
        assert (spec.type == "bool") == (spec.arity == "switch")
        assert spec.cls in (None, "layout", "numerics")
    tp = table["--tensor-model-parallel-size"]
    assert (tp.arity, tp.type, tp.default, tp.owner, tp.field, tp.cls) == ("value", "int", 1, "megatron", "layout.tp", "layout")
    assert table["--recompute-granularity"].choices == ("full", "selective")
    assert table["--use-gated-attention"].owner == "slime-patch"
    assert table["--colocate"].arity == "switch" and table["--colocate"].owner == "slime"
    assert table["--spec"].min_values == 0 and table["--eval-prompt-data"].min_values == 1
    # one flag, one record: the lint view and the numerics rules read the same table
    assert load_known_flags()["flags"]["--spec"] == "values"
    assert known_flag("--sglang-mem-fraction-static").name == "--sglang-"
    assert known_flag("--lr=1e-5") is table["--lr"] and known_flag("--frobnicate") is None


def test_parser_is_argparse_over_the_table():
    p = flag_parser()
    assert isinstance(p, argparse.ArgumentParser)
    ns, rest = p.parse_known_args(["--eval-prompt-data", "aime", "/x.jsonl", "--bf16", "--frobnicate", "3",
                                   "--tensor-model-parallel-size=2", "--spec"])
    got = vars(ns)
    assert got["--eval-prompt-data"] == ["aime", "/x.jsonl"] and got["--tensor-model-parallel-size"] == 2
    assert got["layout.precision"] == "bf16" and got["--spec"] == []
    assert rest == ["--frobnicate", "3"]
    assert "--lr" not in got  # absent flags stay absent (no defaults filled in)


@pytest.mark.parametrize("field_name", sorted(VARIANTS))
def test_every_layout_field_round_trips(field_name, qwen):
    lay = replace(BASE, **VARIANTS[field_name])
    assert getattr(lay, field_name) != getattr(BASE, field_name)
    lay = replace(lay, dp=8 // (lay.tp * lay.pp * lay.cp) or 1)
    argv = to_flags(lay)
    assert any(s.name in argv for s in _flags_of("layout", field_name)), argv
    assert from_flags(argv, qwen, lay.world_size).layout == lay
    assert from_flags(" ".join(argv), qwen, lay.world_size).layout == lay


def test_every_layout_field_has_a_flag_and_a_variant():
    with_flags = {s.target[1] for s in flag_table().values() if s.target and s.target[0] == "layout"}
    assert with_flags == {f.name for f in fields(Layout)} - {"dp"}  # DP is derived, never a flag
    assert set(VARIANTS) == with_flags


def test_workload_fields_round_trip(qwen):
    w = Workload(seq_length=4096, global_batch=64)
    parsed = from_flags(to_flags(BASE, w), qwen, BASE.world_size)
    assert (parsed.workload.seq_length, parsed.workload.global_batch) == (4096, 64)
    hyper = from_flags("--lr 2e-5 --min-lr=0 --lr-decay-style constant --seed 7 --num-rollout 3 --adam-beta2 0.95",
                       qwen, 8).workload
    assert (hyper.lr, hyper.min_lr, hyper.lr_decay_style, hyper.seed, hyper.steps, hyper.adam_beta2) == (
        2e-5, 0.0, "constant", 7, 3, 0.95)


def test_bad_values_are_one_line_flag_errors(qwen):
    with pytest.raises(FlagError) as e:
        from_flags("--tensor-model-parallel-size abc", qwen, 8)
    assert str(e.value) == "--tensor-model-parallel-size 'abc': expected an integer"
    for argv, msg in (("--lr fast", "--lr 'fast': expected a number"),
                      ("--recompute-granularity fulll", "--recompute-granularity 'fulll': expected one of full, selective"),
                      ("--pipeline-model-parallel-size", "--pipeline-model-parallel-size needs a value"),
                      ("--eval-prompt-data --bf16", "--eval-prompt-data needs at least one value")):
        with pytest.raises(FlagError) as e:
            from_flags(argv, qwen, 8)
        assert str(e.value) == msg and "\n" not in str(e.value)
    # issue 14: ETP is a layout field now; an absent one reads as TP when EP > 1 (Megatron validate_args)
    assert from_flags("--expert-tensor-parallel-size 2", qwen, 8).layout.etp == 2
    assert from_flags("--tensor-model-parallel-size 2 --expert-model-parallel-size 2", qwen, 8).layout.etp == 2


def test_unknown_flags_are_reported_as_ignored(qwen):
    p = from_flags(["python3", "train.py", "--tensor-model-parallel-size", "2", "--frobnicate", "3",
                    "--wandb-project", "x", "--sglang-mem-fraction-static", "0.7", "--use-flash-attn",
                    "--eval-prompt-data", "aime", "/x.jsonl", "--foo=bar", "--bf16"], qwen, 8)
    assert p.layout.tp == 2 and p.layout.dp == 4
    assert p.ignored == ["--frobnicate", "--wandb-project", "--sglang-mem-fraction-static", "--use-flash-attn",
                         "--eval-prompt-data", "--foo"]


def test_special_flags(qwen):
    p = from_flags("--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 8", qwen, 8)
    assert p.layout.vpp == 2 and p.ignored == []
    assert from_flags("--max-tokens-per-gpu 8192", qwen, 8).layout.max_tokens_per_gpu is None  # static batching
    p = from_flags("--use-dynamic-batch-size --max-tokens-per-gpu 8192", qwen, 8)
    assert p.dynamic_batching and p.layout.max_tokens_per_gpu == 8192
    assert from_flags("--fp16 --bf16", qwen, 8).layout.precision == "bf16"  # the last one given wins
    assert from_flags("", qwen, 8).layout.distributed_optimizer is False  # absent switch: off
    assert "--bf16" in SPECIAL_FLAGS and "--expert-tensor-parallel-size" in LAYOUT_FLAGS


def test_field_views_keep_their_shape():
    assert LAYOUT_FLAGS["--tensor-model-parallel-size"] == ("tp", "int")
    assert LAYOUT_FLAGS["--use-precision-aware-optimizer"] == ("precision_aware_optimizer", "bool")
    assert LAYOUT_FLAGS["--optimizer-offload-fraction"] == ("offload_fraction", "float")
    assert WORKLOAD_FLAGS["--num-rollout"] == ("steps", "int") and WORKLOAD_FLAGS["--lr-decay-style"] == ("lr_decay_style", "str")
    assert "--bf16" not in LAYOUT_FLAGS


def test_layout_fields_flags_are_classed_layout():
    rules = load_rules()
    for f in fields(Layout):
        for spec in _flags_of("layout", f.name):
            want = "numerics" if f.name in NUMERICS_FIELDS else "layout"
            assert spec.cls == want, spec.name
            assert rules.lookup(spec.name).cls == want, spec.name
    for flag in ("--expert-tensor-parallel-size", "--num-layers-per-virtual-pipeline-stage", "--use-dynamic-batch-size"):
        assert flag_table()[flag].cls == "layout"


def test_numerics_rules_take_per_flag_facts_from_the_table():
    rules = load_rules()
    assert {n for n, s in flag_table().items() if s.cls} == set(rules.args)
    assert rules.args["--tensor-model-parallel-size"].default == "1"
    assert rules.args["--adam-eps"].default == "1e-08" and rules.args["--bf16"].is_bool
    assert rules.args["--optimizer-offload-fraction"].default == "1.0"
    assert rules.lookup("--lr-warmup-fraction").cls == "numerics"  # still a pattern
    # the offload fraction's default: writing the default is no difference
    assert diff_args("--optimizer-cpu-offload", "--optimizer-cpu-offload --optimizer-offload-fraction 1") == []
