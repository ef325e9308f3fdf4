"""Human-readable summary of a recipe (plain text, or a rich renderable)."""

from __future__ import annotations

import re
from typing import Any

from attune.recipe.io import get_path

__all__ = ["summarize", "summary_rows", "render"]

# A notes line that reports a gain, e.g. "ATTUNE tuned it to 2,499.5 (+163%)".
_GAIN_RE = re.compile(r"[+-]\d+(?:\.\d+)?\s*%|\b\d+(?:\.\d+)?x faster\b")


_get = get_path


def _num(v: Any, fmt: str) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return format(v, fmt)


def _gain_notes(notes: Any) -> list[str]:
    if not isinstance(notes, str):
        return []
    out = []
    for line in notes.splitlines():
        line = line.strip().lstrip("-* ").strip()
        # keep only the sentences of a note that state the gain
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z])", line):
            if _GAIN_RE.search(sentence):
                out.append(sentence)
    return out


def summary_rows(recipe: dict) -> list[tuple[str, str]]:
    """(label, value) rows of the summary, in display order; missing fields are left out."""
    rows: list[tuple[str, str]] = []

    def add(label: str, value: str | None) -> None:
        if value not in (None, ""):
            rows.append((label, value))

    add("model", recipe.get("model") if isinstance(recipe.get("model"), str) else None)
    gpu = recipe.get("gpu") if isinstance(recipe.get("gpu"), dict) else {}
    if gpu:
        g = f"{gpu.get('count', '?')} x {gpu.get('type', '?')}"
        if gpu.get("memory_gb") is not None:
            g += f" {gpu['memory_gb']} GB"
        if gpu.get("instance"):
            g += f" ({gpu['instance']})"
        add("GPUs", g)
    add("status", recipe.get("status"))
    add("layout", _get(recipe, "layout", "label"))
    add("summary", _get(recipe, "layout", "summary"))
    add("highlights", _get(recipe, "layout", "highlights"))
    res = recipe.get("result") if isinstance(recipe.get("result"), dict) else {}
    tps = _num(res.get("tokens_per_s_per_gpu"), ",.2f")
    add("throughput", f"{tps} tokens/s/GPU" if tps else None)
    mfu = _num(res.get("mfu"), ".1%")
    add("MFU", mfu)
    usd = _num(res.get("usd_per_million_tokens"), ".2f")
    add("cost", f"${usd} per million tokens" if usd else None)
    cv = _num(res.get("step_time_cv_percent"), ".2f")
    add("step time CV", f"{cv}%" if cv else None)
    if res.get("measured") is not None:
        add("measured", str(res["measured"]))
    corr = recipe.get("correctness") if isinstance(recipe.get("correctness"), dict) else {}
    if corr.get("result") is not None:
        c = str(corr["result"])
        if corr.get("summary"):
            c += f" ({corr['summary']})"
        add("correctness", c)
    for line in _gain_notes(recipe.get("notes")):
        add("gain", line)
    return rows


def summarize(recipe: dict) -> str:
    """Plain-text summary: one 'label: value' line per field."""
    rows = summary_rows(recipe)
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def render(recipe: dict):
    """The summary as a rich Table (for `rich.console.Console().print`)."""
    from rich.table import Table

    title = str(recipe.get("model", "recipe"))
    label = _get(recipe, "layout", "label")
    table = Table(title=f"{title}: {label}" if label else title, show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for k, v in summary_rows(recipe):
        table.add_row(k, v)
    return table
