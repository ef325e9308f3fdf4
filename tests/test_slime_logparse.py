"""attune.runners.slime.logparse against slime log fixtures (tests/fixtures/slime_logs/)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from attune.runners.slime.logparse import format_summary, parse_dict_literal, parse_slime_log

FIX = Path(__file__).parent / "fixtures" / "slime_logs"
# The values written into success_20steps.log by make_fixtures.py (perf/actor_train_time per rollout, s).
TIMES = [71.83, 53.91, 52.61, 52.38, 52.47, 52.42, 52.55, 52.31, 52.44, 52.39,
         52.60, 52.28, 52.50, 52.45, 52.36, 52.52, 52.41, 52.33, 52.48, 52.40]
TOKENS_PER_STEP = 128 * 8192  # rows x row tokens per rollout in the fixture


def _read(name: str) -> str:
    return (FIX / name).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def ok():
    return parse_slime_log(_read("success_20steps.log"), gpus=8)


def test_window_throughput_by_hand(ok):
    window_time = sum(TIMES[5:20])  # steps 5..19 inclusive
    expected = 15 * TOKENS_PER_STEP / window_time / 8
    assert ok.window_tokens == 15 * TOKENS_PER_STEP == 15_728_640
    assert ok.window_time_s == pytest.approx(window_time)
    assert ok.tokens_per_s_per_gpu == pytest.approx(expected, rel=1e-12)
    # tok_per_s is job-wide: per-GPU throughput is 1/8 of it, never the raw value.
    assert ok.tokens_per_s_per_gpu < ok.train_perf[5]["perf/actor_train_tok_per_s"] / 7


def test_other_window(ok):
    run = parse_slime_log(_read("success_20steps.log"), gpus=8, window=(2, 4))
    assert run.tokens_per_s_per_gpu == pytest.approx(3 * TOKENS_PER_STEP / sum(TIMES[2:5]) / 8)


def test_cv(ok):
    w = TIMES[5:20]
    assert ok.step_time_cv_percent == pytest.approx(statistics.stdev(w) / statistics.fmean(w) * 100)
    assert 0.1 < ok.step_time_cv_percent < 0.3


def test_per_step_times_and_tokens(ok):
    assert ok.train_time_s == {i: t for i, t in enumerate(TIMES)}
    assert set(ok.time_source.values()) == {"perf"}
    assert ok.tokens == {i: TOKENS_PER_STEP for i in range(20)}
    assert ok.complete and ok.window_missing == ()


def test_loss_curve(ok):
    assert len(ok.loss) == 20
    assert ok.loss[0] == 1.0213 and ok.loss[19] == 0.8837
    assert all(ok.loss[i + 1] < ok.loss[i] for i in range(19))


def test_rollout_perf_lines_ignored(ok):
    # The RolloutManager's perf lines carry perf/rollout_time and perf/tokens_per_gpu_per_sec; none may leak in.
    for metrics in ok.train_perf.values():
        assert "perf/actor_train_time" in metrics
        assert "perf/rollout_time" not in metrics and "perf/tokens_per_gpu_per_sec" not in metrics


def test_rollout_line_alone_is_not_a_train_step():
    text = ("(RolloutManager pid=99) [2026-10-18 12:00:01] rollout_metrics.py:268 - perf 3: "
            "{'perf/rollout_time': 3.1, 'perf/tokens_per_gpu_per_sec': 41000.0}\n")
    run = parse_slime_log(text, gpus=8, window=(3, 3))
    assert run.train_time_s == {} and not run.complete and run.tokens_per_s_per_gpu is None


def test_nan_grad_norm(ok):
    assert ok.grad_norm_nan_count == 1
    assert math.isnan(ok.grad_norm[7])
    assert ok.grad_norm[6] == pytest.approx(1.5)
    d = ok.to_dict()
    assert d["grad_norm"]["7"] is None
    json.dumps(d, allow_nan=False)  # strict JSON


def test_parse_dict_literal_nonfinite():
    d = parse_dict_literal("{'a': nan, 'b': inf, 'c': -inf, 'd': 1e-05, 'name': 'nan_guard', 'n': 3}")
    assert math.isnan(d["a"]) and d["b"] == math.inf and d["c"] == -math.inf
    assert d["d"] == 1e-05 and d["name"] == "nan_guard" and d["n"] == 3
    with pytest.raises(ValueError, match="unparseable"):
        parse_dict_literal("{'a': __import__('os')}")


def test_missing_steps_make_incomplete():
    text = "\n".join(ln for ln in _read("success_20steps.log").splitlines()
                     if "perf 12: {'perf/train_wait" not in ln)
    run = parse_slime_log(text, gpus=8)
    # The Timer line of rollout 12 is still there, so the time is recovered but tokens are not.
    assert not run.complete and run.window_missing == (12,)
    assert run.time_source[12] == "timer" and run.train_time_s[12] == pytest.approx(52.5)
    assert run.window_tokens == 14 * TOKENS_PER_STEP


def test_timer_fallback_only():
    lines = [f"(MegatronTrainRayActor pid=1) [2026-10-18 12:00:0{i}] timer.py:32 - Timer actor_train end "
             f"(elapsed: {50 + i}.5s)" for i in range(3)]
    run = parse_slime_log("\n".join(lines), gpus=8, window=(0, 2))
    assert run.train_time_s == {0: 50.5, 1: 51.5, 2: 52.5}
    assert run.time_source == {0: "timer", 1: "timer", 2: "timer"}
    assert not run.complete  # no token counts without a perf line
    assert run.tokens_per_s_per_gpu is None


def test_success_has_no_crash(ok):
    assert ok.oom is None and ok.crash is None
    assert ok.nccl_version == "2.28.9"


def test_oom_detected():
    run = parse_slime_log(_read("oom_step2_last_stage.log"), gpus=8)
    assert run.oom is not None
    assert run.oom.requested_gib == pytest.approx(7.58)
    assert run.oom.total_capacity_gib == pytest.approx(139.81)
    assert run.oom.gpu_index == 0
    assert run.oom.actor == "MegatronTrainRayActor" and run.oom.pid == 48217
    assert run.oom.rank == 6  # last pipeline stage of PP 4 x DP 2, tied to the pid by the [rank6] marker
    assert run.oom.rollout_id == 2
    assert run.crash is not None and run.crash.kind == "oom"
    assert sorted(run.train_time_s) == [0, 1] and not run.complete
    assert "Job 'raysubmit_tX3mQ9a1bR2cD4eF' failed" in run.crash.tail
    s = format_summary(run)
    assert "7.58 GiB" in s and "rank 6" in s


def test_old_style_oom_in_mib():
    text = ("(MegatronTrainRayActor pid=7) [rank3]: RuntimeError: CUDA out of memory. Tried to allocate 512.00 MiB "
            "(GPU 0; 79.35 GiB total capacity; 77.10 GiB already allocated)\n")
    run = parse_slime_log(text, gpus=8, window=(0, 0))
    assert run.oom.requested_gib == pytest.approx(0.5)
    assert run.oom.total_capacity_gib == pytest.approx(79.35)
    assert run.oom.rank == 3 and run.oom.pid == 7


def test_crash_detected():
    run = parse_slime_log(_read("crash_rollout_valueerror.log"), gpus=8)
    assert run.oom is None
    assert run.crash is not None and run.crash.kind == "exception"
    assert run.crash.error == "ValueError: row 517 has 8191 tokens, expected 8192"
    assert run.crash.actor == "RolloutManager" and run.crash.pid == 47990
    assert sorted(run.train_time_s) == [0, 1, 2, 3] and not run.complete
    assert "ray.exceptions.RayTaskError(ValueError)" in run.crash.tail


def test_job_failed_without_traceback():
    run = parse_slime_log("Job 'raysubmit_x' failed\n", gpus=8, window=(0, 0))
    assert run.crash is not None and run.crash.kind == "job_failed"


def test_format_summary_units(ok):
    s = format_summary(ok)
    assert "tokens/s/GPU" in s and " s," in s and " %" in s
    assert "2,499.97 tokens/s/GPU" in s


def test_bad_arguments():
    with pytest.raises(ValueError, match="gpus"):
        parse_slime_log("", gpus=0)
    with pytest.raises(ValueError, match="window"):
        parse_slime_log("", gpus=8, window=(5, 4))


def test_fixtures_up_to_date(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_fixtures", FIX / "make_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.success_log() == _read("success_20steps.log")
    assert mod.oom_log() == _read("oom_step2_last_stage.log")
    assert mod.crash_log() == _read("crash_rollout_valueerror.log")
    assert mod.TRAIN_TIMES == TIMES


# ---- slime's real print formats (tests/fixtures/slime_logs/slime_624b824a_sft_2steps_per_rollout.log) ----
# The fixture is hand-written from slime's print statements as documented, with file and line, in
# /work/shared/reference/slime-runtime-and-moe.md section 3 and slime-and-qwen.md sections 2.1-2.3 (its header
# quotes them); it is not produced by make_fixtures.py.
REAL = "slime_624b824a_sft_2steps_per_rollout.log"
REAL_TIMES = [61.37, 48.92, 49.15, 48.87]  # perf/actor_train_time per rollout, s (the fixture's header)
REAL_TOKENS = [731245, 702918, 688401, 715560]  # tokens per rollout (dynamic batching: they differ)


@pytest.fixture(scope="module")
def real():
    return parse_slime_log(_read(REAL), gpus=8, window=(1, 3))


def test_real_format_window_throughput(real):
    assert real.train_time_s == dict(enumerate(REAL_TIMES))
    assert real.tokens == dict(enumerate(REAL_TOKENS))
    assert real.complete and real.window_missing == ()
    assert real.window_tokens == sum(REAL_TOKENS[1:4])
    assert real.tokens_per_s_per_gpu == pytest.approx(sum(REAL_TOKENS[1:4]) / sum(REAL_TIMES[1:4]) / 8, rel=1e-12)
    assert real.oom is None and real.crash is None


def test_real_format_two_optimizer_steps_per_rollout(real):
    # model.py:879: step = rollout_id * steps_per_rollout + step_id, so 4 rollouts give steps 0..7
    assert sorted(real.loss) == list(range(8)) and sorted(real.train_time_s) == [0, 1, 2, 3]
    assert real.loss[0] == 1.1042 and real.loss[7] == 1.0093
    assert real.grad_norm_nan_count == 1 and math.isnan(real.grad_norm[5])


def test_real_format_rollout_perf_lines_ignored(real):
    # rollout_metrics.py:268 prints "perf N" too, without perf/actor_train_time
    for metrics in real.train_perf.values():
        assert "perf/rollout_time" not in metrics and "perf/actor_train_time" in metrics
        assert metrics["perf/step_time"] == pytest.approx(metrics["perf/train_wait_time"] + metrics["perf/train_time"])


def test_real_format_timer_fallback_uses_actor_train_only():
    """Without the perf lines, times come from "Timer actor_train end" (0.1 s resolution), never from the
    "Timer train end" / "Timer update_weights end" lines printed around it."""
    text = "\n".join(ln for ln in _read(REAL).splitlines() if "train_metric_utils.py" not in ln)
    run = parse_slime_log(text, gpus=8, window=(1, 3))
    assert run.train_time_s == {0: 61.4, 1: 48.9, 2: pytest.approx(49.1, abs=0.051), 3: 48.9}
    assert set(run.time_source.values()) == {"timer"} and run.tokens == {} and not run.complete


def test_real_format_logging_prefix_and_critic_step():
    """configure_logger's "[%(asctime)s{prefix}]" may carry a prefix inside the brackets; critic-step lines
    (role_tag "critic-", model.py:918) are not the actor's loss."""
    text = ("(MegatronTrainRayActor pid=7) [2026-08-21 09:15:32 rank 6] model.py:918 - step 0: "
            "{'train/loss': 1.5, 'train/grad_norm': 2.0, 'train/step': 0}\n"
            "(MegatronTrainRayActor pid=7) [2026-08-21 09:15:33] model.py:918 - critic-step 0: "
            "{'train/value_loss': 9.0, 'train/step': 0}\n")
    run = parse_slime_log(text, gpus=8, window=(0, 0))
    assert run.loss == {0: 1.5} and run.grad_norm == {0: 2.0}


