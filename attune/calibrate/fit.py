"""Fitting the estimator's coefficients to measurements (the seed recipe's observations).

Nothing in the estimator imports this module; ``benchmarks/calibrate.py`` and the tests do.
"""

from __future__ import annotations

from dataclasses import replace

from attune.estimator.coefficients import DEFAULT, Coefficients
from attune.estimator.memory import estimate_memory
from attune.estimator.performance import estimate_performance
from attune.spec.engine import get_engine
from attune.spec.flags import from_flags
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import load_model


# The measurements the coefficients are fitted to: the seed recipe (8 x H200, Qwen3.6-27B, slime,
# 8,192-token rows, global batch 128; shared/seeds/attune-tp1-pp4-split16-rb12.yaml). Layouts as the
# Megatron/slime flags that ran.
_SEED = dict(model="Qwen3.6-27B", gpus="8xH200", engine="slime", seq_length=8192, global_batch=128)
_TUNED = ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 16 "
          "--decoder-last-pipeline-num-layers 14 --recompute-granularity full --recompute-method block "
          "--use-dynamic-batch-size --max-tokens-per-gpu 8192 --use-distributed-optimizer --use-precision-aware-optimizer")
_SLIME = ("--tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 2 "
          "--decoder-last-pipeline-num-layers 30 --recompute-granularity full --recompute-method uniform "
          "--recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 8192 --use-distributed-optimizer "
          "--use-precision-aware-optimizer --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d")
_PP2 = ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 8192 "
        "--use-distributed-optimizer --use-precision-aware-optimizer")
OBSERVATIONS = [
    dict(_SEED, what="tuned layout, measured 2026-10-18", flags=_TUNED + " --recompute-num-layers 12",
         tokens_per_s_per_gpu=2499.52, fits=True),
    dict(_SEED, what="slime's layout, measured", flags=_SLIME, tokens_per_s_per_gpu=948.7, fits=True),
    dict(_SEED, what="block recompute of 10: OOM on stage 0", flags=_TUNED + " --recompute-num-layers 10",
         fits=False, stage=0),
    dict(_SEED, what="TP1 PP2: OOM on the last stage", flags=_PP2, fits=False, stage=1),
]


def _evaluate(obs: dict, coef: "Coefficients"):

    model, cluster, engine = load_model(obs["model"]), parse_cluster(obs["gpus"]), get_engine(obs["engine"])
    wl = Workload(seq_length=obs["seq_length"], global_batch=obs["global_batch"])
    layout = from_flags(obs["flags"], model, cluster.world_size, wl).layout
    return (estimate_memory(model, cluster, layout, wl, engine, coef),
            estimate_performance(model, cluster, layout, wl, engine, coef))


def _bisect(f, lo: float, hi: float, iters: int = 40) -> float:
    """Root of a monotone f on [lo, hi] (clamped to the bounds)."""
    flo = f(lo)
    if flo * f(hi) > 0:
        return lo if abs(flo) < abs(f(hi)) else hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if (f(mid) > 0) == (flo > 0):
            lo, flo = mid, f(mid)
        else:
            hi = mid
    return 0.5 * (lo + hi)


def fit(coef: "Coefficients | None" = None, observations: list[dict] | None = None) -> tuple["Coefficients", list[dict]]:
    """Fit the four fitted coefficients to the observations; returns them and a per-observation report.

    Throughput: gemm_efficiency to the layouts without CPU offload, host_optimizer_efficiency to those with it
    (alternating, both monotone). Memory: activation_factor and fixed_overhead_gib on a grid, maximising the
    smallest relative margin of the fit / out-of-memory verdicts.
    """
    coef = coef or DEFAULT
    obs = observations or OBSERVATIONS
    speed = [o for o in obs if "tokens_per_s_per_gpu" in o]
    plain = [o for o in speed if "--optimizer-cpu-offload" not in o["flags"]]
    offl = [o for o in speed if "--optimizer-cpu-offload" in o["flags"]]

    def err(os_, c):
        return sum(_evaluate(o, c)[1].tokens_per_s_per_gpu / o["tokens_per_s_per_gpu"] - 1 for o in os_) / len(os_)

    for _ in range(3):
        if plain:
            coef = replace(coef, gemm_efficiency=_bisect(lambda x: err(plain, replace(coef, gemm_efficiency=x)), 0.2, 1.0))
        if offl:
            coef = replace(coef, host_optimizer_efficiency=_bisect(
                lambda x: err(offl, replace(coef, host_optimizer_efficiency=x)), 0.005, 1.0))
    verdicts = [o for o in obs if "fits" in o]
    best, best_margin = coef, -1e9
    for a in [1.0 + 0.05 * i for i in range(13)]:
        for ovh in [1.5 + 0.5 * j for j in range(10)]:
            c = replace(coef, activation_factor=round(a, 2), fixed_overhead_gib=ovh)
            margin = min((1 if o["fits"] else -1) * (1 - _evaluate(o, c)[0].peak_gib / _evaluate(o, c)[0].capacity_gib)
                         for o in verdicts)
            if margin > best_margin + 1e-9:
                best, best_margin = c, margin
    coef = best
    report = []
    for o in obs:
        mem, perf = _evaluate(o, coef)
        report.append({"what": o["what"], "predicted_tokens_per_s_per_gpu": round(perf.tokens_per_s_per_gpu, 1),
                       "measured_tokens_per_s_per_gpu": o.get("tokens_per_s_per_gpu"),
                       "fits": mem.fits, "observed_fits": o.get("fits"), "peak_gib": round(mem.peak_gib, 1),
                       "peak_stage": mem.peak_stage})
    return coef, report

