"""The Optuna study: ask-and-tell with the memory verdict as a constraint, the model deciding what gets measured.

Every proposal is estimated (microseconds) and recorded as a trial: a layout that breaks a rule, or that the
memory estimator predicts to run out of memory, is an infeasible PRUNED trial carrying its reason and
overflowing stage; a feasible proposal is a PRUNED trial carrying its predicted tokens/s/GPU as an
intermediate value (so TPE ranks it). Per measurement slot the best feasible, not yet measured proposal,
unless predicted slower than `slack` x the prediction of the best measured layout, is re-asked as an
enqueued trial and run on the runner: COMPLETE with the measured tokens/s/GPU, PRUNED+infeasible if it ran
out of memory for real, FAIL if it crashed or hung. The first measured trial is the baseline layout.
`trials` counts completed measured trials in the study, so rerunning resumes up to it.
"""

from __future__ import annotations

from attune.errors import NoFeasibleLayout, UserInputError

import datetime as dt
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import optuna

from attune.estimator.coefficients import DEFAULT, Coefficients
from attune.spec.engine import Engine
from attune.estimator import Estimate, estimate
from attune.spec.hardware import Cluster
from attune.spec.layout import Layout, Workload
from attune.errors import LayoutError
from attune.spec.model import ModelSpec
from ..runners.base import FAILED, OK, OOM, Runner, TrialResult, TrialSpec
from .space import SearchSpace

ROLE_BASELINE, ROLE_CANDIDATE = "baseline", "candidate"
KIND_INVALID, KIND_OOM, KIND_RULE, KIND_DUP, KIND_SLOW, KIND_EST = (
    "invalid", "oom-predicted", "oom-monotone-rule", "duplicate", "skipped-slow", "estimated")
ORPHAN_AGE_S = 2.0  # seconds after which an untagged RUNNING trial is taken as abandoned
INVALID_PENALTY = 1000.0  # constraint value of a layout that breaks a rule: worse than any memory overflow


class StudyError(UserInputError):
    pass


@dataclass
class TuneConfig:
    model: ModelSpec
    cluster: Cluster
    engine: Engine
    workload: Workload
    space: SearchSpace
    runner: Runner
    baseline: Layout
    baseline_note: str
    trials: int = 20
    candidates: int = 48  # TPE proposals estimated (and recorded as trials) per measurement slot
    random_starts: int = 400  # uniform draws scored by the model per slot, the best 5 refined
    slack: float = 0.8
    seed: int = 0
    storage: str = ""
    study_name: str = "attune"
    out_dir: Path = Path(".")
    timeout_s: float | None = None
    coefficients: Coefficients = DEFAULT
    memory_limit_gib: float | None = None
    data_path: str | None = None
    headroom: float = 0.02  # fraction of GPU memory kept free: predictions this close to capacity are not trusted


@dataclass
class TuneOutcome:
    study: optuna.Study
    baseline: optuna.trial.FrozenTrial | None
    best: optuna.trial.FrozenTrial | None
    counts: dict = field(default_factory=dict)
    wall_s: float = 0.0
    stopped: str = ""


def _sampler(seed: int) -> optuna.samplers.BaseSampler:
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=16)