def test_real_format_truncated_job_is_incomplete():
    lines = _read(REAL).splitlines()
    cut = next(i for i, ln in enumerate(lines) if "perf 2: {'perf/train_wait_time'" in ln)
    run = parse_slime_log("\n".join(lines[:cut]), gpus=8, window=(1, 3))
    assert run.window_missing == (2, 3) and not run.complete and run.crash is None
    assert run.window_tokens == REAL_TOKENS[1]


# ---- attune.runners.slime.stack_probe (kept here: the stack probe belongs to the slime runner) ----

import subprocess  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

from attune.runners.slime import stack_probe  # noqa: E402

PROBE_KEYS = {"python", "pytorch", "pytorch_cuda", "cuda", "cuda_driver", "nccl", "transformer_engine",
              "megatron_core", "megatron_lm_commit", "slime_commit", "deepep", "flash_linear_attention", "ray",
              "gpus", "nvidia_driver", "probed_at"}


def test_probe_on_cpu_machine(monkeypatch):
    import platform

    monkeypatch.delenv("MEGATRON_DIR", raising=False)
    monkeypatch.delenv("SLIME_DIR", raising=False)
    p = stack_probe.probe()
    assert set(p) == PROBE_KEYS
    assert p["python"] == platform.python_version()
    torch = pytest.importorskip("torch")
    assert p["pytorch"] == torch.__version__
    if torch.version.cuda is None:  # CPU build: no CUDA build, no NCCL
        assert p["pytorch_cuda"] is None and p["nccl"] is None
    for absent in ("transformer_engine", "megatron_lm_commit", "slime_commit", "deepep"):
        assert p[absent] is None, absent
    try:  # megatron-core is an optional extra (attune[megatron]); the probe reports it when installed
        from importlib.metadata import version
        expected = version("megatron-core")
    except Exception:
        expected = None
    assert p["megatron_core"] == expected
    json.dumps(p, allow_nan=False)


