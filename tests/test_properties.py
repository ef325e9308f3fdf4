"""Property tests of the readers of outside input (issue 23): whatever the input, a reader returns a result or
raises an AttuneError (one line), never another exception, and within a time bound (hypothesis' deadline).

Readers: config.json (load_model), Megatron/slime flags (from_flags), recipes (parse_recipe + validate + lint),
replay tables (ReplayRunner.read), cluster files (parse_cluster_config / load_cluster), corpus rows (read_row),
slime log lines (parse_slime_log)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from attune.calibrate.corpus import read_row
from attune.errors import AttuneError
from attune.recipe import lint, parse_recipe
from attune.recipe.models import validate_recipe
from attune.runners.ray.cluster import load_cluster, parse_cluster_config
from attune.runners.replay import ReplayRunner
from attune.runners.slime.logparse import parse_slime_log
from attune.spec.flags import from_flags
from attune.spec.model import load_model

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "tests" / "fixtures" / "seed_recipe.yaml"
CORPUS = ROOT.parent / "shared" / "measurements" / "dense.yaml"
# Per example, ms: every reader answers a small input in well under a second on one loaded core.
DEADLINE_MS = 3000
PROPS = settings(max_examples=100, deadline=DEADLINE_MS, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                              HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["128", "1e308", "nan", "-1", "", "$(touch x)", "a\nb", "\x00", "\udcff"[:0]]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def accepts(fn, *args, **kw):
    """fn's result, or None when it refused the input with an AttuneError."""
    try:
        return fn(*args, **kw)
    except AttuneError as e:
        assert "\n" not in " ".join(str(e).split()) and str(e).strip(), repr(e)
        return None


# ---------------------------------------------------------------------------------------------- config.json
TINY = json.loads((ROOT / "attune" / "spec" / "model_configs" / "tiny-llama.json").read_text())
HF_KEYS = sorted(TINY) + ["head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "layer_types",
                          "text_config", "linear_num_key_heads", "partial_rotary_factor", "rope_parameters"]


@PROPS
@given(st.dictionaries(st.sampled_from(HF_KEYS), values, max_size=6), st.sampled_from(["llama", "qwen3", "qwen3_next",
                                                                                       "gpt2", "nemotron", "x"]))
def test_config_json_gives_a_model_or_an_attune_error(tmp_path_factory, over, model_type):
    cfg = {**TINY, "model_type": model_type, **over}
    p = tmp_path_factory.mktemp("cfg") / "config.json"
    try:
        p.write_text(json.dumps(cfg))
    except (ValueError, UnicodeEncodeError):
        return
    m = accepts(load_model, str(p))
    if m is not None:  # what it reads is a sane geometry: no NaN, no float counts, no bool layers
        for f in ("num_layers", "hidden", "heads", "kv_heads", "vocab"):
            v = getattr(m, f)
            assert isinstance(v, int) and not isinstance(v, bool) and v >= 1, (f, v)


@PROPS
@given(st.binary(max_size=200))
def test_config_json_bytes(tmp_path_factory, data):
    p = tmp_path_factory.mktemp("cfgb") / "config.json"
    p.write_bytes(data)
    accepts(load_model, str(p))


# ---------------------------------------------------------------------------------------------- flags
FLAG_WORDS = ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
              "--sequence-parallel", "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
              "--decoder-first-pipeline-num-layers", "--num-layers-per-virtual-pipeline-stage", "--lr",
              "--max-tokens-per-gpu", "--micro-batch-size", "--global-batch-size", "--seq-length",
              "--pipeline-model-parallel-layout", "--expert-model-parallel-size", "--recompute-modules"]
flag_values = st.sampled_from(["1", "2", "4", "0", "-1", "nan", "inf", "1e308", "full", "uniform", "block",
                               "selective", "Et*3|t*3L", "(", "'", "core_attn", "2.5", ""])


@PROPS
@given(st.lists(st.one_of(st.sampled_from(FLAG_WORDS), flag_values, st.text(max_size=10)), max_size=12),
       st.sampled_from([1, 2, 8, 16]))
def test_flags_give_a_layout_or_an_attune_error(words, world):
    model = load_model("tiny-llama")
    accepts(from_flags, words, model, world)


@PROPS
@given(st.text(max_size=120))
def test_flag_strings(text):
    accepts(from_flags, text, load_model("tiny-llama"), 8)


# ---------------------------------------------------------------------------------------------- recipes
SEED_DATA = yaml.safe_load(SEED.read_text())


def _paths(d, prefix=()):
    if isinstance(d, dict):
        for k, v in d.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))


SEED_PATHS = list(_paths(SEED_DATA))


def _recipe_checks(data):
    r = accepts(validate_recipe, data, "prop")
    accepts(lint, data)
    return r


def _edited(base: dict, edits) -> dict:
    """A deep copy of ``base`` with each (path, value) set where the path's parents are mappings (else skipped)."""
    data = copy.deepcopy(base)
    for path, v in edits:
        d = data
        for k in path[:-1]:
            if not isinstance(d, dict) or not isinstance(d.get(k), dict):
                break
            d = d[k]
        else:
            d[path[-1]] = v
    return data


