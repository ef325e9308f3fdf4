"""``attune verify``: check a recipe file, mark it ``verified`` or ``failed``, and keep the evidence.

Outputs:

* the recipe file itself is rewritten with ``status``, the ``correctness`` block and ``stack``;
* ``verify.json`` beside the recipe, only when the recipe schema has no room for the negative controls;
* the work folder (``out_dir``; default ``reports/verify/<recipe stem>-<UTC stamp>/`` under the current
  working directory) with each arm's trial folder (``reference/``, ``candidate/``, ``neg-lr/``,
  ``neg-mask/``: log.txt, result.json) and ``verify.json`` (every check's numbers).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from attune.correctness.verdict import Verdict, apply_verdict
from attune.correctness.verify import VerifyError, reference_layout_of, resolve_target, verify_recipe, write_outputs
from attune.recipe import load_recipe, write_recipe
from attune.runners.base import Runner
from attune.runners.registry import get_runner

# The sidecar beside the recipe (negative controls the recipe schema cannot hold).
SIDECAR = "verify.json"


@dataclass(frozen=True, kw_only=True)
class VerifyOutcome:
    """What ``verify`` decided and where it left its files."""

    recipe_path: Path
    """The recipe file, rewritten with the verdict."""
    out_dir: Path
    """The work folder: the arms' trial folders and ``verify.json``."""
    verdict: Verdict
    """Every check's result and the status."""
    sidecar_path: Path | None = None
    """``verify.json`` beside the recipe, when the negative controls did not fit the recipe."""

    @property
    def status(self) -> str:
        return self.verdict.status

    @property
    def passed(self) -> bool:
        return self.verdict.passed

    @property
    def exit_code(self) -> int:
        """0 verified, 1 failed (bad input raises ``VerifyError``, exit code 2)."""
        return 0 if self.passed else 1


def default_out_dir(recipe_path: str | Path, now: dt.datetime | None = None) -> Path:
    """``reports/verify/<recipe stem>-<UTC stamp>/`` under the current working directory."""
    stamp = (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    return Path.cwd() / "reports" / "verify" / f"{Path(recipe_path).stem}-{stamp}"


def verify(recipe_path: str | Path, *, runner: str | Runner = "torch", steps: int = 20, out_dir: str | Path | None = None,
           negative_control: bool = False, reference: str | Path | None = None, cluster_file: str | None = None,
           progress: Callable[[str], None] | None = None) -> VerifyOutcome:
    """Verify the recipe at ``recipe_path`` on ``runner`` and write the verdict into it.

    runner: a registry name or a runner. reference: a recipe whose layout is the reference arm (default: the model's baseline layout within the
    runner's limits). cluster_file: the cluster YAML of runners that need one (``--cluster``). progress:
    called with one line per finished check. Raises ``VerifyError`` (exit code 2) for bad input.
    """
    path = Path(recipe_path)
    if not path.is_file():
        raise VerifyError(f"{recipe_path}: no such recipe file")
    recipe = load_recipe(path)
    r = get_runner(runner, **({"cluster_file": cluster_file} if cluster_file else {})) if isinstance(runner, str) else runner
    ref_layout = ref_source = None
    if reference is not None:
        rp = Path(reference)
        if not rp.is_file():
            raise VerifyError(f"{reference}: no such reference recipe file")
        ref_layout = reference_layout_of(load_recipe(rp), resolve_target(recipe, r, steps))
        ref_source = f"the layout of reference recipe {reference}"
    out = Path(out_dir) if out_dir is not None else default_out_dir(path)
    verdict = verify_recipe(recipe, r, workdir=out, reference_layout=ref_layout, reference_source=ref_source,
                            steps=steps, negative_control=negative_control, progress=progress)
    write_recipe(apply_verdict(recipe, verdict), path)
    write_outputs(verdict, out)
    sidecar = verdict.sidecar()
    sidecar_path = None
    if sidecar:
        sidecar_path = path.parent / SIDECAR
        sidecar_path.write_text(json.dumps(sidecar, indent=2, default=str))
    return VerifyOutcome(recipe_path=path, out_dir=out, verdict=verdict, sidecar_path=sidecar_path)