def test_probe_git_commit_from_env(tmp_path, monkeypatch):
    repo = tmp_path / "Megatron-LM"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q"], cwd=repo, check=True)
    (repo / "f").write_text("x")
    subprocess.run(git + ["add", "f"], cwd=repo, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "m"], cwd=repo, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    monkeypatch.setenv("MEGATRON_DIR", str(repo))
    monkeypatch.setenv("SLIME_DIR", str(tmp_path / "does-not-exist"))
    p = stack_probe.probe()
    assert p["megatron_lm_commit"] == head and p["slime_commit"] is None


def test_probe_never_raises(monkeypatch):
    broken = types.ModuleType("pynvml")

    def boom(*a, **k):
        raise RuntimeError("NVML Shared Library Not Found")

    broken.nvmlInit = boom
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    monkeypatch.setattr(stack_probe.subprocess, "run", boom)
    monkeypatch.setenv("MEGATRON_DIR", "/nonexistent")
    p = stack_probe.probe()
    assert set(p) == PROBE_KEYS
    assert p["gpus"] is None and p["nccl"] is None and p["megatron_lm_commit"] is None


def test_probe_gpu_names_with_fake_nvml(monkeypatch):
    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: None
    fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetCount = lambda: 2
    fake.nvmlDeviceGetHandleByIndex = lambda i: i
    fake.nvmlDeviceGetName = lambda h: b"NVIDIA H200" if h == 0 else "NVIDIA H200"
    fake.nvmlSystemGetDriverVersion = lambda: "570.172.08"
    fake.nvmlSystemGetCudaDriverVersion = lambda: 12090
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    p = stack_probe.probe()
    assert p["gpus"] == ["NVIDIA H200", "NVIDIA H200"]
    assert p["nvidia_driver"] == "570.172.08" and p["cuda_driver"] == "12.9"


