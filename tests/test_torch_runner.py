"""The torch runner: real torchrun trials on CPU (gloo), their measurements, and their failure paths."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from attune.runners.base import FAILED, OK, OOM, TIMEOUT, TrialResult, TrialSpec, UnsupportedLayout, step_time_stats  # noqa: E402
from attune.runners.registry import get_runner  # noqa: E402
from attune.runners.torch_runner import TorchRunner, torch_result  # noqa: E402
from attune.runners.torch_worker import FAULT_ENV, FAULT_RANK_ENV, FAULT_STEP_ENV, lr_at  # noqa: E402
from attune.spec.engine import get_engine  # noqa: E402
from attune.spec.hardware import parse_cluster  # noqa: E402
from attune.spec.layout import Layout, Workload  # noqa: E402
from attune.spec.model import load_model  # noqa: E402

# short rows, small batch, 20 steps: a trial takes a few seconds on 2 CPU cores
WL = Workload(seq_length=128, global_batch=4, steps=20, window=(5, 19), lr=1e-3, min_lr=1e-4,
              warmup_fraction=0.1, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, seed=42)
PP2 = Layout(pp=2, dp=1, first=5, last=3, max_tokens_per_gpu=128, recompute_granularity="full",
             recompute_method="block", recompute_num_layers=2, distributed_optimizer=False)
DP2 = Layout(pp=1, dp=2, max_tokens_per_gpu=128, recompute_granularity="selective", distributed_optimizer=True)
TIMEOUT_S = 120  # generous cap for the runs that should succeed


def spec_for(layout, tmp: Path, model="tiny-qwen3.5", workload=WL, cluster="2xcpu", **kw) -> TrialSpec:
    return TrialSpec(model=load_model(model), cluster=parse_cluster(cluster), layout=layout, workload=workload,
                     engine=get_engine("torch"), trial_dir=tmp, timeout_s=kw.pop("timeout_s", TIMEOUT_S), **kw)


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("pp2")
    return get_runner("torch").run(spec_for(PP2, d)), d


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp2")
    return get_runner("torch").run(spec_for(DP2, d)), d


# ---------------------------------------------------------------------- no launch
def test_unsupported_layouts_raise_before_launch(tmp_path):
    r = TorchRunner()
    for lay, word in ((Layout(tp=2, dp=1), "TP 2"), (Layout(cp=2, dp=1), "CP 2"),
                      (Layout(pp=2, vpp=2, dp=1), "VPP 2")):
        reasons = r.check(spec_for(lay, tmp_path / "x"))
        assert len(reasons) == 1 and "\n" not in reasons[0]
        assert reasons[0].startswith(f"{word} not supported by the torch runner")
        with pytest.raises(UnsupportedLayout, match=f"{word}.*not supported by the torch runner"):
            r.run(spec_for(lay, tmp_path / "x"))
    with pytest.raises(UnsupportedLayout, match="invalid"):
        r.run(spec_for(Layout(pp=1, dp=4), tmp_path / "y"))  # 4 ranks on a 2-worker cluster
    assert r.check(spec_for(PP2, tmp_path / "z")) == []
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists() and not (tmp_path / "z").exists()


def test_command_is_torchrun_standalone(tmp_path):
    cmd = TorchRunner().command(spec_for(PP2, tmp_path), tmp_path / "spec.json")
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "-m", "attune.runners.torch_worker", "--spec", str(tmp_path / "spec.json")]


def _records(tmp_path, recs):
    d = tmp_path / "ranks"
    d.mkdir(parents=True, exist_ok=True)
    for r in recs:
        (d / f"rank{r['rank']}.json").write_text(json.dumps(r))
    return d


def test_classification_from_rank_records(tmp_path):
    spec = spec_for(PP2, tmp_path)
    # a stage-1 OOM followed by the peer's connection error: OOM on stage 1, even though both failed
    d = _records(tmp_path / "a", [
        {"rank": 0, "stage": 0, "status": "failed", "reason": "RuntimeError: Connection reset by peer", "failed_at": 2.0},
        {"rank": 1, "stage": 1, "status": "oom", "reason": "RuntimeError: can't allocate memory", "failed_at": 1.0}])
    res = torch_result(spec, d, "log", 1, False, 3.0)
    assert res.status == OOM and res.oom_stage == 1 and "stage 1 (rank 1)" in res.reason
    # nobody wrote a record and torchrun failed: FAILED with the exit code
    res = torch_result(spec, tmp_path / "empty", "boom\n" * 5, 1, False, 3.0)
    assert res.status == FAILED and "code 1" in res.reason and "boom" in res.log_tail
    # the first rank to fail is the cause
    d = _records(tmp_path / "b", [
        {"rank": 0, "stage": 0, "status": "failed", "reason": "RuntimeError: Connection reset", "failed_at": 2.0},
        {"rank": 1, "stage": 1, "status": "failed", "reason": "ValueError: bad", "failed_at": 1.0}])
    res = torch_result(spec, d, "", 1, False, 3.0)
    assert res.status == FAILED and "rank 1 (stage 1) failed: ValueError: bad" == res.reason
    assert res.gpu_hours == pytest.approx(2 * 3.0 / 3600)


# ---------------------------------------------------------------------- real runs
@pytest.mark.slow
def test_pp2_uneven_split_with_block_recompute(pp2_run):
    res, d = pp2_run
    assert res.status == OK, res.reason + res.log_tail
    assert res.measured
    ranks = sorted(res.extra["ranks"], key=lambda r: r["rank"])
    assert [r["layers"] for r in ranks] == [[0, 5], [5, 8]]
    assert [r["stage"] for r in ranks] == [0, 1]
    spec = load_model("tiny-qwen3.5")
    assert sum(r["stage_params"] for r in ranks) == spec.total_params
    assert ranks[0]["microbatches"] == 4 and ranks[0]["rows_per_microbatch"] == 1
    # loss: starts near ln(vocab), falls, finite everywhere
    losses = [res.losses[i] for i in range(WL.steps)]
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(spec.vocab)) < 0.3
    assert losses[-1] < losses[0] - 1.0
    # peak memory per stage from the ranks' peak RSS: plausible for a torch process (100 MiB .. 4 GiB)
    assert len(res.peak_memory_gib) == 2 and all(0.1 < m < 4.0 for m in res.peak_memory_gib)
    # files
    saved = TrialResult.from_dict(json.loads((d / "result.json").read_text()))
    assert saved.status == OK and saved.losses == res.losses
    log = (d / "log.txt").read_text()
    assert "step 19 loss" in log


@pytest.mark.slow
def test_window_metrics_of_a_real_run(pp2_run):
    res, _ = pp2_run
    assert len(res.step_times_s) == WL.steps and all(t > 0 for t in res.step_times_s)
    assert res.window == (5, 19) and res.window_tokens == 15 * 128 * 4
    st = step_time_stats(res.step_times_s[5:20], tokens=15 * WL.tokens_per_step, gpus=2)
    assert res.tokens_per_s_per_gpu == pytest.approx(st.tokens_per_s_per_gpu) and res.step_time_s == pytest.approx(st.mean_s)
    assert res.step_time_cv_percent == pytest.approx(st.cv_percent)
    assert res.tokens_per_s_per_gpu == pytest.approx(128 * 4 / st.mean_s / 2, rel=1e-9)
    assert 0 < res.step_time_cv_percent < 100
    # worker-hours: 2 workers x the trial's wall time, start-up included
    assert res.wall_s > sum(res.step_times_s)
    assert res.gpu_hours == pytest.approx(2 * res.wall_s / 3600)


@pytest.mark.slow
def test_dp2_sharded_optimizer_same_loss_curve_as_pp2(dp2_run, pp2_run):
    res, _ = dp2_run
    assert res.status == OK, res.reason + res.log_tail
    assert len(res.peak_memory_gib) == 1
    ranks = sorted(res.extra["ranks"], key=lambda r: r["rank"])
    assert [r["dp_rank"] for r in ranks] == [0, 1] and ranks[0]["microbatches"] == 2
    ref, _ = pp2_run
    # same rows, same order, same weights: the layout must not change the numerics (reduction order only)
    for i in range(WL.steps):
        assert res.losses[i] == pytest.approx(ref.losses[i], rel=1e-5), i


@pytest.mark.slow
def test_tied_gpt2_pp2_matches_single_process_training(tmp_path):
    """PP=2 with tied embeddings (a copy on the last stage, grads summed) and uniform recompute
    gives the loss curve of a plain single-process loop over the same rows."""
    from attune.torchmodels import build_model, token_loss_sum
    from attune.torchmodels.data import load_rows, shift_labels

    wl = Workload(seq_length=64, global_batch=4, steps=6, window=(2, 5), lr=2e-3, min_lr=2e-4,
                  warmup_fraction=0.2, weight_decay=0.1, adam_beta2=0.95, seed=3)
    lay = Layout(pp=2, dp=1, first=4, last=2, micro_batch_size=2, recompute_granularity="full",
                 recompute_method="uniform", recompute_num_layers=1, distributed_optimizer=False)
    res = TorchRunner().run(spec_for(lay, tmp_path, model="tiny-gpt2", workload=wl))
    assert res.status == OK, res.reason + res.log_tail
    spec = load_model("tiny-gpt2")
    net = build_model(spec, seed=wl.seed)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wl.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=wl.lr, betas=(wl.adam_beta1, wl.adam_beta2), eps=1e-8)
    rows = load_rows(None, wl.steps * wl.global_batch, wl.seq_length, spec.vocab, wl.seed)
    for step in range(wl.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, wl)
        t, m = rows.take(range(step * 4, step * 4 + 4))
        lab, lm = shift_labels(t, m)
        loss = token_loss_sum(net(torch.from_numpy(t)), torch.from_numpy(lab), torch.from_numpy(lm)) / float(lm.sum())
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert res.losses[step] == pytest.approx(loss.item(), rel=1e-5), step
    assert res.losses[5] < res.losses[0] - 0.3


@pytest.mark.slow
def test_oom_under_memory_limit(tmp_path):
    res = TorchRunner().run(spec_for(PP2, tmp_path, memory_limit_gib=0.001))
    assert res.status == OOM
    assert res.oom_stage in (0, 1)
    assert f"out of memory on pipeline stage {res.oom_stage}" in res.reason
    assert "allocate memory" in res.reason or "MemoryError" in res.reason
    assert json.loads((tmp_path / "result.json").read_text())["status"] == OOM


@pytest.mark.slow
def test_crash_is_failed_with_log_tail(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "crash")
    monkeypatch.setenv(FAULT_RANK_ENV, "1")
    monkeypatch.setenv(FAULT_STEP_ENV, "2")
    res = TorchRunner().run(spec_for(PP2, tmp_path))
    assert res.status == FAILED
    assert res.reason.startswith("rank 1 (stage 1) failed: RuntimeError: injected crash at step 2")
    assert "injected crash" in res.log_tail
    assert "step 1 loss" in (tmp_path / "log.txt").read_text()  # it really trained before crashing
    assert json.loads((tmp_path / "result.json").read_text())["status"] == FAILED


@pytest.mark.slow
def test_hang_is_killed_with_its_process_group(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "hang")
    monkeypatch.setenv(FAULT_RANK_ENV, "0")
    monkeypatch.setenv(FAULT_STEP_ENV, "1")
    res = TorchRunner().run(spec_for(PP2, tmp_path, timeout_s=15))
    assert res.status == TIMEOUT and res.reason == "timeout after 15 s"
    assert 15 <= res.wall_s < 30
    assert "injected hang" in (tmp_path / "log.txt").read_text()
    pids = [int(p.read_text()) for p in (tmp_path / "ranks").glob("rank*.pid")]
    assert len(pids) == 2
    for pid in pids:  # every worker is gone (or a zombie nobody waits for is not possible: reaped by torchrun)
        assert not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]
    assert json.loads((tmp_path / "result.json").read_text())["status"] == TIMEOUT
