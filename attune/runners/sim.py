"""The `sim` runner: the calibrated analytic model stands in for a measurement. Its results are predictions
(`measured=False`), so recipes from it say `status: predicted` and are never verified."""

from __future__ import annotations

from dataclasses import dataclass

from attune.estimator.coefficients import DEFAULT, Coefficients
from attune.estimator import estimate
from .base import OK, OOM, TrialResult, TrialSpec


@dataclass
class SimRunner:
    coefficients: Coefficients = DEFAULT
    name: str = "sim"
    measured: bool = False

    def run(self, spec: TrialSpec) -> TrialResult:
        est = estimate(spec.model, spec.cluster, spec.layout, spec.workload, spec.engine, self.coefficients)
        peaks = [s.total_gib for s in est.memory.stages]
        w = spec.workload
        if not est.fits:
            return TrialResult(status=OOM, measured=False, peak_memory_gib=peaks, reason=est.memory.verdict(),
                               oom_stage=est.memory.peak_stage)
        step = est.perf.step_time_s
        a, b = w.window
        result = TrialResult(
            status=OK, measured=False, tokens_per_s_per_gpu=est.perf.tokens_per_s_per_gpu, step_time_s=step,
            step_time_cv_percent=0.0, step_times_s=[step] * w.steps, peak_memory_gib=peaks, window=(a, b),
            window_tokens=w.tokens_per_step * (b - a + 1),
            gpu_hours=0.0,  # nothing ran
            extra={"mfu": est.perf.mfu, "usd_per_million_tokens": est.perf.usd_per_million_tokens},
        )
        if spec.trial_dir:
            spec.trial_dir.mkdir(parents=True, exist_ok=True)
            result.save(spec.trial_dir / "result.json")
        return result
