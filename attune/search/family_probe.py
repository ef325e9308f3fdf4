"""One trial per unmeasured structure family when the posterior says it could hold the best (issue 20).

A study's residual model learns from what it measured: the layouts near its incumbent. A family of layouts
that no trial has touched (another TP x PP: `family_keys`) carries only the prior's knob-distance spread, and the
expected-improvement acquisition prices it below small gaps near the incumbent whose spreads are a few percent.
Where the model's structural error puts the best layout in such a family (a structure effect the model lacks: in
the structural worlds of benchmarks/search_efficiency.py, Llama-3.1-70B world 10 has its best 2% in the PP1 / TP8
family, 1.5x the model's prediction, while the measured PP2 / TP4 family sits at 1.3x), no measured residual
points there and a local model cannot see it.

`family_probe` gives such a family one trial: among the families without a measured layout (OOMs count as
measured: the family was reached), the one whose best candidate has the largest probability of beating the best
measured by more than min_gain, when that probability is at least FAMILY_P; its candidate with the largest
expected improvement is proposed. A probe is only taken once the study has measured FAMILY_AFTER layouts (the
baseline and the model's first proposals settle the level first), and at most FAMILY_MAX probes per study: the
budget for exploration is bounded, the posterior decides where it goes.

Pure functions over the scored table's features and the acquisition's arrays; the sampler decides when to call it
(`attune.search.sampler.ModelGuidedSampler.assess`, switched by `sampler.FAMILY_PROBE`).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import ndtr

from attune.search.space import FEATURES

# the features that name a family: TP and PP degree (each a doubling per unit, `space.FEATURES`)
FAMILY = tuple(FEATURES.index(f) for f in ("log2_tp", "log2_pp"))
# a family is probed when its best candidate beats the best measured by more than min_gain with at least this
# probability (the stop rule's p_stop is 0.05: a family at FAMILY_P keeps the study from stopping anyway)
FAMILY_P = 0.10
# measured layouts (baseline included) before a probe may be taken, and probes per study at most
FAMILY_AFTER = 3
FAMILY_MAX = 2


def family_keys(features: np.ndarray) -> np.ndarray:
    """[rows] an integer per (TP, PP) family (log2 degrees packed; equal keys: the same family)."""
    f = np.rint(features[..., FAMILY]).astype(np.int64)
    return f[..., 0] * 64 + f[..., 1]


def p_improve(gap: np.ndarray, sd: np.ndarray, p_fit: np.ndarray, min_gain: float) -> np.ndarray:
    """[rows] probability of beating the best measured by more than min_gain and fitting (log gap, its sd)."""
    lg = math.log1p(min_gain)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(sd > 0, (gap - lg) / np.maximum(sd, 1e-12), np.where(gap > lg, np.inf, -np.inf))
    return ndtr(z) * p_fit


def family_probe(features: np.ndarray, measured: np.ndarray, probes_taken: int, pi: np.ndarray, ei: np.ndarray,
                 avail: np.ndarray, n_measured: int, chosen: int | None) -> dict | None:
    """The probe to take now, or None: {"row", "family": (TP, PP), "p_improve"}.

    `measured`: [k, features] of every measured layout (OOMs included); `probes_taken`: probes already measured;
    `pi` / `ei`: per row, the probability of beating the best measured by more than min_gain (times P(fit)) and
    the acquisition (expected improvement times P(fit)); `avail`: the candidates; `chosen`: the acquisition's
    choice (a probe only replaces a choice inside a measured family: the study is refining what it knows)."""
    if n_measured < FAMILY_AFTER or probes_taken >= FAMILY_MAX or not avail.any() or chosen is None:
        return None
    keys = family_keys(features)
    done = family_keys(measured) if len(measured) else np.array([], dtype=np.int64)
    if keys[chosen] not in done:
        return None
    open_ = avail & ~np.isin(keys, done)
    if not open_.any():
        return None
    pi_open = np.where(open_, pi, 0.0)
    r = int(np.argmax(pi_open))
    if pi_open[r] < FAMILY_P:
        return None
    fam = open_ & (keys == keys[r])
    row = int(np.argmax(np.where(fam, ei, -np.inf)))
    tp, pp = (int(round(2 ** features[row, j])) for j in FAMILY)
    return {"row": row, "family": (tp, pp), "p_improve": round(float(pi_open[r]), 3)}
