"""What an interrupted tuner leaves: none of its trials RUNNING.

On Ctrl-C or SIGTERM (attune.cli.signals) the measured trial is failed with reason ``interrupted`` where it runs
(:meth:`attune.search.tuner.Tuner.measure`); :func:`fail_left_running` then fails the other trials this tuner
created and had not told yet (TPE proposals being estimated), so no RUNNING trial outlives the tuner. A tuner
killed with SIGKILL cannot do this: its role-less trials are failed by the next tuner once older than the grace
period, its measured trials once their heartbeat is stale (Tuner.fail_stale_trials).
"""

from __future__ import annotations

import optuna

__all__ = ["fail_left_running"]


def fail_left_running(study: optuna.Study | None, numbers: list[int]) -> int:
    """Fail the trials ``numbers`` of ``study`` that are still RUNNING; returns how many."""
    if study is None or not numbers:
        return 0
    mine = set(numbers)
    n = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if t.number in mine:
            try:  # a FAIL trial without a reason reads back as INTERRUPTED (TrialRecord.from_trial)
                study.tell(t.number, state=optuna.trial.TrialState.FAIL)
                n += 1
            except (ValueError, RuntimeError):  # told meanwhile
                pass
    return n
