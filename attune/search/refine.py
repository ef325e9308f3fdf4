"""Model-guided refinement: greedy hill-climbing over a search space's knobs, scored by the estimator."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from attune.search.space import SearchSpace

# integer knobs moved by +-1 and +-2 (layer-split offsets and recompute groups); other knobs try every choice
STEPPED_KNOBS = ("first_offset", "last_offset", "recompute_layers")
# hill-climbing rounds before giving up on reaching a local optimum (each round tries every neighbour)
MAX_ROUNDS = 25


def neighbours(params: dict, space: SearchSpace) -> Iterator[dict]:
    """Parameter sets one step away: +-1 and +-2 on integer knobs, every other choice on categorical ones."""
    for k, dom in space.knobs.items():
        v = params[k]
        if isinstance(dom, tuple) and len(dom) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in dom) \
                and k in STEPPED_KNOBS:
            for d in (-2, -1, 1, 2):
                if dom[0] <= v + d <= dom[1]:
                    yield {**params, k: v + d}
        else:
            for c in dom:
                if c != v:
                    yield {**params, k: c}


def refine(start: dict, score: Callable[[dict], float], space: SearchSpace,
           max_rounds: int = MAX_ROUNDS) -> tuple[dict, float, int]:
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