@PROPS
@given(st.lists(st.tuples(st.sampled_from(SEED_PATHS), values), max_size=3))
def test_recipe_mutations_give_a_verdict_or_an_attune_error(edits):
    _recipe_checks(_edited(SEED_DATA, edits))


@PROPS
@given(st.text(max_size=300))
def test_recipe_text(text):
    data = accepts(parse_recipe, text, "prop.yaml")
    if data is not None:
        _recipe_checks(data)


# ---------------------------------------------------------------------------------------------- replay tables
cells = st.one_of(flag_values, st.text(max_size=8), st.sampled_from(["ok", "oom", "failed", "OK", "1e308", "-0"]))


@PROPS
@given(st.lists(st.lists(cells, min_size=6, max_size=6), min_size=1, max_size=4),
       st.sampled_from([",", ";"]), st.booleans())
def test_replay_tables_give_rows_or_an_attune_error(tmp_path_factory, rows, sep, trials_csv):
    head = ["state", "role", "tp", "pp", "cp", "vpp"] if trials_csv else \
        ["flags", "outcome", "tokens_per_s_per_gpu", "step_time_s", "peak_gib", "oom_stage"]
    p = tmp_path_factory.mktemp("rep") / "m.csv"
    lines = [",".join(head)] + [sep.join('"' + c.replace('"', '""') + '"' for c in r) for r in rows]
    try:
        p.write_text("\n".join(lines) + "\n")
    except UnicodeEncodeError:
        return
    out = accepts(ReplayRunner.read, p, load_model("Qwen3.6-27B"), 8)
    for r in out or []:
        for x in (r.tokens_per_s_per_gpu, r.step_time_s, r.gpu_hours):
            assert x is None or (math.isfinite(x) and x >= 0)


# ---------------------------------------------------------------------------------------------- cluster files
CLUSTER = {"ray": {"address": "http://127.0.0.1:8265"}, "nodes": 1, "gpus_per_node": 8, "gpu_type": "H200",
           "paths": {k: "/data/x" for k in ("slime", "megatron", "hf_checkpoint", "torch_dist", "sft_data", "output")},
           "env": {"A": "1"}, "timeouts": {"trial_s": 10}}
CLUSTER_PATHS = list(_paths(CLUSTER))


@PROPS
@given(st.lists(st.tuples(st.sampled_from(CLUSTER_PATHS), values), max_size=3))
def test_cluster_files_give_a_config_or_an_attune_error(edits):
    data = _edited(CLUSTER, edits)
    c = accepts(parse_cluster_config, data, "prop.yaml")
    if c is not None:
        assert all(math.isfinite(x) and x > 0 for x in (c.trial_timeout_s, c.poll_s, c.stop_grace_s))
        assert all("\n" not in k for k in c.env)


@PROPS
@given(st.binary(max_size=300))
def test_cluster_file_bytes(tmp_path_factory, data):
    p = tmp_path_factory.mktemp("cl") / "c.yaml"
    p.write_bytes(data)
    accepts(load_cluster, p)


# ---------------------------------------------------------------------------------------------- corpus rows
CORPUS_ROWS = yaml.safe_load(CORPUS.read_text())[:3] if CORPUS.is_file() else []


@pytest.mark.skipif(not CORPUS_ROWS, reason="the measurement corpus (../shared/measurements) is not here")
@PROPS
@given(st.integers(min_value=0, max_value=2), st.lists(st.tuples(st.text(max_size=3), values), max_size=3),
       st.data())
def test_corpus_rows_give_a_row_or_an_attune_error(i, _unused, data):
    row = copy.deepcopy(CORPUS_ROWS[i % len(CORPUS_ROWS)])
    paths = list(_paths(row))
    assume(paths)
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        path = data.draw(st.sampled_from(paths))
        d = row
        for k in path[:-1]:
            if not isinstance(d.get(k), dict):
                break
            d = d[k]
        else:
            d[path[-1]] = data.draw(values)
    accepts(read_row, row, "dense.yaml")


# ---------------------------------------------------------------------------------------------- slime logs
STEP = "(MegatronTrainRayActor pid=1, ip=10.0.0.1) [2026-10-18 12:00:54] model.py:918 - step {n}: {d}"
PERF = "(RolloutManager pid=2, ip=10.0.0.1) [2026-10-18 11:59:42] rollout_metrics.py:268 - perf {n}: {d}"
dict_text = st.one_of(st.text(max_size=60), st.sampled_from([
    "{'train/loss': nan, 'train/grad_norm': inf}", "{'perf/train_time': -1}", "{'perf/train_time': 1e999}",
    "{" * 300, "{'a': " + "[" * 300 + "]" * 300 + "}", "{'perf/tokens_per_gpu_per_sec': '1'}", "{1: 2}", "[]"]))


@PROPS
@given(st.lists(st.tuples(st.sampled_from([STEP, PERF, "{d}"]), st.integers(min_value=-2, max_value=30), dict_text),
                max_size=20), st.integers(min_value=1, max_value=16))
def test_slime_log_lines_give_a_run_or_an_attune_error(lines, gpus):
    text = "\n".join(t.format(n=n, d=d) for t, n, d in lines)
    run = accepts(parse_slime_log, text, gpus)
    if run is not None:
        json.dumps(run.to_dict(), allow_nan=True)  # serialisable
