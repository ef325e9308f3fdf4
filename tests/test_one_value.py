"""One value per fact (issue 18): every public estimate path gives the same answer, and the bubble the CLI
prints is the one --explain sums."""

import json
import re
from dataclasses import asdict

import numpy as np
import pytest

from attune.api.estimate import estimate_target
from attune.api.target import batch_for_cluster, resolve_target
from attune.api.tune import tune_config
from attune.cli import main
from attune.estimator import estimate, estimate_batch, forget
from attune.estimator.coefficients import coefficients_for
from attune.search.scoring import score_space
from attune.search.space import SearchSpace, layout_key, load_space
from attune.spec.columns import LayoutColumns
from attune.spec.layout import Workload
from attune.spec.model import load_model


def test_public_paths_agree(qwen, h200x8, slime, seed_cases, seed_workload):
    """estimate() (a batch of one), estimate_batch over all the seed's layouts at once, the API's estimate_target
    and the scored table: the same step, throughput and stage peaks, with the same (GPU generation's) coefficients
    when none is given."""
    lays = list(seed_cases.values())
    batch = estimate_batch(qwen, h200x8, LayoutColumns.from_layouts(lays), seed_workload, slime)
    for i, lay in enumerate(lays):
        whole = estimate(qwen, h200x8, lay, seed_workload, slime, check_layout=False)
        assert batch.step.step_time_s[i] == whole.perf.step_time_s
        assert batch.tokens_per_s_per_gpu[i] == whole.perf.tokens_per_s_per_gpu
        assert batch.peak_gib[i] == whole.memory.peak_gib
        assert batch.step.bubble_s[i] == whole.perf.bubble_s
        assert [batch.memory.total_gib[i, s] for s in range(lay.pp)] == [s.total_gib for s in whole.memory.stages]
    target = resolve_target(model="Qwen3.6-27B", gpus="8xH200", flags=[])
    via_api = estimate_target(target)
    direct = estimate(target.model, target.cluster, target.layout, target.workload, target.engine)
    assert via_api.to_dict() == direct.to_dict()


def test_one_bubble(qwen, h200x8, slime, seed_cases, seed_workload):
    for lay in seed_cases.values():
        p = estimate(qwen, h200x8, lay, seed_workload, slime, check_layout=False).perf
        assert p.bubble_s == p.breakdown.bubble_s
        assert abs(p.breakdown.total_s - p.step_time_s) < 1e-9 * p.step_time_s


def test_cli_bubble_is_explains(capsys):
    flags = ["--", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
             "--decoder-first-pipeline-num-layers", "16", "--decoder-last-pipeline-num-layers", "14",
             "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "12",
             "--max-tokens-per-gpu", "8192"]
    assert main(["estimate", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--explain", *flags]) == 0
    out = capsys.readouterr().out
    printed = float(re.search(r"incl\. bubble ([\d.]+) s", out).group(1))
    explained = float(re.search(r"pipeline bubble\s*[│|]?\s*([\d.]+)", out).group(1))
    assert abs(printed - explained) < 0.01
    assert main(["estimate", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--json", *flags]) == 0
    js = json.loads(capsys.readouterr().out)
    assert abs(js["performance"]["breakdown_s"]["bubble_s"] - printed) < 0.01


def test_default_batch_grows_with_the_cluster():
    wl, note = batch_for_cluster(Workload(global_batch=128), 8)
    assert wl.global_batch == 128 and note == ""
    wl, note = batch_for_cluster(Workload(global_batch=128), 256)
    assert wl.global_batch == 256 and "128" in note
    assert batch_for_cluster(Workload(global_batch=96), 64)[0].global_batch == 192
    cfg = tune_config(model="DeepSeek-V3", gpus="256xH200")  # exited 2 before: 128 rows over DP 256
    assert cfg.workload.global_batch == 256 and cfg.workload_note
    assert tune_config(model="DeepSeek-V3", gpus="256xH200", global_batch=512).workload.global_batch == 512


def _tiny_moe_space():
    """The dense space's knobs with communication overlap and EP on a tiny hybrid MoE model: offload and overlap
    variants of one layout share kept terms (placements, fixed overheads), so a key missing a field shows here."""
    base = load_space(None)
    knobs = dict(base.knobs, comm_overlap=(False, True), ep=(1, 2), dispatcher=("alltoall", "allgather"),
                 first_offset=(-1, 1), last_offset=(-1, 1), recompute_layers=(1, 2))
    return SearchSpace(name="shared", path="", knobs=knobs, fixed=dict(base.fixed))


def test_shared_terms_equal_fresh_estimates(h200x8, slime):
    m, wl = load_model("tiny-qwen3.5-moe"), Workload(seq_length=1024, global_batch=16)
    pairs = _tiny_moe_space().enumerate(m, 8, wl, slime)
    assert len(pairs) > 500
    rng = np.random.default_rng(0)
    pick = set(rng.choice(len(pairs), 100, replace=False).tolist())
    warm = {i: estimate(m, h200x8, lay, wl, slime, check_layout=False) for i, (_, lay) in enumerate(pairs)}
    for i in sorted(pick):
        forget()  # the kept estimates, batches, placements and fixed overheads
        fresh = estimate(m, h200x8, pairs[i][1], wl, slime, check_layout=False)
        assert asdict(fresh.memory) == asdict(warm[i].memory), pairs[i][1].label()
        assert asdict(fresh.perf) == asdict(warm[i].perf), pairs[i][1].label()


@pytest.mark.parametrize("name", ["tiny-qwen3.5-moe", "tiny-qwen3.5"])
def test_scored_table_is_estimate(h200x8, slime, name):
    """The scored table equals `estimate` row by row, for an MoE model and a dense hybrid."""
    m, wl = load_model(name), Workload(seq_length=1024, global_batch=16)
    space = _tiny_moe_space()
    table = score_space(space, m, h200x8, wl, slime, coefficients_for(h200x8.gpu))
    assert len(table) == len(space.enumerate(m, 8, wl, slime))
    for i in np.random.default_rng(1).choice(len(table), 60, replace=False):
        e = estimate(m, h200x8, table.layouts[i], wl, slime, check_layout=False)
        assert table.peak_gib[i] == e.memory.peak_gib
        assert table.stage_gib[i] == tuple(s.total_gib for s in e.memory.stages)
        if np.isfinite(table.tokens[i]):
            assert table.tokens[i] == e.perf.tokens_per_s_per_gpu
        assert table.row(layout_key(table.layouts[i], m.num_layers)) == i
