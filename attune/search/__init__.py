"""The search: search spaces (package data in spaces/), the typed per-trial record, and the Tuner.

* `attune.search.space`: load a search space (`load_space(None | name | path)`) and map parameters to a Layout.
* `attune.search.records`: `TrialRecord`, the one mapping to and from Optuna user attributes.
* `attune.search.scoring`: the whole space scored once by the model (memory first, deduplicated, cached).
* `attune.search.recalibrate`: the model refitted to one study's measurements.
* `attune.search.sampler`: `ModelGuidedSampler` (expected improvement under the recalibrated model) and
  `busy_or_done_keys`.
* `attune.search.edge`: the memory-edge steps (after a real OOM, after the best fit) the sampler takes.
* `attune.search.tuner`: `TuneConfig`, `Tuner`, `TuneOutcome`.
"""