def test_stack_block_seed_shape():
    p = {"python": "3.12.3", "pytorch": "2.11.0", "pytorch_cuda": "12.9", "cuda": "12.9", "nccl": "2.28.9",
         "transformer_engine": "2.10.0", "megatron_core": "0.16.0rc0",
         "megatron_lm_commit": "1dcf0dafa884ad52ffb243625717a3471643e087",
         "slime_commit": "a897e1f0000000000000000000000000000000000"[:40], "deepep": "1.2.1",
         "probed_at": "2026-10-18"}
    s = stack_probe.stack_block(p)
    assert set(s) == {"framework", "megatron_lm", "transformer_engine", "pytorch", "cuda", "nccl", "deepep",
                      "python", "source"}
    assert s["megatron_lm"] == "commit 1dcf0daf (megatron-core 0.16.0rc0)"
    assert s["pytorch"] == "2.11.0 (CUDA 12.9 build)"
    assert s["nccl"].startswith("2.28.9 (") and "CUDA 12.9 build" in s["nccl"]
    assert s["framework"] == "slime: THUDM/slime a897e1f"
    assert s["cuda"] == "12.9" and s["transformer_engine"] == "2.10.0" and s["python"] == "3.12.3"
    assert "2026-10-18" in s["source"]
    empty = stack_probe.stack_block({})
    assert empty["framework"] is None and empty["pytorch"] is None and empty["megatron_lm"] is None


