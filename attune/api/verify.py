"""``attune verify``: check a recipe file, mark it ``verified`` or ``failed``, and keep the evidence.

Outputs:

* ``recipe.yaml`` in the work folder: the recipe with ``status``, the ``correctness`` block and ``stack``. The
  recipe file itself (attune did not create it) is never rewritten unless ``in_place`` is asked for, and even
  then only when the verdict comes from a measurement (the arms trained and were compared): a recipe that
  fails before any arm ran (its own lint, a runner that cannot run it) is left byte-identical;
* ``verify.json`` beside the written recipe, only when the recipe schema has no room for the negative controls;
* the work folder (``out_dir``; default ``reports/verify/<recipe stem>-<UTC stamp>/`` under the current
  working directory) with each arm's trial folder (``reference/``, ``candidate/``, ``neg-lr/``,
  ``neg-mask/``: log.txt, result.json) and ``verify.json`` (every check's numbers).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from attune.api.outdir import check_out_dir
from attune.correctness.verdict import Verdict, apply_verdict
from attune.correctness.verify import VerifyError, reference_layout_of, resolve_target, verify_recipe, write_outputs
from attune.recipe import load_recipe_model, write_recipe
from attune.runners.base import Runner
from attune.runners.registry import get_runner
from attune.search.options import VerifyOptions

# The sidecar beside the recipe (negative controls the recipe schema cannot hold).
SIDECAR = "verify.json"


@dataclass(frozen=True, kw_only=True)
class VerifyOutcome:
    """What ``verify`` decided and where it left its files."""

    recipe_path: Path
    """The recipe with the verdict: ``out_dir/recipe.yaml``, or the recipe file itself when rewritten in place."""
    out_dir: Path
    """The work folder: the arms' trial folders and ``verify.json``."""
    verdict: Verdict
    """Every check's result and the status."""
    sidecar_path: Path | None = None
    """``verify.json`` beside the recipe, when the negative controls did not fit the recipe."""
    source_path: Path | None = None
    """The recipe file verified."""
    in_place_refused: str = ""
    """Why the recipe file was not rewritten although ``in_place`` was asked for (empty otherwise)."""

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


def verify(recipe_path: str | Path, *, runner: str | Runner = VerifyOptions.runner, steps: int = VerifyOptions.steps,
           out_dir: str | Path | None = None, negative_control: bool = False, reference: str | Path | None = None,
           cluster_file: str | None = None,
           progress: Callable[[str], None] | None = None, in_place: bool = False) -> VerifyOutcome:
    """Verify the recipe at ``recipe_path`` on ``runner`` and write the verdict into it.

    runner: a registry name or a runner. reference: a recipe whose layout is the reference arm (default: the model's baseline layout within the
    runner's limits). cluster_file: the cluster YAML of runners that need one (``--cluster``). progress:
    called with one line per finished check. in_place: rewrite the recipe file itself (only after a measured
    verdict). Raises ``VerifyError`` (exit code 2) for bad input.
    """
    path = Path(recipe_path)
    if not path.is_file():
        raise VerifyError(f"{recipe_path}: no such recipe file")
    out = check_out_dir(out_dir if out_dir is not None else default_out_dir(path))
    if in_place and not os.access(path, os.W_OK):
        raise VerifyError(f"{recipe_path}: --in-place but the recipe file is not writable")
    recipe = load_recipe_model(path)
    r = get_runner(runner, **({"cluster_file": cluster_file} if cluster_file else {})) if isinstance(runner, str) else runner
    ref_layout = ref_source = None
    if reference is not None:
        rp = Path(reference)
        if not rp.is_file():
            raise VerifyError(f"{reference}: no such reference recipe file")
        ref_layout = reference_layout_of(load_recipe_model(rp), resolve_target(recipe, r, steps))
        ref_source = f"the layout of reference recipe {reference}"
    verdict = verify_recipe(recipe, r, workdir=out, reference_layout=ref_layout, reference_source=ref_source,
                            steps=steps, negative_control=negative_control, progress=progress)
    refused = ""
    if in_place and not measured(verdict):
        refused = ("not rewritten in place: the verdict does not come from a measurement "
                   f"({verdict.summary[:160]})")
    target = path if in_place and not refused else out / "recipe.yaml"
    write_recipe(apply_verdict(recipe, verdict), target)
    write_outputs(verdict, out)
    sidecar = verdict.sidecar()
    sidecar_path = None
    if sidecar:
        sidecar_path = target.parent / SIDECAR
        sidecar_path.write_text(json.dumps(sidecar, indent=2, default=str))
    return VerifyOutcome(recipe_path=target, out_dir=out, verdict=verdict, sidecar_path=sidecar_path,
                         source_path=path, in_place_refused=refused)


def measured(verdict: Verdict) -> bool:
    """Whether the verdict comes from a measurement: the configuration check passed and both arms trained to a
    result that the convergence check compared."""
    arms = [verdict.arms.get(k) for k in ("reference", "candidate")]
    return (verdict.configuration.passed and verdict.convergence is not None
            and verdict.convergence.comparison is not None and all(a is not None and a.ok for a in arms))
