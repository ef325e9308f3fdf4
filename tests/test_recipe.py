"""Tests for attune.recipe: schema, I/O round trip, run-block parser, lint and summary."""

from __future__ import annotations

import copy
import datetime as dt
import json
from pathlib import Path

import pytest

from attune.errors import RecipeError as AttuneRecipeError
from attune.errors import UserInputError
from attune.recipe import (
    Finding,
    Recipe,
    RecipeError,
    RecipeTarget,
    dump_recipe,
    has_errors,
    lint,
    load_known_flags,
    load_recipe,
    load_recipe_model,
    load_schema,
    parse_recipe,
    parse_run,
    recipe_target,
    schema_errors,
    summarize,
    to_jsonable,
    validate_recipe,
    write_recipe,
)
from attune.recipe.models import SCHEMA_FILE, LayoutBlock, Result, recipe_json_schema
from attune.spec.layout import Workload

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "tests" / "fixtures" / "seed_recipe.yaml"
REFERENCE = ROOT / "recipes" / "qwen3.6-27b" / "h200" / "attune-tp1-pp4-split16-rb12.yaml"
SEED_ENTRY = "python3 -m --async \\\n"


@pytest.fixture()
def seed() -> dict:
    return load_recipe(SEED)


# The seed's run flags that do nothing in its mode (the flag table's no_effect; lint warns about each).
SEED_NO_OPS = ("--loss-mask-type qwen3_5 \\\n", ' \\\n  --tensorboard-dir "$PROFILE_DIR"')


@pytest.fixture()
def fixed(seed) -> dict:
    """The seed with its entrypoint replaced by slime's train_async.py and its no-op flags dropped."""
    r = copy.deepcopy(seed)
    assert SEED_ENTRY in r["run"]
    r["run"] = r["run"].replace(SEED_ENTRY, "python3 train_async.py \\\n")
    for no_op in SEED_NO_OPS:
        assert no_op in r["run"], no_op
        r["run"] = r["run"].replace(no_op, "")
    return r


def _errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]


def _warnings(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "warning"]


# ------------------------------------------------------------------ fixtures / files

def test_reference_recipe_is_the_seed():
    assert REFERENCE.read_bytes() == SEED.read_bytes()


def test_schema_is_valid_draft_2020_12():
    jsonschema = pytest.importorskip("jsonschema")
    schema = load_schema()
    assert schema["$schema"].endswith("2020-12/schema")
    jsonschema.Draft202012Validator.check_schema(schema)


# ------------------------------------------------------------------ schema

def test_seed_validates(seed):
    assert isinstance(seed["result"]["measured"], dt.date)  # YAML reads it as a date
    assert schema_errors(seed) == []


def test_wrong_enum_names_path(seed):
    seed["layout"]["recompute"]["granularity"] = "fulll"
    errs = schema_errors(seed)
    assert len(errs) == 1
    assert errs[0].startswith("layout.recompute.granularity: 'fulll' is not one of")
    assert "'selective'" in errs[0]


def test_wrong_status_enum(seed):
    seed["status"] = "tested"
    assert any(e.startswith("status: 'tested' is not one of") for e in schema_errors(seed))


def test_wrong_type_names_path(seed):
    seed["layout"]["tp"] = "4"
    seed["layout"]["sequence_parallel"] = "no"
    errs = schema_errors(seed)
    assert "layout.tp: Input should be a valid integer (got '4')" in errs, errs
    assert any(e.startswith("layout.sequence_parallel:") and "boolean" in e for e in errs), errs


def test_bool_is_not_an_integer(seed):
    seed["gpu"]["count"] = True
    assert any(e.startswith("gpu.count:") for e in schema_errors(seed))


def test_missing_required_key_names_path(seed):
    del seed["layout"]["tp"]
    del seed["model"]
    errs = schema_errors(seed)
    assert "layout.tp: required key is missing" in errs
    assert "model: required key is missing" in errs


def test_list_index_in_path(seed):
    seed["correctness"]["component_tests"][0]["result"] = "ok"
    errs = schema_errors(seed)
    assert any(e.startswith("correctness.component_tests[0].result: 'ok' is not one of") for e in errs), errs


def test_unexpected_key_strict_blocks(seed):
    seed["layout"]["recompute"]["num_layer"] = 3
    seed["bogus"] = 1
    errs = schema_errors(seed)
    assert "layout.recompute.num_layer: unexpected key" in errs
    assert "bogus: unexpected key" in errs