def test_probe_json_is_the_printed_line():
    data = json.loads(stack_probe.probe_json([]))
    assert set(data) == PROBE_KEYS
    assert "source" in json.loads(stack_probe.probe_json(["--stack"]))


def test_stack_probe_cli():
    out = subprocess.run([sys.executable, "-m", "attune.runners.slime.stack_probe"], capture_output=True,
                         text=True, timeout=120, check=True)
    data = json.loads(out.stdout)
    assert set(data) == PROBE_KEYS and data["python"]
    out = subprocess.run([sys.executable, "-m", "attune.runners.slime.stack_probe", "--stack"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert "source" in json.loads(out.stdout)


# ---------------------------------------------------------------------------- issue 13: any actor's crash
@pytest.mark.parametrize("name, kind, rank, rollout, error", [
    ("nccl_timeout_rank4.log", "nccl_timeout", 4, 5, "Watchdog caught collective operation timeout"),
    ("actor_died_rank6.log", "actor_died", 6, 3, "ActorDiedError: The actor died unexpectedly"),
    ("train_exception_rank6.log", "exception", 6, 2, "RuntimeError: torch.cat()"),
    ("crash_rollout_valueerror.log", "exception", None, 4, "ValueError: row 517"),
])
def test_crash_kind_rank_and_rollout(name, kind, rank, rollout, error):
    """NCCL watchdog timeouts, dead Ray actors and exceptions in the training loop are crashes of their own
    kind; the rank comes from the line's [rankN] marker or from the rank the dead actor's pid printed."""
    run = parse_slime_log(_read(name), gpus=8)
    c = run.crash
    assert c is not None and c.kind == kind and c.rank == rank and c.rollout_id == rollout
    assert error in c.error and not c.error.startswith("[E1018")  # c10's glog stamp is dropped
    assert run.oom is None and not run.complete
    assert f"crash: {kind}" in format_summary(run)


def test_dead_actor_is_the_one_ray_names_not_the_driver():
    c = parse_slime_log(_read("actor_died_rank6.log"), gpus=8).crash
    assert c.actor == "MegatronTrainRayActor" and c.pid == 48217  # Ray's "\tpid: 48217" detail line


def test_nccl_timeout_without_a_failed_status_is_still_a_crash():
    text = "\n".join(l for l in _read("nccl_timeout_rank4.log").splitlines()
                     if "Traceback" not in l and "failed" not in l and "ray.exceptions" not in l)
    c = parse_slime_log(text, gpus=8).crash
    assert c is not None and c.kind == "nccl_timeout"


def test_host_memory_kill_is_its_own_kind():
    text = _read("success_20steps.log").replace("Job 'raysubmit_tX3mQ9a1bR2cD4eF' succeeded", "") + (
        "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.\n"
        "Memory on the node (IP: 10.0.12.7, ID: 4f1e) where the task (actor ID: 7c2b, name=MegatronTrainRayActor."
        "__init__, pid=48217) was running was 1900.12GB / 2000.00GB (0.95006), which exceeds the memory usage "
        "threshold of 0.95.\n")
    c = parse_slime_log(text, gpus=8).crash
    assert c.kind == "host_oom" and c.rank == 6 and c.rollout_id == 20  # pid 48217 printed [rank6] earlier


def test_a_succeeded_job_has_no_crash_even_with_an_nccl_warning():
    text = _read("success_20steps.log").replace(
        "actor.py:131 - training finished", "actor.py:131 - NCCL error in: x.cpp:1, handled and retried")
    assert parse_slime_log(text, gpus=8).crash is None


def test_both_throughputs_are_named(ok):
    step = [t + 0.63 for t in TIMES]  # perf/step_time = train_wait 0.61 + train (actor_train + 0.02) in the fixture
    assert ok.tokens_per_s_per_gpu_step_time == pytest.approx(15 * TOKENS_PER_STEP / sum(step[5:20]) / 8)
    assert ok.throughput_basis == "actor_train_time" and ok.to_dict()["throughput_basis"] == "actor_train_time"
    s = format_summary(ok)
    assert "tokens/s/GPU over actor_train_time" in s and "tokens/s/GPU over step_time" in s
