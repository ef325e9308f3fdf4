"""Preflight: the data was tokenized with the checkpoint's tokenizer (issue 21).

Real rows are built here with `attune.datasets.build` and a tokenizer trained here (tests/test_data_build.py);
`tokenizer_match` reads the sha256 the build recorded from the parquet footer and compares it with the
checkpoint's tokenizer.json; `judge` turns it into a `tokenizer` row.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from attune.datasets.build import build_rows, write_parquet
from attune.runners.ray.cluster import parse_cluster_config
from attune.runners.slime.preflight import judge
from attune.runners.slime.preflight_probe import data_tokenizer_sha256, node_checks, tokenizer_match
from attune.spec.model import load_model
from tests.test_data_build import make_conversations, make_tokenizer
from tests.test_slime_preflight import make_node

pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = make_tokenizer(d)
    rows = d / "rows.parquet"
    stats = write_parquet(build_rows(make_conversations(), tok, 32, 0), str(rows))
    return tok, rows, stats


def test_same_tokenizer_passes_and_another_fails(built, tmp_path):
    tok, rows, stats = built
    assert data_tokenizer_sha256(str(rows)) == (stats.tokenizer_sha256, "")
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(tok, hf / "tokenizer.json")
    r = tokenizer_match(str(hf), str(rows))
    assert r["ok"] and stats.tokenizer_sha256[:12] in r["detail"]
    other = json.loads((hf / "tokenizer.json").read_text())
    other["model"]["vocab"]["zzzz"] = len(other["model"]["vocab"])  # one more token: another tokenizer
    (hf / "tokenizer.json").write_text(json.dumps(other))
    r = tokenizer_match(str(hf), str(rows))
    assert not r["ok"] and "rebuild the rows" in r["detail"]
    (hf / "tokenizer.json").unlink()
    assert "no readable tokenizer.json" in tokenizer_match(str(hf), str(rows))["detail"]


def test_unknown_data_tokenizer_fails(tmp_path):
    p = tmp_path / "x.parquet"
    p.write_bytes(b"PAR1" + b"\0" * 60 + b"PAR1")
    ok, why = data_tokenizer_sha256(str(p))
    assert ok is None and "footer length" in why
    p.write_bytes(b"not parquet at all")
    assert "no PAR1 footer" in data_tokenizer_sha256(str(p))[1]
    assert not tokenizer_match(str(tmp_path), str(tmp_path / "missing.parquet"))["ok"]


def test_judge_reports_a_tokenizer_row(built, tmp_path):
    tok, rows, _ = built
    paths = make_node(tmp_path)
    shutil.copy(rows, paths["sft_data"])
    shutil.copy(tok, f"{paths['hf_checkpoint']}/tokenizer.json")
    cfg = parse_cluster_config({"ray": {"address": "http://127.0.0.1:8265"}, "nodes": 1, "gpus_per_node": 2,
                                "gpu_type": "cpu", "python": sys.executable, "paths": paths}, "cluster.yaml")
    f = node_checks(paths, sys.executable)
    row = [c for c in judge([f], cfg, load_model("tiny-llama")).checks if c.check == "tokenizer"]
    assert len(row) == 1 and row[0].ok
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    row = [c for c in judge([node_checks(paths, sys.executable)], cfg).checks if c.check == "tokenizer"]
    assert not row[0].ok and "rebuild" in row[0].detail
