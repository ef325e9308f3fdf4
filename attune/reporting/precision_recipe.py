"""The low-precision best of ``attune tune --allow-numerics`` as a recipe of its own (issue 22).

The study's winner stays the bf16 ``recipe.yaml``; the low-precision best (``attune.search.precision_search``) is
written beside it as ``recipe-<recipe>.yaml``: the same model, GPUs and workload, its layout, its run block (the fp8
flags and, for blockwise, ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`` through the slime launch), its predicted result,
and ``status: predicted``. It changes the arithmetic, so ``attune verify`` against a bf16 reference run is what can
make it ``verified``."""

from __future__ import annotations

from attune.estimator.metrics import model_flops_utilization, usd_per_million_tokens
from attune.recipe.codec import to_recipe_block
from attune.recipe.models import Correctness, LayoutBlock, Recipe, validate_block
from attune.reporting.recipe import rerun_of
from attune.search.precision_search import PrecisionComparison
from attune.search.tuner import TuneConfig
from attune.spec.placement import batching
from attune.spec.precision import recipe_of


def low_precision_recipe(cfg: TuneConfig, winner: Recipe, comparison: PrecisionComparison) -> Recipe | None:
    """The low-precision best as a recipe derived from the bf16 winner's (None when no low-precision layout fits)."""
    e = comparison.low
    if e is None:
        return None
    lay, gpu = e.layout, cfg.cluster.gpu
    tps = e.perf.tokens_per_s_per_gpu
    rerun = rerun_of(cfg, lay)
    result = winner.result.model_copy(update=dict(
        tokens_per_s_per_gpu=round(tps, 2), usd_per_million_tokens=round(usd_per_million_tokens(tps, gpu), 4),
        mfu=round(model_flops_utilization(tps, cfg.model, gpu), 4), measured=None, gpu_hours=0.0,
        throughput_basis="predicted", step_time_cv_percent=0.0,
        mfu_note="tokens/s/GPU x 6 x active parameters / dense BF16 peak; predicted",
        gpu_hours_note="nothing ran: predicted by the model (attune tune --allow-numerics)"))
    result.__pydantic_fields_set__.discard("tokens_per_s_per_gpu_step_time")  # a slime-run figure: not predicted
    return winner.model_copy(deep=True, update=dict(
        status="predicted", run=rerun.command, env=dict(rerun.env), result=result,
        layout=validate_block(to_recipe_block(lay, cfg.model, batching(lay, cfg.workload, cfg.engine)), LayoutBlock,
                              "layout"),
        correctness=Correctness(result="not_run", summary=(
            f"not run: {recipe_of(lay)} changes the arithmetic; attune verify compares its loss curve with a bf16 "
            f"reference run (0.5% tolerance) and runs component:precision")),
        notes=(f"- The low-precision best of attune tune --allow-numerics ({', '.join(comparison.recipes)}), "
               f"predicted: {tps:,.1f} tokens/s/GPU, {100 * comparison.gain:+.1f}% over the bf16 best "
               f"{comparison.bf16.layout.label()} ({comparison.bf16.perf.tokens_per_s_per_gpu:,.1f}).\n"
               f"- Peak memory (predicted): {e.memory.peak_gib:.1f} GiB on stage {e.memory.peak_stage} of "
               f"{e.memory.capacity_gib:.1f} GiB.\n")))


__all__ = ["low_precision_recipe"]
