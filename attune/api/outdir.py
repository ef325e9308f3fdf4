"""Output folders (``--out``): checked before any work, and never another study's.

* :func:`check_out_dir`: the folder exists or can be created, is a folder (not a file) and is writable; else one
  line (exit 2) before anything runs.
* :func:`claim_out_dir`: a study's folder records whose it is (``.attune-study.json``: model, GPUs, runner,
  engine, study name, storage with its password masked). Rerunning the same study there resumes it; a
  different study, or a folder holding a recipe, report or ``trials.csv`` attune did not record, is refused
  with one line, so nothing it did not write is overwritten.
"""

from __future__ import annotations

import json
from pathlib import Path

from attune.errors import UserInputError

__all__ = ["OutDirError", "check_out_dir", "claim_out_dir", "STUDY_MARKER"]

STUDY_MARKER = ".attune-study.json"
# The files a study writes into its folder: present without a marker, they are someone else's.
_STUDY_FILES = ("recipe.yaml", "report.md", "trials.csv")


class OutDirError(UserInputError):
    """An output folder that cannot be used (exit code 2)."""


def check_out_dir(path: str | Path, what: str = "--out") -> Path:
    """``path`` as a writable folder (created with its parents), or OutDirError with one line."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise OutDirError(f"{what} {out}: is a file, not a folder; name a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".attune-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise OutDirError(f"{what} {out}: cannot write there ({e.strerror or e.__class__.__name__}); "
                          f"name a writable folder") from None
    return out


def _describe(d: dict) -> str:
    return f"study '{d.get('study_name')}' ({d.get('model')} on {d.get('gpus')}, runner {d.get('runner')})"


def claim_out_dir(out: Path, identity: dict[str, str]) -> None:
    """Record ``identity`` in ``out`` or check it is the one recorded there (OutDirError when not)."""
    marker = out / STUDY_MARKER
    if marker.is_file():
        try:
            have = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise OutDirError(f"--out {out}: {STUDY_MARKER} is unreadable; use another --out") from None
        keys = ("model", "gpus", "runner", "engine", "study_name")
        if not isinstance(have, dict) or any(have.get(k) != identity.get(k) for k in keys):
            theirs = _describe(have) if isinstance(have, dict) else "another study"
            raise OutDirError(f"--out {out} holds the files of {theirs}, not of {_describe(identity)}; "
                              f"use another --out (rerunning the same study there resumes it)")
        return
    found = [f for f in _STUDY_FILES if (out / f).exists()]
    if found:
        raise OutDirError(f"--out {out} already holds {', '.join(found)} that this study did not write; "
                          f"use another --out (attune never overwrites files it did not create)")
    marker.write_text(json.dumps(identity, indent=2) + "\n", encoding="utf-8")
