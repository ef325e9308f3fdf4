"""The bad-input suite (issue 23): hostile and careless input to every sub-command gives one line on stderr
and exit code 2 (bad input) or 1 (a run-time failure), never a traceback or a silent wrong answer, each case
within 5 s (the CLI runs in-process; an escaping exception fails the test with its traceback).

Each case builds its input files in a fresh folder and names the words its one-line error must hold."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from attune.cli import main

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "tests" / "fixtures" / "seed_recipe.yaml"
SMALL = str(ROOT / "tests" / "fixtures" / "spaces" / "dense_small.yaml")
TIME_LIMIT_S = 5.0
NOT_UTF8 = b"name: caf\xe9\nknobs: {}\n"
# 342 bytes of nested YAML aliases: 9^9 = 387 million strings when expanded (the "billion laughs")
ALIAS_BOMB = ("a: &a [lol,lol,lol,lol,lol,lol,lol,lol,lol]\n"
              + "".join(f"{c}: &{c} [{','.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")))
TINY = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 128, "intermediate_size": 352,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096, "hidden_act": "silu"}
CLUSTER = {"ray": {"address": "http://127.0.0.1:8265"}, "nodes": 1, "gpus_per_node": 8, "gpu_type": "H200",
           "paths": {k: "/data/x" for k in ("slime", "megatron", "hf_checkpoint", "torch_dist", "sft_data", "output")}}
FLAGS_A = "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2"
TABLE_HEAD = "flags,outcome,tokens_per_s_per_gpu,step_time_s,peak_gib,oom_stage\n"


def write(d: Path, name: str, content: str | bytes | dict) -> str:
    p = d / name
    if isinstance(content, dict):
        content = json.dumps(content)
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)
    return str(p)


def config(d: Path, **over) -> str:
    return write(d, "config.json", json.dumps({**TINY, **over}))


def cluster(d: Path, text: str | None = None, **over) -> str:
    return write(d, "cluster.yaml", text if text is not None else json.dumps({**CLUSTER, **over}))


def seed_with(d: Path, old: str, new: str) -> str:
    text = SEED.read_text()
    assert old in text
    return write(d, "recipe.yaml", text.replace(old, new))


def estimate_tiny(*extra: str):
    return lambda d: ["estimate", "--model", "tiny-llama", "--gpus", "8xH200", *extra]


def replay(rows: str, *extra: str, name: str = "m.csv"):
    return lambda d: ["tune", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--runner", "replay", "--measurements",
                      write(d, name, TABLE_HEAD + rows), "--search-space", SMALL, "--out", str(d / "out"), *extra]


def trials_csv(d: Path) -> str:
    head = "number,state,role,runner,tp,pp,cp,vpp,dp,sp,first,last,recompute_granularity,outcome," \
           "measured_tokens_per_s_per_gpu,step_time_s\n"
    row = "0,COMPLETE,baseline,torch,2,2,1,1,2,True,,,none,ok,1000.0,10.0\n"
    return write(d, "trials.csv", head + row + row.replace("0,COMPLETE", "1,COMPLETE", 1))


CASES = {
    # ---------------------------------------------------------------- model configs (estimate --model FILE)
    "config-hidden-size-string": (lambda d: ["estimate", "--model", config(d, hidden_size="128"), "--gpus", "8xH200"],
                                  2, "hidden_size"),
    "config-hidden-size-float": (lambda d: ["estimate", "--model", config(d, hidden_size=128.0), "--gpus", "8xH200"],
                                 2, "hidden_size"),
    "config-layers-bool": (lambda d: ["estimate", "--model", config(d, num_hidden_layers=True), "--gpus", "8xH200"],
                           2, "num_hidden_layers"),
    "config-heads-do-not-divide": (lambda d: ["estimate", "--model", config(d, num_attention_heads=3,
                                                                            num_key_value_heads=3), "--gpus", "8xH200"],
                                   2, "must divide hidden_size"),
    "config-kv-heads-do-not-divide": (lambda d: ["estimate", "--model", config(d, num_key_value_heads=3),
                                                 "--gpus", "8xH200"], 2, "num_key_value_heads"),
    "config-vocab-nan": (lambda d: ["estimate", "--model", write(d, "config.json", json.dumps(TINY).replace(
        '"vocab_size": 4096', '"vocab_size": NaN')), "--gpus", "8xH200"], 2, "NaN"),
    "config-rope-inf": (lambda d: ["estimate", "--model", write(d, "config.json", json.dumps(TINY)[:-1]
                                                                + ', "rope_theta": Infinity}'), "--gpus", "8xH200"],
                        2, "Infinity"),
    "config-negative-layers": (lambda d: ["estimate", "--model", config(d, num_hidden_layers=-4), "--gpus", "8xH200"],
                               2, "num_hidden_layers"),
    "config-not-utf8": (lambda d: ["estimate", "--model", write(d, "config.json", b'{"model_type": "ll\xe1ma"}'),
                                   "--gpus", "8xH200"], 2, "UTF-8"),
    "config-not-json": (lambda d: ["estimate", "--model", write(d, "config.json", "{model_type: llama"),
                                   "--gpus", "8xH200"], 2, "not valid JSON"),
    "config-list": (lambda d: ["estimate", "--model", write(d, "config.json", "[1, 2]"), "--gpus", "8xH200"],
                    2, "JSON object"),
    "config-deep-nesting": (lambda d: ["estimate", "--model", write(d, "config.json", "[" * 100000 + "]" * 100000),
                                       "--gpus", "8xH200"], 2, "config"),
    # ---------------------------------------------------------------- flags and options
    "price-inf-json": (estimate_tiny("--price", "inf", "--json"), 2, "finite"),
    "price-nan": (estimate_tiny("--price", "nan"), 2, "finite"),
    "stray-value-after-dashes": (estimate_tiny("--", "4"), 2, "value without a flag"),
    "flag-unknown-value": (estimate_tiny("--", "--tensor-model-parallel-size", "two"), 2, "tensor-model-parallel-size"),
    "seq-zero": (estimate_tiny("--seq", "0"), 2, "--seq"),
    # ---------------------------------------------------------------- recipes
    "recipe-alias-bomb-validate": (lambda d: ["recipe", "validate", write(d, "r.yaml", ALIAS_BOMB)], 2, "aliases"),
    "recipe-alias-bomb-show": (lambda d: ["recipe", "show", write(d, "r.yaml", ALIAS_BOMB)], 2, "aliases"),
    "recipe-alias-bomb-estimate": (lambda d: ["estimate", "--recipe", write(d, "r.yaml", ALIAS_BOMB)], 2, "aliases"),
    "recipe-not-utf8": (lambda d: ["recipe", "validate", write(d, "r.yaml", NOT_UTF8)], 2, "UTF-8"),
    "recipe-deep-nesting": (lambda d: ["recipe", "validate", write(d, "r.yaml", "a: " + "[" * 20000 + "]" * 20000)],
                            2, "r.yaml"),
    # ---------------------------------------------------------------- search spaces
    "space-not-utf8": (lambda d: ["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--search-space",
                                  write(d, "s.yaml", NOT_UTF8), "--out", str(d / "o")], 2, "UTF-8"),
    "space-alias-bomb": (lambda d: ["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--search-space",
                                    write(d, "s.yaml", ALIAS_BOMB), "--out", str(d / "o")], 2, "aliases"),
    "space-no-valid-layout": (lambda d: ["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--search-space",
                                         write(d, "s.yaml", "knobs: {pp: [64]}"), "--out", str(d / "o")],
                              2, "no layout of it passes the rules"),
    "space-int-range-huge": (lambda d: ["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--search-space",
                                        write(d, "s.yaml", "knobs: {recompute_layers: {low: 1, high: 100000000000}}"),
                                        "--out", str(d / "o")], 2, "at most 1024"),
    "space-too-many-choices": (lambda d: ["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--search-space",
                                          write(d, "s.yaml", "knobs: {tp: [" + ",".join(["1"] * 300) + "]}"),
                                          "--out", str(d / "o")], 2, "at most 256"),
    "space-nan-choice": (lambda d: ["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--search-space",
                                    write(d, "s.yaml", "knobs: {tp: [.nan]}"), "--out", str(d / "o")], 2, "knobs.tp"),
    "flag-lr-nan": (estimate_tiny("--", "--lr", "nan"), 2, "finite"),
    "flag-unclosed-quote-run-block": (lambda d: ["slime", "command", "--recipe", seed_with(
        d, "--lr 1e-5", "--lr '1e-5")], 2, "quotation"),
    # ---------------------------------------------------------------- cluster files (slime command --cluster)
    "cluster-not-utf8": (lambda d: ["slime", "command", "--recipe", str(SEED), "--cluster",
                                    write(d, "c.yaml", NOT_UTF8)], 2, "UTF-8"),
    "cluster-trial-nan": (lambda d: ["slime", "command", "--recipe", str(SEED), "--cluster",
                                     cluster(d, timeouts={"trial_s": float("nan")})], 2, "trial_s"),
    "cluster-trial-inf-yaml": (lambda d: ["slime", "command", "--recipe", str(SEED), "--cluster", cluster(
        d, json.dumps(CLUSTER)[:-1] + ', "timeouts": {"trial_s": .inf}}')], 2, "trial_s"),
    "cluster-env-name-newline": (lambda d: ["slime", "command", "--recipe", str(SEED), "--cluster",
                                            cluster(d, env={"NCCL_DEBUG\n": "INFO"})], 2, "env."),
    "cluster-slot-newline": (lambda d: ["slime", "command", "--recipe", str(SEED), "--cluster",
                                        cluster(d, ray={"address": "http://127.0.0.1:8265",
                                                        "slot_resource": "slot\n"})], 2, "slot_resource"),
    "cluster-path-dollar": (lambda d: ["slime", "command", "--recipe", str(SEED), "--cluster",
                                       cluster(d, paths={**CLUSTER["paths"], "slime": "$HOME/slime"})], 2, "expand"),
    "cluster-alias-bomb": (lambda d: ["slime", "command", "--recipe", str(SEED), "--cluster",
                                      write(d, "c.yaml", ALIAS_BOMB)], 2, "aliases"),
    "cluster-env-nan": (lambda d: ["slime", "command", "--recipe", str(SEED), "--cluster", cluster(
        d, json.dumps(CLUSTER)[:-1] + ', "env": {"X": .nan}}')], 2, "env.X"),
    # ---------------------------------------------------------------- slime command: run blocks
    "run-block-lr-nan": (lambda d: ["slime", "command", "--recipe", seed_with(d, "--lr 1e-5", "--lr nan")], 2, "--lr"),
    "run-block-lr-inf": (lambda d: ["slime", "command", "--recipe", seed_with(d, "--lr 1e-5", "--lr inf")], 2, "--lr"),
    # ---------------------------------------------------------------- replay tables
    "replay-not-utf8": (lambda d: ["tune", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--runner", "replay",
                                   "--measurements", write(d, "m.csv", b"flags\n\xff\xfe\n"), "--out", str(d / "o")],
                        2, "UTF-8"),
    "replay-oom-stage-inf": (replay(f'"{FLAGS_A}",oom,,,,inf\n'), 2, "oom_stage"),
    "replay-unclosed-quote": (replay('"--tensor-model-parallel-size \'2",ok,1000,10,,\n'), 2, "quotation"),
    "replay-throughput-inf": (replay(f'"{FLAGS_A}",ok,inf,10,,\n'), 2, "finite"),
    "replay-throughput-huge": (replay(f'"{FLAGS_A}",ok,1e308,10,,\n'), 2, "plausible"),
    "replay-throughput-negative": (replay(f'"{FLAGS_A}",ok,-5,10,,\n'), 2, ">= 0"),
    "replay-trials-csv-duplicate": (lambda d: ["tune", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--runner",
                                               "replay", "--measurements", trials_csv(d), "--out", str(d / "o")],
                                    2, "duplicated row"),
    "replay-alias-bomb": (lambda d: ["tune", "--model", "Qwen3.6-27B", "--gpus", "8xH200", "--runner", "replay",
                                     "--measurements", write(d, "m.yaml", ALIAS_BOMB), "--out", str(d / "o")],
                          2, "aliases"),
    # ---------------------------------------------------------------- data build
    "data-bad-tokenizer": (lambda d: ["data", "build", "--input", write(d, "c.jsonl", '{"messages": []}\n'),
                                      "--tokenizer", write(d, "tokenizer.json", '{"model": {"type": "nope"}'),
                                      "--out", str(d / "rows.parquet")], 2, "tokenizer"),
    "data-input-not-utf8": (lambda d: ["data", "build", "--input", write(d, "c.jsonl", b'{"messages": "\xff"}\n'),
                                       "--tokenizer", write(d, "tokenizer.json", "{}"),
                                       "--out", str(d / "rows.parquet")], 2, "data build"),
    "data-out-is-folder": (lambda d: ["data", "build", "--input", write(d, "c.jsonl", '{"messages": []}\n'),
                                      "--tokenizer", write(d, "tokenizer.json", "{}"), "--out", str(d)],
                           2, "is a folder"),
    # ---------------------------------------------------------------- --out folders
    "run-out-is-file": (lambda d: ["run", "--runner", "torch", "--model", "tiny-llama", "--gpus", "2xcpu", "--out",
                                   write(d, "f", "x")], 2, "is a file"),
    "run-out-unwritable": (lambda d: ["run", "--runner", "torch", "--model", "tiny-llama", "--gpus", "2xcpu",
                                      "--out", "/proc/attune-no"], 2, "cannot write"),
    "calibrate-out-is-file": (lambda d: ["calibrate", "--out", write(d, "f", "x")], 2, "is a file"),
    "verify-out-is-file": (lambda d: ["verify", str(SEED), "--out", write(d, "f", "x")], 2, "is a file"),
    "tune-out-is-file": (lambda d: ["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--out", write(d, "f", "x")],
                         2, "is a file"),
    "tune-out-of-another-study": (lambda d: (write(d, "recipe.yaml", "x: 1"),
                                             ["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--out", str(d)])[1],
                                  2, "did not write"),
    # ---------------------------------------------------------------- storages
    "storage-missing-folder": (lambda d: ["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--storage",
                                          "sqlite:////nonexistent/dir/x.db", "--out", str(d / "o")], 2, "does not exist"),
    "storage-malformed": (lambda d: ["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--storage",
                                     "postgresql://", "--out", str(d / "o")], 2, "no host"),
    "storage-unknown-scheme": (lambda d: ["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--storage",
                                          "ftp://x/y", "--out", str(d / "o")], 2, "unknown database"),
    "storage-newline": (lambda d: ["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--storage",
                                   "sqlite:///a.db\nx", "--out", str(d / "o")], 2, "one line"),
    "study-status-missing-sqlite": (lambda d: ["study", "status", "--storage", f"sqlite:///{d}/typo.db"],
                                    2, "no such study database"),
    "study-status-missing-journal": (lambda d: ["study", "status", "--storage", f"{d}/typo.journal"],
                                     2, "no such study database"),
    # ---------------------------------------------------------------- torch --data
    "tune-data-missing": (lambda d: ["tune", "--model", "tiny-llama", "--gpus", "2xcpu", "--runner", "torch",
                                     "--data", str(d / "none.parquet"), "--out", str(d / "o")], 2, "--data"),
    "tune-data-not-parquet": (lambda d: ["tune", "--model", "tiny-llama", "--gpus", "2xcpu", "--runner", "torch",
                                         "--data", write(d, "rows.parquet", "not parquet"), "--out", str(d / "o")],
                              2, "--data"),
    # ---------------------------------------------------------------- slime parse-log
    "parse-log-deep-literal": (lambda d: ["slime", "parse-log", write(
        d, "job.log", "(MegatronTrainRayActor pid=1) [2026-10-18 12:00:54] model.py:918 - step 0: {'a': "
        + "[" * 50000 + "]" * 50000 + "}\n"), "--gpus", "8"], 1, "steps"),
    "parse-log-huge-literal": (lambda d: ["slime", "parse-log", write(
        d, "job.log", "(MegatronTrainRayActor pid=1) [2026-10-18 12:00:54] model.py:918 - step 0: {'a': '"
        + "x" * 3_000_000 + "'}\n"), "--gpus", "8"], 1, "steps"),
    "parse-log-not-utf8": (lambda d: ["slime", "parse-log", write(d, "job.log", b"\xff\xfe step 0: {\n"),
                                      "--gpus", "8"], 1, "steps"),
    "parse-log-missing": (lambda d: ["slime", "parse-log", str(d / "none.log"), "--gpus", "8"], 2, "no such log"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input(case, tmp_path, capsys, monkeypatch):
    build, code, needle = CASES[case]
    monkeypatch.chdir(tmp_path)
    argv = build(tmp_path)
    t0 = time.monotonic()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusals exit 2 (attune's Parser prints one line first)
        rc = e.code
    took = time.monotonic() - t0
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert rc == code, (rc, err[-500:], cap.out[-500:])
    if code == 2:
        assert len(err.splitlines()) == 1 and err.startswith("attune: error: "), err[-1000:]
        assert needle.lower() in err.lower(), err
    else:
        assert needle.lower() in (err + cap.out).lower(), (err[-500:], cap.out[-500:])
    assert "Traceback" not in cap.err + cap.out
    assert took < TIME_LIMIT_S, f"{case}: {took:.1f} s"


def test_study_status_does_not_create_a_database(tmp_path, capsys):
    assert main(["study", "status", "--storage", f"sqlite:///{tmp_path}/typo.db"]) == 2
    assert not (tmp_path / "typo.db").exists()


def test_verify_leaves_a_tracked_recipe_byte_identical(tmp_path, capsys):
    """A shipped recipe that fails its own lint: verify exits 1 and the file is unchanged, --in-place or not."""
    src = sorted((ROOT / "recipes").rglob("*.yaml"))[0]
    path = tmp_path / src.name
    path.write_bytes(src.read_bytes())
    before = path.read_bytes()
    for extra in ([], ["--in-place"]):
        rc = main(["verify", str(path), "--out", str(tmp_path / f"w{len(extra)}"), *extra])
        assert rc in (1, 2)
        assert path.read_bytes() == before
    capsys.readouterr()


def test_memory_headroom_never_crowns_a_layout_that_does_not_fit(tmp_path, capsys):
    """--memory-headroom 0.9999999: nothing fits within 14 KiB of an H200, so no winner (exit 1), not the
    baseline 'stopped by rule'."""
    rc = main(["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--memory-headroom", "0.9999999",
               "--search-space", SMALL, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 1 and "headroom" in err and "Traceback" not in err


def test_replay_table_without_the_proposed_layouts_says_not_in_the_table(tmp_path, capsys):
    rows = f'"{FLAGS_A} --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",ok,1000,10,,\n'
    argv = replay(rows, "--trials", "2")(tmp_path)
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "not in the table" in err and "shortfall" not in err, err


def test_default_out_folder_of_another_study_is_not_overwritten(tmp_path, monkeypatch, capsys):
    """Without --out a second study of the same day goes to <default>-2; the first study's folder resumes."""
    monkeypatch.chdir(tmp_path)
    base = ["tune", "--model", "tiny-llama", "--gpus", "8xH200", "--trials", "1"]
    assert main(base) == 0
    (first,) = (tmp_path / "reports").iterdir()
    recipe = (first / "recipe.yaml").read_bytes()
    assert main(base + ["--search-space", SMALL]) == 0
    second = first.with_name(first.name + "-2")
    assert (second / "recipe.yaml").is_file() and (first / "recipe.yaml").read_bytes() == recipe
    assert main(base) == 0  # the same study again: resumed in its own folder
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == [first.name, second.name]
    capsys.readouterr()
