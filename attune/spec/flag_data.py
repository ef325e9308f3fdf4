"""The flag table's raw data (``megatron_flags.yaml``), read once, and the per-engine value sets it records.

A leaf of ``attune.spec``: ``attune.spec.flags`` builds its typed ``FlagSpec`` records from ``raw_table()``,
and ``attune.spec.rules`` (which ``flags`` imports, so it cannot import ``flags``) reads
``engine_choices`` from here: the values of a flag an engine really runs, where that is fewer than the
flag's argparse ``choices`` (the table's ``engine_choices`` key, with its source in the entry's note).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

from .textio import load_package_yaml

__all__ = ["TABLE_FILE", "raw_table", "engine_choices"]

TABLE_FILE = "megatron_flags.yaml"


@lru_cache(maxsize=1)
def raw_table() -> Mapping[str, Any]:
    """The table file as YAML data (cached; callers must not mutate it)."""
    text = resources.files("attune.spec").joinpath(TABLE_FILE).read_text(encoding="utf-8")
    return load_package_yaml(text) or {}


def engine_choices(flag: str, engine: str) -> tuple | None:
    """The values of ``flag`` that ``engine`` runs as given (``--moe-token-dispatcher-type`` on slime:
    alltoall and flex; slime rewrites allgather to alltoall), or its argparse ``choices`` where the table
    records no engine-specific set; None for a flag without choices or not in the table."""
    entry = (raw_table().get("flags") or {}).get(flag)
    if not isinstance(entry, dict):
        return None
    per_engine = entry.get("engine_choices") or {}
    if engine in per_engine:
        return tuple(per_engine[engine])
    choices = entry.get("choices")
    return tuple(choices) if choices is not None else None
