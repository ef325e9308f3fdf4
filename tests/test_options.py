"""Options as data (attune.search.options), runner choices and run blocks from the registry, and the recipe as one
typed model (issue 19)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from attune.api.tune import tune
from attune.cli.options import options_from_args
from attune.cli.parser import build_parser
from attune.correctness.verdict import apply_verdict
from attune.recipe import Recipe, load_recipe, validate_recipe
from attune.runners.base import Rerun, Runner, TrialSpec
from attune.runners.registry import TRIAL_KINDS, resolve_runner, runner_class, runner_names
from attune.search.options import RunOptions, TargetOptions, TuneOptions, VerifyOptions, field_docs
from attune.search.sampler import ModelGuidedSampler
from attune.search.tuner import TuneConfig
from attune.spec.engine import get_engine
from attune.spec.hardware import parse_cluster
from attune.spec.layout import Layout, Workload
from attune.spec.model import load_model

SEED = Path(__file__).resolve().parent / "fixtures" / "seed_recipe.yaml"


def _sub(parser, name):
    return next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == name)[1]


def _option(sub, dest):
    return next(a for a in sub._actions if a.dest == dest)


def test_every_option_has_a_docstring_and_one_default():
    docs = field_docs(TuneOptions)
    fields = dataclasses.fields(TuneOptions)
    assert {f.name for f in fields} == set(docs) and all(len(d) > 10 for d in docs.values())
    # TuneConfig and the sampler take the options' defaults, not their own copies
    for opt, cfg in (("min_gain", "min_gain"), ("p_stop", "p_stop"), ("slack", "slack"), ("seed", "seed"),
                     ("sampler", "sampler"), ("recalibrate", "recalibrate"), ("memory_headroom", "headroom"),
                     ("heartbeat_interval_s", "heartbeat_interval_s"), ("grace_period_s", "grace_period_s"),
                     ("storage_timeout_s", "storage_timeout_s")):
        assert TuneConfig.__dataclass_fields__[cfg].default == getattr(TuneOptions, opt), opt
    sig = inspect.signature(ModelGuidedSampler.__init__)
    assert sig.parameters["min_gain"].default == TuneOptions.min_gain


def test_cli_options_are_generated_from_the_dataclass():
    p = build_parser()
    tune = _sub(p, "tune")
    for f in dataclasses.fields(TuneOptions):
        a = _option(tune, f.name)
        assert a.help.startswith(field_docs(TuneOptions)[f.name])
        if f.default is not dataclasses.MISSING:
            assert a.default == f.default, f.name
    # the command line maps to the options field by field; switches and repeats included
    args = p.parse_args(["tune", "--model", "tiny-llama", "--gpus", "2xcpu"])
    assert options_from_args(TuneOptions, args) == TuneOptions(model="tiny-llama", gpus="2xcpu")
    args = p.parse_args(["tune", "--model", "m", "--gpus", "8xH200", "--no-verify", "--no-recalibrate",
                         "--save-recipe", "--allow-numerics", "fp8", "--allow-numerics", "mxfp8", "--timeout", "30",
                         "--cluster", "c.yaml", "--heartbeat", "3", "--min-gain", "0.02"])
    o = options_from_args(TuneOptions, args)
    assert (o.verify, o.recalibrate, o.save_recipe, o.allow_numerics) == (False, False, True, ["fp8", "mxfp8"])
    assert (o.timeout_s, o.cluster_file, o.heartbeat_interval_s, o.min_gain) == (30.0, "c.yaml", 3, 0.02)
    # estimate and run share the target options, not required there
    est = _sub(p, "estimate")
    assert {f.name for f in dataclasses.fields(TargetOptions)} <= {a.dest for a in est._actions}
    assert not _option(est, "model").required and _option(tune, "model").required
    # the siblings: attune run and attune verify
    args = p.parse_args(["run", "--model", "tiny-llama", "--gpus", "2xcpu", "--timeout", "9", "--cluster", "c.yaml"])
    assert options_from_args(RunOptions, args) == RunOptions(model="tiny-llama", gpus="2xcpu", timeout_s=9.0,
                                                             cluster_file="c.yaml", gpus_per_node=None)
    args = p.parse_args(["verify", "r.yaml", "--in-place", "--negative-control"])
    v = options_from_args(VerifyOptions, args)
    assert (v.recipe, v.in_place, v.negative_control, v.runner, v.steps) == ("r.yaml", True, True, "torch", 20)


def test_runner_choices_come_from_the_registry():
    p = build_parser()
    assert _option(_sub(p, "tune"), "runner").choices == list(runner_names(selectable=True))
    assert tuple(_option(_sub(p, "run"), "runner").choices) == runner_names(selectable=True, needs_measurements=False)
    assert tuple(_option(_sub(p, "verify"), "runner").choices) == ("torch", "slime")
    assert "ray-torch" not in runner_names(selectable=True) and "replay" in runner_names(selectable=True)
    assert _option(_sub(p, "tune"), "trial_kind").choices == list(TRIAL_KINDS)
    assert resolve_runner("slime", "torch") == "ray-torch" and resolve_runner("sim", "torch") == "sim"
    assert resolve_runner("torch") == "torch"
    with pytest.raises(Exception, match="trial kind 'jax': allowed slime, torch"):
        resolve_runner("slime", "jax")


@pytest.mark.parametrize("name", runner_names())
def test_every_registered_runner_writes_its_run_block(name):
    cls = runner_class(name)
    assert not getattr(cls.rerun_command, "__isabstractmethod__", False)
    assert Runner.rerun_command.__isabstractmethod__  # a new runner must write one


def _spec(engine: str) -> TrialSpec:
    return TrialSpec(model=load_model("tiny-llama"), cluster=parse_cluster("2xcpu"), layout=Layout(pp=2, dp=1),
                     workload=Workload(seq_length=256, global_batch=8, steps=20, window=(5, 19)),
                     engine=get_engine(engine))


def test_run_block_follows_the_engine_the_runner_stands_for():
    sim = runner_class("sim")()
    torch_run = sim.rerun_command(_spec("torch"))
    assert isinstance(torch_run, Rerun) and torch_run.command.startswith("attune run --runner torch --model tiny-llama")
    assert torch_run.env == {} and "slime" not in torch_run.stack
    slime_run = sim.rerun_command(_spec("slime"))
    assert "train_async.py" in slime_run.command and slime_run.env and slime_run.stack["slime"].startswith("624b824a")


def test_apply_verdict_returns_a_new_model():
    class V:  # the three things apply_verdict reads of a Verdict
        status = "failed"
        stack = {"python": "3.12"}

        @staticmethod
        def correctness_block():
            return {"result": "fail", "summary": "failed", "configuration": "pass"}

    r = validate_recipe(load_recipe(SEED))
    before = r.to_dict()
    out = apply_verdict(r, V())
    assert isinstance(out, Recipe) and out is not r
    assert (out.status, out.correctness.result, out.stack) == ("failed", "fail", {"python": "3.12"})
    assert r.to_dict() == before and r.status == "verified"  # the input is not changed
    assert out.to_dict()["correctness"] == {"result": "fail", "summary": "failed", "configuration": "pass"}


def test_tune_result_recipe_is_the_written_file(tmp_path):
    res = tune(model="tiny-llama", gpus="8xH100", search_space="small", out=tmp_path / "o", trials=2, candidates=4)
    assert isinstance(res.recipe, Recipe)
    assert validate_recipe(load_recipe(res.recipe_path)).to_dict() == res.recipe.to_dict()