def open_study(cfg: TuneConfig) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = cfg.storage
    if storage.endswith(".journal") and "://" not in storage:
        from optuna.storages.journal import JournalFileBackend, JournalStorage
        storage = JournalStorage(JournalFileBackend(storage))
    try:
        study = optuna.create_study(storage=storage, study_name=cfg.study_name, direction="maximize",
                                    sampler=_sampler(cfg.seed), load_if_exists=True)
    except Exception as e:  # bad URL, unreachable database, missing driver
        raise StudyError(f"cannot open the Optuna storage {cfg.storage!r}: {str(e).splitlines()[0]}") from None
    meta = {"model": cfg.model.name, "gpus": cfg.cluster.spec, "engine": cfg.engine.name,
            "runner": cfg.runner.name, "space": cfg.space.name, "seq_length": cfg.workload.seq_length,
            "global_batch": cfg.workload.global_batch}
    have = study.user_attrs
    if have.get("model"):
        diff = [k for k, v in meta.items() if have.get(k) != v]
        if diff:
            k = diff[0]
            raise StudyError(f"study '{cfg.study_name}' was created for {k}={have.get(k)!r}, not {meta[k]!r}; "
                             f"use another --study-name or --out")
    else:
        for k, v in meta.items():
            study.set_user_attr(k, v)
        study.set_user_attr("baseline_note", cfg.baseline_note)
    return study


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fail_stale_trials(study: optuna.Study) -> int:
    """Trials left RUNNING by a tuner on this host that was killed: recorded as FAIL ('interrupted')."""
    n = 0
    host = socket.gethostname()
    now = dt.datetime.now()
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        # a live tuner tags a trial with its host and pid milliseconds after asking for it: an untagged trial
        # older than a few seconds was left by a tuner killed in between
        orphan = "host" not in t.user_attrs and t.datetime_start is not None and \
            (now - t.datetime_start).total_seconds() > ORPHAN_AGE_S
        dead = t.user_attrs.get("host") == host and not _pid_alive(int(t.user_attrs.get("pid", 0)))
        if orphan or dead:
            study._storage.set_trial_user_attr(t._trial_id, "reason", "interrupted: the tuner was killed")
            study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
            n += 1
    return n


def _measured(study: optuna.Study, states=None) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=states)
            if t.user_attrs.get("role") in (ROLE_BASELINE, ROLE_CANDIDATE)]


def _layout_key(d: dict) -> tuple:
    """Identity of a layout for "already measured": uniform recompute in groups of N recomputes every layer
    whatever N, so N does not make a different layout worth another measurement."""
    d = dict(d)
    if d.get("recompute_method") == "uniform":
        d["recompute_num_layers"] = 0
    return tuple(sorted(d.items()))


def _record_estimate(t: optuna.Trial, est: Estimate) -> None:
    t.set_user_attr("layout", est.layout.to_dict())
    t.set_user_attr("label", est.layout.label())
    t.set_user_attr("predicted_tokens_per_s_per_gpu", round(est.perf.tokens_per_s_per_gpu, 3))
    t.set_user_attr("predicted_step_time_s", round(est.perf.step_time_s, 4))
    t.set_user_attr("predicted_mfu", round(est.perf.mfu, 5))
    t.set_user_attr("predicted_peak_gib", round(est.memory.peak_gib, 3))
    t.set_user_attr("predicted_peak_stage", est.memory.peak_stage)
    t.set_user_attr("predicted_stage_gib", [round(s.total_gib, 3) for s in est.memory.stages])


def neighbours(params: dict, space: SearchSpace):
    """Parameter sets one step away: +-1 and +-2 on integer knobs, every other choice on categorical ones."""
    for k, dom in space.knobs.items():
        v = params[k]
        if isinstance(dom, tuple) and len(dom) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in dom) \
                and k in ("first_offset", "last_offset", "recompute_layers"):
            for d in (-2, -1, 1, 2):
                if dom[0] <= v + d <= dom[1]:
                    yield {**params, k: v + d}
        else:
            for c in dom:
                if c != v:
                    yield {**params, k: c}


def refine(start: dict, score, space: SearchSpace, max_rounds: int = 25) -> tuple[dict, float, int]:
    """Greedy hill-climb on the performance model from `start`; returns (params, score, estimates made)."""
    best, best_s = start, score(start)
    n = 1
    for _ in range(max_rounds):
        step = None
        for nb in neighbours(best, space):
            sc = score(nb)
            n += 1
            if sc > best_s + 1e-9:
                step, best_s = nb, sc
        if step is None:
            break
        best = step
    return best, best_s, n


