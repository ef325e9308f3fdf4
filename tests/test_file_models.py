"""The pydantic models of the files attune reads from outside (issue 23): config.json (attune.spec.hfconfig), cluster
files (attune.runners.ray.cluster), replay rows (attune.runners.replay) and search spaces (attune.search.spacefile).
A wrong type, a value out of range or an unknown key is one line naming the field and what is allowed."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml
from pydantic import BaseModel, Field, StrictInt, ValidationError

from attune.errors import ClusterFileError, ModelError, SearchSpaceError
from attune.runners.ray.cluster import load_cluster, parse_cluster_config
from attune.runners.replay import ReplayRunner, ReplayTableError
from attune.search.space import FIXED_ONLY, KNOBS, SPACES_PACKAGE, load_space
from attune.search.spacefile import Fixed, Knobs
from attune.spec.hfconfig import check_hf_config
from attune.spec.model import load_model
from attune.spec.validation import one_line

TINY = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 128, "intermediate_size": 352,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096, "hidden_act": "silu"}
CLUSTER = {"ray": {"address": "http://127.0.0.1:8265"}, "nodes": 1, "gpus_per_node": 8, "gpu_type": "H200",
           "paths": {k: "/data/x" for k in ("slime", "megatron", "hf_checkpoint", "torch_dist", "sft_data", "output")}}
FLAGS = "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2"


def _one_line_naming(msg: str, field: str, *words: str) -> None:
    assert "\n" not in msg and f"{field}:" in msg and all(w in msg for w in words), msg


# ------------------------------------------------------------------------------ the helper
class _Inner(BaseModel):
    model_config = {"extra": "forbid", "title": "thing"}
    n: StrictInt = Field(ge=1, description="how many")


class _Outer(BaseModel):
    inner: _Inner


@pytest.mark.parametrize("data, expected", [
    ({"inner": {"n": 2, "z": 1}}, "inner.z: unknown thing; allowed: n"),
    ({"inner": {}}, "inner.n: missing (how many)"),
    ({"inner": {"n": 0}}, "inner.n: must be a positive integer (got 0)"),
    ({"inner": {"n": "2"}}, "inner.n: '2' is not an integer"),
    ({"inner": []}, "inner: must be a mapping (got list)"),
])
def test_one_line_names_the_field_what_is_wrong_and_what_is_allowed(data, expected):
    with pytest.raises(ValidationError) as e:
        _Outer.model_validate(data)
    assert one_line(e.value, _Outer) == expected


def test_one_line_counts_the_other_errors_and_stays_one_line():
    with pytest.raises(ValidationError) as e:
        _Outer.model_validate({"inner": {"n": "a\nb", "x": 1}})
    msg = one_line(e.value, _Outer)
    assert msg.endswith("(and 1 more)") and "\n" not in msg


# ------------------------------------------------------------------------------ a wrong type in each format
def test_config_json_wrong_type_is_one_line_naming_the_field():
    with pytest.raises(ModelError) as e:
        check_hf_config({**TINY, "num_attention_heads": 4.0}, "x")
    _one_line_naming(str(e.value), "num_attention_heads", "4.0 is not an integer")
    with pytest.raises(ModelError) as e:
        check_hf_config({**TINY, "tie_word_embeddings": 1}, "x")
    _one_line_naming(str(e.value), "tie_word_embeddings", "true or false")


@pytest.mark.parametrize("over, field, words", [
    ({"nodes": "2"}, "nodes", ("'2' is not an integer",)),
    ({"gpus_per_node": 8.0}, "gpus_per_node", ("is not an integer",)),
    ({"timeouts": {"poll_s": True}}, "timeouts.poll_s", ("is not a number",)),
    ({"timeouts": {"poll_s": 0}}, "timeouts.poll_s", ("must be > 0",)),
    ({"timeouts": {"retry_s": 1}}, "timeouts.retry_s", ("unknown key", "trial_s, poll_s, stop_grace_s")),
    ({"paths": {"slime": "/x"}}, "paths.megatron", ("missing", "$MEGATRON_DIR")),
    ({"env": {"X": [1]}}, "env.X", ("string or number",)),
    ({"python": ["python3"]}, "python", ("must be a string",)),
])
def test_cluster_file_model_checks(tmp_path, over, field, words):
    p = tmp_path / "cluster.yaml"
    p.write_text(yaml.safe_dump({**CLUSTER, **over}))
    with pytest.raises(ClusterFileError) as e:
        load_cluster(p)
    assert str(e.value).startswith(f"{p}: {field}:")
    _one_line_naming(str(e.value), field, *words)


def test_cluster_file_values_survive_the_model():
    cfg = parse_cluster_config({**CLUSTER, "gpu_type": "cpu", "gpus_per_node": 2, "nvlink": 0,
                                "ray": {"address": "http://h:8265/", "slot_resource": "slot.a-1"},
                                "paths": {**CLUSTER["paths"], "attune": "/root/attune"},
                                "env": {"A": True, "B": 2.5, "C": ""},
                                "timeouts": {"trial_s": 300, "poll_s": 0.5}}, "c.yaml")
    assert cfg.address == "http://h:8265" and cfg.slot_resource == "slot.a-1" and cfg.nvlink == 0
    assert cfg.env == {"A": "1", "B": "2.5", "C": ""} and cfg.paths.attune == "/root/attune"
    assert (cfg.trial_timeout_s, cfg.poll_s, cfg.stop_grace_s) == (300.0, 0.5, 60.0)


@pytest.fixture(scope="module")
def qwen():
    return load_model("Qwen3.6-27B")


@pytest.mark.parametrize("row, field, words", [
    ({"tokens_per_s_per_gpu": True}, "tokens_per_s_per_gpu", ("not true",)),
    ({"step_time_s": ".nan"}, "step_time_s", ("finite",)),
    ({"peak_gib": [30.5, "lots"]}, "peak_gib.1", ("'lots' is not a number",)),
    ({"outcome": "oom", "oom_stage": 1.5}, "oom_stage", ("whole number",)),
    ({"flags": 2}, "flags", ("is not a string",)),
])
def test_replay_row_model_checks(tmp_path, qwen, row, field, words):
    base = {"flags": FLAGS, "outcome": "ok", "tokens_per_s_per_gpu": 1000, "step_time_s": 10}
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump([{**base, **row}]).replace("'.nan'", ".nan"))
    with pytest.raises(ReplayTableError) as e:
        ReplayRunner(p, model=qwen, world_size=8)
    assert str(e.value).startswith(f"{p} row 2: {field}:")
    _one_line_naming(str(e.value), field, *words)


def test_replay_yaml_peaks_may_be_a_list(tmp_path, qwen):
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump({"rows": [{"flags": FLAGS, "outcome": " OK ", "tokens_per_s_per_gpu": "1000",
                                           "step_time_s": 10, "peak_gib": [60.5, 70]}]}))
    (row,) = ReplayRunner(p, model=qwen, world_size=8).rows
    assert row.outcome == "ok" and row.tokens_per_s_per_gpu == 1000.0 and row.peak_gib == (60.5, 70.0)


def test_trials_csv_cells_are_typed(tmp_path, qwen):
    p = tmp_path / "trials.csv"
    p.write_text("state,role,tp,pp,cp,vpp,dp,sp,measured_tokens_per_s_per_gpu\n"
                 "COMPLETE,baseline,2,2.5,1,1,2,True,1000\n")
    with pytest.raises(ReplayTableError) as e:
        ReplayRunner(p, model=qwen, world_size=8)
    _one_line_naming(str(e.value), "pp", "whole number")


# ------------------------------------------------------------------------------ search spaces
def test_space_models_name_every_knob_and_setting():
    assert list(Knobs.model_fields) == list(KNOBS)
    assert set(Fixed.model_fields) == set(KNOBS) | FIXED_ONLY


@pytest.mark.parametrize("text, field, words", [
    ("knobs: {tp: [true, 2]}", "knobs.tp.0", ("True is not an integer",)),
    ("knobs: {sequence_parallel: [1]}", "knobs.sequence_parallel.0", ("true or false",)),
    ("knobs: {first_offset: {low: 0, high: 2, step: 1}}", "knobs.first_offset.step", ("allowed: low, high",)),
    ("knobs: {recompute: []}", "knobs.recompute", ("at least 1",)),
    ("fixed: {moe_grouped_gemm: 1}", "fixed.moe_grouped_gemm", ("true or false",)),
    ("fixed: {dispatcher: ring}", "fixed.dispatcher", ("'ring' not allowed", "'alltoall'")),
    ("fixed: {warp: 1}", "fixed.warp", ("unknown setting", "moe_grouped_gemm")),
    ("name: [x]", "name", ("must be a string",)),
])
def test_space_file_model_checks(tmp_path, text, field, words):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    with pytest.raises(SearchSpaceError) as e:
        load_space(p)
    assert str(e.value).startswith(f"{p}: {field}:")
    _one_line_naming(str(e.value), field, *words)


def test_space_size_is_bounded_and_file_order_kept(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("knobs: {" + ", ".join(f"{k}: {{low: 0, high: 999}}" for k in ("first_offset", "last_offset",
                                                                                   "recompute_layers")) + ", "
                 "tp: [1, 2, 4, 8, 16, 32, 64], pp: [1, 2, 4, 8, 16, 32, 64]}")
    with pytest.raises(SearchSpaceError, match="knob combinations; at most 1e"):
        load_space(p)
    p.write_text("knobs: {pp: [1, 2], tp: [1, 2], first_offset: {low: -1, high: 1}}\nfixed: {vpp: 1, cp: 1}")
    s = load_space(p)
    assert list(s.knobs) == ["pp", "tp", "first_offset"] and s.knobs["first_offset"] == (-1, 1)
    assert s.fixed == {"vpp": 1, "cp": 1} and s.name == "s"
    for name in ("dense", "moe"):
        text = (resources.files(SPACES_PACKAGE) / f"{name}.yaml").read_text()
        assert list(load_space(name).knobs) == list(yaml.safe_load(text)["knobs"])