def test_free_text_blocks_accept_extra_keys(seed):
    seed["stack"]["flash_attn"] = "2.8.3"
    seed["layout"]["distributed_optimizer"] = True
    seed["layout"]["precision_aware_optimizer"] = True
    seed["x-attune"] = {"study": "abc"}
    assert schema_errors(seed) == []


def test_offload_object_and_null(seed):
    seed["layout"]["offload"] = {"fraction": 1.0, "overlap": True}
    assert schema_errors(seed) == []
    seed["layout"]["offload"] = {"fraction": 1.5, "overlap": True}
    assert any(e.startswith("layout.offload.fraction:") for e in schema_errors(seed))
    seed["layout"]["offload"] = "cpu"
    assert any(e.startswith("layout.offload:") for e in schema_errors(seed))


def test_env_values_are_strings(seed):
    seed["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] = 1
    assert any(e.startswith("env.CUDA_DEVICE_MAX_CONNECTIONS:") for e in schema_errors(seed))


def test_window_needs_two_items(seed):
    seed["result"]["window"] = [5]
    assert any(e.startswith("result.window:") for e in schema_errors(seed))


# ------------------------------------------------------------------ io

def test_round_trip_equal(seed):
    text = dump_recipe(seed)
    assert parse_recipe(text) == seed


def test_dump_style_matches_seed(seed):
    text = dump_recipe(seed)
    # identical to the seed file after its three header comment lines
    seed_body = "".join(SEED.read_text(encoding="utf-8").splitlines(keepends=True)[3:])
    assert text == seed_body
    assert "run: |\n  export CUDA_DEVICE_MAX_CONNECTIONS=1\n" in text
    assert "notes: |\n" in text
    assert "&id" not in text and "*id" not in text


def test_dump_orders_keys_and_keeps_unicode(seed):
    shuffled = dict(reversed(list(seed.items())))
    shuffled["layout"] = dict(reversed(list(seed["layout"].items())))
    shuffled["layout"]["summary"] = "TP 1 → PP 4 — 16/17/17/14"
    shared = [1, 2]
    shuffled["result"]["window"] = shared
    shuffled["x-extra"] = shared  # same object twice: no anchors/aliases
    text = dump_recipe(shuffled)
    keys = [line.split(":")[0] for line in text.splitlines() if line and not line[0].isspace() and line[0] != "-"]
    assert keys[:5] == ["schema_version", "model", "gpu", "author", "status"]
    assert keys[-1] == "x-extra"  # unknown keys go last
    assert "TP 1 → PP 4 — 16/17/17/14" in text
    assert "&" not in text.split("x-extra")[1] and "*id" not in text
    layout_block = text.split("\nlayout:\n")[1]
    assert layout_block.index("  label:") < layout_block.index("  tp:") < layout_block.index("  recompute:")


def test_write_recipe_with_header(tmp_path, seed):
    out = write_recipe(seed, tmp_path / "sub" / "r.yaml", header="a recipe\nsecond line")
    text = out.read_text(encoding="utf-8")
    assert text.startswith("# a recipe\n# second line\nschema_version: 1\n")
    assert load_recipe(out) == seed


def test_dump_tuple_and_numpy(seed):
    np = pytest.importorskip("numpy")
    seed["result"]["window"] = (5, 19)
    seed["result"]["mfu"] = np.float64(0.3886)
    back = parse_recipe(dump_recipe(seed))
    assert back["result"]["window"] == [5, 19]
    assert back["result"]["mfu"] == 0.3886


def test_missing_file_raises_one_line(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(RecipeError) as exc:
        load_recipe(missing)
    msg = str(exc.value)
    assert "\n" not in msg and str(missing) in msg and "no such" in msg


def test_malformed_yaml_raises_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\nlayout:\n  tp: [1, 2\n  pp: 4\n", encoding="utf-8")
    with pytest.raises(RecipeError) as exc:
        load_recipe(bad)
    msg = str(exc.value)
    assert "\n" not in msg and str(bad) in msg and "malformed YAML" in msg and "line " in msg


def test_not_a_mapping_raises(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n", encoding="utf-8")
    with pytest.raises(RecipeError, match=r"list\.yaml: top level is a list"):
        load_recipe(p)
    e = tmp_path / "empty.yaml"
    e.write_text("# nothing\n", encoding="utf-8")
    with pytest.raises(RecipeError, match="empty"):
        load_recipe(e)


def test_duplicate_key_raises(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("model: a\nlayout:\n  tp: 1\n  tp: 2\n", encoding="utf-8")
    with pytest.raises(RecipeError, match="duplicate key 'tp'"):
        load_recipe(p)


# ------------------------------------------------------------------ typed models and the published schema

def test_schema_file_is_up_to_date():
    """attune/recipe/recipe.schema.json is Recipe.model_json_schema(); regenerate with
    `python3 -c "from attune.recipe.models import write_schema; write_schema()"`."""
    assert json.loads(SCHEMA_FILE.read_text(encoding="utf-8")) == recipe_json_schema()
    assert load_schema() == recipe_json_schema()


def test_model_field_order_is_the_written_order(seed):
    assert list(Recipe.model_fields)[: len(seed)] == list(seed)
    assert list(LayoutBlock.model_fields)[: len(seed["layout"])] == list(seed["layout"])
    assert list(Result.model_fields)[: len(seed["result"])] == list(seed["result"])
    props = load_schema()["properties"]
    assert list(props)[: len(seed)] == list(seed)


def _models(model, seen=None):
    seen = set() if seen is None else seen
    if model in seen:
        return seen
    seen.add(model)
    for f in model.model_fields.values():
        for sub in _nested_models(f.annotation):
            _models(sub, seen)
    return seen


def _nested_models(tp):
    import typing

    from pydantic import BaseModel
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        yield tp
    for arg in typing.get_args(tp):
        yield from _nested_models(arg)


def test_every_field_is_documented():
    models = _models(Recipe)
    assert {"Recipe", "Gpu", "LayoutBlock", "Recompute", "Offload", "Correctness", "ComponentTest", "Dataset"} <= {
        m.__name__ for m in models}
    missing = [f"{m.__name__}.{n}" for m in models for n, f in m.model_fields.items() if not f.description]
    assert missing == []


def test_published_schema_agrees_with_model(seed):
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(load_schema())

    def schema_ok(r):
        return not list(validator.iter_errors(to_jsonable(r)))

    assert schema_ok(seed) and schema_errors(seed) == []
    for path, value in [(("layout", "tp"), "4"), (("layout", "recompute", "granularity"), "fulll"),
                        (("bogus",), 1), (("gpu", "count"), True), (("env", "A"), 1),
                        (("layout", "offload"), {"fraction": 1.5, "overlap": True}), (("status",), "tested"),
                        (("result", "mfu"), 2.0), (("layout", "layer_split", "middle"), 3)]:
        r = copy.deepcopy(seed)
        node = r
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        assert not schema_ok(r), path
        assert any(e.startswith(".".join(path)) for e in schema_errors(r)), (path, schema_errors(r))
    r = copy.deepcopy(seed)
    r["x-attune"] = {"study": "abc"}
    r["result"]["speed_note"] = "text"
    r["layout"]["tp_comm_overlap"] = False
    assert schema_ok(r) and schema_errors(r) == []
    r["result"]["speed_note"] = 3
    assert not schema_ok(r) and schema_errors(r) == ["result.speed_note: Input should be a string or null (got 3)"]


def test_recipe_model_round_trip(seed):
    model = validate_recipe(seed)
    assert isinstance(model, Recipe)
    assert model.layout.tp == 1 and model.layout.recompute.method == "block" and model.gpu.memory_gb == 141
    assert model.to_dict() == seed
    assert dump_recipe(model) == dump_recipe(seed)  # byte-stable: 141 stays an integer, dates stay dates
    assert isinstance(model.result.measured, dt.date)


def test_recipe_model_keeps_extension_keys(seed):
    seed["x-attune"] = {"study": "abc"}
    model = validate_recipe(seed)
    assert model.to_dict()["x-attune"] == {"study": "abc"}
    assert dump_recipe(model).endswith("x-attune:\n  study: abc\n")


def test_bad_field_is_one_line_recipe_error_with_path(seed, tmp_path):
    seed["layout"]["tp"] = "4"
    with pytest.raises(RecipeError) as exc:
        validate_recipe(seed)
    assert str(exc.value) == "recipe layout.tp: Input should be a valid integer (got '4')"
    assert isinstance(exc.value, UserInputError) and exc.value.exit_code == 2
    seed["layout"]["recompute"]["granularity"] = "fulll"
    p = write_recipe(seed, tmp_path / "bad.yaml")
    with pytest.raises(RecipeError) as exc:
        load_recipe_model(p)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{p} layout.recompute.granularity: 'fulll' is not one of")
    assert msg.endswith("(and 1 more problem(s))")


@pytest.mark.parametrize("path", sorted(ROOT.glob("recipes/**/*.yaml")) + [ROOT / "reports" / "example" / "recipe.yaml"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_recipes_validate_and_round_trip(path):
    text = path.read_text(encoding="utf-8")
    body = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#"))
    recipe = load_recipe(path)
    assert schema_errors(recipe) == []
    assert dump_recipe(validate_recipe(recipe)) == body  # byte-stable apart from header comments
    t = recipe_target(recipe)
    assert t.layout.world_size == t.cluster.world_size


def test_load_recipe_model(seed):
    model = load_recipe_model(SEED)
    assert model.model == "Qwen3.6-27B" and model.to_dict() == seed


# ------------------------------------------------------------------ recipe -> target

def test_target_of_seed(seed, seed_cases):
    t = recipe_target(seed)
    assert isinstance(t, RecipeTarget)
    assert t.model.name == "Qwen3.6-27B" and t.cluster.spec == "8xH200" and t.cluster.gpus_per_node == 8
    assert t.engine.name == "slime"
    assert t.layout == seed_cases["rb12"]
    assert t.layout.precision_aware_optimizer is True  # the layout block omits it; the run block has the flag
    w = t.workload
    assert (w.seq_length, w.global_batch, w.steps, w.window) == (8192, 128, 20, (5, 19))
    assert (w.lr, w.min_lr, w.lr_decay_style, w.warmup_fraction, w.weight_decay, w.adam_beta1, w.adam_beta2) == (
        1e-5, 1e-6, "cosine", 0.1, 0.1, 0.9, 0.98)
    assert recipe_target(validate_recipe(seed)) == t  # a Recipe reads the same


def test_target_precision_aware_default(seed):
    assert "precision_aware_optimizer" not in seed["layout"]
    no_flag = copy.deepcopy(seed)
    no_flag["run"] = no_flag["run"].replace("  --use-precision-aware-optimizer \\\n", "")
    assert "--use-precision-aware-optimizer" not in no_flag["run"]
    assert recipe_target(no_flag).layout.precision_aware_optimizer is False
    no_run = copy.deepcopy(seed)
    del no_run["run"]
    assert recipe_target(no_run).layout.precision_aware_optimizer is False  # Layout's default
    explicit = copy.deepcopy(seed)
    explicit["layout"]["precision_aware_optimizer"] = False
    assert recipe_target(explicit).layout.precision_aware_optimizer is False  # the block wins over the flag
    explicit["layout"]["precision_aware_optimizer"] = True
    del explicit["run"]
    assert recipe_target(explicit).layout.precision_aware_optimizer is True


def test_target_run_flag_hyper_parameters(seed):
    base = Workload(seq_length=256, global_batch=8, lr=3e-3, min_lr=3e-4, seed=1)
    seed["run"] = seed["run"].replace("--lr 1e-5", "--lr $LR --seed 7").replace("--min-lr 1e-6", "--min-lr 2e-6")
    w = recipe_target(seed, base_workload=base).workload
    assert w.lr == 3e-3  # a shell expansion keeps the base value
    assert (w.min_lr, w.seed) == (2e-6, 7)
    assert (w.seq_length, w.global_batch) == (8192, 128)  # the workload block over the base


def test_target_check_rules_off(seed):
    seed["layout"]["recompute"]["num_layers"] = 40  # more than a stage's 16 layers
    with pytest.raises(AttuneRecipeError, match="recompute"):
        recipe_target(seed)
    assert recipe_target(seed, check_rules=False).layout.recompute_num_layers == 40


def test_target_steps_from_result_block(seed):
    seed["result"]["steps_per_run"] = 8
    del seed["result"]["window"]
    assert recipe_target(seed).workload.window == (2, 7)  # Workload.with_steps
    del seed["result"]["steps_per_run"]
    assert recipe_target(seed, base_workload=Workload(steps=30, window=(3, 29))).workload.steps == 30


def test_target_overrides_rederive_dp(seed):
    t = recipe_target(seed, gpus="16xH200", engine="megatron")
    assert t.cluster.world_size == 16 and t.layout.dp == 4 and t.engine.name == "megatron"
    seed["gpu"]["per_node"] = 4
    t = recipe_target(seed)
    assert (t.cluster.nodes, t.cluster.gpus_per_node) == (2, 4)


@pytest.mark.parametrize("edit,message", [
    (lambda r: r["layout"].__setitem__("tp", "4"), "recipe layout.tp: Input should be a valid integer (got '4')"),
    (lambda r: r["layout"].__setitem__("tp", 3), "recipe layout: TP 3 x PP 4 x CP 1 = 12 does not divide the 8 GPUs"),
    (lambda r: r["layout"]["recompute"].__setitem__("num_layers", 40), "recipe layout: "),
    (lambda r: r.pop("gpu"), "recipe gpu: required key is missing"),
    (lambda r: r["gpu"].__setitem__("per_node", 3), "recipe gpu.count: 8 GPUs is not a multiple of gpu.per_node 3"),
    (lambda r: r["gpu"].__setitem__("type", "Z100"), "recipe gpu: unknown GPU type 'Z100'"),
    (lambda r: r.__setitem__("model", "no-such-model"), "recipe model: unknown model 'no-such-model'"),
    (lambda r: r["workload"].__setitem__("global_batch", 0), "recipe workload.global_batch: "),
])
def test_target_bad_recipe_is_one_line_error(seed, edit, message):
    edit(seed)
    with pytest.raises(AttuneRecipeError) as exc:
        recipe_target(seed)
    assert str(exc.value).startswith(message), str(exc.value)
    assert "\n" not in str(exc.value)


# ------------------------------------------------------------------ run block parser

def test_parse_seed_run(seed):
    rb = parse_run(seed["run"])
    assert rb.env == seed["env"]  # the $(...) with nested quotes survives verbatim
    assert rb.entrypoint == ["python3", "-m", "--async"]
    assert rb.flags[0] == ("--actor-num-nodes", "1")
    assert ("${MODEL_ARGS[@]}", None) in rb.flags
    d = rb.flag_dict()
    assert d["--hf-checkpoint"] == "$HF_CKPT"  # quotes removed
    assert d["--recompute-num-layers"] == "12"
    assert d["--debug-train-only"] is None
    # several flags on one line
    assert d["--lr"] == "1e-5" and d["--lr-decay-style"] == "cosine" and d["--min-lr"] == "1e-6"
    assert "${MODEL_ARGS[@]}" not in d
    assert len(rb.flags) == 46


def test_parse_ray_job_submit_and_quoting():
    text = (
        'export A="x y" B=\'z\'\n'
        "export NCCL_X=$(python3 -c \"import sys; print('a b')\")  # comment\n"
        "ray job submit --address=\"http://127.0.0.1:8265\" \\\n"
        "   --runtime-env-json='{\"env_vars\": {\"K\": \"v w\"}}' \\\n"
        "   -- python3 /root/slime/train.py \\\n"
        '   --spec slime_plugins.models.qwen3_5 get_qwen3_5_spec "${MODEL_ARGS[@]}" \\\n'
        "   --lr=1e-6 --eval-prompt-data aime '/data/aime 2024.jsonl' --clip-grad -1.0 $PERF_ARGS \\\n"
        "   --colocate 2>&1 | tee log.txt\n"
    )
    rb = parse_run(text)
    assert rb.env == {"A": "x y", "B": "z", "NCCL_X": "$(python3 -c \"import sys; print('a b')\")"}
    assert rb.launcher[:3] == ["ray", "job", "submit"] and rb.launcher[-1] == "--"
    assert '--runtime-env-json={"env_vars": {"K": "v w"}}' in rb.launcher
    assert rb.entrypoint == ["python3", "/root/slime/train.py"]
    assert rb.flags == [
        ("--spec", "slime_plugins.models.qwen3_5 get_qwen3_5_spec"),
        ("${MODEL_ARGS[@]}", None),
        ("--lr", "1e-6"),
        ("--eval-prompt-data", "aime /data/aime 2024.jsonl"),
        ("--clip-grad", "-1.0"),
        ("$PERF_ARGS", None),
        ("--colocate", None),
    ]
    assert dict(rb.flag_args)["--eval-prompt-data"] == ("aime", "/data/aime 2024.jsonl")
    assert rb.other_commands == ["tee log.txt"]


def test_parse_assignments_and_prefix_env():
    rb = parse_run(
        "MODEL_ARGS=(\n  --num-layers 64\n  --swiglu\n)\nHF=/m\n"
        "PYTHONUNBUFFERED=1 python3 -u train.py --hf-checkpoint $HF\n"
    )
    assert rb.assignments["HF"] == "/m"
    assert rb.assignments["MODEL_ARGS"].startswith("(") and "--swiglu" in rb.assignments["MODEL_ARGS"]
    assert rb.env == {"PYTHONUNBUFFERED": "1"}
    assert rb.entrypoint == ["python3", "-u", "train.py"]
    assert rb.flags == [("--hf-checkpoint", "$HF")]


def test_parse_non_python_command():
    rb = parse_run("torchrun --nproc-per-node 8 pretrain_gpt.py --tp 2\n")
    assert rb.entrypoint == ["torchrun"]
    assert rb.flags[0] == ("--nproc-per-node", "8 pretrain_gpt.py")


# ------------------------------------------------------------------ lint

def test_lint_seed_flags_module_entrypoint(seed):
    errs = _errors(lint(seed))
    assert len(errs) == 1, errs
    assert errs[0].path == "run"
    assert "python3 -m --async" in errs[0].message and "not a runnable" in errs[0].message


def test_lint_fixed_seed_has_no_errors(fixed):
    findings = lint(fixed)
    assert not has_errors(findings), findings
    assert _warnings(findings) == []  # every seed flag is in the flag table (attune/spec/megatron_flags.yaml)


@pytest.mark.parametrize("entry", [
    "python3 train.py", "python train_async.py", "/usr/bin/python3.12 /root/slime/train.py",
    "python3 -u train.py",
])
def test_lint_accepts_slime_entrypoints(fixed, entry):
    fixed["run"] = fixed["run"].replace("python3 train_async.py", entry)
    assert not has_errors(lint(fixed))


def test_lint_accepts_ray_job_submit(fixed):
    fixed["run"] = fixed["run"].replace(
        "python3 train_async.py", 'ray job submit --address="http://127.0.0.1:8265" -- python3 train_async.py')
    assert not has_errors(lint(fixed))


@pytest.mark.parametrize("entry", ["python3 pretrain_gpt.py", "torchrun train.py", "python3 -m slime.train"])
def test_lint_rejects_other_entrypoints(fixed, entry):
    fixed["run"] = fixed["run"].replace("python3 train_async.py", entry)
    errs = _errors(lint(fixed))
    assert any(f.path == "run" and "entrypoint" in f.message for f in errs), errs


def test_lint_train_async_with_colocate(fixed):
    fixed["run"] = fixed["run"].replace("--debug-train-only \\\n", "--debug-train-only --colocate \\\n")
    errs = _errors(lint(fixed))
    assert any("colocate" in f.message and "train_async" in f.message for f in errs), errs
    fixed["run"] = fixed["run"].replace("train_async.py", "train.py")
    assert not has_errors(lint(fixed))


def test_lint_recompute_num_layers_disagreement(fixed):
    fixed["run"] = fixed["run"].replace("--recompute-num-layers 12", "--recompute-num-layers 10")
    errs = _errors(lint(fixed))
    assert [f.path for f in errs] == ["layout.recompute.num_layers"]
    assert "10" in errs[0].message and "12" in errs[0].message


@pytest.mark.parametrize("old,new,path", [
    ("--tensor-model-parallel-size 1", "--tensor-model-parallel-size 2", "layout.tp"),
    ("--pipeline-model-parallel-size 4", "--pipeline-model-parallel-size 2", "layout.pp"),
    ("--decoder-first-pipeline-num-layers 16", "--decoder-first-pipeline-num-layers 18", "layout.layer_split.first"),
    ("--decoder-last-pipeline-num-layers 14", "--decoder-last-pipeline-num-layers 12", "layout.layer_split.last"),
    ("--context-parallel-size 1", "--context-parallel-size 2", "layout.cp"),
    ("--expert-model-parallel-size 1", "--expert-model-parallel-size 8", "layout.ep"),
    ("--recompute-method block", "--recompute-method uniform", "layout.recompute.method"),
    ("--recompute-granularity full", "--recompute-granularity selective", "layout.recompute.granularity"),
    ("--max-tokens-per-gpu 8192", "--max-tokens-per-gpu 16384", "layout.max_tokens_per_gpu"),
    ("--context-parallel-size 1", "--context-parallel-size 1 --sequence-parallel", "layout.sequence_parallel"),
    ("--context-parallel-size 1", "--context-parallel-size 1 --num-virtual-stages-per-pipeline-rank 2", "layout.vpp"),
    ("--use-distributed-optimizer", "--use-distributed-optimizer --optimizer-cpu-offload", "layout.offload"),
])
def test_lint_layout_disagreements(fixed, old, new, path):
    assert old in fixed["run"]
    fixed["run"] = fixed["run"].replace(old, new)
    errs = _errors(lint(fixed))
    assert path in [f.path for f in errs], errs


def test_lint_missing_layout_flag(fixed):
    assert "  --decoder-last-pipeline-num-layers 14 \\\n" in fixed["run"]
    fixed["run"] = fixed["run"].replace("  --decoder-last-pipeline-num-layers 14 \\\n", "")
    findings = lint(fixed)
    hit = [f for f in findings if f.path == "layout.layer_split.last"]
    # the run has an opaque ${MODEL_ARGS[@]}, so an absent flag is only a warning
    assert hit and hit[0].severity == "warning"
    assert "  ${MODEL_ARGS[@]} \\\n" in fixed["run"]
    fixed["run"] = fixed["run"].replace("  ${MODEL_ARGS[@]} \\\n", "")
    hit = [f for f in lint(fixed) if f.path == "layout.layer_split.last"]
    assert hit and hit[0].severity == "error"


def test_lint_layout_in_agreement_when_offloaded(fixed):
    fixed["layout"]["offload"] = {"fraction": 0.5, "overlap": True}
    fixed["run"] = fixed["run"].replace(
        "--use-distributed-optimizer", "--use-distributed-optimizer --optimizer-cpu-offload "
        "--optimizer-offload-fraction 0.5 --overlap-cpu-optimizer-d2h-h2d")
    assert not has_errors(lint(fixed))
    fixed["layout"]["offload"]["fraction"] = 1.0
    assert [f.path for f in _errors(lint(fixed))] == ["layout.offload.fraction"]


def test_lint_unknown_flag_is_an_error(fixed):
    """slime hands Megatron's parser ignore_unknown_args=True: an unknown flag is silently ignored at launch, so
    lint reports it as an error (issue 13)."""
    assert not has_errors(lint(fixed))
    fixed["run"] = fixed["run"].replace("--debug-train-only", "--debug-train-only --frobnicate-gpus 3")
    errs = _errors(lint(fixed))
    assert len(errs) == 1 and errs[0].path == "run" and "unknown flag --frobnicate-gpus" in errs[0].message
    assert "ignore_unknown_args" in errs[0].message and "did you mean" not in errs[0].message


def test_lint_misspelled_flag_names_the_real_one(fixed):
    fixed["run"] = fixed["run"].replace("--recompute-num-layers 12", "--recompute-num-layer 12")
    msgs = [f.message for f in _errors(lint(fixed))]
    assert any(m.startswith("unknown flag --recompute-num-layer:") and m.endswith("did you mean --recompute-num-layers?")
               for m in msgs), msgs
    # the layout block still says 12 layers: the misspelled flag leaves the run without them
    assert any("run does not set --recompute-num-layers" in f.message for f in lint(fixed))


def test_lint_warns_about_flags_without_effect(seed, fixed):
    """Known flags that do nothing in the run's mode are warnings with the reason and its source."""
    assert not [f for f in lint(fixed) if "has no effect" in f.message]
    seed_warns = {f.message.split()[0] for f in _warnings(lint(seed)) if "has no effect" in f.message}
    assert seed_warns == {"--loss-mask-type", "--tensorboard-dir"}  # custom rollout function; slime's own logger
    fixed["run"] = fixed["run"].replace("--debug-train-only", "--debug-train-only --use-gated-attention "
                                        "--tb-project-name p --tb-experiment-name e")
    warns = {f.message.split()[0]: f.message for f in _warnings(lint(fixed)) if "has no effect" in f.message}
    assert set(warns) == {"--use-gated-attention"}  # no TENSORBOARD_DIR export: the tb names are used
    assert "--attention-output-gate" in warns["--use-gated-attention"] and "megatron.patch" in warns["--use-gated-attention"]
    fixed["run"] = "export TENSORBOARD_DIR=/tb\n" + fixed["run"]
    fixed["env"]["TENSORBOARD_DIR"] = "/tb"
    warns = {f.message.split()[0] for f in _warnings(lint(fixed)) if "has no effect" in f.message}
    assert warns == {"--use-gated-attention", "--tb-project-name", "--tb-experiment-name"}
    # slime's own SFT rollout reads --loss-mask-type: then it has an effect
    fixed["run"] = fixed["run"].replace("pretokenized_sft_rollout.generate_rollout",
                                        "slime.rollout.sft_rollout.generate_rollout") \
        .replace("--debug-train-only", "--debug-train-only --loss-mask-type qwen3_5")
    assert "--loss-mask-type" not in {f.message.split()[0] for f in _warnings(lint(fixed))}


def test_lint_flag_value_shapes(fixed):
    fixed["run"] = fixed["run"].replace("--debug-train-only", "--debug-train-only yes")
    fixed["run"] = fixed["run"].replace("--lr 1e-5", "--lr")
    msgs = [f.message for f in _errors(lint(fixed))]
    assert any("--debug-train-only takes no value" in m for m in msgs), msgs
    assert any("--lr takes one value, got no value" in m for m in msgs), msgs


def test_lint_bad_choice(fixed):
    fixed["run"] = fixed["run"].replace("--attention-backend flash", "--attention-backend flashy")
    assert any("--attention-backend 'flashy'" in f.message for f in _errors(lint(fixed)))


def test_lint_known_flags_file():
    known = load_known_flags()  # a view of the flag table, attune/spec/megatron_flags.yaml
    assert known["flags"]["--colocate"] == "switch"
    assert known["flags"]["--tensor-model-parallel-size"] == "value"
    assert set(known["flags"].values()) <= {"switch", "value", "values"}
    assert known["origin"]["--use-gated-attention"] == "slime-patch" and known["prefixes"] == {"--sglang-": "values"}


def test_lint_flag_value_types(fixed):
    fixed["run"] = fixed["run"].replace("--lr 1e-5", "--lr fast")
    fixed["run"] = fixed["run"].replace("--debug-train-only", "--debug-train-only --rollout-top-k $TOPK "
                                        "--sglang-enable-dp-attention --sglang-mem-fraction-static 0.7")
    errs = _errors(lint(fixed))
    assert [f.message for f in errs] == ["--lr 'fast': expected a number"], errs


def test_lint_layout_rules_are_the_spec_rules(fixed):
    # attune.spec.rules.check on the recipe's layout: TP 3 breaks the world size and the 4 KV heads
    fixed["layout"]["tp"] = 3
    fixed["run"] = fixed["run"].replace("--tensor-model-parallel-size 1", "--tensor-model-parallel-size 3")
    errs = _errors(lint(fixed))
    assert sorted(f.path for f in errs) == ["layout.dp", "layout.tp"], errs
    assert any("query groups" in f.message for f in errs)
    fixed["layout"]["tp"], fixed["layout"]["dp"], fixed["layout"]["sequence_parallel"] = 1, 2, True
    fixed["run"] = fixed["run"].replace("--tensor-model-parallel-size 3", "--tensor-model-parallel-size 1 --sequence-parallel")
    findings = lint(fixed)
    assert not has_errors(findings)
    assert [(f.severity, f.path) for f in findings] == [("warning", "layout.sequence_parallel")]


def test_lint_dynamic_batch_needs_max_tokens(fixed):
    fixed["run"] = fixed["run"].replace("--max-tokens-per-gpu 8192", "")
    fixed["layout"]["max_tokens_per_gpu"] = None
    fixed["layout"]["rows_per_microbatch"] = None
    errs = _errors(lint(fixed))
    assert any("--use-dynamic-batch-size needs --max-tokens-per-gpu" in f.message for f in errs), errs


def test_lint_layout_self_consistency(fixed):
    fixed["layout"]["dp"] = 4
    errs = _errors(lint(fixed))
    assert [f.path for f in errs] == ["layout.dp"]


def test_lint_run_vs_workload_and_gpus(fixed):
    fixed["run"] = fixed["run"].replace("--global-batch-size 128", "--global-batch-size 64")
    fixed["run"] = fixed["run"].replace("--actor-num-nodes 1", "--actor-num-nodes 2")
    paths = [f.path for f in lint(fixed)]
    assert "workload.global_batch" in paths and "gpu.count" in paths


def test_lint_env_drift(fixed):
    fixed["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
    warns = _warnings(lint(fixed))
    assert [f.path for f in warns] == ["env.CUDA_DEVICE_MAX_CONNECTIONS"]


def test_lint_status_and_result_consistency(fixed):
    fixed["correctness"]["result"] = "fail"
    fixed["result"]["window"] = [5, 20]
    errs = _errors(lint(fixed))
    paths = [f.path for f in errs]
    assert "correctness.result" in paths  # verified needs pass
    assert "result.window" in paths  # window past the 20 steps
    assert "result.window_tokens" in [f.path for f in lint(fixed)]


def test_lint_includes_schema_errors(fixed):
    fixed["layout"]["recompute"]["granularity"] = "fulll"
    errs = _errors(lint(fixed))
    assert any(f.path == "layout.recompute.granularity" and "not one of" in f.message for f in errs)


def test_lint_tolerates_garbage():
    findings = lint({"run": 3, "layout": "x"})
    assert has_errors(findings)
    assert all(isinstance(f, Finding) for f in findings)


# ------------------------------------------------------------------ show

def test_summarize(seed):
    text = summarize(seed)
    assert "Qwen3.6-27B" in text
    assert "8 x H200" in text
    assert "verified" in text
    assert "TP1 PP4 DP2" in text
    assert "2,499.52 tokens/s/GPU" in text
    assert "38.9%" in text
    assert "$0.88 per million tokens" in text
    assert "correctness   pass" in text or "pass (" in text
    assert "+163%" in text


def test_summarize_partial_recipe():
    text = summarize({"model": "m", "status": "predicted", "result": {"tokens_per_s_per_gpu": 1000}})
    assert "1,000.00 tokens/s/GPU" in text and "MFU" not in text and "cost" not in text
