"""Refit the calibrated coefficients (attune/calibration.py) to the observations and print them with the
per-observation predictions. Run by hand: `python benchmarks/calibrate.py`."""

from attune.estimator.coefficients import DEFAULT
from attune.estimator.fit import OBSERVATIONS, fit

if __name__ == "__main__":
    coef, report = fit()
    print("fitted coefficients (stored defaults in brackets):")
    for k in ("gemm_efficiency", "host_optimizer_efficiency", "activation_factor", "fixed_overhead_gib"):
        print(f"  {k}: {getattr(coef, k):.4g}  [{getattr(DEFAULT, k):.4g}]")
    for r, o in zip(report, OBSERVATIONS):
        m = r["measured_tokens_per_s_per_gpu"]
        speed = (f"predicted {r['predicted_tokens_per_s_per_gpu']:,.1f} tokens/s/GPU"
                 + (f" vs measured {m:,.1f} ({100 * (r['predicted_tokens_per_s_per_gpu'] / m - 1):+.1f}%)" if m else ""))
        print(f"- {r['what']}: {speed}; peak {r['peak_gib']:.1f} GiB on stage {r['peak_stage']}, "
              f"fits={r['fits']} (observed {r['observed_fits']})")
