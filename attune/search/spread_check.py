"""The study checks its own posterior spread on what it was not fitted to (issue 20: an honest stop rule).

Every measured candidate was proposed with a posterior mean and spread of its log throughput (kept on the trial:
`predicted_model_tokens_per_s_per_gpu`, `predicted_spread_percent`) made before it was measured. Its measurement is
therefore an out-of-sample test of that posterior: z = log(measured / predicted) / sqrt(spread^2 + noise^2), the
noise being the run-to-run noise of one measurement (THROUGHPUT_NOISE). A calibrated posterior gives z ~ N(0, 1); a
model that mis-prices structure the GP does not know (a penalty growing with PP, TP efficiency depending on SP) gives
|z| > 1 however many layouts it has seen near the incumbent.

`spread_factor` turns those tests into a factor on every posterior spread: kappa^2 = (PRIOR_TESTS + sum z^2) /
(PRIOR_TESTS + n), a scaled-inverse-chi^2 posterior mean with PRIOR_TESTS pseudo-tests at kappa = 1, clipped to
KAPPA_RANGE (it only widens). The sampler applies it to the spreads its stop rule and its claimed remaining regret
read (and to its acquisition), so the claim widens where the study's own predictions missed: a study whose model
mis-prices what it measured does not stop on that model's word.
"""

from __future__ import annotations

import math

import optuna

from attune.search.recalibrate import THROUGHPUT_NOISE

# pseudo-tests at kappa = 1 (the prior: the GP's spread is right) against which the study's own tests weigh
PRIOR_TESTS = 2.0
# the factor's range: it only widens (up to three times). The tests are of the layouts the study chose to
# measure, near its incumbent: predictions that held there say nothing of the structure far from it (a table not in
# the repository may put its best layout at another PP or TP), so they never narrow the spread below the GP's
KAPPA_RANGE = (1.0, 3.0)


def prediction_tests(study: optuna.Study) -> list[float]:
    """z of every completed measured candidate proposed with a posterior mean and spread (module docstring), in
    trial order."""
    out = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        a = t.user_attrs
        pred, sd = a.get("predicted_model_tokens_per_s_per_gpu"), a.get("predicted_spread_percent")
        if a.get("role") is None or not t.value or not pred or sd is None or not pred > 0:
            continue
        s = math.sqrt((sd / 100.0) ** 2 + THROUGHPUT_NOISE ** 2)
        out.append(math.log(float(t.value) / float(pred)) / s)
    return out


def spread_factor(tests: list[float]) -> float:
    """kappa from the out-of-sample tests z (module docstring); 1 without any."""
    k2 = (PRIOR_TESTS + sum(z * z for z in tests)) / (PRIOR_TESTS + len(tests))
    return min(max(math.sqrt(k2), KAPPA_RANGE[0]), KAPPA_RANGE[1])
