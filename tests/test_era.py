"""Megatron-LM of the 2021-2022 era (issue 18's physics items 1 and 3): pipeline sends scattered over TP without
sequence parallelism, and published runs of that era read without SP or the distributed optimizer unless stated."""

from attune.calibrate.corpus import read_row
from attune.estimator import estimate
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import from_geometry

GEOM = dict(name="GPT 175B", layers=96, hidden=12288, ffn=49152, heads=96, kv_heads=96, vocab=51200, mlp="gelu")


def _pp_seconds(engine: str, sp: bool) -> float:
    model = from_geometry(**GEOM, seq_length=2048)
    cluster = parse_cluster("128xA100")
    lay = Layout(tp=8, pp=8, dp=2, sp=sp, recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1, distributed_optimizer=False)
    e = estimate(model, cluster, lay, Workload(seq_length=2048, global_batch=256), get_engine(engine),
                 check_layout=False)
    return e.perf.breakdown.exposed_comm_s["pp"]


def test_legacy_pipeline_sends_are_scattered_over_tp():
    legacy, deepspeed = _pp_seconds("megatron-legacy", sp=False), _pp_seconds("megatron-deepspeed", sp=False)
    # the send crosses nodes (PP stride TP x DP = 16 GPUs): 1/TP of it plus an NVLink all-gather is far cheaper
    assert legacy < 0.5 * deepspeed
    # with sequence parallelism the tensor is already split: scatter/gather does not apply
    assert _pp_seconds("megatron-legacy", sp=True) == _pp_seconds("megatron-deepspeed", sp=True)


def _row(engine: str, version: str) -> dict:
    return dict(id="r", series="s", model=dict(GEOM), engine=engine, engine_version=version,
                gpu="A100-SXM-80GB", num_gpus=128, precision="fp16", precision_class="fp16", low_precision=False,
                seq_len=2048, global_batch=256, micro_batch=1, tp=8, pp=8, vpp=None, cp=1, dp=2,
                recompute="full", measured=dict(metric="step_time_s", value=10.0),
                derived=dict(tokens_per_s_per_gpu=400.0), source=dict(url="hand-made"))


def test_era_defaults_for_unstated_sp_and_distributed_optimizer():
    old = read_row(_row("Megatron-LM", "2021 (SC21 paper)"), "dense.yaml")
    assert old.engine.name == "megatron-legacy"
    assert old.layout.sp is False and old.layout.distributed_optimizer is False
    new = read_row(_row("Megatron-LM (Megatron-Core)", "Megatron-Core r0.8.0"), "dense.yaml")
    assert new.engine.name == "megatron"
    assert new.layout.sp is True and new.layout.distributed_optimizer is True
