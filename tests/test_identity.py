"""The one layout identity (issue 19): one `layout_key` for sampler, claims and replay; old claims resume."""

import optuna

from attune.search.coordination import CLAIM, CLAIM_PREFIX, claim_key, contest, live_claim
from attune.spec.identity import layout_key
from attune.spec.layout import Layout


def test_a_claim_written_before_the_one_key_is_rekeyed_from_its_layout():
    L = 64
    lay = Layout(tp=1, pp=4, dp=2, first=16, last=16, recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=2)
    study = optuna.create_study(direction="maximize")
    old = '[["cp",1],["dp",2]]'  # an older attune's claim string: its own JSON, no prefix
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=1.0,
                                              user_attrs={CLAIM: old, "role": "candidate", "layout": lay.to_dict()}))
    rekey = lambda d: claim_key(layout_key(d, L))  # noqa: E731
    new = rekey(lay.to_dict())
    assert new.startswith(CLAIM_PREFIX)
    t = study.trials[0]
    assert live_claim(t) == old and live_claim(t, rekey) == new
    # a new worker claiming the same layout loses to the old trial; another uniform group size does not
    mine = study.ask()
    mine.set_user_attr(CLAIM, new)
    assert "claimed by trial 0" in contest(study, mine, new, target=10, rounds=1, rekey=rekey)
    other = rekey(Layout(**{**lay.to_dict(), "recompute_num_layers": 4}).to_dict())
    theirs = study.ask()
    theirs.set_user_attr(CLAIM, other)
    assert contest(study, theirs, other, target=10, rekey=rekey) is None


def test_grep_finds_one_layout_key():
    """Issue 19: one identity. Exactly one function in attune computes a layout's key (`layout_key`); the replay
    runner, the sampler, the scoring table's column enumeration (its compiled items, `key_function`) and the claims
    call it, and no other `*_key` of a layout exists."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "attune"
    defs = [(p.relative_to(root.parent).as_posix(), m.group(1)) for p in sorted(root.rglob("*.py"))
            for m in re.finditer(r"^\s*def (\w*(?:layout|replay)_key)\(", p.read_text(), re.M)]
    assert defs == [("attune/spec/identity.py", "layout_key")]
    users = {p.relative_to(root.parent).as_posix() for p in root.rglob("*.py") if "layout_key(" in p.read_text()}
    assert {"attune/runners/replay.py", "attune/search/sampler.py", "attune/search/tuner.py",
            "attune/search/enumeration.py"} <= users
