"""The seed recipe's four observations as corpus rows (series ``seed``).

8 x H200, Qwen3.6-27B, slime, 8,192-token rows, global batch 128 (shared/seeds/attune-tp1-pp4-split16-rb12.yaml):
two measured throughputs and four memory verdicts. Layouts as the Megatron/slime flags that ran.
"""

from __future__ import annotations

from attune.calibrate.rows import MEMORY, THROUGHPUT, CorpusRow, MemoryObservation
from attune.spec.engine import get_engine
from attune.spec.flags import from_flags
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Workload
from attune.spec.model import load_model

SEED_SERIES = "seed"
"""The series name of the seed recipe's observations."""

_SOURCE = "shared/seeds/attune-tp1-pp4-split16-rb12.yaml"
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

# (id, flags, measured tokens/s/GPU or None, fits, the stage that ran out of memory)
OBSERVATIONS = (
    ("seed-tuned-tp1-pp4-rb12", _TUNED + " --recompute-num-layers 12", 2499.52, True, None),
    ("seed-slime-tp4-pp2-offload", _SLIME, 948.7, True, None),
    ("seed-tp1-pp4-rb10-oom", _TUNED + " --recompute-num-layers 10", None, False, 0),
    ("seed-tp1-pp2-oom", _PP2, None, False, 1),
)
"""The seed's observations: the tuned layout and slime's measured, two layouts that ran out of memory."""


def seed_observations() -> tuple[CorpusRow, ...]:
    """The seed's observations as expressed rows."""
    model, cluster, engine = load_model("Qwen3.6-27B"), parse_cluster("8xH200"), get_engine("slime")
    base = Workload(seq_length=8192, global_batch=128)
    rows = []
    for rid, flags, tps, fits, stage in OBSERVATIONS:
        parsed = from_flags(flags, model, cluster.world_size, base)
        rows.append(CorpusRow(
            id=rid, series=SEED_SERIES, file="seed", kinds=(THROUGHPUT, MEMORY) if tps else (MEMORY,),
            source=_SOURCE, gpu_name="H200", engine_name="slime", precision="bf16", model=model, cluster=cluster,
            layout=parsed.layout, workload=parsed.workload, engine=engine, tokens_per_s_per_gpu=tps,
            memory=MemoryObservation(fits=fits, stage=stage, metric="ran / CUDA out of memory on the stage"),
        ))
    return tuple(rows)
