"""The `sim` runner: the calibrated analytic model stands in for a measurement. Its results are predictions
(``measured=False``), so recipes from it say ``status: predicted`` and are never verified."""

from __future__ import annotations

from pathlib import Path

from attune.estimator import estimate
from attune.estimator.coefficients import Coefficients
from attune.runners.base import OK, OOM, Capabilities, Rerun, Runner, TrialResult, TrialSpec
from attune.runners.rerun import engine_rerun
from attune.spec.rules import check

__all__ = ["SimRunner"]


class SimRunner(Runner):
    """Runner whose "measurement" is ``attune.estimator.estimate``: instant, no processes, nothing measured."""

    name = "sim"
    # defaults of `attune tune`: 20 measured trials, 32 proposals estimated per trial (a trial costs nothing)
    capabilities = Capabilities(measured=False, default_trials=20, default_candidates=32)

    def __init__(self, coefficients: Coefficients | None = None):  # None: the GPU generation's fitted set
        self.coefficients = coefficients

    def check(self, spec: TrialSpec) -> list[str]:
        return check(spec.layout, spec.model, spec.cluster.world_size, spec.workload, spec.engine)

    def rerun_command(self, spec: TrialSpec) -> Rerun:
        """The engine's launch: a prediction is rerun the way the engine's own runner measures it."""
        return engine_rerun(spec)

    def run(self, spec: TrialSpec) -> TrialResult:
        """As ``Runner.run``, but a spec without ``trial_dir`` writes nothing (no temp folder for a prediction)."""
        if spec.trial_dir is None:
            reasons = self.check(spec)
            if reasons:
                return super().run(spec)  # raises UnsupportedLayout
            result = self._execute(spec, None)
            result.trial_number = spec.trial_number
            return result
        return super().run(spec)

    def _execute(self, spec: TrialSpec, trial_dir: Path | None) -> TrialResult:
        est = estimate(spec.model, spec.cluster, spec.layout, spec.workload, spec.engine, self.coefficients)
        peaks = [s.total_gib for s in est.memory.stages]
        w = spec.workload
        if not est.fits:
            return TrialResult(status=OOM, measured=False, peak_memory_gib=peaks, reason=est.memory.verdict(),
                               oom_stage=est.memory.peak_stage)
        step = est.perf.step_time_s
        a, b = w.window
        return TrialResult(
            status=OK, measured=False, tokens_per_s_per_gpu=est.perf.tokens_per_s_per_gpu, step_time_s=step,
            step_time_cv_percent=0.0, step_times_s=[step] * w.steps, peak_memory_gib=peaks, window=(a, b),
            window_tokens=w.tokens_per_step * (b - a + 1),
            gpu_hours=0.0,  # nothing ran
            extra={"mfu": est.perf.mfu, "usd_per_million_tokens": est.perf.usd_per_million_tokens},
        )
