"""Many tuners, one study: who measures which layout, how many may run at once, and what gets retried.

Several `attune tune` processes (workers) can share one study (PostgreSQL for many hosts, SQLite or a journal on
one machine). Everything they agree on lives in the study's trials, so a worker that is killed leaves nothing
to clean up and a restarted one reads the same state:

* **Claims.** A measured trial is created already RUNNING with its parameters and a ``claim`` user attribute
  (the layout's key) in one storage call (:func:`new_measured_trial`); no WAITING trial is enqueued that
  another worker's ``ask`` could take. The worker then reads the study back (:func:`contest`): if another
  trial holds a live claim on the same layout (RUNNING, or finished COMPLETE or out of memory), or the
  completed trials plus the RUNNING claims exceed the study's trial target, it withdraws its claim and loses.
  Because every worker writes its claim before it reads, of two racing workers at least one sees the other,
  so a layout is never measured twice at once and ``--trials N`` is never overshot. Both may see each other
  and both withdraw; a loser waits a random moment and tries once more when every rival has withdrawn (at most
  ``CONTEST_ROUNDS`` rounds), then takes its next candidate.
* **Retries.** A measured trial that FAILED without an outcome was not failed by its runner: its worker was
  killed (failed as stale by another worker's ``fail_stale_trials`` after the heartbeat grace period) or
  interrupted (SIGINT). Such a trial is retried once, by whichever worker gets to it first
  (:func:`pending_retries`); the retry carries ``retry_of`` = the failed trial's number (in its TrialRecord and
  trials.csv). A retry that fails is not retried again.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import random
import time
from collections.abc import Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from attune.search.records import TrialRecord

__all__ = ["CLAIM", "CLAIM_PREFIX", "claim_of",
           "RETRY_OF", "WITHDRAWN", "CONTEST_ROUNDS", "claim_key", "new_measured_trial", "contest",
           "pending_retries", "slots", "live_claim"]

log = logging.getLogger(__name__)

# user attributes of a measured trial (TrialRecord fields of the same names)
CLAIM, RETRY_OF = "claim", "retry_of"
# the claim value of a trial that withdrew (lost a contest): not a claim on anything
WITHDRAWN = ""
# the prefix of a claim string written with the one layout key (issue 19); older claims are re-keyed (claim_of)
CLAIM_PREFIX = "k2:"
# rounds of a contest before the loser gives up on the layout (each after a random wait)
CONTEST_ROUNDS = 3
# a loser's random wait before it looks again, seconds: long enough that a rival's write-then-read (a few
# storage round trips, milliseconds on PostgreSQL over a LAN) is over
CONTEST_WAIT_S = (0.05, 0.5)


def claim_key(key: tuple) -> str:
    """The claim string of a layout key (``attune.search.space.layout_key``): CLAIM_PREFIX and its items as
    compact JSON."""
    return CLAIM_PREFIX + json.dumps([list(kv) for kv in key], separators=(",", ":"), sort_keys=False)


def claim_of(t: FrozenTrial, rekey: Callable[[dict], str] | None = None) -> str | None:
    """A trial's claim string. A claim written before the one layout key (no CLAIM_PREFIX: an older attune's
    key, which ignored the uniform recompute group size) is re-keyed from the trial's stored layout with
    `rekey` (layout dict -> claim string) when given, so a study resumed by this version compares like with
    like."""
    c = t.user_attrs.get(CLAIM)
    if c and rekey is not None and not c.startswith(CLAIM_PREFIX) and t.user_attrs.get("layout"):
        try:
            return rekey(t.user_attrs["layout"])
        except (TypeError, ValueError):  # a layout this version cannot read: its old claim stands
            return c
    return c


def new_measured_trial(study: optuna.Study, storage: optuna.storages.BaseStorage, params: dict | None,
                       distributions: dict, claim: str, retry_of: int | None = None) -> optuna.Trial:
    """A trial created RUNNING with ``params`` (may be None: no parameters) and its claim in one storage call."""
    attrs = {CLAIM: claim}
    if retry_of is not None:
        attrs[RETRY_OF] = int(retry_of)
    params = dict(params or {})
    frozen = FrozenTrial(number=-1, trial_id=-1, state=TrialState.RUNNING, value=None, values=None,
                         datetime_start=dt.datetime.now(), datetime_complete=None, params=params,
                         distributions={k: distributions[k] for k in params}, user_attrs=attrs, system_attrs={},
                         intermediate_values={})
    study_id = storage.get_study_id_from_name(study.study_name)
    return optuna.Trial(study, storage.create_new_trial(study_id, template_trial=frozen))


def live_claim(t: FrozenTrial, rekey: Callable[[dict], str] | None = None) -> str | None:
    """The layout a trial holds: RUNNING with a claim, or finished COMPLETE, or PRUNED after a real run
    (out of memory); None for failed trials, proposals and withdrawn claims."""
    c = claim_of(t, rekey)
    if not c:
        return None
    if t.state == TrialState.RUNNING or t.state == TrialState.COMPLETE:
        return c
    if t.state == TrialState.PRUNED and t.user_attrs.get("role"):
        return c
    return None


def slots(trials: list[FrozenTrial]) -> tuple[int, int]:
    """(completed measured trials, RUNNING claimed trials) of a study's trials."""
    done = sum(1 for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("role"))
    running = sum(1 for t in trials if t.state == TrialState.RUNNING and t.user_attrs.get(CLAIM))
    return done, running


def _verdict(study: optuna.Study, number: int, claim: str, target: int, rekey=None) -> str | None:
    trials = study.get_trials(deepcopy=False)
    rivals = [t.number for t in trials if t.number != number and live_claim(t, rekey) == claim]
    if rivals:
        return f"layout claimed by trial {rivals[0]} (another worker)"
    done, running = slots(trials)
    if done + running > target:
        return f"no free measurement slot: {done} completed + {running} running > {target} trials"
    return None


def contest(study: optuna.Study, trial: optuna.Trial, claim: str, target: int,
            rounds: int = CONTEST_ROUNDS, rekey: Callable[[dict], str] | None = None) -> str | None:
    """Decide whether ``trial`` (created by :func:`new_measured_trial` with ``claim``) may run: None when it won,
    else why it lost (its claim is withdrawn then; the caller ends the trial). ``rekey`` re-keys claims of an
    older attune (:func:`claim_of`)."""
    why = None
    for r in range(rounds):
        if r:
            time.sleep(random.uniform(*CONTEST_WAIT_S))
            if any(live_claim(t, rekey) == claim for t in study.get_trials(deepcopy=False) if t.number != trial.number):
                return why  # a rival kept its claim: it won
            trial.set_user_attr(CLAIM, claim)
        why = _verdict(study, trial.number, claim, target, rekey)
        if why is None:
            return None
        trial.set_user_attr(CLAIM, WITHDRAWN)
        log.debug("trial %d withdrew its claim: %s", trial.number, why)
    return why


def pending_retries(records: list[TrialRecord]) -> list[TrialRecord]:
    """Measured trials of killed or interrupted workers not retried yet (oldest first): FAIL without an
    outcome, not themselves a retry, and no measured trial carries ``retry_of`` = their number."""
    taken = {r.retry_of for r in records if r.retry_of is not None and r.is_measured}
    return [r for r in records if r.is_measured and r.state == TrialState.FAIL.name and r.outcome is None
            and r.retry_of is None and r.number not in taken and r.layout is not None]
