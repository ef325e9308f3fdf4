import pytest

from attune.errors import FlagError, LayoutError
from attune.recipe import load_recipe
from attune.recipe.codec import from_recipe_blocks
from attune.spec.engine import get_engine
from attune.spec.flags import from_flags, to_flags
from attune.spec.layout import Layout, Workload
from attune.spec.placement import batching, chunk_ranges, stage_layer_counts
from attune.spec.rules import check

from .conftest import SEED


def test_split_rules():
    assert stage_layer_counts(Layout(pp=4, first=16, last=14), 64) == [16, 17, 17, 14]
    assert stage_layer_counts(Layout(pp=2, last=30), 64) == [34, 30]
    assert stage_layer_counts(Layout(pp=4), 64) == [16] * 4
    with pytest.raises(LayoutError, match="divide evenly"):
        stage_layer_counts(Layout(pp=4, first=15, last=14), 64)
    assert chunk_ranges(Layout(pp=2, vpp=2), 8) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]


def test_constraints(qwen, slime):
    w = Workload()
    ok = Layout(tp=4, sp=True, pp=2, dp=1, last=30, recompute_granularity="full", recompute_method="uniform",
                recompute_num_layers=1)
    assert check(ok, qwen, 8, w, slime) == []
    errs = " | ".join(check(Layout(tp=5, dp=1), qwen, 8, w, slime))
    assert "world size 8" in errs and "attention heads" in errs and "query groups" in errs
    assert any("sequence parallelism needs TP > 1" in e for e in check(Layout(sp=True, dp=8), qwen, 8, w, slime))
    assert any("VPP 3" in e for e in check(Layout(pp=2, dp=4, vpp=3), qwen, 8, w, slime))
    assert any("block recompute of 40" in e for e in check(
        Layout(pp=2, dp=4, recompute_granularity="full", recompute_method="block", recompute_num_layers=40), qwen, 8, w, slime))
    assert any("divisible by DP 3" in e for e in check(Layout(dp=3), qwen, 3, Workload(global_batch=128), slime))
    assert any("precision-aware" in e for e in check(Layout(dp=8, optimizer_cpu_offload=True), qwen, 8, w, slime))
    assert any("distributed optimizer" in e for e in check(Layout(dp=8, distributed_optimizer=False), qwen, 8, w, slime))
    # megatron-core splits GDN heads over TP x CP: 16 key heads are not divisible by 8 x 4
    meg = get_engine("megatron")
    assert any("linear key heads" in e for e in check(Layout(tp=8, cp=4, dp=1), qwen, 32, w, meg))


def test_flags_round_trip(qwen):
    lay = Layout(tp=2, sp=True, pp=4, dp=1, first=15, last=15, vpp=1, recompute_granularity="full",
                 recompute_method="block", recompute_num_layers=3, max_tokens_per_gpu=16384,
                 precision_aware_optimizer=True, optimizer_cpu_offload=True, offload_fraction=0.5,
                 overlap_cpu_optimizer=True)
    w = Workload(seq_length=4096, global_batch=64)
    parsed = from_flags(to_flags(lay, w), qwen, 8)
    assert parsed.layout == lay and parsed.workload.seq_length == 4096 and parsed.workload.global_batch == 64
    lay2 = Layout(tp=1, pp=2, dp=2, vpp=2, micro_batch_size=2, distributed_optimizer=False, precision="fp16")
    assert from_flags(to_flags(lay2), qwen, 4).layout == lay2


def test_flags_ignored_and_vpp_by_layers(qwen):
    p = from_flags("--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 8 --wandb-project x "
                   "--use-flash-attn", qwen, 8)
    assert p.layout.vpp == 2 and p.layout.dp == 2
    assert p.ignored == ["--wandb-project", "--use-flash-attn"]
    with pytest.raises(LayoutError, match="needs --max-tokens-per-gpu"):
        from_flags("--use-dynamic-batch-size", qwen, 8)
    with pytest.raises(FlagError, match="expected an integer"):
        from_flags("--tensor-model-parallel-size four", qwen, 8)


def test_recipe_blocks_of_seed(seed_cases):
    r = load_recipe(SEED)
    # the seed's layout block omits precision_aware_optimizer; its run block has the flag
    # (attune.recipe.target reads it from there)
    lay, w = from_recipe_blocks(r["layout"], r["workload"], precision_aware_default=True)
    assert lay == seed_cases["rb12"]
    assert from_recipe_blocks(r["layout"], r["workload"])[0].precision_aware_optimizer is False  # Layout's default
    assert (w.seq_length, w.global_batch) == (8192, 128)


def test_batching(seed_cases, slime):
    b = batching(seed_cases["rb12"], Workload(), slime)
    assert (b.rows_per_microbatch, b.tokens_per_gpu, b.microbatches) == (1, 8192, 64)
    b = batching(Layout(cp=2, dp=4, max_tokens_per_gpu=8192), Workload(), slime)
    assert (b.rows_per_microbatch, b.tokens_per_gpu, b.microbatches) == (2, 8192, 16)