def run_study(cfg: TuneConfig, progress=None) -> TuneOutcome:
    t0 = time.time()
    study = open_study(cfg)
    fail_stale_trials(study)
    model, cluster, wl, eng, space = cfg.model, cfg.cluster, cfg.workload, cfg.engine, cfg.space
    dists = space.distributions()
    host, pid = socket.gethostname(), os.getpid()
    capacity = cluster.gpu.capacity_gib
    usable = capacity * (1.0 - cfg.headroom)

    def fits(e: Estimate) -> bool:
        return e.memory.host_fits and e.memory.peak_gib <= usable

    measured_layouts: set[tuple] = {_layout_key(t.user_attrs["layout"]) for t in _measured(study) if "layout" in t.user_attrs}
    # monotone rule: a stage that ran out of memory for real at a predicted P GiB rules out >= P GiB on that stage
    oom_floor: dict[int, float] = {}
    for t in _measured(study):
        if t.user_attrs.get("outcome") == OOM and t.user_attrs.get("oom_stage") is not None:
            st = int(t.user_attrs["oom_stage"])
            p = t.user_attrs.get("predicted_stage_gib", [])
            if st < len(p):
                oom_floor[st] = min(oom_floor.get(st, 1e18), p[st])

    def n_complete() -> int:
        return len(_measured(study, (optuna.trial.TrialState.COMPLETE,)))

    def best_measured() -> optuna.trial.FrozenTrial | None:
        done = _measured(study, (optuna.trial.TrialState.COMPLETE,))
        feasible = [t for t in done if all(v <= 0 for v in t.constraints.values())]
        return max(feasible, key=lambda t: t.value) if feasible else None

    def measure(params: dict | None, layout: Layout, est: Estimate, role: str) -> optuna.trial.FrozenTrial:
        if params is not None:
            study.enqueue_trial(params, skip_if_exists=False)
        trial = study.ask(dists if params is not None else None)
        trial.set_user_attr("role", role)
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        trial.set_user_attr("runner", cfg.runner.name)
        _record_estimate(trial, est)
        measured_layouts.add(_layout_key(layout.to_dict()))
        tdir = cfg.out_dir / "trials" / f"{trial.number:05d}-{layout.slug()}"
        spec = TrialSpec(model, cluster, layout, wl, eng, trial_dir=tdir, timeout_s=cfg.timeout_s,
                         label=layout.label(), data_path=cfg.data_path, memory_limit_gib=cfg.memory_limit_gib)
        if progress:
            progress(f"running trial {trial.number}: {layout.label()}")
        try:
            res: TrialResult = cfg.runner.run(spec)
        except KeyboardInterrupt:
            trial.set_user_attr("reason", "interrupted")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        except Exception as e:  # a runner bug must not lose the study
            res = TrialResult(status=FAILED, measured=cfg.runner.measured, reason=f"runner error: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        trial.set_user_attr("outcome", res.status)
        trial.set_user_attr("measured", res.measured)
        trial.set_user_attr("gpu_hours", res.gpu_hours)
        if res.reason:
            trial.set_user_attr("reason", res.reason[:2000])
        if res.log_tail:
            trial.set_user_attr("log_tail", res.log_tail[-2000:])
        if res.peak_memory_gib:
            trial.set_user_attr("measured_peak_gib", [round(x, 3) for x in res.peak_memory_gib])
        if res.status == OK:
            trial.set_user_attr("tokens_per_s_per_gpu", res.tokens_per_s_per_gpu)
            trial.set_user_attr("step_time_s", res.step_time_s)
            trial.set_user_attr("step_time_cv_percent", res.step_time_cv_percent)
            trial.set_user_attr("window", list(res.window) if res.window else None)
            trial.set_user_attr("window_tokens", res.window_tokens)
            if res.losses:
                trial.set_user_attr("losses", {str(k): v for k, v in res.losses.items()})
            trial.set_user_attr("extra", res.extra)
            trial.set_constraint("memory_gib", min(est.memory.peak_gib - capacity, -1e-6))
            study.tell(trial, res.tokens_per_s_per_gpu)
        elif res.status == OOM:
            stage = res.oom_stage if res.oom_stage is not None else est.memory.peak_stage
            trial.set_user_attr("oom_stage", stage)
            p = [s.total_gib for s in est.memory.stages]
            if stage < len(p):
                oom_floor[stage] = min(oom_floor.get(stage, 1e18), p[stage])
            trial.set_constraint("memory_gib", max(est.memory.peak_gib - capacity, 0.5))
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return study.trials[trial.number]

    counts = dict(estimated=0, invalid=0, oom_predicted=0, oom_rule=0, duplicate=0, skipped_slow=0, measured=0,
                  refined=0)
    stopped = ""
    # 1. the baseline
    if not [t for t in _measured(study) if t.user_attrs.get("role") == ROLE_BASELINE
            and t.state != optuna.trial.TrialState.RUNNING]:
        est = estimate(model, cluster, cfg.baseline, wl, eng, cfg.coefficients)
        counts["estimated"] += 1
        measure(space.params_for(cfg.baseline, model, wl), cfg.baseline, est, ROLE_BASELINE)
        counts["measured"] += 1
    # 2. measurement slots
    attempts = len([t for t in _measured(study) if t.state != optuna.trial.TrialState.RUNNING])
    dry = 0
    while n_complete() < cfg.trials and attempts < 2 * cfg.trials + 2:
        best = best_measured()
        best_pred = best.user_attrs.get("predicted_tokens_per_s_per_gpu") if best else None
        pick = None
        pool: list[tuple[float, dict]] = []
        for _ in range(cfg.candidates):
            t = study.ask()
            t.set_user_attr("host", host)
            t.set_user_attr("pid", pid)
            params = space.suggest(t)
            t.set_user_attr("kind", KIND_EST)
            try:
                layout = space.to_layout(params, model, cluster.world_size, wl, eng)
            except LayoutError as e:
                counts["invalid"] += 1
                t.set_user_attr("kind", KIND_INVALID)
                t.set_user_attr("reason", str(e)[:500])
                t.set_constraint("valid", INVALID_PENALTY)
                study.tell(t, state=optuna.trial.TrialState.PRUNED)
                continue
            est = estimate(model, cluster, layout, wl, eng, cfg.coefficients, check_layout=False)
            counts["estimated"] += 1
            _record_estimate(t, est)
            pred = est.perf.tokens_per_s_per_gpu
            t.report(pred, 0)
            key = _layout_key(layout.to_dict())
            over = [s for s in est.memory.stages if s.stage in oom_floor and s.total_gib >= oom_floor[s.stage]]
            if not fits(est):
                counts["oom_predicted"] += 1
                t.set_user_attr("kind", KIND_OOM)
                t.set_user_attr("reason", est.memory.verdict() if not est.fits else
                                f"predicted peak {est.memory.peak_gib:.1f} GiB on stage {est.memory.peak_stage} is within the "
                                f"{100 * cfg.headroom:g}% headroom of {capacity:.1f} GiB")
                t.set_constraint("memory_gib", max(est.memory.peak_gib - usable, 1e-3))
                study.tell(t, state=optuna.trial.TrialState.PRUNED)
                continue
            t.set_constraint("memory_gib", est.memory.peak_gib - usable)
            if over:
                counts["oom_rule"] += 1
                t.set_user_attr("kind", KIND_RULE)
                t.set_user_attr("reason", f"stage {over[0].stage} needs {over[0].total_gib:.1f} GiB, at least as much as a "
                                          f"layout that ran out of memory there ({oom_floor[over[0].stage]:.1f} GiB predicted)")
            elif key in measured_layouts:
                counts["duplicate"] += 1
                t.set_user_attr("kind", KIND_DUP)
            elif best_pred and pred < cfg.slack * best_pred:
                counts["skipped_slow"] += 1
                t.set_user_attr("kind", KIND_SLOW)
                t.set_user_attr("reason", f"predicted {pred:.1f} tokens/s/GPU < {cfg.slack:g} x {best_pred:.1f} predicted "
                                          f"for the best measured layout")
            else:
                pool.append((pred, params))
            study.tell(t, state=optuna.trial.TrialState.PRUNED)
        # the model decides what deserves a measurement: hill-climb from the best proposals
        cache: dict[tuple, float] = {}

        def score(p: dict) -> float:
            key = tuple(sorted(p.items()))
            if key not in cache:
                try:
                    lay = space.to_layout(p, model, cluster.world_size, wl, eng)
                except LayoutError:
                    cache[key] = float("-inf")
                    return cache[key]
                e = estimate(model, cluster, lay, wl, eng, cfg.coefficients, check_layout=False)
                bad = (not fits(e) or _layout_key(lay.to_dict()) in measured_layouts
                       or any(s.stage in oom_floor and s.total_gib >= oom_floor[s.stage] for s in e.memory.stages))
                cache[key] = float("-inf") if bad else e.perf.tokens_per_s_per_gpu
            return cache[key]

        # starting points: the best TPE proposals, and the best of a uniform draw scored by the model
        rng = np.random.default_rng([cfg.seed, len(study.trials)])
        draws = [space.random_params(rng) for _ in range(cfg.random_starts)]
        counts["refined"] += len(draws)
        scored = sorted(((score(p), p) for p in draws), key=lambda x: -x[0])
        starts = [p for _, p in sorted(pool, key=lambda x: -x[0])[:3]] + [p for sc, p in scored[:5] if sc > float("-inf")]
        for params in starts:
            p2, sc, n = refine(params, score, space)
            counts["refined"] += n
            if sc > float("-inf") and (best_pred is None or sc >= cfg.slack * best_pred) and (pick is None or sc > pick[0]):
                pick = (sc, p2)
        if pick is not None:
            lay = space.to_layout(pick[1], model, cluster.world_size, wl, eng)
            pick = (pick[1], lay, estimate(model, cluster, lay, wl, eng, cfg.coefficients, check_layout=False))
        study.set_user_attr("refined_estimates", int(study.user_attrs.get("refined_estimates", 0)) + counts["refined"])
        counts["refined"] = 0
        if pick is None:
            dry += 1
            if dry >= 3:
                stopped = "no new feasible candidate worth measuring in 3 rounds of proposals"
                break
            continue
        dry = 0
        measure(pick[0], pick[1], pick[2], ROLE_CANDIDATE)
        counts["measured"] += 1
        attempts += 1
        if progress:
            b = best_measured()
            progress(f"best {b.value:,.1f} tokens/s/GPU ({b.user_attrs.get('label')})" if b else "no measured result yet",
                     advance=n_complete())
    fail_stale_trials(study)  # orphans too young to judge at the start
    baseline = next((t for t in _measured(study) if t.user_attrs.get("role") == ROLE_BASELINE), None)
    return TuneOutcome(study, baseline, best_measured(), counts, time.time() - t0, stopped)


def study_counts(study: optuna.Study) -> dict:
    """Counts over the whole study (all sessions): what was estimated, pruned and measured."""
    c = dict(proposals=0, refined=0, estimated=0, invalid=0, oom_predicted=0, oom_rule=0, duplicate=0, skipped_slow=0,
             estimated_only=0, measured=0, measured_ok=0, measured_oom=0, measured_failed=0)
    kinds = {KIND_INVALID: "invalid", KIND_OOM: "oom_predicted", KIND_RULE: "oom_rule", KIND_DUP: "duplicate",
             KIND_SLOW: "skipped_slow", KIND_EST: "estimated_only"}
    for t in study.get_trials(deepcopy=False):
        role = t.user_attrs.get("role")
        if role:
            c["measured"] += 1
            out = t.user_attrs.get("outcome")
            c["measured_ok" if out == OK else "measured_oom" if out == OOM else "measured_failed"] += 1
            continue
        c["proposals"] += 1
        k = t.user_attrs.get("kind")
        if k in kinds:
            c[kinds[k]] += 1
        if k != KIND_INVALID:
            c["estimated"] += 1
    c["refined"] = int(study.user_attrs.get("refined_estimates", 0))
    return c

