"""The one identity of a layout (`layout_key`): what makes two layouts the same run.

It lives in `attune.spec` because both the search (sampler, scoring table, coordination claims) and the
runners (the replay runner's table) use it, and runners sit below search in the layer map.
"""

from __future__ import annotations

import dataclasses

from .knob_registry import IDENTITY, KEY_CONTEXT
from .layout import Layout
from .placement import stage_layer_counts, virtual_stage_counts

_FIELDS = frozenset(f.name for f in dataclasses.fields(Layout))

# Layout fields the key does not carry as such: the layer split (first / last / layout string) is carried as the
# layers of every (virtual) stage, which is what the engines run; every other field is in the key (normalised
# where a value cannot change the run; attune.spec.knob_registry.IDENTITY declares each).
KEY_DERIVED_FIELDS = tuple(f for i in IDENTITY if i.name not in _FIELDS for f in i.covers)

# The key's function, compiled once from the registry's declared normalisations (one tuple expression, as fast
# as a hand-written one; the expressions are the registry's constants, never input).
_KEY = eval(compile("lambda lay, " + ", ".join(KEY_CONTEXT) + ": ("
                    + "".join(f"({f.name!r}, {f.value}), " for f in IDENTITY) + ")",
                    "<attune.spec.knob_registry.IDENTITY>", "eval"), {})

IDENTITY_ITEMS = tuple(f.name for f in IDENTITY)
"""The key's item names, in its order (``layout_key(...)[i]`` is ``(IDENTITY_ITEMS[i], value)``)."""


def key_function():
    """The key's compiled function ``(lay, counts, virt, full, offload, sp, n) -> key`` (`layout_key` derives the
    context; the search's column enumeration (attune.search.enumeration) passes its own)."""
    return _KEY


def layout_from_dict(d: dict) -> Layout:
    """A Layout from its `to_dict()` as stored on a trial (JSON turns tuples into lists; fields an older attune
    did not have take their defaults, fields it had and this one lacks are dropped)."""
    names = {f.name for f in dataclasses.fields(Layout)}
    return Layout(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})


def layout_key(layout: dict | Layout, num_layers: int) -> tuple:
    """THE identity of a layout: two layouts with the same key run the same way and use the same memory, so a
    measurement of one answers the other. Used by the sampler ("already measured", near-duplicates), the
    scoring table's index and the enumeration's deduplication, the coordination claims, and the replay runner.

    Every Layout field that can change a measurement (memory included) is in it, normalised where the value
    cannot change the run, as `attune.spec.knob_registry.IDENTITY` declares item by item: the split as the
    layers of every stage and virtual stage, SP only at TP > 1, TP communication overlap only with SP, the
    recompute method and its layer count only with full recompute (the count capped at a chunk's layers), the
    recomputed modules only with selective recompute, the offload fraction and the CPU optimizer overlap only
    with optimizer offload, the microbatch size only without dynamic batching. The group size of uniform full
    recompute IS part of it (different memory: attune/estimator/memory.py, uniform branch)."""
    lay = layout if isinstance(layout, Layout) else layout_from_dict(layout)
    counts = tuple(stage_layer_counts(lay, num_layers))
    virt = tuple(virtual_stage_counts(lay, num_layers) or ()) if lay.vpp > 1 else ()  # VPP 1: the stages say it
    full = lay.recompute_granularity == "full"
    n = None
    if full:
        chunk = max(virt) if virt else -(-max(counts) // lay.vpp)
        n = max(1, min(lay.recompute_num_layers or 1, chunk))
    return _KEY(lay, counts, virt, full, bool(lay.optimizer_cpu_offload), bool(lay.sp) and lay.tp > 1, n)
