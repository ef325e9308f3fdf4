"""Published runs that their own source marks as a known performance regression (issue 22).

Such a row measures a software defect of one container release, not the hardware's speed under the release's
recipe: it is read as not expressed, with the source's words as the reason, so it is neither fitted nor scored.
A row is matched by its series and by the footnote marker the source attaches to its figure (the corpus keeps the
marker in the row's quote), so a row of the same table without the marker stays in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownRegression:
    series: str
    """Regular expression over the row's series."""
    marker: str
    """The source's footnote marker on the row's figure (in its quote or notes)."""
    reason: str
    """What the source says, with where."""


KNOWN_REGRESSIONS = (
    KnownRegression(
        series=r"^mbridge-perf-summary-26\.06\.01$", marker="[^gpt-oss-note]",
        reason="known performance regression: the source's footnote on this figure (Megatron-Bridge "
               "docs/performance-summary-archive.md at 09ce5f13c, line 90, under the 26.06.01 table): "
               "'Performance regression in GPT-OSS 120B pre-training is a known issue (NVIDIA/cudnn-frontend "
               "issue 256). It will be resolved with the next container release.'"),
)


def known_regression(row: dict) -> str | None:
    """The reason a row is a known regression of its release, or None."""
    series = str(row.get("series") or "")
    text = " ".join(str(row.get(k) or "") for k in ("quote", "notes"))
    for k in KNOWN_REGRESSIONS:
        if re.search(k.series, series) and k.marker in text:
            return k.reason
    return None


__all__ = ["KnownRegression", "KNOWN_REGRESSIONS", "known_regression"]
