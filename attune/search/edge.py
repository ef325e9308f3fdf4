"""Walking the memory edge (issue 20): the steps the sampler takes next to a measured OOM or a measured fit.

The best layouts sit at the memory edge, where the model is least sure. A real OOM on stage s is a measurement
of that edge: stage s needed more than capacity. The next proposal is then the cheapest change that takes
memory off stage s (`off_stage_rows`), priced by the recalibrated model: among the layouts of the same
structure (TP, SP, PP, VPP, CP, optimizer offload, EP, ETP, dispatcher: `STRUCTURE`) within EDGE_RADIUS knob
steps whose stage-s memory is predicted lower (more recompute layers in its chunks, a layer moved off s, fewer
tokens per microbatch, selective instead of no recompute), the one predicted fastest that is likely to fit.
After a measured fit, the step toward less recompute (`less_recompute_rows`: the same split and batching,
fewer recomputed layers, selective instead of full, none instead of selective) is tried when the model says it
pays. Both bypass the near-duplicate rule: a step back across an edge just measured is the point.

Pure functions over the scored table's arrays (`ScoredSpace.features`, per-position peaks); the sampler
decides when to take a step (`attune.search.sampler.ModelGuidedSampler.assess`).
"""

from __future__ import annotations

import numpy as np

from attune.search.space import FEATURES
from attune.spec.placement import stage_layer_counts

# features that fix a layout's structure: an edge step keeps them
STRUCTURE = tuple(FEATURES.index(f) for f in ("log2_tp", "sp", "log2_pp", "log2_vpp", "log2_cp", "offload",
                                              "log2_ep", "log2_etp", "allgather"))
# features of the split and the batching (a less-recompute step keeps them too)
SPLIT_BATCH = tuple(FEATURES.index(f) for f in ("first_shift", "last_shift", "log2_tokens"))
_SEL, _FULL, _FRAC = FEATURES.index("selective"), FEATURES.index("full"), FEATURES.index("recompute_fraction")
# knob steps an edge step may span (a few recompute layers, up to 8 layers moved between stages, one halving of
# the tokens per microbatch, or selective instead of none: each one knob step or less, `space.FEATURES`), and
# the memory a step must take off the stage to count, GiB (below the allocator noise of a measured peak)
EDGE_RADIUS = 2.0
EDGE_MIN_SAVING_GIB = 0.25
# an edge step is proposed only when the memory model gives it at least this probability of fitting
EDGE_P_FIT = 0.5


def position(stage: int, pp: int) -> tuple[int, ...]:
    """Indices into (first, middle, last) of a pipeline stage (a single stage is first and last)."""
    if pp == 1:
        return (0, 2)
    return (0,) if stage == 0 else (2,) if stage == pp - 1 else (1,)


def recompute_level(features: np.ndarray) -> np.ndarray:
    """How much a layout recomputes, ordered: none 0, selective 1, full 2 + the fraction of a chunk's layers."""
    return features[..., _SEL] + features[..., _FULL] * (2.0 + features[..., _FRAC])


def same_structure(features: np.ndarray, r0: int, dims=STRUCTURE) -> np.ndarray:
    """Rows whose `dims` features equal row r0's."""
    return np.all(np.abs(features[:, dims] - features[r0, dims]) < 1e-9, axis=1)


def _recompute(lay) -> tuple:
    return (lay.recompute_granularity, lay.recompute_method, lay.recompute_num_layers,
            tuple(lay.effective_recompute_modules), tuple(lay.offload_modules))


def _tokens(lay) -> int:
    return lay.max_tokens_per_gpu * lay.cp if lay.max_tokens_per_gpu else lay.micro_batch_size


def one_change(lay0, lay1, num_layers: int, stage: int | None = None) -> str | None:
    """The one change taking memory off `stage` from lay0 to lay1 (the same structure assumed), or None when
    lay1 changes more than one of: the recompute (more of it), the split (fewer layers on `stage`), the tokens
    per microbatch (fewer)."""
    c0, c1 = stage_layer_counts(lay0, num_layers), stage_layer_counts(lay1, num_layers)
    same_split, same_rec, same_tok = c0 == c1, _recompute(lay0) == _recompute(lay1), _tokens(lay0) == _tokens(lay1)
    if same_split and same_tok and not same_rec:
        return "recompute"
    if same_rec and same_tok and not same_split and (stage is None or c1[stage] < c0[stage]):
        return "split"
    if same_split and same_rec and _tokens(lay1) < _tokens(lay0):
        return "tokens"
    return None


def off_stage_rows(features: np.ndarray, stage_mean_gib: np.ndarray, r0: int, positions: tuple[int, ...],
                   layouts=None, num_layers: int | None = None, stage: int | None = None) -> np.ndarray:
    """Rows that take memory off the stage positions of row r0 that ran out (a bool mask): the same structure,
    within EDGE_RADIUS knob steps, predicted at least EDGE_MIN_SAVING_GIB lower at every such position, and
    (given `layouts` and `num_layers`) one change away (`one_change`: more recompute, fewer layers on `stage`,
    or fewer tokens per microbatch). `stage_mean_gib` is (rows, 3): the recalibrated predicted peak per
    position (-inf where none)."""
    near = np.abs(features - features[r0]).sum(1) <= EDGE_RADIUS
    lower = np.ones(len(features), dtype=bool)
    for j in positions:
        lower &= stage_mean_gib[:, j] <= stage_mean_gib[r0, j] - EDGE_MIN_SAVING_GIB
    out = same_structure(features, r0) & near & lower
    out[r0] = False
    if layouts is not None and num_layers is not None:
        for i in np.flatnonzero(out):
            out[i] = one_change(layouts[r0], layouts[i], num_layers, stage) is not None
    return out


def less_recompute_rows(features: np.ndarray, r0: int) -> np.ndarray:
    """Rows one step toward less recompute from row r0 (a bool mask): the same structure, split and batching,
    a lower recompute level, within EDGE_RADIUS knob steps."""
    near = np.abs(features - features[r0]).sum(1) <= EDGE_RADIUS
    out = same_structure(features, r0, STRUCTURE + SPLIT_BATCH) & near
    return out & (recompute_level(features) < recompute_level(features[r0]) - 1e-9)


def step_kind(f0: np.ndarray, f1: np.ndarray) -> str:
    """What an edge step changed, in words (from the knob features of the two layouts)."""
    parts = []
    r0, r1 = float(recompute_level(f0)), float(recompute_level(f1))
    if r1 > r0:
        parts.append("more recompute" if f0[_FULL] and f1[_FULL] else
                     "selective instead of none" if f1[_SEL] and not f0[_FULL] else "full recompute")
    elif r1 < r0:
        parts.append("less recompute")
    split = [FEATURES.index("first_shift"), FEATURES.index("last_shift")]
    if np.any(np.abs(f1[split] - f0[split]) > 1e-9):
        parts.append("layers moved between stages")
    tok = FEATURES.index("log2_tokens")
    if f1[tok] < f0[tok]:
        parts.append("fewer tokens per microbatch")
    elif f1[tok] > f0[tok]:
        parts.append("more tokens per microbatch")
    return ", ".join(parts) or "another layout of the same structure"
