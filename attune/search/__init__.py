"""The search: search spaces (package data in spaces/), the typed per-trial record, and the Tuner.

* `attune.search.space`: load a search space (`load_space(None | name | path)`) and map parameters to a Layout.
* `attune.search.records`: `TrialRecord`, the one mapping to and from Optuna user attributes.
* `attune.search.refine`: model-guided hill-climbing.
* `attune.search.tuner`: `TuneConfig`, `Tuner`, `TuneOutcome`.
"""
